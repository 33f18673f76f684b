// Kernels that test the emulator itself (built only into the emulation library): shared-memory
// poisoning, shuffles, barriers, dynamic shared memory, and the errors it must report.
#include "common.cuh"

// Reads shared memory nobody wrote: must see the poison (NaN), never zeros from a previous block.
extern "C" __global__ void emu_read_unwritten_shared(float* out, int write_first) {
  __shared__ float buf[64];
  if (write_first && blockIdx.x == 0) buf[threadIdx.x] = 1.f;  // only block 0 writes
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = buf[threadIdx.x];
}
PS_EXPORT_KERNEL(emu_read_unwritten_shared)

// out[lane][0..3] = xor(lane ^ 5), down(+3, width 8), broadcast(lane 7), group_sum<8>(lane)
extern "C" __global__ void emu_shuffles(int* out) {
  const int lane = threadIdx.x % 32;
  int* row = out + threadIdx.x * 4;
  row[0] = __shfl_xor_sync(PS_FULL_MASK, lane, 5);
  row[1] = __shfl_down_sync(PS_FULL_MASK, lane, 3, 8);
  row[2] = __shfl_sync(PS_FULL_MASK, lane, 7);
  row[3] = static_cast<int>(ps::group_sum<8>(static_cast<float>(lane)));
}
PS_EXPORT_KERNEL(emu_shuffles)

// Block sum through static and dynamic shared memory; thread 0 writes the total per block.
extern "C" __global__ void emu_block_sum(const float* in, float* out) {
  PS_DYNAMIC_SHARED(float, partial);
  __shared__ float total;
  partial[threadIdx.x] = in[blockIdx.x * blockDim.x + threadIdx.x];
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.f;
    for (unsigned i = 0; i < blockDim.x; ++i) s += partial[i];
    total = s;
  }
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = total;
}
PS_EXPORT_KERNEL(emu_block_sum)

// Errors the emulator must report: mode 0 a barrier only half the block reaches, 1 an exit
// before a barrier, 2 two different barriers, 3 a shuffle only some lanes reach.
extern "C" __global__ void emu_bad_sync(int mode) {
  if (mode == 0) {
    if (threadIdx.x < 16) __syncthreads();
  } else if (mode == 1) {
    if (threadIdx.x == 3) return;
    __syncthreads();
  } else if (mode == 2) {
    if (threadIdx.x % 2) {
      __syncthreads();
    } else {
      __syncthreads();
    }
  } else if (mode == 3) {
    if (threadIdx.x < 8) __shfl_xor_sync(PS_FULL_MASK, 1, 1);
  }
}
PS_EXPORT_KERNEL(emu_bad_sync)

// Reads a neighbour's shared slot after `mode`: 0 nothing, 1 a shuffle, 2 __syncwarp(),
// 3 __syncthreads(). The neighbour is lane ^ 1 of the same warp, or (cross_warp) the same lane
// of the next warp. Only a barrier that spans both threads orders the write before the read:
// under the ThreadSanitizer flavour modes 0 and 1, and mode 2 across warps, are data races.
extern "C" __global__ void emu_neighbour_read(const float* in, float* out, int mode, int cross_warp) {
  __shared__ float buf[256];
  const int t = threadIdx.x;
  buf[t] = in[blockIdx.x * blockDim.x + t];
  float zero = 0.f;
  if (mode == 1) zero = __shfl_xor_sync(PS_FULL_MASK, zero, 1);
  if (mode == 2) __syncwarp();
  if (mode == 3) __syncthreads();
  const int other = cross_warp ? (t + PS_WARP_SIZE) % blockDim.x : t ^ 1;
  out[blockIdx.x * blockDim.x + t] = buf[other] + zero;
}
PS_EXPORT_KERNEL(emu_neighbour_read)
