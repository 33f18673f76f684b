// Stand-in for CUDA's cuda_bf16.h where no toolkit is installed: __nv_bfloat16 as the upper 16
// bits of a float32, converted with round-to-nearest-even (NaN stays a quiet NaN).
#ifndef PAGEDSERVE_EMU_FALLBACK_BF16_H
#define PAGEDSERVE_EMU_FALLBACK_BF16_H

#include <cstdint>
#include <cstring>

struct __nv_bfloat16 {
  std::uint16_t bits;
};
using nv_bfloat16 = __nv_bfloat16;

inline __nv_bfloat16 __float2bfloat16_rn(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{static_cast<std::uint16_t>((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return __nv_bfloat16{static_cast<std::uint16_t>(u >> 16)};
}
inline __nv_bfloat16 __float2bfloat16(float x) { return __float2bfloat16_rn(x); }
inline float __bfloat162float(__nv_bfloat16 x) {
  const std::uint32_t u = static_cast<std::uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

#endif
