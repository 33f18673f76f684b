"""CPU emulation of CUDA for the kernel tests: g++ builds engine_svc/kernels/*.cu unchanged
against cuda_emu.h, and the result is launched through ctypes (see build.py, launcher.py).

Two runtimes, chosen when the library is built (build.py's flavours); both poison shared memory
with NaN before every block and report a __syncthreads() or warp operation that not every thread
reaches instead of hanging:

- fibers (the default, fast; cuda_emu.cpp): a block's CUDA threads are fibers of one OS thread,
  switched at __syncthreads() and at warp operations; blocks run in parallel on several OS
  threads, so __shared__ is thread_local. test_kernels_emu.py and the backend tests use it.
- threads (-DPS_EMU_THREADS; cuda_emu_threads.cpp): every CUDA thread is an OS thread and blocks
  run one at a time, so __shared__ is one static section (shared_section.ld). Its "tsan" flavour
  compiles the kernels with -fsanitize=thread; the runtime hides its own synchronization from
  ThreadSanitizer (hidden_sync.h) and announces only the ordering CUDA guarantees - __syncthreads(),
  __syncwarp(), the end of a block - so a missing barrier is reported as a data race; races between
  blocks of one grid are not (test_kernels_tsan.py, through tsan_cases.py in a child process).
"""
