// Ragged paged attention for XLA's CPU backend, as an XLA FFI custom call.
//
// Every query token of a ragged batch (decode rows and prefill chunks alike)
// attends over its sequence's paged KV cache, read in place through the
// block table. The plain-jnp kernels (kernels_pallas/attention/xla.py) have to gather
// the blocks into contiguous copies before each dot, since XLA's CPU dots
// cannot read through a gather; that moves every cached byte three times,
// and on a CPU the bytes are the cost. Semantics are those of
// kernels_pallas.reference.ragged_paged_attention_reference: a query at
// position p sees positions [0, p] of its sequence (the last sliding_window
// of them when set); scores = (q . k) * scale, optionally soft-capped
// (cap * tanh(s / cap)); softmax in float32 (the online form of
// flash-attention); weighted sum of v.
//
// Operands (row-major):
//   q          float32 [T, Hq, D]
//   k_cache    [N, block_size * Hkv * D]  float32, or uint16 bit patterns of bfloat16 (each block one row:
//              a unit KV-head axis in the operand would let XLA's CPU layout assignment move it and copy
//              the whole cache around the call)
//   v_cache    same shape and dtype as k_cache
//   tables     int32 [S, W]   block ids, in [0, N)
//   token_row  int32 [T]      the sequence row of each query token; -1: a padding token (zeros out)
//   token_pos  int32 [T]      the position of each query token in its sequence
// Attributes: scale (f32), soft_cap (f32, 0 = none), sliding_window (i32, 0 = none), block_size (i32),
// num_kv_heads (i32).
// Result: float32 [T, Hq, D].
// Errors: a row outside [0, S), a position at or past W * block_size, or a block id outside [0, N) that a
// token would read returns an FFI error naming the token and the value (no out-of-bounds read).
//
// Work: runs of up to kTile consecutive tokens of one row are the units (a decode row is a unit of one),
// so each KV block a unit needs is read once for all its queries. A decode row goes through attend_unit (per
// KV head, its query heads together: dot products across a block's keys); a run of several tokens, when block
// size and head dim are multiples of 8, through attend_unit_tiled, whose register-tiled multiply-adds make
// prefill attention matmul-shaped. Decode rows whose tables begin with the same blocks (a prefix-cached system
// prompt; no sliding window, tiled shapes, at least kMinSharedBlocks) are taken up to kTile at a time as cascade
// units (form_cascades): the shared blocks once for all of them through the GEMM-shaped path, then each row's
// own blocks through attend_unit from where that left off. The calling thread and tasks on XLA's intra-op thread
// pool take units from one atomic counter (a unit through attend_unit reserves the next one of its kind as it
// starts, so that its last block prefetches that one's first); the caller returns once every unit is done. Vectors
// are the target's registers (-march=native): 16 floats with AVX-512, 8 with AVX2.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cpu_vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxllm_cpu;

constexpr int64_t kTile = 16;           // query tokens per unit
constexpr int64_t kMaxBlockSize = 256;  // tokens per block
// Blocks ahead whose lines are prefetched (0-3 alike on the tiled path; decode: 1, 2 and 4 alike, all faster than
// none).
constexpr int64_t kPrefetchBlocks = 1;
// Units of at least this many query tokens take the GEMM-shaped path when the shapes allow it.
constexpr int64_t kTiledMinTokens = 2;
// Decode tokens form cascade units over at least this many shared blocks (form_cascades). Not tuned.
constexpr int64_t kMinSharedBlocks = 2;

inline float load(const float* p) { return *p; }
inline float load(const uint16_t* p) { return __builtin_bit_cast(float, static_cast<uint32_t>(*p) << 16); }

// 2^n for the whole numbers n in [-126, 0] (as floats), built in the exponent bits: one float, or every lane.
inline float two_to(float n) { return __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23); }
inline VF two_to(VF n) { return reinterpret_cast<VF>((__builtin_convertvector(n, VI) + 127) << 23); }

// exp(x) for x <= 0 (the softmax's shifted scores), of one float or of every lane of a vector, in a form the
// compiler vectorizes: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (relative error
// below 2e-7), times 2^n. Below -87 (where e^x is under float's normal range) it returns 0; -inf (a key a query
// does not see) takes the clamp before n's conversion to an integer, so none reaches it out of range.
template <typename V>
inline V exp_nonpositive(V x) {
  const V lowest = V{} - 87.0f;
  const V clamped = x < lowest ? lowest : x;
  // Round to the nearest integer by adding and subtracting 1.5 * 2^23 (exact for |value| < 2^22): plain
  // arithmetic that vectorizes, where roundf is a library call in every lane.
  const V n = (clamped * 1.44269504f + 12582912.0f) - 12582912.0f;
  const V r = (clamped - n * 0.693145752f) - n * 1.42860677e-6f;
  V poly = V{} + 1.0f / 720.0f;
  poly = poly * r + 1.0f / 120.0f;
  poly = poly * r + 1.0f / 24.0f;
  poly = poly * r + 1.0f / 6.0f;
  poly = poly * r + 0.5f;
  poly = poly * r + 1.0f;
  poly = poly * r + 1.0f;
  return x < lowest ? V{} : poly * two_to(n);
}

// The lines of the next block's K and V that a slice of this block's work prefetches (into L2), a few at a time through
// its arithmetic: `step` between the loads of the scores' and the weighted sum's loops issues `rate` of them, `issue` a
// burst. In bursts of a slice's whole share (64 lines of K and 64 of V for SmolLM2's float32 cache in blocks of 16 with
// AVX-512; 32 and 32 with AVX2, whose slices are half as many heads) the prefetches filled the core's miss buffers and
// the loads of this block's work queued behind them, so memory and arithmetic took turns; spread out, they overlap.
struct Prefetch {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t line = 0, end = 0, rate = 0;  // lines [line, end) are still to prefetch, `rate` per step
  inline void issue(int64_t n) {
    for (; n > 0 && line < end; --n, ++line) {
      __builtin_prefetch(k + line * 64, 0, 2);
      __builtin_prefetch(v + line * 64, 0, 2);
    }
  }
  inline void step() { issue(rate); }
};

// The kLanes dot products of q [dim] with kLanes consecutive keys (key t at keys + t * stride), dim a multiple
// of kLanes: per key kLanes-lane partial sums, then the kLanes vectors summed across lanes together by a tree of
// shuffles (log2 kLanes levels), a fraction of the cost of a horizontal sum per key. The loop over keys is the
// inner, unrolled one, so the kLanes multiply-add chains are independent: one key at a time, each chain waited
// on the latency of the one before (profiled: the decode kernel's largest cost before).
inline VF scores_of_lanes(const float* q, const float* keys, int64_t stride, int64_t dim, Prefetch& pf) {
  VF part[kLanes] = {};
  for (int64_t d = 0; d < dim; d += kLanes) {
    pf.step();
    const VF qd = loadv(q + d);
#pragma GCC unroll 16
    for (int t = 0; t < kLanes; ++t) part[t] += qd * loadv(keys + t * stride + d);
  }
  return sum_lanes_together(part);  // lane t: key t's dot
}

// a[d] = a[d] * rescale + sum over t in [t_lo, t_hi) of weights[t] * vals[t * stride + d], for d in
// [0, NV * kLanes). Even and odd tokens go to separate accumulators, so 2 * NV multiply-add chains run at once
// (NV alone left the loop waiting on the multiply-add latency).
template <int NV>
inline void add_weighted_values(const float* weights, const float* vals, int64_t stride, int64_t t_lo, int64_t t_hi,
                                float rescale, float* a, Prefetch& pf) {
  VF even[NV], odd[NV];
#pragma GCC unroll 16
  for (int i = 0; i < NV; ++i) {
    even[i] = loadv(a + i * kLanes) * rescale;
    odd[i] = VF{};
  }
  int64_t t = t_lo;
  for (; t + 1 < t_hi; t += 2) {
    pf.step();
    const float w0 = weights[t], w1 = weights[t + 1];
    const float* v0 = vals + t * stride;
    const float* v1 = v0 + stride;
#pragma GCC unroll 16
    for (int i = 0; i < NV; ++i) {
      even[i] += w0 * loadv(v0 + i * kLanes);
      odd[i] += w1 * loadv(v1 + i * kLanes);
    }
  }
  if (t < t_hi) {
#pragma GCC unroll 16
    for (int i = 0; i < NV; ++i) even[i] += weights[t] * loadv(vals + t * stride + i * kLanes);
  }
#pragma GCC unroll 16
  for (int i = 0; i < NV; ++i) storev(a + i * kLanes, even[i] + odd[i]);
}

// Query heads of one KV head that attend_unit takes together, so each key and value vector it loads serves all of
// them: as many as the registers hold in scores_of_heads, AVX-512's 32 (3 heads by half a vector of keys of partial
// sums, 24, beside the 3 queries, the 3 sums of the first half and a key: 31) or AVX2's 16 (2 by 4: 8 + 2 + 2 + 1).
#ifdef __AVX512F__
constexpr int kHeadsAtOnce = 3;
#else
constexpr int kHeadsAtOnce = 2;
#endif
constexpr int kHalfLanes = kLanes / 2;

// out[g * kMaxBlockSize + t] for g in [0, G), t in [0, kLanes): the dot products of G queries (query g at
// q + g * dim, [dim]) with kLanes consecutive keys (key t at keys + t * stride), dim a multiple of kLanes. The keys
// go in two halves of kHalfLanes, each key's vectors loaded once for the G queries; each half's partial sums fold
// down to a vector per query by the first levels of sum_lanes_together's tree, and its last level joins the halves.
// Half the keys at a time keep the G * kHalfLanes partial sums and their row pointers in registers (all kLanes
// keys at once had GCC park the pointers in vector registers and move them back for every load).
template <int G>
inline void scores_of_heads(const float* q, int64_t dim, const float* keys, int64_t stride, float* out, Prefetch& pf) {
  VF halves[2][G];
#pragma GCC unroll 2
  for (int half = 0; half < 2; ++half) {
    const float* key = keys + half * kHalfLanes * stride;
    VF part[G][kHalfLanes] = {};
    for (int64_t d = 0; d < dim; d += kLanes) {
      pf.step();
      VF qd[G];
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) qd[g] = loadv(q + g * dim + d);
#pragma GCC unroll 16
      for (int t = 0; t < kHalfLanes; ++t) {
        const VF k = loadv(key + t * stride + d);
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) part[g][t] += qd[g] * k;
      }
    }
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) halves[half][g] = fold_half(part[g]);
  }
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) storev(out + g * kMaxBlockSize, fold(halves[0][g], halves[1][g], kLevels - 1));
}

// For g in [0, G): a[g * dim + d] = a[g * dim + d] * rescale[g] + sum over t in [t_lo, t_hi) of
// weights[g * kMaxBlockSize + t] * vals[t * stride + d], for d in [0, NV * kLanes). Each value vector is loaded
// once for the G query heads, whose G * NV multiply-add chains run at once.
template <int G, int NV>
inline void add_weighted_values_of_heads(const float* weights, const float* vals, int64_t stride, int64_t t_lo,
                                         int64_t t_hi, const float* rescale, float* a, int64_t dim, Prefetch& pf) {
  VF out[G][NV];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) {
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) out[g][i] = loadv(a + g * dim + i * kLanes) * rescale[g];
  }
  for (int64_t t = t_lo; t < t_hi; ++t) {
    pf.step();
    VF v[NV];
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) v[i] = loadv(vals + t * stride + i * kLanes);
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      const float w = weights[g * kMaxBlockSize + t];
#pragma GCC unroll 8
      for (int i = 0; i < NV; ++i) out[g][i] += w * v[i];
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) {
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) storev(a + g * dim + i * kLanes, out[g][i]);
  }
}

struct Problem {
  const float* q;
  const void* k;
  const void* v;
  const int32_t* tables;
  const int32_t* token_row;
  const int32_t* token_pos;
  float* out;
  int64_t q_heads, kv_heads, head_dim, block_size, width;
  float scale, soft_cap;
  int32_t window;
};

struct Unit {
  int64_t first, count;  // query tokens [first, first + count), all of one row (unless members_at is set)
  // A cascade unit's count decode tokens: Shared::members[members_at, members_at + count), of rows whose block
  // tables begin with the same shared_blocks blocks, every one of which each of the tokens sees whole. -1: none.
  int64_t members_at = -1, shared_blocks = 0;
};

// A decode token's attention carried over from its cascade unit: its query heads' running max and sum ([Hq]) and
// accumulators ([Hq, D]) after the blocks [0, blocks) of its row.
struct Resume {
  const float* max;
  const float* sum;
  const float* acc;
  int64_t blocks;
};

// Per-thread running state of a unit's (query, query head) pairs: scaled queries, accumulators, max and sum;
// and a bfloat16 block's keys and values in float32.
struct Scratch {
  std::vector<float> q, acc, run_max, run_sum, k_block, v_block;
};

// The block's elements as float32: in place for a float32 cache; converted once into `buffer` for bfloat16
// bits, so the loops below convert each element once rather than once per query head that reads it.
inline const float* as_float(const float* block, int64_t, std::vector<float>&) { return block; }
inline const float* as_float(const uint16_t* block, int64_t count, std::vector<float>& buffer) {
  buffer.resize(count);
  float* out = buffer.data();
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) out[i] = load(block + i);
  return out;
}

// One block's keys [t_lo, t_hi) for G query heads of one KV head: their scaled queries at q, accumulators at acc
// (both dim apart), running max and sum at run_max and run_sum; the KV head's keys and values at kb and vb, token t
// at t * stride. Scores, the online softmax's update, the weighted sum of values. `fast`: block size and head dim
// are whole vectors.
template <int G>
void attend_block_heads(const Problem& p, bool fast, const float* q, const float* kb, const float* vb, int64_t stride,
                        int64_t t_lo, int64_t t_hi, float* run_max, float* run_sum, float* acc, Prefetch& pf) {
  const int64_t dim = p.head_dim, bs = p.block_size;
  alignas(64) float scores[G * kMaxBlockSize];  // then the softmax's weights, in place
  float rescale[G];
  if (fast) {
    // Only the vectors of keys that hold [t_lo, t_hi): a row's last block is half empty on average.
    for (int64_t t0 = t_lo - t_lo % kLanes; t0 < t_hi; t0 += kLanes) {
      if constexpr (G == 1) {
        storev(scores + t0, scores_of_lanes(q, kb + t0 * stride, stride, dim, pf));
      } else {
        scores_of_heads<G>(q, dim, kb + t0 * stride, stride, scores + t0, pf);
      }
    }
  } else {
    pf.issue(pf.end);  // the scalar loops below take no steps
    for (int g = 0; g < G; ++g) {
      for (int64_t t = t_lo; t < t_hi; ++t) {
        const float* key = kb + t * stride;
        const float* qv = q + g * dim;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < dim; ++d) dot += qv[d] * key[d];
        scores[g * kMaxBlockSize + t] = dot;
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    float* sc = scores + g * kMaxBlockSize;
    if (p.soft_cap > 0.0f) {
      for (int64_t t = t_lo; t < t_hi; ++t) sc[t] = p.soft_cap * std::tanh(sc[t] / p.soft_cap);
    }
    if (fast) {
      // Whole vectors of keys, those outside [t_lo, t_hi) at -inf (weight 0), and the lanes' max and sum by
      // max_lanes and add_lanes.
      const int64_t v_lo = t_lo - t_lo % kLanes;
      VF vmax = VF{} - INFINITY;
      for (int64_t t0 = v_lo; t0 < t_hi; t0 += kLanes) {
        const VI t = kIota + static_cast<int32_t>(t0);
        const VF v =
            t >= static_cast<int32_t>(t_lo) && t < static_cast<int32_t>(t_hi) ? loadv(sc + t0) : VF{} - INFINITY;
        storev(sc + t0, v);
        vmax = max_of(vmax, v);
      }
      const float old_max = run_max[g];
      const float block_max = max_lanes(vmax);
      const float new_max = block_max > old_max ? block_max : old_max;
      rescale[g] = exp_nonpositive(old_max - new_max);  // 0 where no block came before (-inf)
      VF vsum = VF{};
      for (int64_t t0 = v_lo; t0 < t_hi; t0 += kLanes) {
        const VF w = exp_nonpositive(loadv(sc + t0) - new_max);
        storev(sc + t0, w);
        vsum += w;
      }
      run_sum[g] = run_sum[g] * rescale[g] + add_lanes(vsum);
      run_max[g] = new_max;
      continue;
    }
    // A loop of its own, so that it vectorizes (with the dot products and the cap in it, it ran a key at a time).
    float block_max = -INFINITY;
#pragma omp simd reduction(max : block_max)
    for (int64_t t = t_lo; t < t_hi; ++t) block_max = sc[t] > block_max ? sc[t] : block_max;
    const float old_max = run_max[g];
    const float new_max = block_max > old_max ? block_max : old_max;
    rescale[g] = exp_nonpositive(old_max - new_max);  // 0 where no block came before (-inf)
    float block_sum = 0.0f;
#pragma omp simd reduction(+ : block_sum)
    for (int64_t t = t_lo; t < t_hi; ++t) {
      sc[t] = exp_nonpositive(sc[t] - new_max);
      block_sum += sc[t];
    }
    run_sum[g] = run_sum[g] * rescale[g] + block_sum;
    run_max[g] = new_max;
  }
  if (fast) {
    // Four vectors of output elements at a time, held across the block's tokens.
    int64_t d0 = 0;
    for (; d0 + 4 * kLanes <= dim; d0 += 4 * kLanes) {
      if constexpr (G == 1) {
        add_weighted_values<4>(scores, vb + d0, stride, t_lo, t_hi, rescale[0], acc + d0, pf);
      } else {
        add_weighted_values_of_heads<G, 4>(scores, vb + d0, stride, t_lo, t_hi, rescale, acc + d0, dim, pf);
      }
    }
    for (; d0 < dim; d0 += kLanes) {
      if constexpr (G == 1) {
        add_weighted_values<1>(scores, vb + d0, stride, t_lo, t_hi, rescale[0], acc + d0, pf);
      } else {
        add_weighted_values_of_heads<G, 1>(scores, vb + d0, stride, t_lo, t_hi, rescale, acc + d0, dim, pf);
      }
    }
  } else {
    for (int g = 0; g < G; ++g) {
      float* a = acc + g * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) a[d] *= rescale[g];
      for (int64_t t = t_lo; t < t_hi; ++t) {
        const float w = scores[g * kMaxBlockSize + t];
        const float* value = vb + t * stride;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) a[d] += w * value[d];
      }
    }
  }
}

// Attention of one unit's queries over the blocks they see. Each block is visited once, every KV head of it
// before the next block (a block is one contiguous run of block_size * Hkv * D elements), and the next block
// is prefetched while this one is computed: a row's blocks lie anywhere in a cache far larger than the CPU's.
// The query heads of a KV head go through attend_block_heads up to kHeadsAtOnce at a time, in chunks as even as
// that allows (a group of 4 in two of 2, not 3 and 1).
// With `from` (a unit of one token), the token's state after its row's first from->blocks blocks is taken up and
// the blocks after them attended.
template <typename T>
void attend_unit(const Problem& p, const Unit& u, Scratch& s, const Resume* from = nullptr,
                 int64_t then_block = -1) {
  const int64_t heads = p.q_heads, group = p.q_heads / p.kv_heads, dim = p.head_dim, bs = p.block_size;
  const int64_t pairs = u.count * heads;
  s.q.resize(pairs * dim);
  if (from != nullptr) {
    s.acc.assign(from->acc, from->acc + pairs * dim);
    s.run_max.assign(from->max, from->max + pairs);
    s.run_sum.assign(from->sum, from->sum + pairs);
  } else {
    s.acc.assign(pairs * dim, 0.0f);
    s.run_max.assign(pairs, -INFINITY);
    s.run_sum.assign(pairs, 0.0f);
  }
  int64_t lo_all = INT64_MAX, hi_all = 0;
  int64_t lo[kTile], hi[kTile];  // positions [lo, hi] each query sees
  for (int64_t j = 0; j < u.count; ++j) {
    const int64_t pos = p.token_pos[u.first + j];
    hi[j] = pos;
    lo[j] = p.window > 0 && pos + 1 > p.window ? pos + 1 - p.window : 0;
    lo_all = lo[j] < lo_all ? lo[j] : lo_all;
    hi_all = hi[j] > hi_all ? hi[j] : hi_all;
    const float* src = p.q + (u.first + j) * heads * dim;
    for (int64_t i = 0; i < heads * dim; ++i) s.q[j * heads * dim + i] = src[i] * p.scale;
  }
  const T* kc = static_cast<const T*>(p.k);
  const T* vc = static_cast<const T*>(p.v);
  const int64_t token_stride = p.kv_heads * dim;  // elements between consecutive tokens of a block
  const int64_t block_elems = bs * token_stride;
  const int32_t* table = p.tables + static_cast<int64_t>(p.token_row[u.first]) * p.width;
  // Blocks and head dims of whole vectors take the vector path.
  const bool fast = bs % kLanes == 0 && dim % kLanes == 0;
  const int64_t chunks = (group + kHeadsAtOnce - 1) / kHeadsAtOnce;  // of a KV head's query heads
  const int64_t slices = p.kv_heads * chunks;                         // of a block's work per query token
  const int64_t first = from != nullptr ? std::max(lo_all - lo_all % bs, from->blocks * bs) : lo_all - lo_all % bs;
  // The Prefetch steps that attend_block_heads<n> takes over a block's keys [t_lo, t_hi) on the vector path: its
  // scores' loops over head dims per vector of keys (twice for n > 1: scores_of_heads's halves), its weighted sums'
  // over tokens (by twos for n = 1). A row's last block holds a few keys: counted as a whole block, most of a
  // slice's share would be left to the next slice's burst, and the last slice's to none.
  const auto steps_of = [&](int64_t n, int64_t t_lo, int64_t t_hi) {
    const int64_t key_vectors = (t_hi - 1) / kLanes - t_lo / kLanes + 1;
    const int64_t score_steps = key_vectors * (dim / kLanes) * (n > 1 ? 2 : 1);
    const int64_t sums = dim / (4 * kLanes) + (dim % (4 * kLanes)) / kLanes;
    return std::max<int64_t>(1, score_steps + sums * (n > 1 ? t_hi - t_lo : (t_hi - t_lo) / 2));
  };
  Prefetch pf;
  for (int64_t start = first; start <= hi_all; start += bs) {
    // The lines of a block ahead, prefetched a share per slice of this block's work below, so that each slice's
    // loads overlap the next block's (Prefetch: an eighth of a share at once, then the rest spread evenly over the
    // steps of its loops; the whole share at once held this block's loads up behind it). Into L2 (prefetcht1): into
    // L1 they evicted the K and V this block's heads reread. None at all is slower; two blocks ahead is the same
    // as one.
    const char* next_k = nullptr;
    const char* next_v = nullptr;
    if (start + kPrefetchBlocks * bs <= hi_all || then_block >= 0) {
      // then_block: the next unit's first, after this unit's last block (one block ahead).
      static_assert(kPrefetchBlocks == 1, "then_block stands for the block one past a unit's last");
      const int64_t ahead = start + kPrefetchBlocks * bs <= hi_all ? table[start / bs + kPrefetchBlocks] : then_block;
      next_k = reinterpret_cast<const char*>(kc + ahead * block_elems);
      next_v = reinterpret_cast<const char*>(vc + ahead * block_elems);
    }
    const int64_t block_lines = (block_elems * static_cast<int64_t>(sizeof(T)) + 63) / 64;
    const int64_t lines_per_slice = (block_lines + slices - 1) / slices;
    const float* kb = as_float(kc + table[start / bs] * block_elems, block_elems, s.k_block);
    const float* vb = as_float(vc + table[start / bs] * block_elems, block_elems, s.v_block);
    for (int64_t j = 0; j < u.count; ++j) {
      // The tokens of this block query j sees: [t_lo, t_hi).
      const int64_t t_lo = lo[j] > start ? lo[j] - start : 0;
      const int64_t t_hi = hi[j] - start + 1 < bs ? hi[j] - start + 1 : bs;
      if (t_lo >= t_hi) continue;
      for (int64_t h = 0; h < p.kv_heads; ++h) {
        for (int64_t c = 0, g0 = 0; c < chunks; ++c) {
          const int64_t n = (group - g0) / (chunks - c);  // even chunks, the larger ones last
          if (next_k != nullptr && j == 0) {
            const int64_t slice = h * chunks + c;
            pf.issue(pf.end);  // what the last slice left
            // The last slices of a block of few lines may get none (begin clamped to end).
            pf = Prefetch{next_k, next_v, std::min(block_lines, slice * lines_per_slice),
                          std::min(block_lines, (slice + 1) * lines_per_slice), 0};
            const int64_t lines = pf.end - pf.line, burst = lines / 8, steps = steps_of(n, t_lo, t_hi);
            pf.issue(burst);
            pf.rate = (lines - burst + steps - 1) / steps;
          }
          const int64_t pair = j * heads + h * group + g0;
          const float* q = s.q.data() + pair * dim;
          const float* keys = kb + h * dim;
          const float* vals = vb + h * dim;
          float* run_max = s.run_max.data() + pair;
          float* run_sum = s.run_sum.data() + pair;
          float* acc = s.acc.data() + pair * dim;
          if constexpr (kHeadsAtOnce >= 3) {
            if (n == 3) {
              attend_block_heads<3>(p, fast, q, keys, vals, token_stride, t_lo, t_hi, run_max, run_sum, acc, pf);
            }
          }
          if (n == 2) {
            attend_block_heads<2>(p, fast, q, keys, vals, token_stride, t_lo, t_hi, run_max, run_sum, acc, pf);
          } else if (n == 1) {
            attend_block_heads<1>(p, fast, q, keys, vals, token_stride, t_lo, t_hi, run_max, run_sum, acc, pf);
          }
          g0 += n;
        }
      }
    }
  }
  pf.issue(pf.end);  // the next unit's first block, what its last slice left
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const float inv = 1.0f / s.run_sum[pair];
    float* out = p.out + u.first * heads * dim + pair * dim;
    const float* a = s.acc.data() + pair * dim;
    for (int64_t d = 0; d < dim; ++d) out[d] = a[d] * inv;
  }
}

// The GEMM-shaped path for units of several query tokens (prefill chunks). Per KV head the unit's
// (token, query head) pairs are the lanes m of vectors (kLanes wide): the queries are held transposed (qt[d][m]), so the
// scores of a block come out transposed too (st[t][m]) from broadcast-multiply-adds with no sum across lanes, the
// online softmax runs lane-wise down the block's keys, and the weighted sum of values is kept transposed
// (acc[d][m]). Register tiles: kTB keys or kDB output dims by kMB vectors of lanes.
#ifdef __AVX512F__
constexpr int kTB = 8, kDB = 8, kMB = 3;  // 24 accumulators of AVX-512's 32 registers
#else
constexpr int kTB = 4, kDB = 4, kMB = 2;  // 8 of AVX2's 16, beside the operands and a broadcast
#endif
// Lanes no query owns start from this running max rather than -inf, so exp(max_old - max_new) stays defined.
constexpr float kNoScore = -1e30f;

struct TileScratch {
  std::vector<float> qt, st, acc, run_max, run_sum, alpha, k_head, v_head, resume_max, resume_sum, resume_acc;
  std::vector<int32_t> lo, hi;
};

// st[t][m] = sum over d of qt[d][m] * keys[t * stride + d], for keys [t0, t0 + TB) and lanes of vectors
// [mv0, mv0 + MB) (mp lanes per row of qt and st).
template <int TB, int MB>
inline void score_tile(const float* qt, int64_t mp, const float* keys, int64_t stride, int64_t dim, float* st,
                       int64_t t0, int64_t mv0) {
  VF acc[TB][MB] = {};
  for (int64_t d = 0; d < dim; ++d) {
    VF qv[MB];
    for (int b = 0; b < MB; ++b) qv[b] = loadv(qt + d * mp + (mv0 + b) * kLanes);
    for (int a = 0; a < TB; ++a) {
      const float key = keys[(t0 + a) * stride + d];
      for (int b = 0; b < MB; ++b) acc[a][b] += qv[b] * key;
    }
  }
  for (int a = 0; a < TB; ++a)
    for (int b = 0; b < MB; ++b) storev(st + (t0 + a) * mp + (mv0 + b) * kLanes, acc[a][b]);
}

// acc[d][m] = acc[d][m] * alpha[m] + sum over t in [t_lo, t_hi) of vals[t * stride + d] * st[t][m], for dims
// [d0, d0 + DB) and the lanes of vectors [mv0, mv0 + MB).
template <int DB, int MB>
inline void value_tile(const float* st, int64_t mp, const float* vals, int64_t stride, int64_t t_lo, int64_t t_hi,
                       const float* alpha, float* acc, int64_t d0, int64_t mv0) {
  VF out[DB][MB], scale[MB];
  for (int b = 0; b < MB; ++b) scale[b] = loadv(alpha + (mv0 + b) * kLanes);
  for (int a = 0; a < DB; ++a)
    for (int b = 0; b < MB; ++b) out[a][b] = loadv(acc + (d0 + a) * mp + (mv0 + b) * kLanes) * scale[b];
  for (int64_t t = t_lo; t < t_hi; ++t) {
    VF w[MB];
    for (int b = 0; b < MB; ++b) w[b] = loadv(st + t * mp + (mv0 + b) * kLanes);
    for (int a = 0; a < DB; ++a) {
      const float v = vals[t * stride + d0 + a];
      for (int b = 0; b < MB; ++b) out[a][b] += w[b] * v;
    }
  }
  for (int a = 0; a < DB; ++a)
    for (int b = 0; b < MB; ++b) storev(acc + (d0 + a) * mp + (mv0 + b) * kLanes, out[a][b]);
}

template <int MB>
inline void score_vectors(const float* qt, int64_t mp, const float* keys, int64_t stride, int64_t dim, int64_t bs,
                          float* st, int64_t mv0) {
  for (int64_t t0 = 0; t0 < bs; t0 += kTB) score_tile<kTB, MB>(qt, mp, keys, stride, dim, st, t0, mv0);
}

template <int MB>
inline void value_vectors(const float* st, int64_t mp, const float* vals, int64_t stride, int64_t dim, int64_t t_lo,
                          int64_t t_hi, const float* alpha, float* acc, int64_t mv0) {
  for (int64_t d0 = 0; d0 < dim; d0 += kDB) value_tile<kDB, MB>(st, mp, vals, stride, t_lo, t_hi, alpha, acc, d0, mv0);
}

// One KV head's slice of a block ([bs] tokens of [dim] elements, `stride` apart) as float32: in place for a
// float32 cache, converted into `buffer` (stride dim) for bfloat16 bits. Returns the pointer and sets stride.
inline const float* head_slice(const float* block, int64_t bs, int64_t dim, int64_t& stride, std::vector<float>&) {
  return block;
}
inline const float* head_slice(const uint16_t* block, int64_t bs, int64_t dim, int64_t& stride,
                               std::vector<float>& buffer) {
  buffer.resize(bs * dim);
  float* out = buffer.data();
  for (int64_t t = 0; t < bs; ++t) {
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) out[t * dim + d] = load(block + t * stride + d);
  }
  stride = dim;
  return out;
}

// A unit through the GEMM-shaped path (block_size and head_dim multiples of 8); same result as attend_unit.
// For a cascade unit (members set: its decode tokens), only its shared blocks are attended, and each query
// head's running max, sum and accumulators go to s.resume_max, resume_sum ([count, Hq]) and resume_acc ([count, Hq,
// D]) for attend_unit to take up, instead of the result to out.
template <typename T>
void attend_unit_tiled(const Problem& p, const Unit& u, TileScratch& s, const int32_t* members = nullptr) {
  const int64_t heads = p.q_heads, group = p.q_heads / p.kv_heads, dim = p.head_dim, bs = p.block_size;
  const auto token = [&](int64_t j) { return members != nullptr ? int64_t{members[j]} : u.first + j; };
  const int64_t lanes = u.count * group, vectors = (lanes + kLanes - 1) / kLanes, mp = vectors * kLanes;
  s.qt.resize(dim * mp);
  s.st.resize(bs * mp);
  s.acc.resize(dim * mp);
  s.run_max.resize(mp);
  s.run_sum.resize(mp);
  s.alpha.resize(mp);
  s.lo.resize(mp);
  s.hi.resize(mp);
  int64_t lo_all = INT64_MAX, hi_all = 0, lo_max = 0, hi_min = INT64_MAX;
  for (int64_t m = 0; m < mp; ++m) {
    if (m < lanes) {
      const int64_t pos = p.token_pos[token(m / group)];
      const int64_t lo = p.window > 0 && pos + 1 > p.window ? pos + 1 - p.window : 0;
      s.lo[m] = static_cast<int32_t>(lo);
      s.hi[m] = static_cast<int32_t>(pos);
      lo_all = lo < lo_all ? lo : lo_all;
      hi_all = pos > hi_all ? pos : hi_all;
      lo_max = lo > lo_max ? lo : lo_max;
      hi_min = pos < hi_min ? pos : hi_min;
    } else {
      s.lo[m] = 0;  // a spare lane: a zero query that sees every key, its result dropped
      s.hi[m] = INT32_MAX;
    }
  }
  if (members != nullptr) {
    // Every member sees these blocks whole (no window): no key is masked.
    hi_all = u.shared_blocks * bs - 1;
    s.resume_max.resize(u.count * heads);
    s.resume_sum.resize(u.count * heads);
    s.resume_acc.resize(u.count * heads * dim);
  }
  const T* kc = static_cast<const T*>(p.k);
  const T* vc = static_cast<const T*>(p.v);
  const int64_t token_stride = p.kv_heads * dim, block_elems = bs * token_stride;
  const int32_t* table = p.tables + static_cast<int64_t>(p.token_row[token(0)]) * p.width;
  float* qt = s.qt.data();
  float* st = s.st.data();
  float* acc = s.acc.data();
  float* run_max = s.run_max.data();
  float* run_sum = s.run_sum.data();
  float* alpha = s.alpha.data();
  const int32_t* lo = s.lo.data();
  const int32_t* hi = s.hi.data();
  for (int64_t h = 0; h < p.kv_heads; ++h) {
    // Lane m = j * group + g is head h * group + g of the unit's token j: each such query row is read once,
    // contiguously (an index divided by group per element would make this copy a large share of a short
    // prefill's attention).
    for (int64_t j = 0; j < u.count; ++j) {
      for (int64_t g = 0; g < group; ++g) {
        const float* src = p.q + (token(j) * heads + h * group + g) * dim;
        const int64_t m = j * group + g;
        for (int64_t d = 0; d < dim; ++d) qt[d * mp + m] = src[d] * p.scale;
      }
    }
    for (int64_t d = 0; d < dim; ++d) {
      for (int64_t m = lanes; m < mp; ++m) qt[d * mp + m] = 0.0f;
    }
    std::fill(s.acc.begin(), s.acc.end(), 0.0f);
    std::fill(s.run_max.begin(), s.run_max.end(), kNoScore);
    std::fill(s.run_sum.begin(), s.run_sum.end(), 0.0f);
    for (int64_t start = lo_all - lo_all % bs; start <= hi_all; start += bs) {
      if (start + kPrefetchBlocks * bs <= hi_all) {
        const int64_t ahead = table[start / bs + kPrefetchBlocks] * block_elems + h * dim;
        for (int64_t t = 0; t < bs; ++t) {
          for (int64_t off = 0; off < dim * static_cast<int64_t>(sizeof(T)); off += 64) {
            __builtin_prefetch(reinterpret_cast<const char*>(kc + ahead + t * token_stride) + off);
            __builtin_prefetch(reinterpret_cast<const char*>(vc + ahead + t * token_stride) + off);
          }
        }
      }
      const int64_t base = table[start / bs] * block_elems + h * dim;
      int64_t k_stride = token_stride, v_stride = token_stride;
      const float* keys = head_slice(kc + base, bs, dim, k_stride, s.k_head);
      const float* vals = head_slice(vc + base, bs, dim, v_stride, s.v_head);
      int64_t mv = 0;
      for (; mv + kMB <= vectors; mv += kMB) score_vectors<kMB>(qt, mp, keys, k_stride, dim, bs, st, mv);
      for (; mv < vectors; ++mv) score_vectors<1>(qt, mp, keys, k_stride, dim, bs, st, mv);
      if (p.soft_cap > 0.0f) {
        for (int64_t i = 0; i < bs * mp; ++i) st[i] = p.soft_cap * std::tanh(st[i] / p.soft_cap);
      }
      // Keys [t_lo, t_hi) of this block are seen by some lane; a key some lane does not see scores -inf there.
      const int64_t t_lo = lo_all > start ? lo_all - start : 0;
      const int64_t t_hi = hi_all - start + 1 < bs ? hi_all - start + 1 : bs;
      if (start < lo_max || start + bs - 1 > hi_min) {
        for (int64_t t = 0; t < bs; ++t) {
          const int32_t pos = static_cast<int32_t>(start + t);
#pragma omp simd
          for (int64_t m = 0; m < mp; ++m) {
            if (pos < lo[m] || pos > hi[m]) st[t * mp + m] = -INFINITY;
          }
        }
      }
#pragma omp simd
      for (int64_t m = 0; m < mp; ++m) alpha[m] = run_max[m];
      for (int64_t t = t_lo; t < t_hi; ++t) {
#pragma omp simd
        for (int64_t m = 0; m < mp; ++m) alpha[m] = st[t * mp + m] > alpha[m] ? st[t * mp + m] : alpha[m];
      }
      // alpha holds the new running max here; below it becomes the old accumulators' rescale.
      for (int64_t t = t_lo; t < t_hi; ++t) {
#pragma omp simd
        for (int64_t m = 0; m < mp; ++m) st[t * mp + m] = exp_nonpositive(st[t * mp + m] - alpha[m]);
      }
#pragma omp simd
      for (int64_t m = 0; m < mp; ++m) {
        const float new_max = alpha[m];
        alpha[m] = exp_nonpositive(run_max[m] - new_max);
        run_max[m] = new_max;
        run_sum[m] *= alpha[m];
      }
      for (int64_t t = t_lo; t < t_hi; ++t) {
#pragma omp simd
        for (int64_t m = 0; m < mp; ++m) run_sum[m] += st[t * mp + m];
      }
      mv = 0;
      for (; mv + kMB <= vectors; mv += kMB) value_vectors<kMB>(st, mp, vals, v_stride, dim, t_lo, t_hi, alpha, acc, mv);
      for (; mv < vectors; ++mv) value_vectors<1>(st, mp, vals, v_stride, dim, t_lo, t_hi, alpha, acc, mv);
    }
    for (int64_t m = 0; m < lanes; ++m) {
      if (members != nullptr) {
        const int64_t pair = (m / group) * heads + h * group + m % group;
        s.resume_max[pair] = run_max[m];
        s.resume_sum[pair] = run_sum[m];
        for (int64_t d = 0; d < dim; ++d) s.resume_acc[pair * dim + d] = acc[d * mp + m];
        continue;
      }
      const float inv = 1.0f / run_sum[m];
      float* out = p.out + ((u.first + m / group) * heads + h * group + m % group) * dim;
      for (int64_t d = 0; d < dim; ++d) out[d] = acc[d * mp + m] * inv;
    }
  }
}

// A cascade unit: its members' shared blocks once for all of them through the GEMM-shaped path (lanes of several
// rows' queries), then each member's own blocks through attend_unit, taking up where that left off. Decode over
// a shared prefix (a system prompt that prefix caching keeps in the same blocks for every row) reads those blocks
// once per unit rather than once per row, in register tiles rather than in dot products summed across lanes.
template <typename T>
void attend_cascade(const Problem& p, const Unit& u, const int32_t* members, TileScratch& ts, Scratch& s) {
  const int64_t heads = p.q_heads, dim = p.head_dim;
  attend_unit_tiled<T>(p, u, ts, members);
  for (int64_t j = 0; j < u.count; ++j) {
    const Resume from{ts.resume_max.data() + j * heads, ts.resume_sum.data() + j * heads,
                      ts.resume_acc.data() + j * heads * dim, u.shared_blocks};
    attend_unit<T>(p, Unit{members[j], 1}, s, &from);
  }
}

struct Shared {
  Problem problem;
  bool bits16;
  bool tiled;  // units of several tokens take attend_unit_tiled
  std::vector<Unit> units;
  std::vector<int32_t> members;  // of the cascade units
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// Whether unit i goes through attend_unit alone (a decode row, or a run of tokens where the tiles do not apply).
inline bool plain(const Shared& s, int64_t i) {
  return s.units[i].members_at < 0 && !(s.tiled && s.units[i].count >= kTiledMinTokens);
}

// The first block unit i reads (of its first token's row), for the unit before it to prefetch.
inline int64_t first_block_of(const Shared& s, int64_t i) {
  const Problem& p = s.problem;
  const int64_t t = s.units[i].first, pos = p.token_pos[t];
  const int64_t lo = p.window > 0 && pos + 1 > p.window ? pos + 1 - p.window : 0;
  return p.tables[static_cast<int64_t>(p.token_row[t]) * p.width + lo / p.block_size];
}

// Take units until none is left; returns after the last unit this thread took. A plain unit reserves the unit after it
// when it starts, if that one is plain too, so that its last block prefetches that one's first: each row's first block
// would otherwise come from memory unprefetched. Tiled and cascade units are neither reserved nor reserve: holding a
// long unit back while another runs could leave the other threads idle at the end.
void drain(Shared& s) {
  thread_local Scratch scratch;
  thread_local TileScratch tile_scratch;
  const int64_t total = static_cast<int64_t>(s.units.size());
  int64_t i = s.next.fetch_add(1);
  while (i < total) {
    int64_t after = -1, then_block = -1;
    if (plain(s, i)) {
      int64_t peek = s.next.load();
      if (peek < total && plain(s, peek) && s.next.compare_exchange_strong(peek, peek + 1)) {
        after = peek;
        then_block = first_block_of(s, after);
      }
    }
    if (s.units[i].members_at >= 0) {
      const int32_t* members = s.members.data() + s.units[i].members_at;
      if (s.bits16) {
        attend_cascade<uint16_t>(s.problem, s.units[i], members, tile_scratch, scratch);
      } else {
        attend_cascade<float>(s.problem, s.units[i], members, tile_scratch, scratch);
      }
    } else if (!plain(s, i)) {
      if (s.bits16) {
        attend_unit_tiled<uint16_t>(s.problem, s.units[i], tile_scratch);
      } else {
        attend_unit_tiled<float>(s.problem, s.units[i], tile_scratch);
      }
    } else if (s.bits16) {
      attend_unit<uint16_t>(s.problem, s.units[i], scratch, nullptr, then_block);
    } else {
      attend_unit<float>(s.problem, s.units[i], scratch, nullptr, then_block);
    }
    s.done.fetch_add(1, std::memory_order_release);
    i = after >= 0 ? after : s.next.fetch_add(1);
  }
}

// Cascade units formed in this process (jaxllm_cascade_units: for tests and profiles).
std::atomic<int64_t> cascade_units{0};

// Cascade units out of the decode tokens (units of one token). Tokens are grouped by their row's first block;
// within a group each token's share is the blocks its table has in common with the group's first token's, up to
// those it sees whole; tokens sharing at least kMinSharedBlocks are taken in order of their share, largest first,
// in pieces of up to kTile tokens (lanes of kTile * group queries, as a prefill unit's) whose shared blocks are the
// smallest share among them, so that a row that shares less only shortens its own piece. The pieces come in a
// multiple of the threads, as even as that allows, so that the threads get the same work (and the rows' own
// blocks, from memory, dominate it); none where a piece would have fewer than half a vector of query lanes (the
// tiles would be mostly padding). Cascade units go first in s.units, the other units after them in their order.
// Not with a sliding window (a key of the shared blocks could lie outside it).
void form_cascades(Shared& s, int64_t threads) {
  const Problem& p = s.problem;
  const int64_t group = p.q_heads / p.kv_heads;
  const auto table_of = [&](int64_t unit) { return p.tables + p.token_row[s.units[unit].first] * p.width; };
  std::vector<std::pair<int32_t, int64_t>> decode;  // (first block, unit) of the decode units that could share
  for (int64_t i = 0; i < static_cast<int64_t>(s.units.size()); ++i) {
    const Unit& u = s.units[i];
    if (u.count == 1 && p.token_pos[u.first] + 1 >= kMinSharedBlocks * p.block_size) {
      decode.emplace_back(table_of(i)[0], i);
    }
  }
  std::sort(decode.begin(), decode.end());
  std::vector<Unit> cascades;
  std::vector<bool> taken(s.units.size(), false);
  std::vector<std::pair<int64_t, int64_t>> share;  // (-shared blocks, unit) of one group
  for (size_t lo = 0, hi = 0; lo < decode.size(); lo = hi) {
    hi = lo;
    while (hi < decode.size() && decode[hi].first == decode[lo].first) ++hi;
    const int32_t* lead = table_of(decode[lo].second);
    share.clear();
    for (size_t k = lo; k < hi; ++k) {
      const int64_t unit = decode[k].second;
      const int32_t* table = table_of(unit);
      const int64_t whole = (p.token_pos[s.units[unit].first] + 1) / p.block_size;
      int64_t b = 0;
      while (b < whole && table[b] == lead[b]) ++b;
      if (b >= kMinSharedBlocks) share.emplace_back(-b, unit);
    }
    const int64_t n = static_cast<int64_t>(share.size());
    const int64_t pieces = threads * ((n + threads * kTile - 1) / (threads * kTile));
    const int64_t piece = (n + pieces - 1) / pieces;
    if (n < 2 || 2 * piece * group < kLanes) continue;
    std::sort(share.begin(), share.end());
    for (int64_t k = 0; k + 1 < n; k += piece) {
      const int64_t count = std::min(piece, n - k);
      const int64_t shared = -share[k + count - 1].first;  // the piece's smallest share
      Unit c{s.units[share[k].second].first, count, static_cast<int64_t>(s.members.size()), shared};
      for (int64_t m = 0; m < count; ++m) {
        s.members.push_back(static_cast<int32_t>(s.units[share[k + m].second].first));
        taken[share[k + m].second] = true;
      }
      cascades.push_back(c);
    }
  }
  if (cascades.empty()) return;
  cascade_units.fetch_add(static_cast<int64_t>(cascades.size()), std::memory_order_relaxed);
  for (size_t i = 0; i < s.units.size(); ++i) {
    if (!taken[i]) cascades.push_back(s.units[i]);
  }
  s.units.swap(cascades);
}

std::string at(int64_t token) { return "paged_attention_cpu: token " + std::to_string(token) + " "; }

ffi::Error RaggedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                      ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> token_row, ffi::Buffer<ffi::S32> token_pos,
                      ffi::ResultBuffer<ffi::F32> out, float scale, float soft_cap, int32_t sliding_window,
                      int32_t block_size, int32_t num_kv_heads) {
  const auto qd = q.dimensions(), kd = k_cache.dimensions(), td = tables.dimensions();
  if (qd.size() != 3 || kd.size() != 2 || td.size() != 2 || block_size < 1 || block_size > kMaxBlockSize ||
      num_kv_heads < 1 || qd[1] % num_kv_heads != 0 || kd[1] != int64_t{block_size} * num_kv_heads * qd[2] ||
      token_row.element_count() != static_cast<size_t>(qd[0]) ||
      token_pos.element_count() != static_cast<size_t>(qd[0])) {
    return ffi::Error::InvalidArgument(
        "paged_attention_cpu: q must be [T, Hq, D] with Hq a multiple of num_kv_heads, caches "
        "[N, block_size * Hkv * D] with block_size <= 256, tables [S, W], token_row and token_pos [T]");
  }
  const ffi::DataType dtype = k_cache.element_type();
  if (v_cache.element_type() != dtype || (dtype != ffi::DataType::F32 && dtype != ffi::DataType::U16)) {
    return ffi::Error::InvalidArgument("paged_attention_cpu: caches must both be float32 or uint16 (bfloat16 bits)");
  }
  Problem p{q.typed_data(), k_cache.untyped_data(), v_cache.untyped_data(), tables.typed_data(),
            token_row.typed_data(), token_pos.typed_data(), out->typed_data(), qd[1], num_kv_heads, qd[2],
            block_size, td[1], scale, soft_cap, sliding_window};
  const int64_t num_tokens = qd[0], num_rows = td[0], num_blocks = kd[0];
  auto shared = std::make_shared<Shared>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int32_t row = p.token_row[t], pos = p.token_pos[t];
    if (row < 0) {
      std::memset(p.out + t * p.q_heads * p.head_dim, 0, sizeof(float) * p.q_heads * p.head_dim);
      continue;
    }
    if (row >= num_rows) {
      return ffi::Error::InvalidArgument(at(t) + "row " + std::to_string(row) + " outside [0, " +
                                         std::to_string(num_rows) + ")");
    }
    if (pos < 0 || pos >= p.width * p.block_size) {
      return ffi::Error::InvalidArgument(at(t) + "position " + std::to_string(pos) + " outside the table's " +
                                         std::to_string(p.width * p.block_size) + " positions");
    }
    const int64_t first_block = p.window > 0 && pos + 1 > p.window ? (pos + 1 - p.window) / p.block_size : 0;
    for (int64_t b = first_block; b <= pos / p.block_size; ++b) {
      const int32_t id = p.tables[row * p.width + b];
      if (id < 0 || id >= num_blocks) {
        return ffi::Error::InvalidArgument(at(t) + "(row " + std::to_string(row) + ") block id " +
                                           std::to_string(id) + " outside [0, " + std::to_string(num_blocks) + ")");
      }
    }
    Unit* last = shared->units.empty() ? nullptr : &shared->units.back();
    if (last != nullptr && last->first + last->count == t && p.token_row[last->first] == row && last->count < kTile) {
      ++last->count;
    } else {
      shared->units.push_back(Unit{t, 1});
    }
  }
  shared->problem = p;
  shared->bits16 = dtype == ffi::DataType::U16;
  shared->tiled = block_size % kTB == 0 && p.head_dim % kDB == 0;
  if (shared->tiled && p.window == 0) form_cascades(*shared, std::max<int64_t>(1, pool.num_threads()));
  const int64_t total = static_cast<int64_t>(shared->units.size());
  const int64_t helpers = pool.num_threads() - 1;
  for (int64_t i = 0; i < helpers && i + 1 < total; ++i) {
    // A task that starts after the work is done finds nothing to take; the shared_ptr keeps its state alive.
    pool.Schedule([shared] { drain(*shared); });
  }
  drain(*shared);
  while (shared->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

// The number of cascade units formed in this process so far.
extern "C" int64_t jaxllm_cascade_units() { return cascade_units.load(std::memory_order_relaxed); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmPagedAttentionCpu, RaggedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<int32_t>("block_size")
                                  .Attr<int32_t>("num_kv_heads"));
