// The gated MLP's activation on CPU, bfloat16: out = silu(gate) * up over the fused gate/up projection.
//
//   gate_up [..., 2 N] bfloat16 (gate, then up)  ->  out [..., N] = bf16(g * up / (1 + exp(-g))), g and up widened
//
// computed in float32 and rounded once, as inductor's fused kernel does. That kernel spent most of its
// time in Sleef's exp and a division (one 2,048-token prefill: 25 ms of 0.36 s, 30 layers); here
// exp is a Cephes-style polynomial scaled by VSCALEFPS (the decode attention's, |rel err| < 2e-7) and
// the reciprocal is VRCP14PS with one Newton step (< 1e-7), so a result differs from that kernel's
// only where the float32 value lies within a few ulps of a bfloat16 rounding boundary.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define PAGEDSERVE_BF16_ACTIVATION 1
#endif

#include "cpu_simd.h"

namespace {

#ifdef PAGEDSERVE_BF16_ACTIVATION
inline __m512 widen(__m256i bf16) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16));
}

// 16 outputs (mask: the valid lanes of a short tail)
inline void silu_mul16(const c10::BFloat16* g, const c10::BFloat16* u, c10::BFloat16* out, __mmask16 m) {
  const __m512 gf = widen(_mm256_maskz_loadu_epi16(m, g)), uf = widen(_mm256_maskz_loadu_epi16(m, u));
  const __m512 neg = _mm512_sub_ps(_mm512_setzero_ps(), gf);
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), pagedserve_simd::exp512_in_range(
                                                           _mm512_min_ps(_mm512_max_ps(neg, _mm512_set1_ps(-87.0f)),
                                                                         _mm512_set1_ps(88.0f))));
  __m512 r = _mm512_rcp14_ps(d);
  r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));  // one Newton step: r (2 - d r)
  _mm256_mask_storeu_epi16(out, m, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_mul_ps(gf, uf), r)));
}
#endif

bool silu_mul_available() {
#ifdef PAGEDSERVE_BF16_ACTIVATION
  return true;
#else
  return false;
#endif
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(silu_mul_available(), "silu_mul: this build has no AVX512-BF16 code");
  TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16, "silu_mul: needs bfloat16, got ", gate_up.scalar_type());
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "silu_mul: the last dimension must be even (gate, up)");
  const at::Tensor x = gate_up.contiguous();
  const int64_t n = x.size(-1) / 2, rows = n == 0 ? 0 : x.numel() / (2 * n);
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = n;
  at::Tensor out = at::empty(sizes, x.options());
#ifdef PAGEDSERVE_BF16_ACTIVATION
  const c10::BFloat16* src = x.data_ptr<c10::BFloat16>();
  c10::BFloat16* dst = out.data_ptr<c10::BFloat16>();
  // a row of the default model is 1,536 outputs: split from a few rows on, so a decode step of one
  // row stays in this thread
  at::parallel_for(0, rows, std::max<int64_t>(1, 8192 / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const c10::BFloat16* g = src + r * 2 * n;
      c10::BFloat16* o = dst + r * n;
      int64_t j = 0;
      for (; j + 16 <= n; j += 16) silu_mul16(g + j, g + n + j, o + j, 0xFFFF);
      if (j < n) silu_mul16(g + j, g + n + j, o + j, __mmask16((1u << (n - j)) - 1));
    }
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("silu_mul_available() -> bool", &silu_mul_available);
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) { m.impl("silu_mul", &silu_mul); }
