// Vector helpers shared by the CPU kernels (paged_attention_cpu.cc, matmul_cpu.cc): one register of floats (VF)
// and of int32 lanes (VI: shuffle masks; kIota its lane indices) in GCC's vector extensions, loads and stores,
// a tree of shuffles that sums kLanes vectors across their lanes at once (sum_lanes_together, or in halves with
// fold_half), and one vector's max and sum across its lanes.
#pragma once

#include <cstdint>
#include <cstring>

namespace jaxllm_cpu {

// One vector register of floats: 16 lanes with AVX-512, 8 otherwise (AVX2). Wider generic vectors than the
// registers make GCC spill every operation to the stack, so the lane count follows the target.
#ifdef __AVX512F__
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float VF __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t VI __attribute__((vector_size(kLanes * sizeof(int32_t))));
#ifdef __AVX512F__
constexpr VI kIota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#else
constexpr VI kIota = {0, 1, 2, 3, 4, 5, 6, 7};
#endif

inline VF loadv(const float* p) {
  VF v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void storev(float* p, VF v) { std::memcpy(p, &v, sizeof(v)); }

// Shuffle masks of the tree below, level k = 1, 2, ...: lanes [0, kLanes / 2) of the result take pairs of a's
// lanes, the rest pairs of b's, each pair half = kLanes >> k lanes apart within segments of 2 * half lanes.
#ifdef __AVX512F__
constexpr VI kLo[4] = {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                       {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
                       {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
                       {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}};
constexpr VI kHi[4] = {{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
                       {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31},
                       {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31},
                       {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31}};
constexpr int kLevels = 4;
#else
constexpr VI kLo[3] = {{0, 1, 2, 3, 8, 9, 10, 11}, {0, 1, 4, 5, 8, 9, 12, 13}, {0, 2, 4, 6, 8, 10, 12, 14}};
constexpr VI kHi[3] = {{4, 5, 6, 7, 12, 13, 14, 15}, {2, 3, 6, 7, 10, 11, 14, 15}, {1, 3, 5, 7, 9, 11, 13, 15}};
constexpr int kLevels = 3;
#endif

// Two vectors of partial sums become one with half as many partials each (a's in the low half, b's in the high).
inline VF fold(VF a, VF b, int level) {
  return __builtin_shuffle(a, b, kLo[level]) + __builtin_shuffle(a, b, kHi[level]);
}

// One vector whose lane i is the sum of part[i]'s lanes: log2 kLanes levels of folds (kLanes - 1 in all), a
// fraction of the cost of a horizontal sum per vector. Overwrites part.
// Fully unrolled, so GCC keeps part in registers (a loop over the levels left it on the stack, with a memset).
inline VF sum_lanes_together(VF (&part)[kLanes]) {
#pragma GCC unroll 8
  for (int level = 0; level < kLevels; ++level) {
#pragma GCC unroll 16
    for (int i = 0; i < (kLanes >> (level + 1)); ++i) part[i] = fold(part[2 * i], part[2 * i + 1], level);
  }
  return part[0];
}

// A lane-wise max of two vectors.
inline VF max_of(VF a, VF b) { return a > b ? a : b; }

// The largest of v's lanes, and their sum: log2 kLanes steps that combine v with itself, lanes swapped across
// halves, quarters, ... (a reduction loop leaves GCC's horizontal sum a chain of kLanes scalar adds through the
// stack).
inline float max_lanes(VF v) {
#pragma GCC unroll 8
  for (int half = kLanes / 2; half > 0; half /= 2) v = max_of(v, __builtin_shuffle(v, kIota ^ half));
  return v[0];
}
inline float add_lanes(VF v) {
#pragma GCC unroll 8
  for (int half = kLanes / 2; half > 0; half /= 2) v += __builtin_shuffle(v, kIota ^ half);
  return v[0];
}

// sum_lanes_together's tree on half as many vectors (kLanes / 2), all its levels but the last: one vector of
// partial sums such that fold(fold_half(lo), fold_half(hi), kLevels - 1) equals sum_lanes_together over lo's vectors
// then hi's (the tree folds neighbours, so each half folds on its own until the last level). Overwrites part.
inline VF fold_half(VF (&part)[kLanes / 2]) {
#pragma GCC unroll 8
  for (int level = 0; level + 1 < kLevels; ++level) {
#pragma GCC unroll 16
    for (int i = 0; i < (kLanes >> (level + 2)); ++i) part[i] = fold(part[2 * i], part[2 * i + 1], level);
  }
  return part[0];
}

}  // namespace jaxllm_cpu
