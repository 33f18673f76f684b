"""EngineConfig: every engine knob in one frozen dataclass, with vLLM's names. No I/O here.

The dataclass is defined in ``shared.config`` (the engine service's config holds one, and
``shared`` imports no service); the engine imports it from here.
"""

from __future__ import annotations

from shared.config import EngineConfig

__all__ = ["DEFAULT_CPU_KV_BYTES", "EngineConfig"]

DEFAULT_CPU_KV_BYTES = 1 << 30
