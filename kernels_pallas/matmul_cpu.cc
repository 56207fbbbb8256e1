// x @ w[layer] for XLA's CPU backend, as an XLA FFI custom call: the dense layers of a decode step.
//
// Inside the model's layer scan, XLA slices each layer's weights out of the stacked parameters with a
// dynamic-slice, which on its CPU backend is a copy of every weight on every step (a dot cannot read through
// the slice), and its dots of a few rows then stream the copy again. A decode step of a small model is those
// bytes. This call takes the whole stacked weight and the layer index and reads that layer's weight in place,
// once: each column panel's rows stream through registers for a few rows of x at a time.
//
// Operands (row-major):
//   x      float32 [M, K]
//   w      float32 [L, K, N], N a multiple of 16 (bfloat16 weights keep XLA's dots: on a CPU with
//          AVX-512-BF16 they multiply pairs of bf16 in one instruction, faster than converting to float32 here)
//   layer  int32 []   in [0, L)
// Result: float32 [M, N], accumulated in float32.
// Errors: N not a multiple of 16, K or N not matching x, or a layer outside [0, L) returns an FFI error
// naming the value.
//
// Work: panels of up to kCols vectors of columns are the units, taken from an atomic counter by the calling
// thread and tasks on XLA's intra-op thread pool; within a panel, tiles of kRows rows of x by the panel's
// vectors accumulate in registers down K.

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#ifdef __AVX512F__
constexpr int kLanes = 16;
constexpr int kRows = 6;  // 6 rows x 4 vectors: 24 accumulators of AVX-512's 32 registers
#else
constexpr int kLanes = 8;
constexpr int kRows = 3;  // 3 x 4: 12 of AVX2's 16
#endif
constexpr int kCols = 4;  // vectors of columns per panel

typedef float VF __attribute__((vector_size(kLanes * sizeof(float))));

inline VF load_weights(const float* p) {
  VF v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// y[r0, r0 + R) x [c0, c0 + C * kLanes) = x[r0, r0 + R) @ w[:, c0, c0 + C * kLanes).
template <int R, int C>
inline void tile(const float* x, const float* w, float* y, int64_t k_dim, int64_t n, int64_t r0, int64_t c0) {
  VF acc[R][C] = {};
  const float* rows = x + r0 * k_dim;
  for (int64_t k = 0; k < k_dim; ++k) {
    VF wv[C];
    for (int c = 0; c < C; ++c) wv[c] = load_weights(w + k * n + c0 + c * kLanes);
    for (int r = 0; r < R; ++r) {
      const float xv = rows[r * k_dim + k];
      for (int c = 0; c < C; ++c) acc[r][c] += wv[c] * xv;
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) std::memcpy(y + (r0 + r) * n + c0 + c * kLanes, &acc[r][c], sizeof(VF));
  }
}

// The last `rows_left` (< kRows) rows of a panel, as one tile of exactly that many rows.
template <int C, int R = kRows - 1>
inline void tail(const float* x, const float* w, float* y, int64_t k_dim, int64_t n, int64_t r0, int64_t c0,
                 int64_t rows_left) {
  if constexpr (R > 0) {
    if (rows_left == R) {
      tile<R, C>(x, w, y, k_dim, n, r0, c0);
    } else {
      tail<C, R - 1>(x, w, y, k_dim, n, r0, c0, rows_left);
    }
  }
}

template <int C>
void panel(const float* x, const float* w, float* y, int64_t m, int64_t k_dim, int64_t n, int64_t c0) {
  int64_t r = 0;
  for (; r + kRows <= m; r += kRows) tile<kRows, C>(x, w, y, k_dim, n, r, c0);
  tail<C>(x, w, y, k_dim, n, r, c0, m - r);
}

struct Shared {
  const float* x;
  const float* w;
  float* y;
  int64_t m, k, n, panels;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

void run_panel(const Shared& s, int64_t p) {
  const float* w = s.w;
  const int64_t c0 = p * kCols * kLanes;
  const int64_t vectors = (s.n - c0) / kLanes;
  if (vectors >= 4) {
    panel<4>(s.x, w, s.y, s.m, s.k, s.n, c0);
  } else if (vectors == 3) {
    panel<3>(s.x, w, s.y, s.m, s.k, s.n, c0);
  } else if (vectors == 2) {
    panel<2>(s.x, w, s.y, s.m, s.k, s.n, c0);
  } else {
    panel<1>(s.x, w, s.y, s.m, s.k, s.n, c0);
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

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[1] != xd[1] || wd[2] % 16 != 0 || layer.element_count() != 1) {
    return ffi::Error::InvalidArgument("matmul_cpu: x must be [M, K], w [L, K, N] with N a multiple of 16, "
                                       "layer one int32");
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
  s->m = m;
  s->k = k;
  s->n = n;
  s->panels = (n + kCols * kLanes - 1) / (kCols * kLanes);
  for (int64_t i = 0; i + 1 < pool.num_threads() && i + 1 < s->panels; ++i) {
    // A task that starts after the work is done finds nothing to take; the shared_ptr keeps its state alive.
    pool.Schedule([s] { drain(*s); });
  }
  drain(*s);
  while (s->done.load(std::memory_order_acquire) < s->panels) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmMatmulCpu, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
