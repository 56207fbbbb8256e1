// Matmuls for XLA's CPU backend, as XLA FFI custom calls: the dense layers and the lm_head of a step.
//
// jaxllm_matmul_cpu, x @ w[layer]: inside the model's layer scan, XLA slices each layer's weights out of the
// stacked parameters with a dynamic-slice, which on its CPU backend is a copy of every weight on every step (a
// dot cannot read through the slice), and its dots of a few rows then stream the copy again. A decode step of a
// small model is those bytes. This call takes the whole stacked weight and the layer index and reads that
// layer's weight in place, once: each column panel's rows stream through registers for a few rows of x at a
// time.
//
// jaxllm_matmul_bf16_cpu: the same for bfloat16 weights and x. XLA's bfloat16 dots pay the same slice copy; here
// the weights are read in place at half float32's bytes, and with AVX-512-BF16 each vdpbf16ps multiplies 16
// pairs of bfloat16 (two rows of K) into float32 accumulators.
//
// jaxllm_matmul_nt_cpu, x @ w^T: the tied embedding [V, E] as the lm_head, each output a dot of a row of x
// with a row of w. On full rows the embedding streams from memory as under XLA's dot; what it is for is `rows`
// below: a step's head has one row per sequence of its bucket, most of them padding in a prefill step.
//
// jaxllm_matmul_nt_packed_cpu: the same product with w's panels packed once beforehand (the engine keeps them
// beside the embedding): each panel is read where it lies, from one row of x on, instead of transposed on every
// call.
//
// All take `rows`, the rows of x that hold tokens (a step's batch is padded to its bucket): only those are
// computed, the rest of y is zeros, so a padded step pays for its real tokens (and a padding row never holds
// stale memory that could be NaN).
//
// Operands (row-major):
//   jaxllm_matmul_cpu:    x float32 [M, K]; w float32 [L, K, N], N a multiple of 16; layer int32 [] in [0, L);
//                         rows int32 [].
//   jaxllm_matmul_bf16_cpu: as jaxllm_matmul_cpu with x and w bfloat16 (or uint16 bfloat16 bits) and K even. Without
//                         AVX-512-BF16 the weights are converted to float32 as they are read.
//   jaxllm_matmul_nt_cpu: x float32 [M, K]; w float32 [N, K], K a multiple of 16; rows int32 [].
//   jaxllm_matmul_nt_packed_cpu: x, w and rows as jaxllm_matmul_nt_cpu with N a multiple of kPanel; panels float32
//                         [N / kPanel, K, kPanel], panels[p][k][j] = w[p * kPanel + j][k] (w's values unread).
// Result: float32 [M, N], accumulated in float32; rows [rows, M) zeros (rows is clamped to [0, M]).
// Errors: shapes outside those above return an FFI error saying what is expected; a layer outside [0, L) one
// naming the layer.
//
// Work: panels of columns (the last ones in pieces: set_units) are the units, taken from an atomic counter by the
// calling thread and tasks on XLA's intra-op thread pool. Within a panel of kPanel columns, tiles of kRows rows
// of x accumulate in registers down K (x of at most kFewRows rows: panels of kFewPanel columns, tiles of
// kFewTileRows rows);
// jaxllm_matmul_nt_cpu first transposes its panel (kPanel rows of w) into a per-thread buffer, by blocks of
// kLanes x kLanes in registers, so the same tiles read it. With fewer than kPackMinRows rows (and in a last,
// narrower panel) it takes dot tiles instead: kNtRows rows of x by kNtCols rows of w, kLanes accumulators of
// lane-wise partial dots down K, summed across lanes together by the shuffle tree of cpu_vectors.h.
// jaxllm_matmul_nt_packed_cpu's panels are kPanel columns at any row count, read in place by the same tiles.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

#include "cpu_vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxllm_cpu;

// Tiles of kRows rows by kCols vectors of columns in panels of kPanel columns; x of at most kFewRows rows takes
// tiles of kFewTileRows rows by kFewCols vectors instead, in panels of kFewPanel columns.
#ifdef __AVX512F__
constexpr int kRows = 6;  // 6 rows x 4 vectors: 24 accumulators of AVX-512's 32 registers
constexpr int kCols = 4;
constexpr int kFewRows = kRows, kFewTileRows = kRows, kFewCols = kCols;
constexpr int kNtRows = 4;  // 4 x 4 dots: 16 accumulators, 4 + 4 more registers for x and w
#else
// AVX2: 6 x 2 (12 of its 16 registers) reads each panel once per 6 rows, where 3 x 4 read it once per 3. Up to
// 6 rows tiles of 3 x 4 read 128 bytes of each row of the weights at a time, which stream from memory faster
// than 64.
constexpr int kRows = 6;
constexpr int kCols = 2;
constexpr int kFewRows = 6, kFewTileRows = 3, kFewCols = 4;
constexpr int kNtRows = 2;  // 2 x 4 dots: 8 accumulators, 2 + 4 more registers
#endif
constexpr int64_t kPanel = kCols * kLanes;
constexpr int64_t kFewPanel = kFewCols * kLanes;
constexpr int kNtCols = kLanes / kNtRows;  // rows of w per dot tile: a tile's dots fill one vector
// jaxllm_matmul_nt_cpu: from this many rows of x a panel of w is transposed into a buffer and multiplied as in
// jaxllm_matmul_cpu; fewer rows take the dot tiles (reading w once, at memory speed either way).
constexpr int64_t kPackMinRows = 8;
static_assert(kPackMinRows > kFewRows && kRows >= kFewRows, "packed panels and tiles of more than one tile of "
              "rows are kPanel columns wide");

// A bfloat16's bits as the float32 it is (its high half).
inline float to_float(uint16_t b) { return __builtin_bit_cast(float, static_cast<uint32_t>(b) << 16); }
inline float to_float(float f) { return f; }

// kLanes consecutive weights as float32: a load, or for bfloat16 bits a widening and a shift.
inline VF loadw(const float* p) { return loadv(p); }
inline VF loadw(const uint16_t* p) {
  typedef uint16_t VH __attribute__((vector_size(kLanes * sizeof(uint16_t))));
  typedef uint32_t VU __attribute__((vector_size(kLanes * sizeof(uint32_t))));
  VH h;
  std::memcpy(&h, p, sizeof(h));
  return reinterpret_cast<VF>(__builtin_convertvector(h, VU) << 16);
}

// One tile's operands: rows of x (xs elements apart), k rows of a panel of w (ws apart) from the same K offset,
// rows of y (ys apart); accumulate: add to y's values (a later chunk of K) instead of storing. pf: pf_rows rows
// (pf_stride elements apart, pf_lines cache lines each) of the weights a later tile reads, prefetched one row
// per row of K here so that memory is read while this tile computes (pf_rows 0: none).
template <typename T>
struct Operands {
  const T* x;
  int64_t xs;
  const T* w;
  int64_t ws;
  float* y;
  int64_t ys;
  int64_t k;
  bool accumulate;
  const T* pf = nullptr;
  int64_t pf_stride = 0, pf_rows = 0;
  int pf_lines = 0;
};

// The prefetches of Operands::pf due at row k of a tile of o.k rows (row k, and k + o.k, ... past o.k rows).
// Into L2, not L1 (prefetcht1, not t0): the chunk the tiles reread fills L1 (32 KiB of it with AVX-512), and lines
// prefetched into L1 would evict it.
template <typename T>
inline void prefetch_rows(const Operands<T>& o, int64_t k) {
  for (int64_t row = k; row < o.pf_rows; row += o.k) {
    const char* line = reinterpret_cast<const char*>(o.pf + row * o.pf_stride);
    for (int i = 0; i < o.pf_lines; ++i) __builtin_prefetch(line + 64 * i, 0, 2);
  }
}

// y[r0, r0 + R) x [0, C * kLanes) (+)= x[r0, r0 + R) @ w[:, 0, C * kLanes).
// T: float, or uint16_t for bfloat16 bits converted to float32 as they are read (CPUs without AVX-512-BF16).
template <int R, int C, typename T>
inline void tile(const Operands<T>& o, int64_t r0) {
  VF acc[R][C] = {};
  if (o.accumulate) {
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < C; ++c) acc[r][c] = loadv(o.y + (r0 + r) * o.ys + c * kLanes);
    }
  }
  const T* rows = o.x + r0 * o.xs;
  for (int64_t k = 0; k < o.k; ++k) {
    prefetch_rows(o, k);
    VF wv[C];
    for (int c = 0; c < C; ++c) wv[c] = loadw(o.w + k * o.ws + c * kLanes);
    for (int r = 0; r < R; ++r) {
      const float xv = to_float(rows[r * o.xs + k]);
      for (int c = 0; c < C; ++c) acc[r][c] += wv[c] * xv;
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) storev(o.y + (r0 + r) * o.ys + c * kLanes, acc[r][c]);
  }
}

#ifdef __AVX512BF16__
// The bfloat16 tile where the CPU multiplies pairs of bfloat16 in one instruction (vdpbf16ps: lane i of the
// accumulator += a[2i] * b[2i] + a[2i + 1] * b[2i + 1], in float32): K is taken two rows at a time, rows k and
// k + 1 of 32 columns interleaved into two registers of pairs (vpunpcklwd / vpunpckhwd, shared by the R rows of
// x), and each row's (x[k], x[k + 1]) broadcast as one 32-bit pair. The interleave works within 128-bit lanes,
// so `lo` holds columns 0-3, 8-11, 16-19, 24-27 of the 32 and `hi` the others; the accumulators leave (and
// re-enter) that order once per tile (a 16-bit permute across lanes, vpermt2w, is three micro-ops per use on
// Intel cores). C: vectors of 16 columns, even; o.k even (the caller checks).
template <int R, int C>
inline void tile_pairs(const Operands<uint16_t>& o, int64_t r0) {
  static_assert(kLanes == 16 && C % 2 == 0, "AVX-512: 16 float32 lanes, 32 bfloat16 columns per pair of vectors");
  // Column j of the 32 sits in lo (j % 8 < 4) or hi, lane 4 * (j / 8) + j % 4 of it; index bit 4 picks the
  // second operand.
  alignas(64) static constexpr int32_t kFirst[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
  alignas(64) static constexpr int32_t kSecond[16] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
  alignas(64) static constexpr int32_t kLo[16] = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  alignas(64) static constexpr int32_t kHi[16] = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; c += 2) {
      if (o.accumulate) {
        const float* in = o.y + (r0 + r) * o.ys + c * kLanes;
        const __m512 a = _mm512_loadu_ps(in), b = _mm512_loadu_ps(in + kLanes);
        acc[r][c] = _mm512_permutex2var_ps(a, _mm512_load_si512(kLo), b);
        acc[r][c + 1] = _mm512_permutex2var_ps(a, _mm512_load_si512(kHi), b);
      } else {
        acc[r][c] = acc[r][c + 1] = _mm512_setzero_ps();
      }
    }
  }
  const uint16_t* rows = o.x + r0 * o.xs;
  for (int64_t k = 0; k < o.k; k += 2) {
    prefetch_rows(o, k);
    prefetch_rows(o, k + 1);
    __m512bh wv[C];
    for (int c = 0; c < C; c += 2) {
      const __m512i a = _mm512_loadu_si512(o.w + k * o.ws + c * kLanes);
      const __m512i b = _mm512_loadu_si512(o.w + (k + 1) * o.ws + c * kLanes);
      wv[c] = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(a, b));
      wv[c + 1] = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(a, b));
    }
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, rows + r * o.xs + k, sizeof(pair));
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wv[c], xv);
    }
  }
  const __m512i first = _mm512_load_si512(kFirst), second = _mm512_load_si512(kSecond);
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; c += 2) {
      float* out = o.y + (r0 + r) * o.ys + c * kLanes;
      _mm512_storeu_ps(out, _mm512_permutex2var_ps(acc[r][c], first, acc[r][c + 1]));
      _mm512_storeu_ps(out + kLanes, _mm512_permutex2var_ps(acc[r][c], second, acc[r][c + 1]));
    }
  }
}
#endif

// One tile of R rows: the pairs tile for bfloat16 where the CPU has it, else the float32 arithmetic of tile.
template <int R, int C, typename T>
inline void any_tile(const Operands<T>& o, int64_t r0) {
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, uint16_t> && C % 2 == 0) {
    tile_pairs<R, C>(o, r0);
    return;
  }
#endif
  tile<R, C>(o, r0);
}

// The last `rows_left` (< R + 1) rows of a panel, as one tile of exactly that many rows.
template <int R, int C, typename T>
inline void tail(const Operands<T>& o, int64_t r0, int64_t rows_left) {
  if constexpr (R > 0) {
    if (rows_left == R) {
      any_tile<R, C>(o, r0);
    } else {
      tail<R - 1, C>(o, r0, rows_left);
    }
  }
}

// Rows [0, m) of the tiles of one chunk of K; the rows of o.pf are shared out among the tiles.
template <int R, int C, typename T>
inline void tiles(Operands<T> o, int64_t m) {
  const int64_t count = (m + R - 1) / R, pf_rows = o.pf_rows, share = (pf_rows + count - 1) / count;
  const T* pf = o.pf;
  int64_t r = 0;
  for (int64_t t = 0; t < count; ++t, r += R) {
    o.pf = pf + std::min(t * share, pf_rows) * o.pf_stride;
    o.pf_rows = std::clamp<int64_t>(pf_rows - t * share, 0, share);
    if (r + R <= m) {
      any_tile<R, C>(o, r);
    } else {
      tail<R - 1, C>(o, r, m - r);
    }
  }
}

// Rows of K per chunk of a panel read in place at w's stride, or copied for fewer than kWholeMinRows rows of x,
// when x has more than one tile of rows: at most 128 rows of 64 float32 columns, 32 KiB (AVX2: 8 KiB of a
// 16-column panel, 16 KiB of a 32-column one), which stay in L1 while every tile of rows reads them.
constexpr int64_t kChunk = 128;
// From this many rows of a unit (its rows of x) a chunk (from kWholeMinRows rows, a pass: below) is copied into a
// contiguous buffer (below, panel); fewer rows' tiles read it in place unless its rows are a multiple of 4 KiB
// apart. With AVX-512 the copy cost more than it saved up to 8 tiles of rows; AVX2 copies from two tiles.
#ifdef __AVX512F__
constexpr int64_t kCopyMinRows = 8 * kRows + 1;
#else
constexpr int64_t kCopyMinRows = kFewTileRows + 1;
#endif
// From this many rows a copied panel is copied in passes of up to kPassBytes (all of K, for SmolLM2), and each tile
// runs down a whole pass from the buffer (in L2: 144 KiB at K = 576, 384 KiB at K = 1536) instead of in chunks
// from L1: a chunk's tiles add to y, so every chunk after the first reread and rewrote all of the unit's rows of
// y, and a chunk of 32 KiB filled L1 beside the tiles' rows of x. Below that, the whole copy, a stream of the
// weights with little arithmetic beside it, is slower than chunks. With AVX-512 a unit is copied from 49 rows
// (kCopyMinRows) except where w's rows are a multiple of 4 KiB apart.
constexpr int64_t kWholeMinRows = 4 * kRows;
// The most of a panel one pass of its tiles reads: K = 1536 at 64 float32 columns (a longer K goes in passes that
// add to y, each prefetched while the one before computes). A pass and the next one prefetched beside it take
// 768 KiB, within a 1 MiB L2.
constexpr int64_t kPassBytes = 384 * 1024;

// Rows [0, m) of y's C vectors of columns at y (row stride ys) from w's at w (row stride ws).
// One tile of rows reads the panel once, in place. More tiles read it once per tile, so the panel is taken in
// chunks of kChunk rows of K; from kCopyMinRows rows, or where the rows are a multiple of 4 KiB apart, each chunk
// is copied into a contiguous per-thread buffer first (unless w is one already): in place, rows of the panel ws
// elements apart map to few cache sets when ws * sizeof(T) is a multiple of 4 KiB, and a chunk stays in L1
// while the tiles reread it. The tiles of a later chunk add to y. A panel that is contiguous already
// (jaxllm_matmul_nt_cpu's packed one, whose y rows are the vocabulary apart, often a multiple of 4 KiB, so that
// rereading y per chunk would miss every cache; or a w exactly one panel wide) or copied from kWholeMinRows rows
// is taken in passes of up to
// kPassBytes instead of chunks. While a chunk's (or pass's) tiles run they prefetch the next one's rows, or
// `next`'s first (the panel this thread takes next, same stride and at least as wide; nullptr: none), so that
// the copy (or, in place, the tiles) finds them in cache.
template <int R, int C, typename T>
void panel(const T* x, const T* w, int64_t ws, float* y, int64_t ys, int64_t m, int64_t k_dim, const T* next) {
  constexpr int64_t cols = C * kLanes;
  if (m <= R) {
    tiles<R, C>(Operands<T>{x, k_dim, w, ws, y, ys, k_dim, false}, m);
    return;
  }
  constexpr int lines = std::max<int>(1, cols * sizeof(T) / 64);
  thread_local std::vector<T> chunk;
  const bool copy = ws != cols && (m >= kCopyMinRows || ws * static_cast<int64_t>(sizeof(T)) % 4096 == 0);
  constexpr int64_t pass = kPassBytes / (cols * sizeof(T));
  static_assert(pass % 2 == 0 && pass >= kChunk, "passes of whole pairs of rows (the bfloat16 pairs tiles)");
  const int64_t step = (ws == cols || (copy && m >= kWholeMinRows)) ? pass : kChunk;
  // Only grown: a resize that shrank and regrew would zero the buffer again.
  const int64_t held = std::min(step, k_dim) * cols;
  if (copy && static_cast<int64_t>(chunk.size()) < held) chunk.resize(held);
  for (int64_t k0 = 0; k0 < k_dim; k0 += step) {
    const int64_t kc = std::min(step, k_dim - k0);
    const T* rows = w + k0 * ws;
    if (copy) {
      for (int64_t k = 0; k < kc; ++k) std::memcpy(chunk.data() + k * cols, rows + k * ws, cols * sizeof(T));
      rows = chunk.data();
    }
    Operands<T> o{x + k0, k_dim, rows, copy ? cols : ws, y, ys, kc, k0 > 0};
    if (ws == cols) {
      // A contiguous panel (jaxllm_matmul_nt_cpu's packed one, or a w one panel wide) is read where it is: the
      // hardware's prefetcher follows it.
    } else if (k0 + kc < k_dim) {
      o.pf = w + (k0 + kc) * ws;
      o.pf_rows = std::min(step, k_dim - k0 - kc);
    } else if (next != nullptr) {
      o.pf = next;
      o.pf_rows = std::min(step, k_dim);
    }
    o.pf_stride = ws;
    o.pf_lines = lines;
    tiles<R, C>(o, m);
  }
}

// The kLanes x kLanes block in v (row i = v[i]) transposed in registers: stage t swaps bit t of the row and
// lane indices, pairing rows i and i | 2^t through two-vector shuffles.
inline void transpose(VF (&v)[kLanes]) {
#pragma GCC unroll 8
  for (int t = 0; t < kLevels; ++t) {
    const int b = 1 << t;
    const VI bit = (kIota & b) != 0;  // -1 where lane j has bit t
    const VI lo = kIota + (bit & (kLanes - b));     // bit clear: a[j]; set: b[j - 2^t]
    const VI hi = kIota + ((bit & kLanes) | (~bit & b));  // bit clear: a[j + 2^t]; set: b[j]
#pragma GCC unroll 16
    for (int i = 0; i < kLanes; ++i) {
      if (i & b) continue;
      const VF a = v[i], c = v[i | b];
      v[i] = __builtin_shuffle(a, c, lo);
      v[i | b] = __builtin_shuffle(a, c, hi);
    }
  }
}

// packed[k][j] = w[j][k] for the kPanel rows of w at w (row length k_dim, a multiple of kLanes).
void pack_transposed(const float* w, int64_t k_dim, float* packed) {
  for (int64_t j0 = 0; j0 < kPanel; j0 += kLanes) {
    for (int64_t k0 = 0; k0 < k_dim; k0 += kLanes) {
      VF v[kLanes];
      for (int i = 0; i < kLanes; ++i) v[i] = loadv(w + (j0 + i) * k_dim + k0);
      transpose(v);
      for (int i = 0; i < kLanes; ++i) storev(packed + (k0 + i) * kPanel + j0, v[i]);
    }
  }
}

// Keeps v in a vector register from here on (an empty x86 asm whose operand must be one); elsewhere nothing.
inline void in_register(VF& v) {
#if defined(__x86_64__) || defined(__i386__)
  asm("" : "+v"(v));
#else
  (void)v;
#endif
}

// y[r0, r0 + kNtRows) x [c0, c0 + kNtCols) = x[...] @ w[c0, ...]^T, for the rows below m and columns below n of
// that tile (the others read row m - 1 of x or row n - 1 of w, in bounds, and are not stored).
inline void nt_tile(const float* x, const float* w, float* y, int64_t m, int64_t k_dim, int64_t n, int64_t r0,
                    int64_t c0) {
  const float* xr[kNtRows];
  const float* wr[kNtCols];
  for (int r = 0; r < kNtRows; ++r) xr[r] = x + std::min<int64_t>(r0 + r, m - 1) * k_dim;
  for (int c = 0; c < kNtCols; ++c) wr[c] = w + std::min<int64_t>(c0 + c, n - 1) * k_dim;
  VF acc[kLanes] = {};  // acc[r * kNtCols + c]: lane-wise partial sums of dot(x row r0 + r, w row c0 + c)
  for (int64_t d = 0; d < k_dim; d += kLanes) {
    VF xv[kNtRows], wv[kNtCols];
    // Each vector loaded once into a register: left to itself GCC folds one operand's loads into the
    // multiply-adds, loading it once per use (20 loads per 16 multiply-adds instead of 8).
    for (int r = 0; r < kNtRows; ++r) {
      xv[r] = loadv(xr[r] + d);
      in_register(xv[r]);
    }
    for (int c = 0; c < kNtCols; ++c) {
      wv[c] = loadv(wr[c] + d);
      in_register(wv[c]);
    }
    for (int c = 0; c < kNtCols; ++c) {
      for (int r = 0; r < kNtRows; ++r) acc[r * kNtCols + c] += xv[r] * wv[c];
    }
  }
  float dots[kLanes];
  storev(dots, sum_lanes_together(acc));
  const int64_t cols = std::min<int64_t>(kNtCols, n - c0);
  for (int r = 0; r < kNtRows && r0 + r < m; ++r) {
    std::memcpy(y + (r0 + r) * n + c0, dots + r * kNtCols, cols * sizeof(float));
  }
}

struct Shared {
  const float* x;
  const float* w;
  const uint16_t* xb = nullptr;  // jaxllm_matmul_bf16_cpu: x and w as bfloat16 bits (x and w unused)
  const uint16_t* wb = nullptr;
  float* y;
  int64_t m, k, n;
  int64_t panel_cols, panels;  // set_panels
  // Units of work (set_units): panels [0, whole) whole, then each later panel in `pieces` pieces of rows
  // (by_rows) or of columns.
  int64_t whole, pieces, units;
  bool by_rows;
  bool transposed;  // jaxllm_matmul_nt_cpu
  const float* packed = nullptr;  // jaxllm_matmul_nt_packed_cpu: w's panels as pack_transposed leaves them
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// The panels of s's m rows: kFewPanel columns each up to kFewRows rows, else kPanel (packed panels: kPanel).
void set_panels(Shared& s) {
  s.panel_cols = s.m <= kFewRows && s.packed == nullptr ? kFewPanel : kPanel;
  s.panels = (s.n + s.panel_cols - 1) / s.panel_cols;
}

// Whether drain takes each unit one ahead: with more than one tile of rows (see drain).
bool reserves_ahead(const Shared& s) { return s.m > (s.m <= kFewRows ? kFewTileRows : kRows); }

// The units `threads` threads share: whole panels while every thread can take one, then the last
// panels % threads panels cut into `threads` pieces each, so that no thread waits idle through a last whole
// panel (N = 576 is 9 panels of 64 columns, 192 is 3: on 2 cores whole panels alone leave one thread idle at the
// end). With more than one tile of rows the pieces are runs of tiles, each reading the panel's weights again
// (which many rows amortize); with one tile (a decode step, which streams the weights once) they are runs of the
// panel's columns, whole vectors each. Where drain reserves a thread's next unit ahead, fewer panels than two per
// thread are all cut: the reservation would otherwise give the first thread two whole panels of three and the
// other thread the third in both pieces, and as many panels as threads would all go to the first. Not where
// drain takes one unit at a time (a decode step): pieces of columns there are slower than the split above.
void set_units(Shared& s, int64_t threads) {
  const int64_t tail = s.panels % threads;
  const bool cut_all = reserves_ahead(s) && s.panels < 2 * threads;
  s.by_rows = s.m > kRows;
  const int64_t most = s.by_rows ? (s.m + kRows - 1) / kRows : s.panel_cols / kLanes;
  s.pieces = tail > 0 || cut_all ? std::min(threads, most) : 1;
  s.whole = s.pieces <= 1 ? s.panels : cut_all ? 0 : s.panels - tail;
  s.units = s.whole + (s.panels - s.whole) * s.pieces;
}

// panel<R, C> for the panel's `vectors` vectors of columns (C or more: C), with C = kFewCols up to kFewRows
// rows, else kCols.
template <int R, int C, typename T>
void panel_of(const T* x, const T* w, int64_t ws, float* y, int64_t ys, int64_t m, int64_t k_dim,
              int64_t vectors, const T* next) {
  if (vectors >= C) {
    panel<R, C>(x, w, ws, y, ys, m, k_dim, next);
  } else if constexpr (C > 1) {
    panel_of<R, C - 1>(x, w, ws, y, ys, m, k_dim, vectors, next);
  }
}

template <typename T>
void any_panel(const T* x, const T* w, int64_t ws, float* y, int64_t ys, int64_t m, int64_t k_dim,
               int64_t vectors, const T* next) {
  if (m <= kFewRows) {
    panel_of<kFewTileRows, kFewCols>(x, w, ws, y, ys, m, k_dim, vectors, next);
  } else {
    panel_of<kRows, kCols>(x, w, ws, y, ys, m, k_dim, vectors, next);
  }
}

// Unit u: rows [r0, r0 + rows) by columns [c0, c0 + cols) of one panel (rows or cols may be 0: a piece past
// the last row or column).
struct Unit {
  int64_t panel, r0, rows, c0, cols;
};

Unit unit_of(const Shared& s, int64_t u) {
  const int64_t panel = u < s.whole ? u : s.whole + (u - s.whole) / s.pieces;
  Unit unit{panel, 0, s.m, panel * s.panel_cols, std::min(s.panel_cols, s.n - panel * s.panel_cols)};
  if (u < s.whole) return unit;
  const int64_t piece = (u - s.whole) % s.pieces;
  // Each piece but the last spans whole tiles of rows or whole vectors of columns; the last takes what is left.
  const int64_t step = s.by_rows ? kRows : kLanes;
  int64_t& start = s.by_rows ? unit.r0 : unit.c0;
  int64_t& size = s.by_rows ? unit.rows : unit.cols;
  const int64_t span = ((size + step - 1) / step + s.pieces - 1) / s.pieces * step;
  const int64_t end = start + size;
  start = std::min(end, start + piece * span);
  size = std::min(end, start + span) - start;
  return unit;
}

// One unit (unit_of); `next`: the unit this thread takes after it (its panel's weights are
// prefetched), or -1.
void run_unit(const Shared& s, int64_t u, int64_t next) {
  const Unit unit = unit_of(s, u);
  if (unit.rows == 0 || unit.cols == 0) return;
  const int64_t c0 = unit.c0, cols = unit.cols;
  const int64_t vectors = cols / kLanes;  // jaxllm_matmul_cpu and _bf16_cpu: N is a multiple of 16
  const int64_t m = unit.rows, x0 = unit.r0 * s.k, y0 = unit.r0 * s.n + c0;
  // The next panel's rows are prefetched as wide as this one's: not where it is a narrower last panel.
  const int64_t next_c0 = next >= 0 ? unit_of(s, next).c0 : s.n;
  const bool ahead = s.n - next_c0 >= cols;
  if (s.wb != nullptr) {
    const uint16_t* after = ahead ? s.wb + next_c0 : nullptr;
    any_panel(s.xb + x0, s.wb + c0, s.n, s.y + y0, s.n, m, s.k, vectors, after);
    return;
  }
  if (s.transposed && s.packed == nullptr && (s.m < kPackMinRows || cols < kPanel)) {
    for (int64_t r0 = 0; r0 < m; r0 += kNtRows) {
      for (int64_t c = c0; c < c0 + cols; c += kNtCols) {
        nt_tile(s.x + x0, s.w, s.y + unit.r0 * s.n, m, s.k, s.n, r0, c);
      }
    }
    return;
  }
  const float* w = s.w + c0;
  int64_t ws = s.n;
  if (s.packed != nullptr) {
    // A piece of a panel's columns starts within its packed panel.
    w = s.packed + c0 / kPanel * kPanel * s.k + c0 % kPanel;
    ws = kPanel;
  } else if (s.transposed) {
    thread_local std::vector<float> packed;
    packed.resize(s.k * kPanel);
    pack_transposed(s.w + c0 * s.k, s.k, packed.data());
    w = packed.data();
    ws = kPanel;
  }
  // A transposed panel is packed from rows of w, not read at this stride: nothing of it to prefetch. A packed one
  // is contiguous, and the hardware's prefetcher follows it (prefetching the next panel's lines as well is
  // slower).
  const float* after = ahead && !s.transposed ? s.w + next_c0 : nullptr;
  any_panel(s.x + x0, w, ws, s.y + y0, s.n, m, s.k, vectors, after);
}

// Take units until none is left; returns after the last unit this thread took. With more than one tile of rows
// each unit is taken one ahead, so that its weights are prefetched while the one before it computes; with one
// tile (a decode step) nothing is prefetched, and taking two at a time would only leave threads idle.
void drain(Shared& s) {
  const bool ahead = reserves_ahead(s);
  int64_t u = s.next.fetch_add(1);
  while (u < s.units) {
    const int64_t next = ahead ? s.next.fetch_add(1) : -1;
    run_unit(s, u, next < s.units ? next : -1);
    s.done.fetch_add(1, std::memory_order_release);
    u = ahead ? next : s.next.fetch_add(1);
  }
}

// Zeros in y's rows [rows, M), then the panels of the first `rows` rows over the pool.
void run(ffi::ThreadPool& pool, std::shared_ptr<Shared> s, int64_t total_rows) {
  std::memset(s->y + s->m * s->n, 0, (total_rows - s->m) * s->n * sizeof(float));
  if (s->m == 0) return;
  set_units(*s, std::max<int64_t>(1, pool.num_threads()));
  for (int64_t i = 0; i + 1 < pool.num_threads() && i + 1 < s->units; ++i) {
    // A task that starts after the work is done finds nothing to take; the shared_ptr keeps its state alive.
    pool.Schedule([s] { drain(*s); });
  }
  drain(*s);
  while (s->done.load(std::memory_order_acquire) < s->units) std::this_thread::yield();
}

int64_t valid_rows(ffi::Buffer<ffi::S32>& rows, int64_t m) {
  return std::clamp<int64_t>(*rows.typed_data(), 0, m);
}

// What both stacked matmuls share once their shapes are checked: the layer's range check, then the run, with
// `place(s, offset)` setting s's operand pointers (w at the layer's element offset). name: the call's, for errors.
template <typename Place>
ffi::Error run_stacked(ffi::ThreadPool& pool, const std::string& name, int64_t m, int64_t k, int64_t layers,
                       int64_t n, ffi::Buffer<ffi::S32>& layer, ffi::Buffer<ffi::S32>& rows, float* y,
                       Place place) {
  const int32_t index = *layer.typed_data();
  if (index < 0 || index >= layers) {
    return ffi::Error::InvalidArgument(name + ": layer " + std::to_string(index) + " outside [0, " +
                                       std::to_string(layers) + ")");
  }
  auto s = std::make_shared<Shared>();
  place(*s, index * k * n);
  s->y = y;
  s->m = valid_rows(rows, m);
  s->k = k;
  s->n = n;
  set_panels(*s);
  s->transposed = false;
  run(pool, s, m);
  return ffi::Error::Success();
}

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[1] != xd[1] || wd[2] % 16 != 0 || layer.element_count() != 1 ||
      rows.element_count() != 1) {
    return ffi::Error::InvalidArgument("matmul_cpu: x must be [M, K], w [L, K, N] with N a multiple of 16, "
                                       "layer and rows one int32 each");
  }
  return run_stacked(pool, "matmul_cpu", xd[0], xd[1], wd[0], wd[2], layer, rows, y->typed_data(),
                     [&](Shared& s, int64_t offset) {
                       s.x = x.typed_data();
                       s.w = w.typed_data() + offset;
                     });
}

// bfloat16, or uint16 holding bfloat16 bits (the engine's stored layer weights on CPU: models.loop_storage).
bool is_bf16_bits(const ffi::AnyBuffer& b) {
  return b.element_type() == ffi::DataType::BF16 || b.element_type() == ffi::DataType::U16;
}

ffi::Error MatmulBf16Impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> layer,
                          ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (!is_bf16_bits(x) || !is_bf16_bits(w) || xd.size() != 2 || wd.size() != 3 || wd[1] != xd[1] ||
      wd[1] % 2 != 0 || wd[2] % 16 != 0 || layer.element_count() != 1 || rows.element_count() != 1) {
    return ffi::Error::InvalidArgument("matmul_bf16_cpu: x must be bfloat16 [M, K], w bfloat16 [L, K, N] (or "
                                       "uint16 bits of them) with K even and N a multiple of 16, layer and rows "
                                       "one int32 each");
  }
  return run_stacked(pool, "matmul_bf16_cpu", xd[0], xd[1], wd[0], wd[2], layer, rows, y->typed_data(),
                     [&](Shared& s, int64_t offset) {
                       s.xb = static_cast<const uint16_t*>(x.untyped_data());
                       s.wb = static_cast<const uint16_t*>(w.untyped_data()) + offset;
                     });
}

// jaxllm_matmul_nt_cpu, or with `packed` jaxllm_matmul_nt_packed_cpu (its shapes checked already).
ffi::Error run_nt(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::F32>& w, const float* packed,
                  ffi::Buffer<ffi::S32>& rows, ffi::ResultBuffer<ffi::F32>& y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || wd[1] != xd[1] || xd[1] % 16 != 0 || wd[0] < 1 ||
      rows.element_count() != 1) {
    return ffi::Error::InvalidArgument(std::string(packed != nullptr ? "matmul_nt_packed_cpu" : "matmul_nt_cpu") +
                                       ": x must be [M, K] with K a multiple of 16, w [N, K] with N >= 1, rows "
                                       "one int32");
  }
  auto s = std::make_shared<Shared>();
  s->x = x.typed_data();
  s->w = w.typed_data();
  s->packed = packed;
  s->y = y->typed_data();
  s->m = valid_rows(rows, xd[0]);
  s->k = xd[1];
  s->n = wd[0];
  set_panels(*s);
  s->transposed = true;
  run(pool, s, xd[0]);
  return ffi::Error::Success();
}

ffi::Error MatmulNtImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                        ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y) {
  return run_nt(pool, x, w, nullptr, rows, y);
}

ffi::Error MatmulNtPackedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                              ffi::Buffer<ffi::F32> panels, ffi::Buffer<ffi::S32> rows,
                              ffi::ResultBuffer<ffi::F32> y) {
  const auto wd = w.dimensions(), pd = panels.dimensions();
  if (wd.size() != 2 || pd.size() != 3 || pd[0] * kPanel != wd[0] || pd[1] != wd[1] || pd[2] != kPanel) {
    const std::string p = std::to_string(kPanel);
    return ffi::Error::InvalidArgument("matmul_nt_packed_cpu: w must be [N, K] with N a multiple of " + p +
                                       " and panels [N / " + p + ", K, " + p + "]");
  }
  return run_nt(pool, x, w, panels.typed_data(), rows, y);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmMatmulCpu, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmMatmulBf16Cpu, MatmulBf16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmMatmulNtCpu, MatmulNtImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmMatmulNtPackedCpu, MatmulNtPackedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// The columns of jaxllm_matmul_nt_packed_cpu's panels in this build (kPanel: 64 with AVX-512, 16 with AVX2).
extern "C" int64_t jaxllm_matmul_panel_columns() { return kPanel; }
