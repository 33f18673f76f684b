"""EmuLauncher: launches the CPU-emulated kernels through ctypes, with cupy's calling convention.

Arguments come as numpy scalars, exactly as cupy.RawKernel takes them: np.uint64 for a device
pointer, np.int32 / np.int64 for integers, np.float32 for floats. Unlike a real launch, every
argument is checked against the kernel's C signature, so the backend's plumbing cannot pass a
mis-sized or misplaced value unnoticed.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np

_CODES = {np.uint64: ("P", ctypes.c_uint64), np.int32: ("i", ctypes.c_int32), np.int64: ("l", ctypes.c_int64),
          np.float32: ("f", ctypes.c_float)}


class EmuLauncher:
    """Owns the loaded emulation library; runs one kernel launch at a time per call."""

    num_sms = 132  # what the backend's split-K heuristic sees (an H200's count)

    def __init__(self, library: str | Path) -> None:
        lib = ctypes.CDLL(str(library))
        lib.ps_emu_launch.argtypes = [ctypes.c_char_p, *[ctypes.c_uint] * 6, ctypes.c_ulonglong,
                                      ctypes.POINTER(ctypes.c_void_p)]
        lib.ps_emu_launch.restype = ctypes.c_int
        lib.ps_emu_last_error.argtypes = [ctypes.c_char_p, ctypes.c_int]
        lib.ps_emu_kernel_signature.argtypes = [ctypes.c_char_p]
        lib.ps_emu_kernel_signature.restype = ctypes.c_char_p
        lib.ps_emu_kernel_name.restype = ctypes.c_char_p
        lib.ps_emu_mode.restype = ctypes.c_char_p
        self.lib = lib
        self.mode = lib.ps_emu_mode().decode()  # "fibers" or "threads" (build.py's flavours)
        self.launches: list[tuple[str, tuple, tuple, int]] = []  # (name, grid, block, shared) for tests

    def kernel_names(self) -> list[str]:
        return [self.lib.ps_emu_kernel_name(i).decode() for i in range(self.lib.ps_emu_num_kernels())]

    def multiprocessor_count(self, device) -> int:
        return self.num_sms

    def launch(self, device, config, name: str, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0) -> None:
        signature = self.lib.ps_emu_kernel_signature(name.encode())
        if signature is None:
            raise KeyError(f"no emulated kernel named {name}")
        signature = signature.decode()
        if len(signature) != len(args):
            raise TypeError(f"{name} takes {len(signature)} arguments ({signature}), got {len(args)}")
        values = []
        for i, (code, arg) in enumerate(zip(signature, args)):
            arg_code, ctype = _CODES.get(type(arg), ("?", None))
            if arg_code != code:
                raise TypeError(f"{name} argument {i}: kernel wants {code!r}, got {type(arg).__name__}")
            values.append(ctype(arg.item()))
        pointers = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
        grid3 = tuple(grid) + (1,) * (3 - len(grid))
        block3 = tuple(block) + (1,) * (3 - len(block))
        self.launches.append((name, grid3, block3, shared_mem))
        if self.lib.ps_emu_launch(name.encode(), *grid3, *block3, shared_mem, pointers) != 0:
            buf = ctypes.create_string_buffer(4096)
            self.lib.ps_emu_last_error(buf, len(buf))
            raise RuntimeError(f"{name}: {buf.value.decode()}")


@functools.cache
def emulated_launcher() -> EmuLauncher:
    """The session's launcher over the emulation library (built once, cached on disk by source hash)."""
    from tests.cuda_emu.build import build

    return EmuLauncher(build())
