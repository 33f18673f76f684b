"""glibc's malloc kept from handing a step's large buffers back to the kernel (CPU engines).

glibc serves every block above its mmap threshold (dynamic, at most 32 MB by default) with a fresh
mmap and unmaps it on free, and trims the heap's top once 128 KB are free there. A step's large
tensors (a decode step at batch 256 allocates 256 x 49,152 float32 logits, 50 MB; a 2,048-token
prefill ~12 MB per activation) are then new zeroed pages every step, and the engine's threads
page-fault through them: measured here, converting those logits to float32 took 13-15 ms into a
fresh buffer and 1-2 ms into a reused one, and the LM head's matmul 21-23 ms against 16-18. vLLM's
CPU build gets the same effect by preloading tcmalloc. Here one mallopt() at start-up raises the
mmap threshold and the trim threshold, so freed blocks are reused; the process keeps up to
TRIM_THRESHOLD of freed heap (its steady state is a step's peak, not a leak).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

logger = logging.getLogger("pagedserve.engine")

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # <malloc.h>
MMAP_THRESHOLD = 256 << 20  # blocks above this still get their own mapping (the KV pool's, say)
TRIM_THRESHOLD = 512 << 20
TOP_PAD = 64 << 20


@functools.cache
def keep_freed_memory() -> bool:
    """Apply the settings once per process; False where the C library has no mallopt (not glibc)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = all(mallopt(param, value) == 1 for param, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD)))
    logger.debug("malloc tuned for large step buffers: %s", done)
    return done


__all__ = ["keep_freed_memory"]
