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

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
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

template <typename T>
int64_t row_argmax(const T* x_in, int64_t n) {
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
  bool has_nan = nan != 0;
  for (int64_t t = i; t < n; ++t) {
    best = std::max(best, x(t));
    has_nan |= x(t) != x(t);
  }
  // the first position equal to the max (or, with a NaN in the row, the first NaN)
  const __m512 target = _mm512_set1_ps(best);
  for (i = 0; i + kLanes <= n; i += kLanes) {
    const __m512 v = load16(x_in + i);
    const __mmask16 hit = has_nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  for (; i < n; ++i)
    if (has_nan ? x(i) != x(i) : x(i) == best) return i;
  return 0;
}
#else
template <typename T>
int64_t row_argmax(const T* x_in, int64_t n) {
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
  // the first position equal to the max (or, with a NaN in the row, the first NaN)
  auto hit = [&](float v) { return nan ? v != v : v == best; };
  for (i = 0; i + kLanes <= n; i += kLanes) {
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

// ---------------------------------------------------------------------------------------------
// Sampling at temperature > 0: the Gumbel-max race over counter-based noise (engine_svc/race.py
// holds the definition and its pure-torch twin). Element j of a row draws the 52-bit integer k_j
// from (key, counter, j) alone, so a seeded sequence's token depends on nothing but its seed, its
// output position and its logits; d_j = (2 k_j + 1) 2^-53 is uniform on (0, 1), E_j = -log1p(-d_j)
// an exponential variate, and the row's token is the first j with the largest
//
//   score_j = (logit_j - max) - log(E_j)        (in double; logits already divided by temperature)
//
// Computing two logarithms per element would cost more than the forward at large batch, so each
// element is first bounded without them: E_j >= d_j and d_j >= 2^(msb(2 k_j + 1) - 53), hence
// -log(E_j) <= ln 2 * (53 - msb(2 k_j + 1)). An element whose bound cannot reach the best exact
// score so far is skipped; the few left (those with a large logit or an extreme draw) are scored
// exactly. The skipped ones could not have won, so the answer is the full race's.

inline uint64_t mix64(uint64_t x) {  // SplitMix64's finaliser
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kCounterSalt = 0xD6E8FEB86659FD93ull;
constexpr double kLn2 = 0.6931471805599453;

inline uint64_t row_base(uint64_t key, uint64_t counter) { return mix64(key + mix64(counter ^ kCounterSalt)); }

inline double exact_score(float shifted, uint64_t odd) {
  const double d = static_cast<double>(odd) * 0x1p-53;
  return static_cast<double>(shifted) - std::log(-std::log1p(-d));
}

// The row's largest logit and its first index (-1 when nothing is finite: NaN never counts).
inline std::pair<float, int64_t> row_top(const float* x, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
#ifdef __AVX512F__
  __m512 lanes = _mm512_set1_ps(top);
  for (; j + kLanes <= n; j += kLanes) {
    const __m512 v = _mm512_loadu_ps(x + j);
    lanes = _mm512_mask_mov_ps(lanes, _mm512_cmp_ps_mask(v, lanes, _CMP_GT_OQ), v);  // a NaN is never greater
  }
  top = _mm512_reduce_max_ps(lanes);
#elif defined(__AVX2__) && defined(__FMA__)
  // four accumulators, so that the max's latency does not chain every load
  __m256 lanes[4] = {_mm256_set1_ps(top), _mm256_set1_ps(top), _mm256_set1_ps(top), _mm256_set1_ps(top)};
  for (; j + 32 <= n; j += 32)
    for (int k = 0; k < 4; ++k)
      lanes[k] = _mm256_max_ps(_mm256_loadu_ps(x + j + 8 * k), lanes[k]);  // the second operand where the first is NaN
  alignas(32) float eight[8];
  _mm256_store_ps(eight, _mm256_max_ps(_mm256_max_ps(lanes[0], lanes[1]), _mm256_max_ps(lanes[2], lanes[3])));
  top = *std::max_element(eight, eight + 8);
#endif
  for (; j < n; ++j)
    if (x[j] > top) top = x[j];
  if (!(top > -std::numeric_limits<float>::infinity())) return {top, -1};
  j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (const __m256 target = _mm256_set1_ps(top); j + 8 <= n; j += 8)
    if (const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), target, _CMP_EQ_OQ)))
      return {top, j + __builtin_ctz(hit)};
#endif
  for (; x[j] != top; ++j) {
  }
  return {top, j};
}

int64_t row_race(const float* x, int64_t n, uint64_t key, uint64_t counter) {
  const auto [top, top_at] = row_top(x, n);
  if (top_at < 0) return 0;  // nothing finite (or NaN only): as the torch twin's argmax of -inf/NaN
  const uint64_t base = row_base(key, counter);
  auto odd_at = [base](int64_t j) { return ((mix64(base + static_cast<uint64_t>(j + 1) * kGolden) >> 12) << 1) | 1; };
  // the row's largest logit first: its exact score makes a high bar at once
  double best = exact_score(0.0f, odd_at(top_at));
  int64_t best_at = top_at;
  auto consider = [&](int64_t j, float shifted, uint64_t odd) {
    const double score = exact_score(shifted, odd);
    if (score > best || (score == best && j < best_at)) best = score, best_at = j;
  };
  int64_t j = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  // 16 elements at a time. No noise lifts an element by more than 53 ln 2 (d >= 2^-53), so a block
  // whose logits all sit further than that below the best score is skipped unhashed; the others'
  // noise is hashed 8 to a vector (msb(odd) exactly, as the exponent of odd in double: odd < 2^53)
  // and only the elements whose bound reaches the best are scored exactly, in order, as below.
  const __m512i golden = _mm512_set1_epi64(static_cast<int64_t>(kGolden)), one = _mm512_set1_epi64(1);
  const __m512i c1 = _mm512_set1_epi64(static_cast<int64_t>(0xBF58476D1CE4E5B9ull));
  const __m512i c2 = _mm512_set1_epi64(static_cast<int64_t>(0x94D049BB133111EBull));
  // base + (j + 1 + lane) kGolden for lane 0..7 of each half of the block at j, moved on per block
  __m512i start[2];
  for (int half = 0; half < 2; ++half)
    start[half] = _mm512_add_epi64(_mm512_set1_epi64(static_cast<int64_t>(base)),
                                   _mm512_mullo_epi64(_mm512_set_epi64(8, 7, 6, 5, 4, 3, 2, 1), golden));
  start[1] = _mm512_add_epi64(start[1], _mm512_set1_epi64(static_cast<int64_t>(8 * kGolden)));
  const __m512i step = _mm512_set1_epi64(static_cast<int64_t>(16 * kGolden));
  const __m512 vtop = _mm512_set1_ps(top);
  alignas(64) uint64_t odds[8];
  alignas(64) float shifted16[16];
  // best - 53 ln 2 - 1e-6, rounded down to a float: a conservative bar for a block, redone when best moves
  auto bar_of = [](double b) {
    return _mm512_set1_ps(std::nextafter(static_cast<float>(b - 53 * kLn2 - 1e-6), -std::numeric_limits<float>::infinity()));
  };
  double bar_best = best;
  __m512 bar = bar_of(best);
  for (; j + 16 <= n; j += 16, start[0] = _mm512_add_epi64(start[0], step), start[1] = _mm512_add_epi64(start[1], step)) {
    const __m512 shifted = _mm512_sub_ps(_mm512_loadu_ps(x + j), vtop);
    if (best != bar_best) bar_best = best, bar = bar_of(best);
    const __mmask16 live = _mm512_cmp_ps_mask(shifted, bar, _CMP_GE_OQ);  // false for NaN, -inf
    if (!live) continue;
    _mm512_store_ps(shifted16, shifted);
    for (int half = 0; half < 2; ++half) {
      const __mmask8 live8 = static_cast<__mmask8>(live >> (8 * half));
      if (!live8) continue;
      __m512i h = start[half];
      h = _mm512_xor_si512(h, _mm512_srli_epi64(h, 30));
      h = _mm512_mullo_epi64(h, c1);
      h = _mm512_xor_si512(h, _mm512_srli_epi64(h, 27));
      h = _mm512_mullo_epi64(h, c2);
      h = _mm512_xor_si512(h, _mm512_srli_epi64(h, 31));
      const __m512i odd = _mm512_or_si512(_mm512_slli_epi64(_mm512_srli_epi64(h, 12), 1), one);
      const __m512d msb = _mm512_getexp_pd(_mm512_cvtepu64_pd(odd));
      const __m512d sd = _mm512_cvtps_pd(_mm256_loadu_ps(shifted16 + 8 * half));
      const __m512d bound = _mm512_add_pd(sd, _mm512_mul_pd(_mm512_set1_pd(kLn2), _mm512_sub_pd(_mm512_set1_pd(53.0), msb)));
      __mmask8 cand = live8 & _mm512_cmp_pd_mask(_mm512_add_pd(bound, _mm512_set1_pd(1e-6)), _mm512_set1_pd(best), _CMP_GE_OQ);
      if (!cand) continue;
      _mm512_store_si512(odds, odd);
      for (; cand; cand &= cand - 1) {
        const int lane = __builtin_ctz(cand);
        const int64_t at = j + 8 * half + lane;
        if (at != top_at) consider(at, shifted16[8 * half + lane], odds[lane]);
      }
    }
  }
#elif defined(__AVX2__) && defined(__FMA__)
  // AVX2 (no AVX-512: AMD Zen 3), 8 elements at a time, skipping blocks as above. AVX2 has no 64-bit
  // multiply, so mullo64 builds one from three 32 x 32 -> 64-bit products, and no 64-bit integer to
  // double conversion, so the noise bound comes from the hash's top 24 bits, exact in a float:
  // msb(odd) = msb(h) - 11 = 29 + e for e = msb(h >> 40), so 53 - msb(odd) = 151 - (biased exponent
  // of h >> 40); an all-zero top (odds of 2^-24) has biased exponent 0, the largest bound: kept.
  // The bound is added in float, its rounding (< 1e-5 here) covered by a 1e-4 margin on the bar;
  // the candidates are then scored exactly, in order, as below.
  auto mullo64 = [](__m256i a, __m256i b_lo, __m256i b_hi) {  // a * b mod 2^64, b = b_hi 2^32 + b_lo
    const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), b_lo), _mm256_mul_epu32(a, b_hi));
    return _mm256_add_epi64(_mm256_mul_epu32(a, b_lo), _mm256_slli_epi64(cross, 32));
  };
  auto mix4 = [&](__m256i h) {  // mix64 on 4 lanes
    const __m256i c1_lo = _mm256_set1_epi64x(static_cast<int64_t>(0xBF58476D1CE4E5B9ull & 0xFFFFFFFFull));
    const __m256i c1_hi = _mm256_set1_epi64x(static_cast<int64_t>(0xBF58476D1CE4E5B9ull >> 32));
    const __m256i c2_lo = _mm256_set1_epi64x(static_cast<int64_t>(0x94D049BB133111EBull & 0xFFFFFFFFull));
    const __m256i c2_hi = _mm256_set1_epi64x(static_cast<int64_t>(0x94D049BB133111EBull >> 32));
    h = mullo64(_mm256_xor_si256(h, _mm256_srli_epi64(h, 30)), c1_lo, c1_hi);
    h = mullo64(_mm256_xor_si256(h, _mm256_srli_epi64(h, 27)), c2_lo, c2_hi);
    return _mm256_xor_si256(h, _mm256_srli_epi64(h, 31));
  };
  // base + (j + 1 + lane) kGolden: the even lanes of the block at j in start[0], the odd ones in
  // start[1], so that their top halves interleave back into element order in one OR
  __m256i start[2];
  for (int odd_lanes = 0; odd_lanes < 2; ++odd_lanes)
    start[odd_lanes] = _mm256_set_epi64x(static_cast<int64_t>(base + (7 + odd_lanes) * kGolden),
                                         static_cast<int64_t>(base + (5 + odd_lanes) * kGolden),
                                         static_cast<int64_t>(base + (3 + odd_lanes) * kGolden),
                                         static_cast<int64_t>(base + (1 + odd_lanes) * kGolden));
  const __m256i step = _mm256_set1_epi64x(static_cast<int64_t>(8 * kGolden));
  const __m256 vtop = _mm256_set1_ps(top), ln2 = _mm256_set1_ps(static_cast<float>(kLn2));
  const __m256i bias = _mm256_set1_epi32(151);
  auto below = [](double b) {  // a float at or below b
    return _mm256_set1_ps(std::nextafter(static_cast<float>(b), -std::numeric_limits<float>::infinity()));
  };
  double bar_best = best;
  __m256 block_bar = below(best - 53 * kLn2 - 1e-6), bar = below(best - 1e-4);
  for (; j + 8 <= n; j += 8, start[0] = _mm256_add_epi64(start[0], step), start[1] = _mm256_add_epi64(start[1], step)) {
    const __m256 shifted = _mm256_sub_ps(_mm256_loadu_ps(x + j), vtop);
    if (best != bar_best) bar_best = best, block_bar = below(best - 53 * kLn2 - 1e-6), bar = below(best - 1e-4);
    const __m256 live = _mm256_cmp_ps(shifted, block_bar, _CMP_GE_OQ);  // false for NaN, -inf
    if (!_mm256_movemask_ps(live)) continue;
    const __m256i top24 = _mm256_or_si256(_mm256_srli_epi64(mix4(start[0]), 40),
                                          _mm256_slli_epi64(_mm256_srli_epi64(mix4(start[1]), 40), 32));
    const __m256i exponent = _mm256_srli_epi32(_mm256_castps_si256(_mm256_cvtepi32_ps(top24)), 23);
    const __m256 bound = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(bias, exponent)), ln2, shifted);
    for (int cand = _mm256_movemask_ps(_mm256_and_ps(live, _mm256_cmp_ps(bound, bar, _CMP_GE_OQ))); cand; cand &= cand - 1) {
      const int64_t at = j + __builtin_ctz(cand);
      if (at != top_at) consider(at, x[at] - top, odd_at(at));
    }
  }
#endif
  for (; j < n; ++j) {
    const float shifted = x[j] - top;
    if (!(shifted > -std::numeric_limits<float>::infinity()) || j == top_at) continue;  // masked (or NaN)
    const uint64_t odd = odd_at(j);
    const double bound = static_cast<double>(shifted) + kLn2 * (53 - (63 - __builtin_clzll(odd)));
    if (bound + 1e-6 < best) continue;  // cannot reach the best even with its noise's largest value
    consider(j, shifted, odd);
  }
  return best_at;
}

at::Tensor race_rows(const at::Tensor& logits, const at::Tensor& keys, const at::Tensor& counters) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.device().is_cpu(),
              "race_rows: float32 2-D CPU logits");
  TORCH_CHECK(keys.scalar_type() == at::kLong && counters.scalar_type() == at::kLong && keys.dim() == 1 &&
                  counters.dim() == 1 && keys.size(0) == logits.size(0) && counters.size(0) == logits.size(0),
              "race_rows: one int64 key and counter per row");
  const at::Tensor x = logits.contiguous(), k = keys.contiguous(), c = counters.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* ids = out.data_ptr<int64_t>();
  const float* data = x.data_ptr<float>();
  const int64_t* kd = k.data_ptr<int64_t>();
  const int64_t* cd = c.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      ids[r] = row_race(data + r * n, n, static_cast<uint64_t>(kd[r]), static_cast<uint64_t>(cd[r]));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("race_rows(Tensor logits, Tensor keys, Tensor counters) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
  m.impl("race_rows", &race_rows);
}
