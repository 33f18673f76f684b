// CPU emulation of the CUDA subset pagedserve's kernels use, so that g++ (C++20) compiles the
// very same .cu sources: `g++ -x c++ -include cuda_emu.h kernel.cu`.
//
// - Each thread block runs on one OS thread; its CUDA threads are fibers that switch at
//   __syncthreads() and at warp-synchronous operations (shuffles, __syncwarp). Blocks run in
//   parallel on several OS threads.
// - __shared__ is `static thread_local`: one copy per running block. The runtime fills it, and
//   the dynamic shared buffer, with NaN (0x7fff7fff) before every block, so a missing barrier or
//   a read of an unwritten element shows up as NaN in the output.
// - A __syncthreads() or warp operation that not every thread reaches, or reaches at another
//   source line, is reported as a launch error, never hung.
// - Kernels register themselves by name (PS_EXPORT_KERNEL) and are launched with
//   ps_emu_launch(name, grid, block, shared bytes, args) - the cuLaunchKernel calling convention.
// - With -DPS_EMU_THREADS (the ThreadSanitizer flavour) every CUDA thread is an OS thread instead
//   and blocks run one at a time, so __shared__ is a plain static, gathered into one section by
//   shared_section.ld and poisoned there (see cuda_emu_threads.cpp).
#ifndef PAGEDSERVE_CUDA_EMU_H
#define PAGEDSERVE_CUDA_EMU_H

#define PS_CUDA_EMU 1

#include <math.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

// half / bfloat16: CUDA's own headers in host mode, or tests/cuda_emu/fallback without a toolkit.
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef __VECTOR_TYPES_H__
struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};
#endif

#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#undef __forceinline__
#undef __noinline__
#undef __launch_bounds__
#define __global__
#define __device__
#define __host__
#ifdef PS_EMU_THREADS
#define __shared__ static
#else
#define __shared__ static thread_local
#endif
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#ifndef __align__
#define __align__(n) __attribute__((aligned(n)))
#endif

namespace ps_emu {

struct ThreadState {  // what a CUDA thread can ask about itself
  uint3 thread_idx;
};
struct BlockState {  // what every thread of the running block shares
  uint3 block_idx;
  dim3 block_dim, grid_dim;
};

const ThreadState& this_thread();
const BlockState& this_block();
void* dynamic_shared();
void syncthreads(const char* file, int line);
void syncwarp(unsigned mask, const char* file, int line);
// Every lane of the warp deposits `bits`; returns the bits deposited by lane `src_lane`.
std::uint64_t warp_exchange(unsigned mask, std::uint64_t bits, int src_lane, const char* file, int line);
int lane_id();

// Kernel registry: a trampoline that unpacks cuLaunchKernel-style argument pointers.
using Trampoline = void (*)(void* fn, void** args);
void register_kernel(const char* name, void* fn, Trampoline trampoline, const char* signature);

template <typename A>
constexpr char arg_code() {
  if constexpr (std::is_pointer_v<A>) return 'P';
  else if constexpr (std::is_same_v<A, float>) return 'f';
  else if constexpr (std::is_same_v<A, double>) return 'd';
  else if constexpr (std::is_integral_v<A> && sizeof(A) == 4) return 'i';
  else if constexpr (std::is_integral_v<A> && sizeof(A) == 8) return 'l';
  else return '?';
}

template <typename... A>
struct Invoker {
  template <std::size_t... I>
  static void call(void (*f)(A...), void** args, std::index_sequence<I...>) {
    f(*static_cast<std::remove_cv_t<A>*>(args[I])...);
  }
  static void trampoline(void* fn, void** args) {
    call(reinterpret_cast<void (*)(A...)>(fn), args, std::index_sequence_for<A...>{});
  }
  static inline const char signature[] = {arg_code<A>()..., '\0'};
};

struct Registrar {
  template <typename... A>
  Registrar(const char* name, void (*f)(A...)) {
    register_kernel(name, reinterpret_cast<void*>(f), &Invoker<A...>::trampoline, Invoker<A...>::signature);
  }
};

template <typename T>
inline std::uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffle of a type wider than 8 bytes");
  std::uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  return bits;
}
template <typename T>
inline T from_bits(std::uint64_t bits) {
  T v;
  std::memcpy(&v, &bits, sizeof(T));
  return v;
}

}  // namespace ps_emu

#define threadIdx (::ps_emu::this_thread().thread_idx)
#define blockIdx (::ps_emu::this_block().block_idx)
#define blockDim (::ps_emu::this_block().block_dim)
#define gridDim (::ps_emu::this_block().grid_dim)
#define warpSize 32
#define __syncthreads() ::ps_emu::syncthreads(__FILE__, __LINE__)

#define PS_DYNAMIC_SHARED(type, name) type* name = reinterpret_cast<type*>(::ps_emu::dynamic_shared())
#define PS_EMU_EXPORT_(name) static ::ps_emu::Registrar ps_emu_registrar_##name(#name, &name);
#define PS_EXPORT_KERNEL(name) PS_EMU_EXPORT_(name)

inline void __syncwarp(unsigned mask = 0xffffffffu, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::ps_emu::syncwarp(mask, file, line);
}

template <typename T>
inline T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32, const char* file = __builtin_FILE(),
                     int line = __builtin_LINE()) {
  const int lane = ::ps_emu::lane_id();
  const int src = (lane / width) * width + (src_lane % width);
  return ::ps_emu::from_bits<T>(::ps_emu::warp_exchange(mask, ::ps_emu::to_bits(v), src, file, line));
}

template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32, const char* file = __builtin_FILE(),
                         int line = __builtin_LINE()) {
  const int lane = ::ps_emu::lane_id();
  int src = lane ^ lane_mask;
  if (src / width != lane / width || src >= 32) src = lane;  // outside the segment: own value
  return ::ps_emu::from_bits<T>(::ps_emu::warp_exchange(mask, ::ps_emu::to_bits(v), src, file, line));
}

template <typename T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32, const char* file = __builtin_FILE(),
                          int line = __builtin_LINE()) {
  const int lane = ::ps_emu::lane_id();
  const int src = (lane % width) + static_cast<int>(delta) < width ? lane + static_cast<int>(delta) : lane;
  return ::ps_emu::from_bits<T>(::ps_emu::warp_exchange(mask, ::ps_emu::to_bits(v), src, file, line));
}

// Device math and bit intrinsics the kernels use.
inline float __int_as_float(int x) { return ::ps_emu::from_bits<float>(static_cast<std::uint32_t>(x)); }
inline float __int_as_float(unsigned x) { return ::ps_emu::from_bits<float>(x); }
inline int __float_as_int(float x) { return static_cast<int>(static_cast<std::uint32_t>(::ps_emu::to_bits(x))); }
inline float __expf(float x) { return std::exp(x); }
inline float __fdividef(float a, float b) { return a / b; }
template <typename T>
inline T __ldg(const T* p) { return *p; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }

#endif  // PAGEDSERVE_CUDA_EMU_H
