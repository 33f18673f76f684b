// What the two runtimes of the CUDA emulation share (internal to tests/cuda_emu, never seen by a
// kernel): the kernel registry, shared-memory poisoning, error wording, and the one function
// each runtime provides. cuda_emu_api.cpp implements this and the ctypes entry points;
// cuda_emu.cpp (fibers, the default) or cuda_emu_threads.cpp (-DPS_EMU_THREADS) runs the grid.
#ifndef PAGEDSERVE_CUDA_EMU_RUNTIME_H
#define PAGEDSERVE_CUDA_EMU_RUNTIME_H

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

#include "cuda_emu.h"

namespace ps_emu {

constexpr std::uint32_t kPoison = 0x7fff7fffu;  // NaN as float32, and as each float16 / bfloat16 half
constexpr int kWarpSize = 32;

struct Kernel {
  void* fn;
  Trampoline trampoline;
  std::string signature;
};

std::map<std::string, Kernel>& registry();

// Fills p with kPoison (NaN), so a read of an element nobody wrote shows in the output.
void poison(void* p, std::size_t bytes);

std::string where(const char* file, int line);
std::string block_name(const uint3& block_idx);  // "block (x,y,z)"

// Runs every block of one launch; returns "" or the first block's error. Each runtime has one.
std::string run_grid(const Kernel& kernel, dim3 grid, dim3 block, std::size_t shared_bytes, void** args);

}  // namespace ps_emu

#endif  // PAGEDSERVE_CUDA_EMU_RUNTIME_H
