// Greedy sampling on CPU: the index of each row's largest logit (float32 or bfloat16 rows), as torch.argmax(dim=-1) answers it
// (the first maximal index; a row holding NaN answers its first NaN), several times faster here:
// ATen's argmax tracks an index per element (~7 ms for 256 rows of a 49,152-token vocabulary)
// where a max needs ~0.8 ms. So each row is read twice, the second time from L2:
//
//   pass 1  the max over 16 lanes, and whether a NaN is there
//   pass 2  the first 16-wide chunk holding the max (or a NaN), then the first index within it
//
// (AVX-512 intrinsics where the build has them, else loops written for the auto-vectoriser.)
//
// Rows are split over the threads.
//
// Sampling on CPU (sample_rows): one draw per row from softmax(logits / temperature), by the inverse
// of its distribution function, one uniform u in [0, 1) per row:
//
//   pass 1  m = the row's max (and whether a NaN is there: then the first NaN, as argmax answers)
//   pass 2  s = the sum of w[i] = exp((x[i] - m) / T) over 16-wide chunks, in order (0 where x[i] = -inf)
//   pass 3  the same chunk sums again until they pass u * s, then the first index within that chunk
//           whose running sum passes it
//
// Passes 2 and 3 add the very same chunk sums in the same order, so the walk meets the total it
// aims inside; a draw that rounding carries past a chunk's last positive weight takes that weight's
// index (never a masked one). This replaces the exponential race of the torch path (an exponential
// variate per vocabulary entry: ~290 ms for 256 rows of a 49,152-token vocabulary here, as long as a
// whole decode step at that batch) with two exponentials per entry and no random numbers.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu_simd.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kLanes = 16;

#ifdef __AVX512F__
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
// bfloat16 -> float32 is exact (the high half of the float's bits): the same argmax as on a float32 copy
inline __m512 load16(const c10::BFloat16* x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)x)), 16));
}

// The row's max, and whether it holds a NaN.
template <typename T>
float row_max(const T* x_in, int64_t n, bool& has_nan) {
  auto x = [x_in](int64_t i) { return static_cast<float>(x_in[i]); };
  __m512 lanes = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m512 v = load16(x_in + i);
    lanes = _mm512_max_ps(lanes, v);  // a NaN never wins a comparison: noted below instead
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  float best = _mm512_reduce_max_ps(lanes);
  has_nan = nan != 0;
  for (int64_t t = i; t < n; ++t) {
    best = std::max(best, x(t));
    has_nan |= x(t) != x(t);
  }
  return best;
}

template <typename T>
int64_t row_argmax(const T* x_in, int64_t n) {
  auto x = [x_in](int64_t i) { return static_cast<float>(x_in[i]); };
  bool has_nan = false;
  const float best = row_max(x_in, n, has_nan);
  // the first position equal to the max (or, with a NaN in the row, the first NaN)
  const __m512 target = _mm512_set1_ps(best);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m512 v = load16(x_in + i);
    const __mmask16 hit = has_nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  for (; i < n; ++i)
    if (has_nan ? x(i) != x(i) : x(i) == best) return i;
  return 0;
}
#else
// The row's max, and whether it holds a NaN.
template <typename T>
float row_max(const T* x_in, int64_t n, bool& has_nan) {
  auto x = [x_in](int64_t i) { return static_cast<float>(x_in[i]); };
  float lanes[kLanes];
  std::fill(lanes, lanes + kLanes, -std::numeric_limits<float>::infinity());
  bool nan = false;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) {
      lanes[j] = std::max(lanes[j], x(i + j));  // a NaN never wins a comparison: noted below instead
      nan |= x(i + j) != x(i + j);
    }
  float best = *std::max_element(lanes, lanes + kLanes);
  for (int64_t t = i; t < n; ++t) {
    best = std::max(best, x(t));
    nan |= x(t) != x(t);
  }
  has_nan = nan;
  return best;
}

template <typename T>
int64_t row_argmax(const T* x_in, int64_t n) {
  auto x = [x_in](int64_t i) { return static_cast<float>(x_in[i]); };
  bool nan = false;
  const float best = row_max(x_in, n, nan);
  // the first position equal to the max (or, with a NaN in the row, the first NaN)
  auto hit = [&](float v) { return nan ? v != v : v == best; };
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    bool any = false;
    for (int64_t j = 0; j < kLanes; ++j) any |= hit(x(i + j));
    if (any)
      for (int64_t j = 0; j < kLanes; ++j)
        if (hit(x(i + j))) return i + j;
  }
  for (; i < n; ++i)
    if (hit(x(i))) return i;
  return 0;  // a row of -inf only: every element equals the max, so this is unreachable for n > 0
}
#endif

// Below this exponent a weight is 0, not exp_nonpos's clamp at exp(-87) (float's smallest normal
// numbers): an entry that far below the max never draws, even for a uniform of exactly 0.
constexpr float kMinExponent = -87.0f;

// The chunk of 16 weights w[i] = exp((x[i] - m) * inv_t) from position i on (0 where x[i] = -inf,
// below kMinExponent and past the row's end), into w; answers their sum, added in one fixed order.
#ifdef __AVX512F__
template <typename T>
inline float chunk_weights(const T* x, int64_t i, int64_t n, float m, float inv_t, float* w) {
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 v;
  if (i + kLanes <= n) {
    v = load16(x + i);
  } else {
    alignas(64) float tail[kLanes];
    for (int64_t j = 0; j < kLanes; ++j) tail[j] = i + j < n ? static_cast<float>(x[i + j]) : -std::numeric_limits<float>::infinity();
    v = _mm512_load_ps(tail);
  }
  const __m512 arg = _mm512_mul_ps(_mm512_sub_ps(v, _mm512_set1_ps(m)), _mm512_set1_ps(inv_t));
  const __mmask16 live = _mm512_cmp_ps_mask(v, minus_inf, _CMP_NEQ_OQ) &
                         _mm512_cmp_ps_mask(arg, _mm512_set1_ps(kMinExponent), _CMP_GE_OQ);
  const __m512 e = _mm512_maskz_mov_ps(live, pagedserve_simd::exp512_nonpos(arg));
  _mm512_storeu_ps(w, e);
  return _mm512_reduce_add_ps(e);
}
#else
template <typename T>
inline float chunk_weights(const T* x, int64_t i, int64_t n, float m, float inv_t, float* w) {
  float sum = 0.f;
  for (int64_t j = 0; j < kLanes; ++j) {
    const float v = i + j < n ? static_cast<float>(x[i + j]) : -std::numeric_limits<float>::infinity();
    const float arg = (v - m) * inv_t;  // -inf for a masked entry
    w[j] = arg >= kMinExponent ? pagedserve_simd::exp_nonpos(arg) : 0.f;
    sum += w[j];
  }
  return sum;
}
#endif

template <typename T>
int64_t row_sample(const T* x, int64_t n, float inv_t, float u) {
  bool has_nan = false;
  const float m = row_max(x, n, has_nan);
  // a NaN, a +inf (all the mass on it), or nothing allowed (every logit -inf): the index argmax answers
  if (has_nan || !std::isfinite(m)) return row_argmax(x, n);
  alignas(64) float w[kLanes];
  float total = 0.f;
  for (int64_t i = 0; i < n; i += kLanes) total += chunk_weights(x, i, n, m, inv_t, w);
  const float target = u * total;
  float acc = 0.f;
  for (int64_t i = 0; i < n; i += kLanes) {
    const float chunk = chunk_weights(x, i, n, m, inv_t, w);
    if (acc + chunk > target) {
      int64_t last = -1;
      for (int64_t j = 0; j < kLanes; ++j) {
        if (w[j] <= 0.f) continue;
        last = j;
        acc += w[j];
        if (acc > target) return i + j;
      }
      if (last >= 0) return i + last;  // the lanes' own order rounded short of the chunk's sum
    }
    acc += chunk;
  }
  // rounding carried the draw past the end: the last position with a positive weight
  for (int64_t i = n - 1; i >= 0; --i)
    if (static_cast<float>(x[i]) != -std::numeric_limits<float>::infinity()) return i;
  return 0;
}

// One draw per row: logits [rows, vocab] (float32 or bfloat16), inverse temperatures and uniforms in [0, 1), [rows] float32.
at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& inv_temperatures, const at::Tensor& uniforms) {
  TORCH_CHECK(logits.dim() == 2 && (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16) &&
                  logits.device().is_cpu(),
              "sample_rows: float32 or bfloat16 2-D CPU logits");
  TORCH_CHECK(logits.size(1) > 0, "sample_rows: an empty row has nothing to draw");
  for (const at::Tensor* t : {&inv_temperatures, &uniforms})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == logits.size(0) && t->scalar_type() == at::kFloat && t->device().is_cpu(),
                "sample_rows: inverse temperatures and uniforms are float32 [rows] on the CPU");
  const at::Tensor x = logits.contiguous(), inv_t = inv_temperatures.contiguous(), u = uniforms.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  const float *inv_tp = inv_t.data_ptr<float>(), *up = u.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(inv_tp[r] > 0.f && std::isfinite(inv_tp[r]) && up[r] >= 0.f && up[r] < 1.f,
                "sample_rows: each inverse temperature > 0 and finite, each uniform in [0, 1)");
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* ids = out.data_ptr<int64_t>();
  auto each_row = [&](const auto* data) {
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) ids[r] = row_sample(data + r * n, n, inv_tp[r], up[r]);
    });
  };
  if (x.scalar_type() == at::kFloat)
    each_row(x.data_ptr<float>());
  else
    each_row(x.data_ptr<c10::BFloat16>());
  return out;
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16) &&
                  logits.device().is_cpu(),
              "argmax_rows: float32 or bfloat16 2-D CPU logits");
  TORCH_CHECK(logits.size(1) > 0, "argmax_rows: an empty row has no argmax");
  const at::Tensor x = logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* ids = out.data_ptr<int64_t>();
  auto each_row = [&](const auto* data) {
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) ids[r] = row_argmax(data + r * n, n);
    });
  };
  if (x.scalar_type() == at::kFloat)
    each_row(x.data_ptr<float>());
  else
    each_row(x.data_ptr<c10::BFloat16>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("sample_rows(Tensor logits, Tensor inv_temperatures, Tensor uniforms) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
  m.impl("sample_rows", &sample_rows);
}
