// Shared pieces of the pagedserve kernels: element types, float conversions, warp reductions,
// and the macros that name and instantiate every exported kernel.
//
// The same sources compile three ways:
//   nvcc / NVRTC (cupy.RawModule)         real GPU code;
//   g++ -include tests/cuda_emu/cuda_emu.h  CPU emulation for the tests (PS_CUDA_EMU defined).
// Only two things differ, and both go through macros the emulator pre-defines:
// dynamic shared memory (PS_DYNAMIC_SHARED, as HIP_DYNAMIC_SHARED does) and the registration
// of exported kernels by name (PS_EXPORT_KERNEL, empty on the GPU).
#ifndef PAGEDSERVE_KERNELS_COMMON_CUH
#define PAGEDSERVE_KERNELS_COMMON_CUH

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef PS_DYNAMIC_SHARED
#define PS_DYNAMIC_SHARED(type, name) extern __shared__ __align__(16) type name[]
#endif
#ifndef PS_EXPORT_KERNEL
#define PS_EXPORT_KERNEL(name)
#endif

#define PS_WARP_SIZE 32
#define PS_FULL_MASK 0xffffffffu

// ---------------------------------------------------------------------------------------------
// Instantiation lists. Every exported kernel is `extern "C"` and named
//   <kernel>_<dtype>[_h<head size>][_b<block size>]      e.g. ps_paged_decode_f16_h128_b16
// cupy_backend compiles one configuration at a time (-DPS_ONE_CONFIG -DPS_CONFIG_DTYPE=f16
// -DPS_CONFIG_HEAD=128 -DPS_CONFIG_BLOCK=16); nvcc and the emulator build all of them.
#define PS_CAT_(a, b) a##b
#define PS_CAT(a, b) PS_CAT_(a, b)
#define PS_NAME_T(kernel, tname) PS_CAT(kernel, PS_CAT(_, tname))
#define PS_NAME_TH(kernel, tname, head) PS_CAT(PS_NAME_T(kernel, tname), PS_CAT(_h, head))
#define PS_NAME_THB(kernel, tname, head, block) PS_CAT(PS_NAME_TH(kernel, tname, head), PS_CAT(_b, block))

#define PS_TYPE_f32 float
#define PS_TYPE_f16 __half
#define PS_TYPE_bf16 __nv_bfloat16
#define PS_TYPE(tname) PS_CAT(PS_TYPE_, tname)

#if defined(PS_ONE_CONFIG)
#define PS_FOR_EACH_DTYPE(X) X(PS_CONFIG_DTYPE)
#define PS_FOR_EACH_DTYPE_HEAD(X) X(PS_CONFIG_DTYPE, PS_CONFIG_HEAD)
#define PS_FOR_EACH_CONFIG(X) X(PS_CONFIG_DTYPE, PS_CONFIG_HEAD, PS_CONFIG_BLOCK)
#else
#define PS_FOR_EACH_DTYPE(X) X(f32) X(f16) X(bf16)
#define PS_FOR_EACH_HEAD_(X, t) X(t, 64) X(t, 128)
#define PS_FOR_EACH_DTYPE_HEAD(X) PS_FOR_EACH_HEAD_(X, f32) PS_FOR_EACH_HEAD_(X, f16) PS_FOR_EACH_HEAD_(X, bf16)
#define PS_FOR_EACH_BLOCK_(X, t, h) X(t, h, 8) X(t, h, 16) X(t, h, 32)
#define PS_FOR_EACH_CONFIG_T_(X, t) PS_FOR_EACH_BLOCK_(X, t, 64) PS_FOR_EACH_BLOCK_(X, t, 128)
#define PS_FOR_EACH_CONFIG(X) PS_FOR_EACH_CONFIG_T_(X, f32) PS_FOR_EACH_CONFIG_T_(X, f16) PS_FOR_EACH_CONFIG_T_(X, bf16)
#endif

namespace ps {

// ---------------------------------------------------------------------------------------------
// Storage types <-> float32 (all arithmetic is float32; rounding back is round-to-nearest-even).
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// -inf without <math.h> (NVRTC has no INFINITY macro).
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// VEC elements of T that move as one 16-byte load.
template <typename T, int VEC>
struct __align__(16) Vec {
  T v[VEC];
};

template <typename T, int VEC>
__device__ __forceinline__ void load_vec(const T* __restrict__ src, float (&dst)[VEC]) {
  const Vec<T, VEC> raw = *reinterpret_cast<const Vec<T, VEC>*>(src);
#pragma unroll
  for (int i = 0; i < VEC; ++i) dst[i] = to_float(raw.v[i]);
}

// ---------------------------------------------------------------------------------------------
// Butterfly reductions over groups of WIDTH consecutive lanes (WIDTH a power of two <= 32);
// every lane of the group ends with the result. All 32 lanes of the warp must call them.
template <int WIDTH>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int mask = WIDTH / 2; mask > 0; mask >>= 1) x += __shfl_xor_sync(PS_FULL_MASK, x, mask);
  return x;
}

template <int WIDTH>
__device__ __forceinline__ float group_max(float x) {
#pragma unroll
  for (int mask = WIDTH / 2; mask > 0; mask >>= 1) x = fmaxf(x, __shfl_xor_sync(PS_FULL_MASK, x, mask));
  return x;
}

}  // namespace ps

#endif  // PAGEDSERVE_KERNELS_COMMON_CUH
