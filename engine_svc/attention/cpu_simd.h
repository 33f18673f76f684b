// AVX-512 helpers shared by the CPU kernels (cpu_kernels.cpp, cpu_prefill.cpp, cpu_amx_prefill.cpp), and AVX2 ones
// (cpu_kernels.cpp, cpu_gemv.cpp, cpu_prefill.cpp); header-only, so each translation unit gets its own inline copy. Part of the build's
// hash (cpu_ops.HEADERS).
#pragma once

namespace pagedserve_simd {

// Cephes' expf, for every width: exp(x) = 2^k p(r) with k = round(x log2(e)), r = x - k ln(2) (ln 2
// in two parts, so that r is exact), p(r) = 1 + r + r^2 (c0 r^5 + ... + c5); |rel err| < 2e-7.
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

}  // namespace pagedserve_simd

#if defined(__AVX2__) && defined(__FMA__)
#include <c10/util/BFloat16.h>
#include <immintrin.h>

namespace pagedserve_simd {

// 8 bfloat16 values as float32 (exact: a bfloat16 is the upper half of a float32)
inline __m256 widen8(const c10::BFloat16* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

// the sum of v's 8 lanes
inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// exp(x) for x <= 0 on 8 lanes: cpu_kernels.cpp's exp_nonpos (Cephes), clamped at -87 so that 2^k
// stays a normal float built from its exponent bits
inline __m256 exp256_nonpos(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(kLn2Lo), _mm256_fnmadd_ps(k, _mm256_set1_ps(kLn2Hi), x));
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

}  // namespace pagedserve_simd

#endif

#ifdef __AVX512F__
#include <immintrin.h>

namespace pagedserve_simd {

// 16-bit lanes (a[i], b[i]) for i in [0, 16) and [16, 32) of two vectors of 32 (for _mm512_permutex2var_epi16)
inline const __m512i kInterleaveLo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                                      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
inline const __m512i kInterleaveHi = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24,
                                                      55, 23, 54, 22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);

// exp(x) on 16 lanes for x in [-87, 88] (the caller clamps): the Cephes-style polynomial of exp_nonpos
// (cpu_kernels.cpp), scaled by 2^k with VSCALEFPS (no integer bit tricks: a large k saturates, never wraps).
inline __m512 exp512_in_range(__m512 x) {
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2Lo), _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2Hi), x));
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, k);
}

// exp(x) for x <= 0 (scores less their max)
inline __m512 exp512_nonpos(__m512 x) { return exp512_in_range(_mm512_max_ps(x, _mm512_set1_ps(-87.0f))); }

}  // namespace pagedserve_simd

#endif
