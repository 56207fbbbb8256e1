// Paged decode attention for XLA's CPU backend, as an XLA FFI custom call.
//
// One query token per row attends over the row's paged KV cache, read in
// place through its block table. The plain-jnp kernels have to gather the
// blocks into a contiguous copy before each dot (XLA's CPU dots cannot read
// through a gather), which moves every cached byte three times; this reads
// it once. Semantics are those of
// kernels_pallas.reference.paged_attention_reference for one query per row:
// scores = (q . k) * scale, optionally soft-capped (cap * tanh(s / cap)),
// masked to the row's first ctx_len positions (and to the last
// sliding_window of them when set), softmax in float32, weighted sum of v.
//
// Operands (row-major):
//   q          float32 [S, Hq, D]    (already in float32)
//   k_cache    [N, block_size * Hkv * D]  float32, or bfloat16 / uint16 bit patterns of bfloat16 (each
//              block one row: a unit KV-head axis in the operand would let XLA's CPU layout assignment
//              move it and copy the whole cache around the call)
//   v_cache    same shape and dtype as k_cache
//   tables     int32 [S, W]          block ids, < N
//   ctx_lens   int32 [S]             positions each row sees; 0 = padding row (zeros out)
// Attributes: scale (f32), soft_cap (f32, 0 = none), sliding_window (i32, 0 = none), block_size (i32),
// num_kv_heads (i32).
// Result: float32 [S, Hq, D].
// Errors: an id outside [0, N) or ctx_len > W * block_size returns an FFI
// error naming the row and value (no out-of-bounds read).
//
// Work is split by rows and run on XLA's intra-op thread pool: the calling
// thread and the scheduled tasks take rows from one atomic counter, and the
// caller returns once every row is done.

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxQHeads = 64;
constexpr int kMaxHeadDim = 256;
constexpr int kMaxBlockSize = 128;
// Blocks ahead whose lines are prefetched (measured: 0-3 within 5% of each other; 1 at the low end).
constexpr int kPrefetchBlocks = 1;

inline float load(const float* p) { return *p; }
inline float load(const uint16_t* p) { return __builtin_bit_cast(float, static_cast<uint32_t>(*p) << 16); }

// exp(x) for x <= 0 (the softmax's shifted scores), in a form the compiler vectorizes: x = n ln2 + r with
// |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (relative error below 2e-7), times 2^n built in the
// exponent bits. Below -87 (where e^x is under float's normal range) it returns 0.
inline float exp_nonpositive(float x) {
  const float clamped = x < -87.0f ? -87.0f : x;
  const float n = __builtin_roundf(clamped * 1.44269504f);
  const float r = (clamped - n * 0.693145752f) - n * 1.42860677e-6f;
  float poly = 1.0f / 720.0f;
  poly = poly * r + 1.0f / 120.0f;
  poly = poly * r + 1.0f / 24.0f;
  poly = poly * r + 1.0f / 6.0f;
  poly = poly * r + 0.5f;
  poly = poly * r + 1.0f;
  poly = poly * r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : poly * scale;
}

struct Problem {
  const float* q;
  const void* k;
  const void* v;
  const int32_t* tables;
  const int32_t* ctx_lens;
  float* out;
  int64_t rows, q_heads, kv_heads, head_dim, block_size, width;
  float scale, soft_cap;
  int32_t window;
};

// Attention of one row's query heads over its blocks. Blocks are visited once each, every KV head of a block
// before the next block (a block is one contiguous run of block_size * Hkv * D elements), and the next block is
// prefetched while this one is computed: the row's blocks lie anywhere in a cache far larger than the CPU's.
template <typename T>
void attend_row(const Problem& p, int64_t row) {
  const int64_t group = p.q_heads / p.kv_heads, dim = p.head_dim, bs = p.block_size;
  float* out = p.out + row * p.q_heads * dim;
  const int32_t n = p.ctx_lens[row];
  if (n <= 0) {
    std::memset(out, 0, sizeof(float) * p.q_heads * dim);
    return;
  }
  const T* kc = static_cast<const T*>(p.k);
  const T* vc = static_cast<const T*>(p.v);
  const int64_t token_stride = p.kv_heads * dim;  // elements between consecutive tokens of a block
  const int64_t block_elems = bs * token_stride;
  alignas(64) float q[kMaxQHeads][kMaxHeadDim];
  alignas(64) float acc[kMaxQHeads][kMaxHeadDim];
  float run_max[kMaxQHeads], run_sum[kMaxQHeads];
  for (int64_t h = 0; h < p.q_heads; ++h) {
    const float* src = p.q + (row * p.q_heads + h) * dim;
    for (int64_t d = 0; d < dim; ++d) q[h][d] = src[d] * p.scale;
    std::memset(acc[h], 0, sizeof(float) * dim);
    run_max[h] = -INFINITY;
    run_sum[h] = 0.0f;
  }
  const int32_t first = p.window > 0 && n > p.window ? n - p.window : 0;
  const int32_t* table = p.tables + row * p.width;
  alignas(64) float scores[kMaxBlockSize];
  alignas(64) float weights[kMaxBlockSize];
  for (int64_t start = first - first % bs; start < n; start += bs) {
    if (start + kPrefetchBlocks * bs < n) {
      const int32_t ahead = table[start / bs + kPrefetchBlocks];
      const char* next_k = reinterpret_cast<const char*>(kc + ahead * block_elems);
      const char* next_v = reinterpret_cast<const char*>(vc + ahead * block_elems);
      for (int64_t off = 0; off < block_elems * static_cast<int64_t>(sizeof(T)); off += 64) {
        __builtin_prefetch(next_k + off);
        __builtin_prefetch(next_v + off);
      }
    }
    const int64_t lo = start < first ? first - start : 0;
    const int64_t hi = n - start < bs ? n - start : bs;
    const T* kb = kc + table[start / bs] * block_elems;
    const T* vb = vc + table[start / bs] * block_elems;
    for (int64_t qh = 0; qh < p.q_heads; ++qh) {
      const int64_t h = qh / group;
      float block_max = -INFINITY;
      for (int64_t t = lo; t < hi; ++t) {
        const T* key = kb + t * token_stride + h * dim;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < dim; ++d) s += q[qh][d] * load(key + d);
        if (p.soft_cap > 0.0f) s = p.soft_cap * std::tanh(s / p.soft_cap);
        scores[t] = s;
        block_max = s > block_max ? s : block_max;
      }
      const float new_max = block_max > run_max[qh] ? block_max : run_max[qh];
      const float rescale = std::exp(run_max[qh] - new_max);  // 0 on the first block (-inf)
      float block_sum = 0.0f;
#pragma omp simd reduction(+ : block_sum)
      for (int64_t t = lo; t < hi; ++t) {
        weights[t] = exp_nonpositive(scores[t] - new_max);
        block_sum += weights[t];
      }
      run_sum[qh] = run_sum[qh] * rescale + block_sum;
      float* a = acc[qh];
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) a[d] *= rescale;
      for (int64_t t = lo; t < hi; ++t) {
        const float w = weights[t];
        const T* value = vb + t * token_stride + h * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) a[d] += w * load(value + d);
      }
      run_max[qh] = new_max;
    }
  }
  for (int64_t h = 0; h < p.q_heads; ++h) {
    const float inv = 1.0f / run_sum[h];
    for (int64_t d = 0; d < dim; ++d) out[h * dim + d] = acc[h][d] * inv;
  }
}

struct Shared {
  Problem problem;
  bool bf16;
  int64_t num_rows;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// Take rows until none is left; returns after the last row this thread took.
void drain(Shared& s) {
  constexpr int64_t kRowsPerGrab = 2;
  for (;;) {
    const int64_t begin = s.next.fetch_add(kRowsPerGrab);
    if (begin >= s.num_rows) return;
    const int64_t end = begin + kRowsPerGrab < s.num_rows ? begin + kRowsPerGrab : s.num_rows;
    for (int64_t i = begin; i < end; ++i) {
      if (s.bf16) {
        attend_row<uint16_t>(s.problem, i);
      } else {
        attend_row<float>(s.problem, i);
      }
    }
    s.done.fetch_add(end - begin, std::memory_order_release);
  }
}

ffi::Error PagedDecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_cache,
                           ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> ctx_lens,
                           ffi::ResultBuffer<ffi::F32> out, float scale, float soft_cap, int32_t sliding_window,
                           int32_t block_size, int32_t num_kv_heads) {
  const auto qd = q.dimensions(), kd = k_cache.dimensions(), td = tables.dimensions();
  if (qd.size() != 3 || kd.size() != 2 || td.size() != 2 || block_size < 1 || num_kv_heads < 1 ||
      kd[1] != static_cast<int64_t>(block_size) * num_kv_heads * qd[2]) {
    return ffi::Error::InvalidArgument(
        "paged_decode_cpu: q must be [S, Hq, D], caches [N, block_size * Hkv * D], tables [S, W]");
  }
  const ffi::DataType dtype = k_cache.element_type();
  if (v_cache.element_type() != dtype ||
      (dtype != ffi::DataType::F32 && dtype != ffi::DataType::BF16 && dtype != ffi::DataType::U16)) {
    return ffi::Error::InvalidArgument("paged_decode_cpu: caches must both be float32, bfloat16 or uint16 (bf16 bits)");
  }
  Problem p{q.typed_data(), k_cache.untyped_data(), v_cache.untyped_data(), tables.typed_data(),
            ctx_lens.typed_data(), out->typed_data(), qd[0], qd[1], num_kv_heads, qd[2], block_size, td[1],
            scale, soft_cap, sliding_window};
  const int64_t num_blocks = kd[0];
  if (p.q_heads % p.kv_heads != 0 || p.q_heads > kMaxQHeads ||
      p.head_dim > kMaxHeadDim || p.block_size > kMaxBlockSize || td[0] != p.rows) {
    return ffi::Error::InvalidArgument(
        "paged_decode_cpu: shapes out of range (head_dim <= 256, block_size <= 128, <= 64 query heads)");
  }
  for (int64_t r = 0; r < p.rows; ++r) {
    const int32_t n = p.ctx_lens[r];
    if (n > p.width * p.block_size) {
      return ffi::Error::InvalidArgument("paged_decode_cpu: row " + std::to_string(r) + " ctx_len " +
                                         std::to_string(n) + " exceeds the table's " +
                                         std::to_string(p.width * p.block_size) + " positions");
    }
    for (int64_t b = 0; b * p.block_size < n; ++b) {
      const int32_t id = p.tables[r * p.width + b];
      if (id < 0 || id >= num_blocks) {
        return ffi::Error::InvalidArgument("paged_decode_cpu: row " + std::to_string(r) + " block id " +
                                           std::to_string(id) + " outside [0, " + std::to_string(num_blocks) + ")");
      }
    }
  }
  auto shared = std::make_shared<Shared>();
  shared->problem = p;
  shared->bf16 = dtype != ffi::DataType::F32;
  shared->num_rows = p.rows;
  const int64_t helpers = pool.num_threads() - 1;
  for (int64_t i = 0; i < helpers && i * 8 < shared->num_rows; ++i) {
    // A task that starts after the work is done finds nothing to take; the shared_ptr keeps its state alive.
    pool.Schedule([shared] { drain(*shared); });
  }
  drain(*shared);
  while (shared->done.load(std::memory_order_acquire) < shared->num_rows) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmPagedDecodeCpu, PagedDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<int32_t>("block_size")
                                  .Attr<int32_t>("num_kv_heads"));
