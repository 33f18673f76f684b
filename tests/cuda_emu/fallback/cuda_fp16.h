// Stand-in for CUDA's cuda_fp16.h where no toolkit is installed: __half as _Float16 storage with
// the round-to-nearest-even conversions the kernels use. (With a toolkit the emulator uses
// CUDA's own header in host mode instead.)
#ifndef PAGEDSERVE_EMU_FALLBACK_FP16_H
#define PAGEDSERVE_EMU_FALLBACK_FP16_H

struct __half {
  _Float16 value;
};
using half = __half;

inline __half __float2half_rn(float x) { return __half{static_cast<_Float16>(x)}; }
inline __half __float2half(float x) { return __float2half_rn(x); }
inline float __half2float(__half x) { return static_cast<float>(x.value); }

#endif
