// The thread runtime of the CUDA CPU emulation (-DPS_EMU_THREADS; see cuda_emu.h): every CUDA
// thread of a block is an OS thread, so ThreadSanitizer sees the kernels' shared-memory accesses
// as they really interleave. Slower than the fibers; kept for `build(flavour="tsan")`.
//
// - Blocks run one after another on a pool of blockDim OS threads per launch. __shared__ is a
//   plain static there, gathered by shared_section.ld into one section that is poisoned with NaN
//   before every block.
// - The runtime's own synchronization is invisible to TSan: this file is compiled without
//   -fsanitize=thread and waits with futexes on atomics (hidden_sync.h; TSan intercepts pthread
//   locks, not these). The only happens-before edges TSan sees are the ones CUDA promises,
//   announced with hb_release / hb_acquire: __syncthreads() orders the block, __syncwarp() the warp,
//   and one block ends before the next starts (so races between blocks of a grid go unseen).
//   A shuffle exchanges values but orders no memory, as on the GPU.
// - A __syncthreads() or warp operation that cannot complete is reported, never hung: the block
//   counts threads that wait and threads that exited, and fails when none can move; waiting
//   threads then leave the kernel by an exception.
#ifdef PS_EMU_THREADS
#include <atomic>
#include <climits>
#include <cstring>
#include <memory>
#include <system_error>
#include <thread>
#include <vector>

#include "cuda_emu_runtime.h"
#include "hidden_sync.h"

// Bounds of the __shared__ section, defined by shared_section.ld.
extern "C" __attribute__((visibility("hidden"))) char ps_emu_shared_begin[], ps_emu_shared_end[];

namespace ps_emu {
namespace {

struct BlockAbort {};  // thrown out of a kernel whose block failed

struct WarpSync {  // one warp's exchange; fields under ThreadBlock::lock
  int num_lanes = 0, exited = 0;
  std::uint64_t slots[2][kWarpSize];  // double-buffered by operation parity
  int arrived[2] = {0, 0};
  std::uint64_t completed = 0;  // warp operations every lane has reached
  const char* file[2] = {nullptr, nullptr};
  int line[2] = {0, 0};
  std::atomic<std::uint32_t> wake{0};  // futex word: bumped when an operation completes
  char hb[2];                           // TSan sync objects of __syncwarp, by parity
};

// One launch's pool and the state of its running block (fields below `lock` are guarded by it).
struct ThreadBlock {
  BlockState shape;
  Kernel kernel;
  void** args = nullptr;
  int num_threads = 0;
  std::vector<std::uint32_t> dynamic_shared;
  std::unique_ptr<WarpSync[]> warps;
  int num_warps = 0;
  std::atomic<std::uint32_t> posted{0};    // blocks handed to the pool (futex word)
  std::atomic<std::uint32_t> finished{0};  // threads done with the current block (futex word)
  std::atomic<bool> stop{false};
  // TSan sync objects: every thread's end of a block happens before the launching thread posts
  // the next one, which happens before that block's start (and nothing else does).
  char block_end_hb, block_start_hb;

  FutexLock lock;
  int barrier_arrived = 0, exited = 0, waiting = 0;  // waiting: blocked and not yet released
  std::uint64_t barrier_gen = 0;
  const char* barrier_file = nullptr;
  int barrier_line = 0;
  std::atomic<std::uint32_t> barrier_wake{0};  // futex word: bumped when a barrier completes
  char barrier_hb[2];                           // TSan sync objects of __syncthreads, by parity
  bool failed = false;
  std::string error;
};

struct CudaThread {  // what one pool thread knows about itself
  ThreadState state;
  ThreadBlock* block = nullptr;
  int warp = 0, lane = 0;
  std::uint64_t barriers = 0, warp_ops = 0;  // counted per block
};

thread_local CudaThread* tl_thread = nullptr;

void wake_all(ThreadBlock& b) {
  b.barrier_wake.fetch_add(1);
  futex_wake(b.barrier_wake, INT_MAX);
  for (int w = 0; w < b.num_warps; ++w) {
    b.warps[w].wake.fetch_add(1);
    futex_wake(b.warps[w].wake, INT_MAX);
  }
}

// Leaves the kernel of a block that failed (lock held on entry, released here).
[[noreturn]] void abort_locked(ThreadBlock& b) {
  b.lock.unlock();
  throw BlockAbort{};
}

// Records the block's first error, wakes every waiter and leaves the kernel (lock held on entry).
[[noreturn]] void fail_locked(ThreadBlock& b, const std::string& message) {
  if (!b.failed) {
    b.failed = true;
    b.error = message + " in " + block_name(b.shape.block_idx);
  }
  wake_all(b);
  abort_locked(b);
}

std::string describe_waits(const ThreadBlock& b) {
  int at_warp = 0;
  for (int w = 0; w < b.num_warps; ++w) at_warp += b.warps[w].arrived[0] + b.warps[w].arrived[1];
  std::string s = std::to_string(b.barrier_arrived) + " thread(s) at __syncthreads()";
  if (b.barrier_arrived) s += " (" + where(b.barrier_file, b.barrier_line) + ")";
  return s + ", " + std::to_string(at_warp) + " at a warp operation, " + std::to_string(b.exited) + " exited";
}

// Fails the block when every thread that has not exited waits for another one (lock held).
void check_progress_locked(ThreadBlock& b) {
  if (b.waiting > 0 && b.waiting + b.exited == b.num_threads) fail_locked(b, "deadlock: " + describe_waits(b));
}

// Blocks until done() (lock held on entry and on return); leaves the kernel if the block failed.
template <typename Done>
void wait_locked(ThreadBlock& b, std::atomic<std::uint32_t>& wake, Done done) {
  while (!done()) {
    if (b.failed) abort_locked(b);
    const std::uint32_t seen = wake.load();
    b.lock.unlock();
    futex_wait(wake, seen);
    b.lock.lock();
  }
}

std::uint64_t warp_op(unsigned mask, std::uint64_t bits, int src_lane, const char* file, int line,
                      bool orders_memory) {
  CudaThread& t = *tl_thread;
  ThreadBlock& b = *t.block;
  WarpSync& w = b.warps[t.warp];
  const std::uint64_t op = t.warp_ops++;
  const int buf = static_cast<int>(op & 1);
  if (orders_memory) hb_release(&w.hb[buf]);
  b.lock.lock();
  if (b.failed) abort_locked(b);
  const unsigned full = w.num_lanes == kWarpSize ? 0xffffffffu : ((1u << w.num_lanes) - 1u);
  if (mask != full && mask != 0xffffffffu) fail_locked(b, "partial-warp masks are not emulated (" + where(file, line) + ")");
  if (w.exited) fail_locked(b, "a thread exited while lanes of its warp wait at a warp operation (" + where(file, line) + ")");
  if (w.arrived[buf] == 0) {
    w.file[buf] = file;
    w.line[buf] = line;
  } else if (line != w.line[buf] || std::strcmp(file, w.file[buf]) != 0) {
    fail_locked(b, "divergent warp operation: " + where(file, line) + " vs " + where(w.file[buf], w.line[buf]));
  }
  w.slots[buf][t.lane] = bits;
  if (++w.arrived[buf] == w.num_lanes) {
    w.arrived[buf] = 0;
    w.completed = op + 1;
    b.waiting -= w.num_lanes - 1;
    w.wake.fetch_add(1);
    futex_wake(w.wake, INT_MAX);
  } else {
    ++b.waiting;
    check_progress_locked(b);
    wait_locked(b, w.wake, [&] { return w.completed > op; });
  }
  const std::uint64_t result = src_lane < 0 || src_lane >= w.num_lanes ? bits : w.slots[buf][src_lane];
  b.lock.unlock();
  if (orders_memory) hb_acquire(&w.hb[buf]);
  return result;
}

// A kernel returned: an exit is an error while others wait for this thread (lock taken here).
void exit_kernel(CudaThread& t) {
  ThreadBlock& b = *t.block;
  b.lock.lock();
  if (!b.failed) {
    WarpSync& w = b.warps[t.warp];
    ++b.exited;
    ++w.exited;
    if (b.barrier_arrived > 0) {
      fail_locked(b, "a thread exited while others wait at __syncthreads() (" +
                         where(b.barrier_file, b.barrier_line) + ")");
    }
    if (w.arrived[0] || w.arrived[1]) fail_locked(b, "a thread exited while lanes of its warp wait at a warp operation");
    check_progress_locked(b);
  }
  b.lock.unlock();
}

void pool_thread(ThreadBlock& b, int linear) {
  CudaThread t;
  const dim3 dim = b.shape.block_dim;
  t.state.thread_idx = {linear % dim.x, (linear / dim.x) % dim.y, linear / (dim.x * dim.y)};
  t.block = &b;
  t.warp = linear / kWarpSize;
  t.lane = linear % kWarpSize;
  tl_thread = &t;
  for (std::uint32_t next = 1;; ++next) {
    for (std::uint32_t seen; (seen = b.posted.load()) < next;) futex_wait(b.posted, seen);
    if (b.stop) break;
    hb_acquire(&b.block_start_hb);
    t.barriers = t.warp_ops = 0;
    try {
      b.kernel.trampoline(b.kernel.fn, b.args);
      exit_kernel(t);
    } catch (const BlockAbort&) {
    }
    hb_release(&b.block_end_hb);
    if (b.finished.fetch_add(1) + 1 == static_cast<std::uint32_t>(b.num_threads)) futex_wake(b.finished, INT_MAX);
  }
  tl_thread = nullptr;
}

// Readies the pool's state for block `index` (the pool is idle: every thread waits on `posted`).
void reset_block(ThreadBlock& b, long long index) {
  const dim3 grid = b.shape.grid_dim;
  b.shape.block_idx = {static_cast<unsigned>(index % grid.x), static_cast<unsigned>((index / grid.x) % grid.y),
                       static_cast<unsigned>(index / (1LL * grid.x * grid.y))};
  poison(ps_emu_shared_begin, static_cast<std::size_t>(ps_emu_shared_end - ps_emu_shared_begin));
  if (!b.dynamic_shared.empty()) poison(b.dynamic_shared.data(), b.dynamic_shared.size() * 4);
  for (int w = 0; w < b.num_warps; ++w) {
    WarpSync& warp = b.warps[w];
    warp.exited = warp.arrived[0] = warp.arrived[1] = 0;
    warp.completed = 0;
  }
  b.barrier_arrived = b.exited = b.waiting = 0;
  b.barrier_gen = 0;
  b.finished = 0;
}

// Starts one OS thread per CUDA thread; returns "" or why they could not all start.
std::string start_pool(ThreadBlock& b, std::vector<std::thread>& pool) {
  try {
    for (int i = 0; i < b.num_threads; ++i) pool.emplace_back(pool_thread, std::ref(b), i);
  } catch (const std::system_error& e) {
    return "cannot start " + std::to_string(b.num_threads) + " threads for a block: " + e.what();
  }
  return "";
}

void stop_pool(ThreadBlock& b, std::vector<std::thread>& pool) {
  b.stop = true;
  b.posted.fetch_add(1);
  futex_wake(b.posted, INT_MAX);
  for (std::thread& t : pool) t.join();
}

}  // namespace

const ThreadState& this_thread() { return tl_thread->state; }
const BlockState& this_block() { return tl_thread->block->shape; }
void* dynamic_shared() { return tl_thread->block->dynamic_shared.data(); }
int lane_id() { return tl_thread->lane; }

void syncthreads(const char* file, int line) {
  CudaThread& t = *tl_thread;
  ThreadBlock& b = *t.block;
  void* hb = &b.barrier_hb[t.barriers++ & 1];
  hb_release(hb);
  b.lock.lock();
  if (b.failed) abort_locked(b);
  if (b.exited > 0) fail_locked(b, "a thread exited while others wait at __syncthreads() (" + where(file, line) + ")");
  if (b.barrier_arrived == 0) {
    b.barrier_file = file;
    b.barrier_line = line;
  } else if (line != b.barrier_line || std::strcmp(file, b.barrier_file) != 0) {
    fail_locked(b, "divergent __syncthreads(): " + where(file, line) + " vs " + where(b.barrier_file, b.barrier_line));
  }
  if (++b.barrier_arrived == b.num_threads) {
    b.barrier_arrived = 0;
    ++b.barrier_gen;
    b.waiting -= b.num_threads - 1;
    b.barrier_wake.fetch_add(1);
    futex_wake(b.barrier_wake, INT_MAX);
  } else {
    const std::uint64_t gen = b.barrier_gen;
    ++b.waiting;
    check_progress_locked(b);
    wait_locked(b, b.barrier_wake, [&] { return b.barrier_gen > gen; });
  }
  b.lock.unlock();
  hb_acquire(hb);
}

std::uint64_t warp_exchange(unsigned mask, std::uint64_t bits, int src_lane, const char* file, int line) {
  return warp_op(mask, bits, src_lane, file, line, false);
}

void syncwarp(unsigned mask, const char* file, int line) { warp_op(mask, 0, -1, file, line, true); }

std::string run_grid(const Kernel& kernel, dim3 grid, dim3 block, std::size_t shared_bytes, void** args) {
  auto b = std::make_unique<ThreadBlock>();
  b->kernel = kernel;
  b->args = args;
  b->shape.grid_dim = grid;
  b->shape.block_dim = block;
  b->num_threads = static_cast<int>(block.x * block.y * block.z);
  b->num_warps = (b->num_threads + kWarpSize - 1) / kWarpSize;
  b->warps = std::make_unique<WarpSync[]>(b->num_warps);
  for (int i = 0; i < b->num_threads; ++i) ++b->warps[i / kWarpSize].num_lanes;
  b->dynamic_shared.resize((shared_bytes + 3) / 4);  // before the pool starts: TSan sees it as ordered
  std::vector<std::thread> pool;
  std::string error = start_pool(*b, pool);
  const long long num_blocks = 1LL * grid.x * grid.y * grid.z;
  for (long long i = 0; i < num_blocks && error.empty() && !b->failed; ++i) {
    reset_block(*b, i);
    hb_release(&b->block_start_hb);
    b->posted.fetch_add(1);
    futex_wake(b->posted, INT_MAX);
    for (std::uint32_t done; (done = b->finished.load()) != static_cast<std::uint32_t>(b->num_threads);)
      futex_wait(b->finished, done);
    hb_acquire(&b->block_end_hb);
  }
  stop_pool(*b, pool);
  return b->failed ? b->error : error;
}

}  // namespace ps_emu

#endif  // PS_EMU_THREADS
