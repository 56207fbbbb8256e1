// Matmuls for XLA's CPU backend, as XLA FFI custom calls: the dense layers and the lm_head of a step.
//
// jaxllm_matmul_cpu, x @ w[layer]: inside the model's layer scan, XLA slices each layer's weights out of the
// stacked parameters with a dynamic-slice, which on its CPU backend is a copy of every weight on every step (a
// dot cannot read through the slice), and its dots of a few rows then stream the copy again. A decode step of a
// small model is those bytes. This call takes the whole stacked weight and the layer index and reads that
// layer's weight in place, once: each column panel's rows stream through registers for a few rows of x at a
// time.
//
// jaxllm_matmul_nt_cpu, x @ w^T: the tied embedding [V, E] as the lm_head, each output a dot of a row of x
// with a row of w. Against XLA's dot of that shape it gains little on full rows (48 rows of SmolLM2's
// [49152, 576] embedding: 10.3 -> 9.7-11 ms, the embedding streaming from memory either way); what it is for is
// `rows` below: a step's head has one row per sequence of its bucket, most of them padding in a prefill step.
//
// Both take `rows`, the rows of x that hold tokens (a step's batch is padded to its bucket): only those are
// computed, the rest of y is zeros, so a padded step pays for its real tokens (and a padding row never holds
// stale memory that could be NaN).
//
// Operands (row-major):
//   jaxllm_matmul_cpu:    x float32 [M, K]; w float32 [L, K, N], N a multiple of 16 (bfloat16 weights keep XLA's
//                         dots: on a CPU with AVX-512-BF16 they multiply pairs of bf16 in one instruction, faster
//                         than converting to float32 here); layer int32 [] in [0, L); rows int32 [].
//   jaxllm_matmul_nt_cpu: x float32 [M, K]; w float32 [N, K], K a multiple of 16; rows int32 [].
// Result: float32 [M, N], accumulated in float32; rows [rows, M) zeros (rows is clamped to [0, M]).
// Errors: shapes outside those above return an FFI error saying what is expected; a layer outside [0, L) one
// naming the layer.
//
// Work: panels of columns are the units, taken from an atomic counter by the calling thread and tasks on XLA's
// intra-op thread pool. Within a panel of kPanel columns, tiles of kRows rows of x accumulate in registers down K;
// jaxllm_matmul_nt_cpu first transposes its panel (kPanel rows of w) into a per-thread buffer, by blocks of
// kLanes x kLanes in registers, so the same tiles read it. With fewer than kPackMinRows rows (and in a last,
// narrower panel) it takes dot tiles instead: kNtRows rows of x by kNtCols rows of w, kLanes accumulators of
// lane-wise partial dots down K, summed across lanes together by the shuffle tree of cpu_vectors.h.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cpu_vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxllm_cpu;

#ifdef __AVX512F__
constexpr int kRows = 6;  // 6 rows x 4 vectors: 24 accumulators of AVX-512's 32 registers
constexpr int kNtRows = 4;  // 4 x 4 dots: 16 accumulators, 4 + 4 more registers for x and w
#else
constexpr int kRows = 3;  // 3 x 4: 12 of AVX2's 16
constexpr int kNtRows = 2;  // 2 x 4 dots: 8 accumulators, 2 + 4 more registers
#endif
constexpr int kCols = 4;  // vectors of columns per panel
constexpr int64_t kPanel = kCols * kLanes;  // columns per panel
constexpr int kNtCols = kLanes / kNtRows;  // rows of w per dot tile: a tile's dots fill one vector
// jaxllm_matmul_nt_cpu: from this many rows of x a panel of w is transposed into a buffer and multiplied as in
// jaxllm_matmul_cpu; fewer rows take the dot tiles (reading w once, at memory speed either way).
constexpr int64_t kPackMinRows = 8;

// y[r0, r0 + R) x [0, C * kLanes) = x[r0, r0 + R) @ w[:, 0, C * kLanes), w's rows ws floats apart, y's ys.
template <int R, int C>
inline void tile(const float* x, const float* w, int64_t ws, float* y, int64_t ys, int64_t k_dim, int64_t r0) {
  VF acc[R][C] = {};
  const float* rows = x + r0 * k_dim;
  for (int64_t k = 0; k < k_dim; ++k) {
    VF wv[C];
    for (int c = 0; c < C; ++c) wv[c] = loadv(w + k * ws + c * kLanes);
    for (int r = 0; r < R; ++r) {
      const float xv = rows[r * k_dim + k];
      for (int c = 0; c < C; ++c) acc[r][c] += wv[c] * xv;
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) storev(y + (r0 + r) * ys + c * kLanes, acc[r][c]);
  }
}

// The last `rows_left` (< kRows) rows of a panel, as one tile of exactly that many rows.
template <int C, int R = kRows - 1>
inline void tail(const float* x, const float* w, int64_t ws, float* y, int64_t ys, int64_t k_dim, int64_t r0,
                 int64_t rows_left) {
  if constexpr (R > 0) {
    if (rows_left == R) {
      tile<R, C>(x, w, ws, y, ys, k_dim, r0);
    } else {
      tail<C, R - 1>(x, w, ws, y, ys, k_dim, r0, rows_left);
    }
  }
}

// Rows [0, m) of y's C vectors of columns at y (row stride ys) from w's at w (row stride ws).
template <int C>
void panel(const float* x, const float* w, int64_t ws, float* y, int64_t ys, int64_t m, int64_t k_dim) {
  int64_t r = 0;
  for (; r + kRows <= m; r += kRows) tile<kRows, C>(x, w, ws, y, ys, k_dim, r);
  tail<C>(x, w, ws, y, ys, k_dim, r, m - r);
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
  float* y;
  int64_t m, k, n, panels;
  bool transposed;  // jaxllm_matmul_nt_cpu
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// One panel of kPanel output columns (the last one may be narrower).
void run_panel(const Shared& s, int64_t p) {
  const int64_t c0 = p * kPanel;
  const int64_t cols = std::min(kPanel, s.n - c0);
  if (s.transposed && (s.m < kPackMinRows || cols < kPanel)) {
    for (int64_t r0 = 0; r0 < s.m; r0 += kNtRows) {
      for (int64_t c = c0; c < c0 + cols; c += kNtCols) nt_tile(s.x, s.w, s.y, s.m, s.k, s.n, r0, c);
    }
    return;
  }
  const float* w = s.w + c0;
  int64_t ws = s.n;
  if (s.transposed) {
    thread_local std::vector<float> packed;
    packed.resize(s.k * kPanel);
    pack_transposed(s.w + c0 * s.k, s.k, packed.data());
    w = packed.data();
    ws = kPanel;
  }
  float* y = s.y + c0;
  const int64_t vectors = cols / kLanes;  // jaxllm_matmul_cpu: N is a multiple of 16
  if (vectors >= 4) {
    panel<4>(s.x, w, ws, y, s.n, s.m, s.k);
  } else if (vectors == 3) {
    panel<3>(s.x, w, ws, y, s.n, s.m, s.k);
  } else if (vectors == 2) {
    panel<2>(s.x, w, ws, y, s.n, s.m, s.k);
  } else {
    panel<1>(s.x, w, ws, y, s.n, s.m, s.k);
  }
}

// Take panels until none is left; returns after the last panel this thread took.
void drain(Shared& s) {
  for (;;) {
    const int64_t p = s.next.fetch_add(1);
    if (p >= s.panels) return;
    run_panel(s, p);
    s.done.fetch_add(1, std::memory_order_release);
  }
}

// Zeros in y's rows [rows, M), then the panels of the first `rows` rows over the pool.
void run(ffi::ThreadPool& pool, std::shared_ptr<Shared> s, int64_t total_rows) {
  std::memset(s->y + s->m * s->n, 0, (total_rows - s->m) * s->n * sizeof(float));
  if (s->m == 0) return;
  for (int64_t i = 0; i + 1 < pool.num_threads() && i + 1 < s->panels; ++i) {
    // A task that starts after the work is done finds nothing to take; the shared_ptr keeps its state alive.
    pool.Schedule([s] { drain(*s); });
  }
  drain(*s);
  while (s->done.load(std::memory_order_acquire) < s->panels) std::this_thread::yield();
}

int64_t valid_rows(ffi::Buffer<ffi::S32>& rows, int64_t m) {
  return std::clamp<int64_t>(*rows.typed_data(), 0, m);
}

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[1] != xd[1] || wd[2] % 16 != 0 || layer.element_count() != 1 ||
      rows.element_count() != 1) {
    return ffi::Error::InvalidArgument("matmul_cpu: x must be [M, K], w [L, K, N] with N a multiple of 16, "
                                       "layer and rows one int32 each");
  }
  const int64_t m = xd[0], k = xd[1], layers = wd[0], n = wd[2];
  const int32_t index = *layer.typed_data();
  if (index < 0 || index >= layers) {
    return ffi::Error::InvalidArgument("matmul_cpu: layer " + std::to_string(index) + " outside [0, " +
                                       std::to_string(layers) + ")");
  }
  auto s = std::make_shared<Shared>();
  s->x = x.typed_data();
  s->w = w.typed_data() + index * k * n;
  s->y = y->typed_data();
  s->m = valid_rows(rows, m);
  s->k = k;
  s->n = n;
  s->panels = (n + kPanel - 1) / kPanel;
  s->transposed = false;
  run(pool, s, m);
  return ffi::Error::Success();
}

ffi::Error MatmulNtImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                        ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || wd[1] != xd[1] || xd[1] % 16 != 0 || wd[0] < 1 ||
      rows.element_count() != 1) {
    return ffi::Error::InvalidArgument("matmul_nt_cpu: x must be [M, K] with K a multiple of 16, w [N, K] with "
                                       "N >= 1, rows one int32");
  }
  auto s = std::make_shared<Shared>();
  s->x = x.typed_data();
  s->w = w.typed_data();
  s->y = y->typed_data();
  s->m = valid_rows(rows, xd[0]);
  s->k = xd[1];
  s->n = wd[0];
  s->panels = (s->n + kPanel - 1) / kPanel;
  s->transposed = true;
  run(pool, s, xd[0]);
  return ffi::Error::Success();
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmMatmulNtCpu, MatmulNtImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
