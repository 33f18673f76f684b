// The fiber runtime of the CUDA CPU emulation (see cuda_emu.h), the default: the per-block fiber
// scheduler, barriers, warp exchanges and shared-memory poisoning. The registry and the ctypes
// entry points are in cuda_emu_api.cpp; -DPS_EMU_THREADS selects cuda_emu_threads.cpp instead.
//
// Fibers: on x86-64 a fiber switch is a few register moves (ps_emu_switch below), because the
// kernels switch at every shuffle and swapcontext costs a system call per switch; elsewhere (or
// with -DPS_EMU_UCONTEXT) the fibers are plain ucontext ones.
#ifndef PS_EMU_THREADS
#include <link.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#include "cuda_emu_runtime.h"

#if defined(__x86_64__) && !defined(PS_EMU_UCONTEXT)
#define PS_EMU_ASM_SWITCH 1
// Saves the callee-saved registers, MXCSR and the x87 control word on the current stack, stores
// the stack pointer in *save, loads `load` and restores the same from there.
asm(R"(
  .text
  .p2align 4
  .globl ps_emu_switch
  .hidden ps_emu_switch
  .type ps_emu_switch,@function
ps_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size ps_emu_switch, .-ps_emu_switch
)");
extern "C" void ps_emu_switch(void** save, void* load);
#endif

namespace ps_emu {
namespace {

constexpr std::size_t kStackBytes = 256 * 1024;

enum class Wait { kNone, kBarrier, kWarp, kDone };

struct Fiber {
  ThreadState state;
  int linear = 0, warp = 0, lane = 0;
  Wait wait = Wait::kNone;
  std::uint64_t wait_for = 0;  // barrier generation or warp operation count that releases it
  std::uint64_t warp_ops = 0;  // warp operations this lane has started
  char* stack = nullptr;
#ifdef PS_EMU_ASM_SWITCH
  void* sp = nullptr;
#else
  ucontext_t context;
#endif
};

struct Warp {
  int num_lanes = 0;
  std::uint64_t slots[2][kWarpSize];
  int arrived[2] = {0, 0};
  std::uint64_t completed = 0;  // operations every lane has reached
  const char* file[2] = {nullptr, nullptr};
  int line[2] = {0, 0};
};

// Everything one OS thread needs to run blocks of one launch; stacks are reused across blocks.
struct Block {
  BlockState shape;
  Kernel kernel;
  void** args = nullptr;
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  int num_threads = 0, num_done = 0;
  int barrier_arrived = 0;
  std::uint64_t barrier_gen = 0;
  const char* barrier_file = nullptr;
  int barrier_line = 0;
  Fiber* current = nullptr;
  std::vector<std::uint32_t> dynamic_shared;
  std::string error;
#ifdef PS_EMU_ASM_SWITCH
  void* main_sp = nullptr;
#else
  ucontext_t main_context;
#endif
};

thread_local Block* tl_block = nullptr;  // the only thread_local of the runtime (see poison_shared)

std::mutex stack_mutex;
std::vector<char*> free_stacks;

char* take_stack() {
  {
    std::lock_guard<std::mutex> lock(stack_mutex);
    if (!free_stacks.empty()) {
      char* s = free_stacks.back();
      free_stacks.pop_back();
      return s;
    }
  }
  const long page = sysconf(_SC_PAGESIZE);
  void* mem = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) std::abort();
  mprotect(mem, page, PROT_NONE);  // guard page: a stack overflow faults instead of corrupting
  return static_cast<char*>(mem) + page;
}

void give_back_stacks(std::vector<Fiber>& fibers) {
  std::lock_guard<std::mutex> lock(stack_mutex);
  for (Fiber& f : fibers) {
    if (f.stack) free_stacks.push_back(f.stack);
    f.stack = nullptr;
  }
}

void switch_fiber(Block& b, Fiber* from, Fiber* to) {
  b.current = to;
#ifdef PS_EMU_ASM_SWITCH
  ps_emu_switch(from ? &from->sp : &b.main_sp, to ? to->sp : b.main_sp);
#else
  swapcontext(from ? &from->context : &b.main_context, to ? &to->context : &b.main_context);
#endif
}

bool runnable(const Block& b, const Fiber& f) {
  switch (f.wait) {
    case Wait::kNone: return true;
    case Wait::kBarrier: return b.barrier_gen >= f.wait_for;
    case Wait::kWarp: return b.warps[f.warp].completed >= f.wait_for;
    case Wait::kDone: return false;
  }
  return false;
}

std::string describe_waits(const Block& b) {
  std::string s;
  int at_barrier = 0, at_warp = 0;
  for (const Fiber& f : b.fibers) {
    at_barrier += f.wait == Wait::kBarrier;
    at_warp += f.wait == Wait::kWarp;
  }
  s += std::to_string(at_barrier) + " thread(s) at __syncthreads()";
  if (at_barrier) s += " (" + where(b.barrier_file, b.barrier_line) + ")";
  s += ", " + std::to_string(at_warp) + " at a warp operation, " + std::to_string(b.num_done) + " exited";
  return s;
}

[[noreturn]] void fail(Block& b, const std::string& message) {
  if (b.error.empty()) {
    b.error = message + " in " + block_name(b.shape.block_idx);
  }
  switch_fiber(b, b.current, nullptr);  // back to the block's OS thread; this fiber is abandoned
  std::abort();
}

// Runs the next fiber that can make progress; returns when the calling fiber may go on.
void yield(Block& b) {
  Fiber* self = b.current;
  const int n = b.num_threads;
  for (int i = 1; i <= n; ++i) {
    Fiber& f = b.fibers[(self->linear + i) % n];
    if (&f != self && runnable(b, f)) {
      switch_fiber(b, self, &f);
      return;
    }
  }
  if (runnable(b, *self)) return;
  fail(b, "deadlock: " + describe_waits(b));
}

void fiber_main() {
  Block& b = *tl_block;
  b.kernel.trampoline(b.kernel.fn, b.args);
  Fiber* self = b.current;
  self->wait = Wait::kDone;
  ++b.num_done;
  if (b.barrier_arrived > 0) {
    fail(b, "a thread exited while others wait at __syncthreads() (" + where(b.barrier_file, b.barrier_line) + ")");
  }
  const Warp& w = b.warps[self->warp];
  if (w.arrived[0] || w.arrived[1]) fail(b, "a thread exited while lanes of its warp wait at a warp operation");
  if (b.num_done == b.num_threads) switch_fiber(b, self, nullptr);
  for (int i = 1; i < b.num_threads; ++i) {
    Fiber& f = b.fibers[(self->linear + i) % b.num_threads];
    if (runnable(b, f)) switch_fiber(b, self, &f);
  }
  fail(b, "deadlock after a thread exited: " + describe_waits(b));
}

#ifdef PS_EMU_ASM_SWITCH
[[noreturn]] void fiber_entry() {
  fiber_main();
  std::abort();
}

void init_fiber(Fiber& f) {
  auto* top = reinterpret_cast<std::uint64_t*>(f.stack + kStackBytes);  // 16-byte aligned
  *--top = 0;                                                          // fiber_entry's return address
  *--top = reinterpret_cast<std::uint64_t>(&fiber_entry);              // popped by `ret`
  for (int i = 0; i < 6; ++i) *--top = 0;                              // rbp rbx r12 r13 r14 r15
  *--top = 0x1f80ull | (0x037full << 32);                              // MXCSR, x87 control word
  f.sp = top;
}
#else
void init_fiber(Fiber& f) {
  getcontext(&f.context);
  f.context.uc_stack.ss_sp = f.stack;
  f.context.uc_stack.ss_size = kStackBytes;
  f.context.uc_link = nullptr;
  makecontext(&f.context, &fiber_main, 0);
}
#endif

// __shared__ variables are the module's thread_locals: fill this thread's copy of the module's
// TLS block (its zero-initialized part) with NaN, keeping the runtime's own pointer.
struct TlsRange {
  char* begin = nullptr;
  std::size_t size = 0;
};

int find_tls(dl_phdr_info* info, std::size_t, void* data) {
  auto* range = static_cast<TlsRange*>(data);
  const auto self = reinterpret_cast<ElfW(Addr)>(&find_tls);
  bool mine = false;
  const ElfW(Phdr)* tls = nullptr;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& ph = info->dlpi_phdr[i];
    if (ph.p_type == PT_LOAD && self >= info->dlpi_addr + ph.p_vaddr && self < info->dlpi_addr + ph.p_vaddr + ph.p_memsz)
      mine = true;
    if (ph.p_type == PT_TLS) tls = &ph;
  }
  if (!mine) return 0;
  if (tls != nullptr && info->dlpi_tls_data != nullptr) {
    range->begin = static_cast<char*>(info->dlpi_tls_data) + tls->p_filesz;
    range->size = tls->p_memsz - tls->p_filesz;
  }
  return 1;
}

void poison_shared(const TlsRange& tls) {
  Block* keep = tl_block;
  if (tls.begin) poison(tls.begin, tls.size);
  // tl_block's address never escapes, so the compiler "knows" poison() cannot touch it and would
  // drop the restore as a no-op; hiding `keep` from it keeps the store.
  asm volatile("" : "+r"(keep));
  tl_block = keep;
}

void run_block(Block& b, const TlsRange& tls) {
  poison_shared(tls);
  if (!b.dynamic_shared.empty()) poison(b.dynamic_shared.data(), b.dynamic_shared.size() * 4);
  for (Warp& w : b.warps) {
    w.arrived[0] = w.arrived[1] = 0;
    w.completed = 0;
  }
  b.num_done = 0;
  b.barrier_arrived = 0;
  b.barrier_gen = 0;
  for (Fiber& f : b.fibers) {
    f.wait = Wait::kNone;
    f.wait_for = 0;
    f.warp_ops = 0;
    init_fiber(f);
  }
  switch_fiber(b, nullptr, &b.fibers[0]);
}

struct Launch {
  Kernel kernel;
  dim3 grid, block;
  std::size_t shared_bytes;
  void** args;
  std::atomic<long long> next{0};
  std::mutex error_mutex;
  std::string error;
  std::atomic<bool> failed{false};
};

void worker(Launch& launch) {
  Block b;
  tl_block = &b;
  TlsRange tls;
  dl_iterate_phdr(&find_tls, &tls);
  b.kernel = launch.kernel;
  b.args = launch.args;
  b.shape.block_dim = launch.block;
  b.shape.grid_dim = launch.grid;
  b.num_threads = static_cast<int>(launch.block.x * launch.block.y * launch.block.z);
  b.fibers.resize(b.num_threads);
  b.warps.resize((b.num_threads + kWarpSize - 1) / kWarpSize);
  for (int i = 0; i < b.num_threads; ++i) {
    Fiber& f = b.fibers[i];
    f.linear = i;
    f.warp = i / kWarpSize;
    f.lane = i % kWarpSize;
    f.state.thread_idx = {i % launch.block.x, (i / launch.block.x) % launch.block.y,
                          i / (launch.block.x * launch.block.y)};
    f.stack = take_stack();
    ++b.warps[f.warp].num_lanes;
  }
  b.dynamic_shared.resize((launch.shared_bytes + 3) / 4);
  const long long num_blocks = 1LL * launch.grid.x * launch.grid.y * launch.grid.z;
  for (long long i = launch.next++; i < num_blocks && !launch.failed; i = launch.next++) {
    b.shape.block_idx = {static_cast<unsigned>(i % launch.grid.x),
                         static_cast<unsigned>((i / launch.grid.x) % launch.grid.y),
                         static_cast<unsigned>(i / (1LL * launch.grid.x * launch.grid.y))};
    run_block(b, tls);
    if (!b.error.empty()) {
      std::lock_guard<std::mutex> lock(launch.error_mutex);
      if (launch.error.empty()) launch.error = b.error;
      launch.failed = true;
    }
  }
  give_back_stacks(b.fibers);
  tl_block = nullptr;
}

int num_workers() {
  if (const char* env = std::getenv("PS_EMU_THREADS")) return std::max(1, std::atoi(env));
  return std::max(1u, std::thread::hardware_concurrency());
}

}  // namespace

const ThreadState& this_thread() { return tl_block->current->state; }
const BlockState& this_block() { return tl_block->shape; }
void* dynamic_shared() { return tl_block->dynamic_shared.data(); }
int lane_id() { return tl_block->current->lane; }

void syncthreads(const char* file, int line) {
  Block& b = *tl_block;
  if (b.num_done > 0) {
    fail(b, "__syncthreads() at " + where(file, line) + " reached after " + std::to_string(b.num_done) +
                " thread(s) of the block exited");
  }
  if (b.barrier_arrived == 0) {
    b.barrier_file = file;
    b.barrier_line = line;
  } else if (line != b.barrier_line || std::strcmp(file, b.barrier_file) != 0) {
    fail(b, "divergent __syncthreads(): " + where(file, line) + " vs " + where(b.barrier_file, b.barrier_line));
  }
  if (++b.barrier_arrived == b.num_threads) {
    b.barrier_arrived = 0;
    ++b.barrier_gen;
    return;
  }
  Fiber* self = b.current;
  self->wait = Wait::kBarrier;
  self->wait_for = b.barrier_gen + 1;
  yield(b);
  self->wait = Wait::kNone;
}

std::uint64_t warp_exchange(unsigned mask, std::uint64_t bits, int src_lane, const char* file, int line) {
  Block& b = *tl_block;
  Fiber* self = b.current;
  Warp& w = b.warps[self->warp];
  const unsigned full = w.num_lanes == kWarpSize ? 0xffffffffu : ((1u << w.num_lanes) - 1u);
  if (mask != full && mask != 0xffffffffu) fail(b, "partial-warp masks are not emulated (" + where(file, line) + ")");
  const std::uint64_t op = self->warp_ops++;
  const int buf = static_cast<int>(op & 1);
  if (w.arrived[buf] == 0) {
    w.file[buf] = file;
    w.line[buf] = line;
  } else if (line != w.line[buf] || std::strcmp(file, w.file[buf]) != 0) {
    fail(b, "divergent warp operation: " + where(file, line) + " vs " + where(w.file[buf], w.line[buf]));
  }
  w.slots[buf][self->lane] = bits;
  if (++w.arrived[buf] == w.num_lanes) {
    w.arrived[buf] = 0;
    w.completed = op + 1;
  } else {
    self->wait = Wait::kWarp;
    self->wait_for = op + 1;
    yield(b);
    self->wait = Wait::kNone;
  }
  if (src_lane < 0 || src_lane >= w.num_lanes) return bits;
  return w.slots[buf][src_lane];
}

void syncwarp(unsigned mask, const char* file, int line) { warp_exchange(mask, 0, -1, file, line); }

std::string run_grid(const Kernel& kernel, dim3 grid, dim3 block, std::size_t shared_bytes, void** args) {
  Launch launch;
  launch.kernel = kernel;
  launch.grid = grid;
  launch.block = block;
  launch.shared_bytes = shared_bytes;
  launch.args = args;
  const long long num_blocks = 1LL * grid.x * grid.y * grid.z;
  const int n = static_cast<int>(std::min<long long>(num_workers(), num_blocks));
  std::vector<std::thread> threads;
  for (int i = 1; i < n; ++i) threads.emplace_back(worker, std::ref(launch));
  worker(launch);
  for (std::thread& t : threads) t.join();
  return launch.failed ? launch.error : std::string();
}

}  // namespace ps_emu

#endif  // PS_EMU_THREADS
