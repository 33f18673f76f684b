// The parts of the CUDA emulation that do not depend on how CUDA threads run (see
// cuda_emu_runtime.h): the kernel registry, poisoning, and the ctypes entry points.
#include <algorithm>
#include <cstring>
#include <iterator>
#include <mutex>

#include "cuda_emu_runtime.h"

namespace ps_emu {

std::map<std::string, Kernel>& registry() {
  static std::map<std::string, Kernel> kernels;
  return kernels;
}

void register_kernel(const char* name, void* fn, Trampoline trampoline, const char* signature) {
  registry()[name] = Kernel{fn, trampoline, signature};
}

void poison(void* p, std::size_t bytes) {
  auto* words = static_cast<std::uint32_t*>(p);
  for (std::size_t i = 0; i < bytes / 4; ++i) words[i] = kPoison;
  std::memset(static_cast<char*>(p) + bytes / 4 * 4, 0x7f, bytes % 4);
}

std::string where(const char* file, int line) {
  return std::string(file ? file : "?") + ":" + std::to_string(line);
}

std::string block_name(const uint3& b) {
  return "block (" + std::to_string(b.x) + "," + std::to_string(b.y) + "," + std::to_string(b.z) + ")";
}

namespace {

// Not thread_local: the fiber runtime poisons the module's TLS block before every block.
std::mutex last_error_mutex;
std::string last_error;

void set_last_error(const std::string& message) {
  std::lock_guard<std::mutex> lock(last_error_mutex);
  last_error = message;
}

}  // namespace
}  // namespace ps_emu

extern "C" {

// Launches `name` like cuLaunchKernel: args[i] points at the value of parameter i.
// Returns 0, or -1 with the reason in ps_emu_last_error().
int ps_emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                  unsigned long long shared_bytes, void** args) {
  using namespace ps_emu;
  auto it = registry().find(name);
  if (it == registry().end()) {
    set_last_error(std::string("no kernel named ") + name);
    return -1;
  }
  if (gx * gy * gz == 0) return 0;
  if (bx * by * bz == 0 || bx * by * bz > 1024) {
    set_last_error("block of " + std::to_string(bx * by * bz) + " threads");
    return -1;
  }
  const std::string error = run_grid(it->second, dim3(gx, gy, gz), dim3(bx, by, bz), shared_bytes, args);
  if (!error.empty()) {
    set_last_error(error);
    return -1;
  }
  return 0;
}

// Copies the last launch error into buf (NUL-terminated); returns its full length.
int ps_emu_last_error(char* buf, int size) {
  std::lock_guard<std::mutex> lock(ps_emu::last_error_mutex);
  const std::string& e = ps_emu::last_error;
  if (size > 0) {
    const std::size_t n = std::min<std::size_t>(e.size(), static_cast<std::size_t>(size - 1));
    std::memcpy(buf, e.data(), n);
    buf[n] = '\0';
  }
  return static_cast<int>(e.size());
}

// The parameter kinds of a kernel: P pointer, i 32-bit int, l 64-bit int, f float, d double.
const char* ps_emu_kernel_signature(const char* name) {
  auto it = ps_emu::registry().find(name);
  return it == ps_emu::registry().end() ? nullptr : it->second.signature.c_str();
}

int ps_emu_num_kernels() { return static_cast<int>(ps_emu::registry().size()); }

const char* ps_emu_kernel_name(int i) {
  auto it = ps_emu::registry().begin();
  std::advance(it, i);
  return it->first.c_str();
}

// Which runtime this library was built with: "fibers" or "threads".
const char* ps_emu_mode() {
#ifdef PS_EMU_THREADS
  return "threads";
#else
  return "fibers";
#endif
}

}  // extern "C"
