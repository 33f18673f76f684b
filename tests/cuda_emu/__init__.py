"""CPU emulation of CUDA for the kernel tests: g++ builds engine_svc/kernels/*.cu unchanged
against cuda_emu.h, and the result is launched through ctypes (see build.py, launcher.py)."""
