// Synchronization that ThreadSanitizer cannot see, and the happens-before edges it is told about
// instead: the thread runtime (cuda_emu_threads.cpp) waits with these, so TSan checks a kernel
// against the ordering CUDA promises, not against the runtime's own locking. Include it only
// from code compiled without -fsanitize=thread: instrumented atomics would be seen again.
#ifndef PAGEDSERVE_CUDA_EMU_HIDDEN_SYNC_H
#define PAGEDSERVE_CUDA_EMU_HIDDEN_SYNC_H

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>

// Present when libtsan is loaded (the tsan flavour); null otherwise.
extern "C" __attribute__((weak)) void __tsan_acquire(void* addr);
extern "C" __attribute__((weak)) void __tsan_release(void* addr);

namespace ps_emu {

// What happened before hb_release(sync) in this thread happens before whatever follows a later
// hb_acquire(sync) in any thread, as far as TSan knows; no-ops without TSan.
inline void hb_release(void* sync) {
  if (&__tsan_release != nullptr) __tsan_release(sync);
}
inline void hb_acquire(void* sync) {
  if (&__tsan_acquire != nullptr) __tsan_acquire(sync);
}

inline void futex_wait(std::atomic<std::uint32_t>& word, std::uint32_t seen) {
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr, 0);
}
inline void futex_wake(std::atomic<std::uint32_t>& word, int count) {
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAKE_PRIVATE, count, nullptr, nullptr, 0);
}

// A mutex TSan cannot see (Drepper's futex mutex): 0 free, 1 locked, 2 locked with waiters.
class FutexLock {
 public:
  void lock() {
    std::uint32_t c = 0;
    if (state_.compare_exchange_strong(c, 1, std::memory_order_acquire)) return;
    if (c != 2) c = state_.exchange(2, std::memory_order_acquire);
    while (c != 0) {
      futex_wait(state_, 2);
      c = state_.exchange(2, std::memory_order_acquire);
    }
  }
  void unlock() {
    if (state_.exchange(0, std::memory_order_release) == 2) futex_wake(state_, 1);
  }

 private:
  std::atomic<std::uint32_t> state_{0};
};

}  // namespace ps_emu

#endif  // PAGEDSERVE_CUDA_EMU_HIDDEN_SYNC_H
