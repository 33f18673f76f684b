// A linear layer for decode-sized batches on CPU: y[m] = x[m] W^T (+ b), bfloat16 (AVX512-BF16) or float32.
//
// A decode step of a small batch multiplies a few token rows by every weight matrix once, so its
// time is the time to stream the weights from memory. oneDNN's GEMM packs and tiles for large M
// and reaches ~20 GB/s at M = 1 here; this loop reads each weight row once, front to back, and
// multiplies it with all M (<= kMaxRows) token rows while it is in registers:
//
//   W [N, K] row-major        for n in rows of this thread:         acc[m] += x[m][k:k+32] . W[n][k:k+32]
//   x [M, K]                    for k in 0, 32, ..., K - 32:         (one VDPBF16PS: 32 bf16 products,
//                                 for m < M: dpbf16(acc[m], ...)      summed pairwise in float32)
//                               y[m][n] = sum(acc[m]) (+ b[n])
//
// Weight rows are split over the threads (at::parallel_for), so both cores stream; more than 8 token
// rows go in tiles of 8 over a cached block of weight rows. A larger float32 M goes to oneDNN's
// matmul (mkldnn::_linear_pointwise), anything else (another dtype, a larger bfloat16 M, K not a
// multiple of 32, a CPU without AVX-512 and BF16) to at::linear (oneDNN for bfloat16). A CPU with
// AVX2 but no AVX-512 takes bfloat16 rows widened to float32 (widened_linear), and past them float32
// from a float32 packed copy: oneDNN has no bfloat16 there, and at::linear's is a scalar loop; its
// float32 rows take the same loop up to kMaxRowsF32Avx2, and oneDNN past them.
//
// out_dtype float32 for bfloat16 x (a model's logits): the loops, the tiles and oneDNN from a float32
// copy all sum in float32, and y keeps those sums instead of rounding them to bfloat16 (3 significant
// digits, enough to flip near-tied top tokens); only a bfloat16 oneDNN or at::linear rounds, and is
// widened after.
//
// What oneDNN computes it computes faster from a weight reordered once into its own blocked layout
// (pack_linear_weight: a handle to the packed copy, held here until release_linear_weight) than
// from the plain matrix, which it reorders piece by piece on every call. 30 layers' weights, bf16,
// packed against plain, interleaved: 0.87x the time at 256 rows, 0.85x at 64, 0.76x at 32, 0.84x
// for a 2,048-token prefill; float32 0.76x at 8 and 32 rows, 0.96x at 256. The price is a second
// copy of every weight (the plain one stays: the GEMV loop, the AMX tiles and the embedding read it).
//
// On a CPU with AMX (Intel Sapphire Rapids and later) bfloat16 rows up to amx_rows() go to cpu_amx.cpp
// instead: there this loop is compute-bound from 3-4 rows (41 ms for 30 layers' weights at 8 rows,
// against 10-12 ms through the tiles, which stream at memory speed up to 16 rows; at one row the
// tiles were 13.3 against 15.2 ms with the LM head). Where the tiles stop beating oneDNN depends on
// the machine: past 128 rows on one Xeon VM (29 against 38 ms at 128), past 32 on another (48 rows:
// 26.0 against 25.2 ms; 128: 45.8 against 36.2), so the engine measures it at start-up with its own
// weights (cpu_ops.calibrate_amx_rows) and sets it here; until then it is kMaxRows.

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "cpu_amx.h"
#include "cpu_simd.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define PAGEDSERVE_BF16_GEMV 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDSERVE_AVX2_GEMV 1
#endif

namespace {

// x's sizes with the last one N: y's
std::vector<int64_t> out_sizes(const at::Tensor& x, int64_t N) {
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = N;
  return sizes;
}

constexpr int64_t kTileRows = 8, kBlockRows = 32;
// Measured here against at::linear (2 threads): bfloat16 2-3.5x faster at M = 1, even at M = 24-32,
// and oneDNN's blocked GEMM ahead from M = 64 (1.3-1.9x at 256). float32: at::linear is MKL's SGEMM,
// which runs AVX2 code on this AMD CPU (~170 GFLOP/s); oneDNN's float32 matmul runs AVX-512 (~420
// GFLOP/s at M = 2,048, same float32 arithmetic). Streaming 30 layers' weights from memory, as a
// step does, this loop is 1.3-1.7x faster than oneDNN up to M = 7 and 1.2-1.7x slower from M = 8.
constexpr int64_t kMaxRowsBf16 = 24, kMaxRowsF32 = 7;
// Without AVX-512 (widened_linear below; 30 layers' bfloat16 weights, 2 threads, AMD Zen 3), against
// float32 from a float32 packed copy in oneDNN: 9.4 against 20.7 ms at M = 1 (float32 weights:
// twice the bytes), 33.9 against 45.5 at 16, 120.5 against 126.2 at 64, 178.5 against 171.1 at 96.
constexpr int64_t kMaxRowsBf16Avx2 = 64;
// float32 weights there (the same 30 layers, interleaved) against oneDNN from the packed copy: 14.8
// against 19.1 ms at M = 1, 21.6 against 27.7 at 8, 34.1 against 41.0 at 16, 59.2 against 62.1 at 32,
// 107.6 against 104.1 at 64 (and noisy between: 0.91-1.15x at 40-56).
constexpr int64_t kMaxRowsF32Avx2 = 32;

#ifdef PAGEDSERVE_BF16_GEMV
// float32 weights: 16 products per FMA instead of 32, the same streaming order.
template <int M>
void gemv_rows_f32(const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N, int64_t begin,
                   int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    const float* row = w + n * K;
    for (int64_t k = 0; k < K; k += 16) {
      const __m512 wk = _mm512_loadu_ps(row + k);
      for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k), wk, acc[m]);
    }
    const float b = bias ? bias[n] : 0.f;
    for (int m = 0; m < M; ++m) y[m * N + n] = _mm512_reduce_add_ps(acc[m]) + b;
  }
}

template <int M, typename Y>
void gemv_rows(const c10::BFloat16* x, const c10::BFloat16* w, const c10::BFloat16* bias, Y* y, int64_t K, int64_t N,
               int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    const c10::BFloat16* row = w + n * K;
    for (int64_t k = 0; k < K; k += 32) {
      const __m512bh wk = (__m512bh)_mm512_loadu_si512(row + k);
      for (int m = 0; m < M; ++m)
        acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_loadu_si512(x + m * K + k), wk);
    }
    const float b = bias ? static_cast<float>(bias[n]) : 0.f;
    for (int m = 0; m < M; ++m) y[m * N + n] = static_cast<Y>(_mm512_reduce_add_ps(acc[m]) + b);
  }
}

template <int M, typename T, typename Y>
void gemv_block(const T* x, const T* w, const T* bias, Y* y, int64_t K, int64_t N, int64_t begin, int64_t end) {
  if constexpr (std::is_same_v<T, float>)
    gemv_rows_f32<M>(x, w, bias, y, K, N, begin, end);
  else
    gemv_rows<M>(x, w, bias, y, K, N, begin, end);
}

// Token rows in tiles of 8 (the accumulators of one tile stay in registers); a block of kBlockRows
// weight rows is read from memory by the first tile and from cache by the others.
template <typename T, typename Y>
void gemv(const T* x, const T* w, const T* bias, Y* y, int64_t M, int64_t K, int64_t N) {
  at::parallel_for(0, (N + kBlockRows - 1) / kBlockRows, 0, [&](int64_t block_begin, int64_t block_end) {
    for (int64_t b = block_begin; b < block_end; ++b) {
      const int64_t begin = b * kBlockRows, end = std::min(N, (b + 1) * kBlockRows);
      for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
        const T* xt = x + m0 * K;
        Y* yt = y + m0 * N;
        switch (std::min<int64_t>(kTileRows, M - m0)) {
          case 1: gemv_block<1>(xt, w, bias, yt, K, N, begin, end); break;
          case 2: gemv_block<2>(xt, w, bias, yt, K, N, begin, end); break;
          case 3: gemv_block<3>(xt, w, bias, yt, K, N, begin, end); break;
          case 4: gemv_block<4>(xt, w, bias, yt, K, N, begin, end); break;
          case 5: gemv_block<5>(xt, w, bias, yt, K, N, begin, end); break;
          case 6: gemv_block<6>(xt, w, bias, yt, K, N, begin, end); break;
          case 7: gemv_block<7>(xt, w, bias, yt, K, N, begin, end); break;
          default: gemv_block<8>(xt, w, bias, yt, K, N, begin, end);
        }
      }
    }
  });
}

template <typename T>
at::Tensor small_batch_linear(const at::Tensor& x, const at::Tensor& weight, const T* bias, int64_t M,
                              at::ScalarType out) {
  const int64_t K = x.size(-1), N = weight.size(0);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty(out_sizes(x, N), x.options().dtype(out));
  const T *xp = xc.data_ptr<T>(), *wp = weight.data_ptr<T>();
  if (out == at::kFloat)
    gemv<T, float>(xp, wp, bias, y.data_ptr<float>(), M, K, N);
  else
    gemv<T, T>(xp, wp, bias, y.data_ptr<T>(), M, K, N);
  return y;
}
#endif

#ifdef PAGEDSERVE_AVX2_GEMV
// A CPU with AVX2 and FMA but no AVX-512 (e.g. AMD Zen 3). bfloat16 weights: that CPU has no bfloat16
// arithmetic, at::linear's bfloat16 matmul is a scalar loop (~1 GFLOP/s) and oneDNN takes no
// bfloat16, so each weight row is widened to float32 in registers (a bfloat16 is the upper half of a
// float32) and multiplied with the token rows, widened once per call: a decode step still streams 2
// bytes a weight, half a float32 model's. float32 weights: the same loop without the widening, where
// it streams faster than oneDNN for a few rows. Two accumulators a row over alternate 8-wide k steps
// hide the FMA's latency; token rows go in tiles of 4 (8 accumulators and 2 weight vectors of AVX2's
// 16 registers).
constexpr int64_t kTileRowsAvx2 = 4;

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) { return pagedserve_simd::widen8(p); }

template <int M, typename T, typename Y>
void widened_rows(const float* x, const T* w, const T* bias, Y* y, int64_t K, int64_t N, int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    __m256 even[M], odd[M];
    for (int m = 0; m < M; ++m) even[m] = odd[m] = _mm256_setzero_ps();
    const T* row = w + n * K;
    for (int64_t k = 0; k < K; k += 16) {
      const __m256 w0 = load8(row + k), w1 = load8(row + k + 8);
      for (int m = 0; m < M; ++m) {
        even[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), w0, even[m]);
        odd[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k + 8), w1, odd[m]);
      }
    }
    const float b = bias ? static_cast<float>(bias[n]) : 0.f;
    for (int m = 0; m < M; ++m) y[m * N + n] = static_cast<Y>(pagedserve_simd::sum8(_mm256_add_ps(even[m], odd[m])) + b);
  }
}

// y = x W^T (+ b) for x [M, K] (float32) and W [N, K] of dtype T (bfloat16 or float32), K % 16 == 0;
// weight rows split over the threads in blocks of kBlockRows, each block read from memory by its first
// tile of token rows.
template <typename T, typename Y>
void widened(const float* xp, const T* wp, const T* bias, Y* yp, int64_t M, int64_t K, int64_t N) {
  at::parallel_for(0, (N + kBlockRows - 1) / kBlockRows, 0, [&](int64_t block_begin, int64_t block_end) {
    for (int64_t b = block_begin; b < block_end; ++b) {
      const int64_t begin = b * kBlockRows, end = std::min(N, (b + 1) * kBlockRows);
      for (int64_t m0 = 0; m0 < M; m0 += kTileRowsAvx2) {
        const float* xt = xp + m0 * K;
        Y* yt = yp + m0 * N;
        switch (std::min<int64_t>(kTileRowsAvx2, M - m0)) {
          case 1: widened_rows<1>(xt, wp, bias, yt, K, N, begin, end); break;
          case 2: widened_rows<2>(xt, wp, bias, yt, K, N, begin, end); break;
          case 3: widened_rows<3>(xt, wp, bias, yt, K, N, begin, end); break;
          default: widened_rows<4>(xt, wp, bias, yt, K, N, begin, end);
        }
      }
    }
  });
}

template <typename T>
at::Tensor widened_linear(const at::Tensor& x, const at::Tensor& weight, const T* bias, int64_t M, at::ScalarType out) {
  const int64_t K = x.size(-1), N = weight.size(0);
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // float32 x: itself
  at::Tensor y = at::empty(out_sizes(x, N), x.options().dtype(out));
  const float* xp = xf.data_ptr<float>();
  const T* wp = weight.data_ptr<T>();
  if (out == at::kFloat)
    widened<T, float>(xp, wp, bias, y.data_ptr<float>(), M, K, N);
  else
    widened<T, T>(xp, wp, bias, y.data_ptr<T>(), M, K, N);
  return y;
}
#endif

// oneDNN's linear for float32 (at::linear would take MKL's), through the dispatcher: ATen registers
// it as mkldnn::_linear_pointwise with no C++ entry point of its own.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, weight, bias, std::string("none"), c10::List<c10::optional<at::Scalar>>(), c10::IValue()};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// The packed weights, by handle (an index; a released slot is reused).
class PackedWeights {
 public:
  int64_t add(const at::Tensor& weight, int64_t batch_size) {
    static const c10::OperatorHandle reorder =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_reorder_linear_weight", "");
    torch::jit::Stack stack{weight, batch_size};
    reorder.callBoxed(&stack);
    const at::Tensor packed = stack[0].toTensor();
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i = 0; i < slots_.size(); ++i)
      if (!slots_[i].packed.defined()) {
        slots_[i] = {packed, weight.sizes().vec(), weight.scalar_type()};
        return static_cast<int64_t>(i);
      }
    slots_.push_back({packed, weight.sizes().vec(), weight.scalar_type()});
    return static_cast<int64_t>(slots_.size()) - 1;
  }

  void release(int64_t handle) {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(slots_.size()) && slots_[handle].packed.defined(),
                "release_linear_weight: no packed weight ", handle);
    slots_[handle] = Slot{};
  }

  // The packed copy of `weight` under `handle`; raises unless it was packed from a matrix of
  // weight's shape and dtype (or a float32 copy of a bfloat16 weight: where oneDNN has no bfloat16).
  at::Tensor get(int64_t handle, const at::Tensor& weight) {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(slots_.size()) && slots_[handle].packed.defined(),
                "linear: no packed weight ", handle);
    const Slot& slot = slots_[handle];
    const bool widened = slot.dtype == at::kFloat && weight.scalar_type() == at::kBFloat16;
    TORCH_CHECK(slot.sizes == weight.sizes().vec() && (slot.dtype == weight.scalar_type() || widened),
                "linear: packed weight ", handle, " was packed from another matrix");
    return slot.packed;
  }

  int64_t size() {
    std::lock_guard<std::mutex> lock(mutex_);
    return std::count_if(slots_.begin(), slots_.end(), [](const Slot& s) { return s.packed.defined(); });
  }

 private:
  struct Slot {
    at::Tensor packed;
    std::vector<int64_t> sizes;
    at::ScalarType dtype = at::kFloat;
  };
  std::mutex mutex_;
  std::vector<Slot> slots_;
};

PackedWeights& packed_weights() {
  static PackedWeights* weights = new PackedWeights();  // never destroyed: no teardown-order hazard at exit
  return *weights;
}

int64_t pack_linear_weight(const at::Tensor& weight, int64_t batch_size) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat),
              "pack_linear_weight: a bfloat16 or float32 matrix");
  TORCH_CHECK(at::hasMKLDNN() && at::globalContext().userEnabledMkldnn(), "pack_linear_weight: oneDNN is off");
  return packed_weights().add(weight.contiguous(), batch_size);
}

void release_linear_weight(int64_t handle) { packed_weights().release(handle); }

int64_t num_packed_weights() { return packed_weights().size(); }

bool onednn_takes(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  return at::hasMKLDNN() && at::globalContext().userEnabledMkldnn() && x.numel() > 0 && x.scalar_type() == at::kFloat &&
         weight.scalar_type() == at::kFloat && weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight.size(1) &&
         (!bias.has_value() || !bias->defined() || bias->scalar_type() == at::kFloat);
}

// The most token rows `linear` hands to the tiles (0: none); linear_amx itself takes up to kMaxRows.
std::atomic<int64_t> amx_rows_limit{pagedserve::amx::kMaxRows};

int64_t amx_rows() { return amx_rows_limit.load(std::memory_order_relaxed); }

void set_amx_rows(int64_t rows) {
  TORCH_CHECK(rows >= 0 && rows <= pagedserve::amx::kMaxRows, "set_amx_rows: 0..", pagedserve::amx::kMaxRows,
              " rows, got ", rows);
  amx_rows_limit.store(rows, std::memory_order_relaxed);
}

// The AMX kernel takes these: bfloat16, contiguous, K in tile-wide steps, N in blocks of 16 rows.
bool amx_takes(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias, int64_t M) {
  const int64_t K = x.size(-1), N = weight.size(0);
  const bool has_bias = bias.has_value() && bias->defined();
  return x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 &&
         weight.size(1) == K && weight.is_contiguous() && K % 32 == 0 && N % 16 == 0 && M >= 1 &&
         M <= pagedserve::amx::kMaxRows &&
         (!has_bias || (bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N));
}

// y's dtype: x's, or float32 where asked (a model's logits: the loops accumulate in float32, so a
// bfloat16 model's logits need not be rounded to bfloat16; paths that round anyway are widened after)
at::ScalarType out_type(const at::Tensor& x, const c10::optional<at::ScalarType>& out_dtype) {
  const at::ScalarType out = out_dtype.value_or(x.scalar_type());
  TORCH_CHECK(out == x.scalar_type() || out == at::kFloat, "linear: out_dtype is x's dtype or float32, not ", out);
  return out;
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                      c10::optional<at::ScalarType> out_dtype) {
  const int64_t K = x.size(-1), N = weight.size(0), M = K > 0 ? x.numel() / K : 0;
  TORCH_CHECK(pagedserve::amx::available(), "linear_amx: this CPU (or kernel) gives no AMX-BF16 tiles");
  TORCH_CHECK(amx_takes(x, weight, bias, M), "linear_amx: needs bfloat16, 1..", pagedserve::amx::kMaxRows,
              " rows, K % 32 == 0, N % 16 == 0, contiguous weight and bias");
  const at::ScalarType out = out_type(x, out_dtype);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty(out_sizes(x, N), x.options().dtype(out));
  const bool has_bias = bias.has_value() && bias->defined();
  const c10::BFloat16 *xp = xc.data_ptr<c10::BFloat16>(), *wp = weight.data_ptr<c10::BFloat16>();
  const c10::BFloat16* bp = has_bias ? bias->data_ptr<c10::BFloat16>() : nullptr;
  if (out == at::kFloat)
    pagedserve::amx::linear(xp, wp, bp, y.data_ptr<float>(), M, K, N);
  else
    pagedserve::amx::linear(xp, wp, bp, y.data_ptr<c10::BFloat16>(), M, K, N);
  return y;
}

// The GEMV loop for a few rows, oneDNN (or at::linear) for the rest: never the tiles. With a packed
// handle (>= 0) the rest goes to oneDNN with that packed copy of weight; the handle is checked
// against weight whichever path runs.
at::Tensor vector_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                         int64_t packed, c10::optional<at::ScalarType> out_dtype) {
  const at::Tensor packed_weight = packed >= 0 ? packed_weights().get(packed, weight) : at::Tensor();
  const at::ScalarType out = out_type(x, out_dtype);
#ifdef PAGEDSERVE_BF16_GEMV
  const int64_t K = x.size(-1), N = weight.size(0);
  const int64_t M = K > 0 ? x.numel() / K : 0;
  const bool has_bias = bias.has_value() && bias->defined();
  const auto dtype = x.scalar_type();
  if ((dtype == at::kBFloat16 || dtype == at::kFloat) && weight.scalar_type() == dtype && weight.dim() == 2 &&
      weight.size(1) == K && weight.is_contiguous() && K % 32 == 0 && M >= 1 && M <= (dtype == at::kFloat ? kMaxRowsF32 : kMaxRowsBf16) &&
      (!has_bias || (bias->scalar_type() == dtype && bias->is_contiguous() && bias->numel() == N))) {
    if (dtype == at::kFloat)
      return small_batch_linear<float>(x, weight, has_bias ? bias->data_ptr<float>() : nullptr, M, out);
    return small_batch_linear<c10::BFloat16>(x, weight, has_bias ? bias->data_ptr<c10::BFloat16>() : nullptr, M, out);
  }
#endif
#ifdef PAGEDSERVE_AVX2_GEMV
  {
    const int64_t K = x.size(-1), N = weight.size(0), M = K > 0 ? x.numel() / K : 0;
    const bool has_bias = bias.has_value() && bias->defined();
    const auto dtype = x.scalar_type();
    if ((dtype == at::kBFloat16 || dtype == at::kFloat) && weight.scalar_type() == dtype && weight.dim() == 2 &&
        weight.size(1) == K && weight.is_contiguous() && K % 16 == 0 && M >= 1 &&
        M <= (dtype == at::kFloat ? kMaxRowsF32Avx2 : kMaxRowsBf16Avx2) &&
        (!has_bias || (bias->scalar_type() == dtype && bias->is_contiguous() && bias->numel() == N))) {
      if (dtype == at::kFloat)
        return widened_linear<float>(x, weight, has_bias ? bias->data_ptr<float>() : nullptr, M, out);
      return widened_linear<c10::BFloat16>(x, weight, has_bias ? bias->data_ptr<c10::BFloat16>() : nullptr, M, out);
    }
  }
#endif
  const bool bias_matches = !bias.has_value() || !bias->defined() || bias->scalar_type() == weight.scalar_type();
  if (packed >= 0 && x.numel() > 0 && x.scalar_type() == weight.scalar_type() && x.size(-1) == weight.size(1) &&
      bias_matches) {
    if (packed_weight.scalar_type() == x.scalar_type()) return onednn_linear(x, packed_weight, bias).to(out);
    // a float32 copy of a bfloat16 weight (oneDNN has no bfloat16 on this CPU): the rows in float32
    const c10::optional<at::Tensor> bias_f32 =
        bias.has_value() && bias->defined() ? c10::optional<at::Tensor>(bias->to(at::kFloat)) : c10::nullopt;
    return onednn_linear(x.to(at::kFloat), packed_weight, bias_f32).to(out);
  }
  return (onednn_takes(x, weight, bias) ? onednn_linear(x, weight, bias) : at::linear(x, weight, bias)).to(out);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                  int64_t packed, c10::optional<at::ScalarType> out_dtype) {
  const int64_t K = x.size(-1), M = K > 0 ? x.numel() / K : 0;
  if (M <= amx_rows() && pagedserve::amx::available() && amx_takes(x, weight, bias, M)) {
    if (packed >= 0) packed_weights().get(packed, weight);  // the tiles read weight itself; the handle must still match
    return amx_linear(x, weight, bias, out_dtype);
  }
  return vector_linear(x, weight, bias, packed, out_dtype);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias, int packed=-1, ScalarType? out_dtype=None) -> Tensor");
  m.def("linear_amx(Tensor x, Tensor weight, Tensor? bias, ScalarType? out_dtype=None) -> Tensor");
  m.def("linear_vector(Tensor x, Tensor weight, Tensor? bias, int packed=-1, ScalarType? out_dtype=None) -> Tensor");
  m.def("amx_available() -> bool", &pagedserve::amx::available);
  m.def("pack_linear_weight(Tensor weight, int batch_size) -> int", &pack_linear_weight);
  m.def("release_linear_weight(int handle) -> ()", &release_linear_weight);
  m.def("num_packed_weights() -> int", &num_packed_weights);
  m.def("amx_rows() -> int", &amx_rows);
  m.def("set_amx_rows(int rows) -> ()", &set_amx_rows);
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("linear", &linear);
  m.impl("linear_amx", &amx_linear);
  m.impl("linear_vector", &vector_linear);
}
