"""A request's KV in the paged pool, as a KV connector sees it: the layout its bytes have, the
gather/scatter between the pool's blocks and one contiguous tensor, the connector interface and
its one error. No I/O here (no redis): the engine imports this module; the connectors that move
bytes through a store live in ``engine_svc/kv_transfer.py``."""

from __future__ import annotations

import math
import sys
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

class KVTransferError(Exception):
    """A KV entry that cannot be loaded; ``reason`` is missing | expired | mismatch | corrupt |
    unavailable. The caller recomputes the prompt instead."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason



@dataclass(frozen=True, slots=True, kw_only=True)
class KVLayout:
    """What a pool's KV bytes mean; a loader accepts only an entry written for its own layout."""

    model_id: str
    num_layers: int
    dtype: str  # float32 | bfloat16 | float16
    block_size: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of_pool(cls, model_id: str, kv_caches) -> KVLayout:
        k = kv_caches[0][0]
        dtype = next((name for name, dt in _DTYPES.items() if dt == k.dtype), None)
        if dtype is None:
            raise ValueError(f"KV transfer supports {', '.join(_DTYPES)}, not {k.dtype}")
        _, block_size, num_kv_heads, head_dim = k.shape
        return cls(model_id=model_id, num_layers=len(kv_caches), dtype=dtype, block_size=block_size,
                   num_kv_heads=num_kv_heads, head_dim=head_dim)

    def payload_bytes(self, num_tokens: int) -> int:
        elem = torch.empty((), dtype=_DTYPES[self.dtype]).element_size()
        return 2 * self.num_layers * num_tokens * self.num_kv_heads * self.head_dim * elem


@dataclass(slots=True)
class KVTransferStats:
    """What one connector moved, cumulative (the engine reports them as counters); only the
    connector writes them."""

    num_saved: int = 0
    num_loaded: int = 0
    bytes_saved: int = 0
    bytes_loaded: int = 0
    save_seconds: float = 0.0  # gather + encode + store, summed over saves
    load_seconds: float = 0.0  # fetch + check + scatter, summed over successful loads
    num_fallbacks: int = 0  # loads that raised: the caller recomputed
    fallback_reasons: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------- the pool side
def token_slots(block_table, num_tokens: int, block_size: int, num_blocks: int, device) -> torch.Tensor:
    """int64 [num_tokens]: the pool slot of each of a request's first num_tokens tokens."""
    needed = -(-num_tokens // block_size)
    if num_tokens <= 0 or len(block_table) < needed:
        raise ValueError(f"{num_tokens} tokens need {needed} blocks, the block table has {len(block_table)}")
    blocks = torch.as_tensor(list(block_table[:needed]), dtype=torch.int64)
    if int(blocks.min()) < 1 or int(blocks.max()) >= num_blocks:
        raise ValueError(f"block ids must be in 1..{num_blocks - 1} (0 is the null block)")
    offsets = torch.arange(block_size, dtype=torch.int64)
    return (blocks[:, None] * block_size + offsets).reshape(-1)[:num_tokens].to(device)


def gather_kv(kv_caches, block_table, num_tokens: int, staging: torch.Tensor | None = None) -> torch.Tensor:
    """A request's KV as one contiguous CPU tensor [num_layers, 2 (K, V), num_tokens, heads, head_dim],
    in ``staging`` (CPU uint8, large enough) when given."""
    k0 = kv_caches[0][0]
    num_blocks, block_size, heads, head_dim = k0.shape
    slots = token_slots(block_table, num_tokens, block_size, num_blocks, k0.device)
    shape = (len(kv_caches), 2, num_tokens, heads, head_dim)
    if staging is None:
        out = torch.empty(shape, dtype=k0.dtype)
    else:
        out = staging[:k0.element_size() * math.prod(shape)].view(k0.dtype).view(shape)
    on_device = out if k0.device.type == "cpu" else torch.empty(shape, dtype=k0.dtype, device=k0.device)
    for layer, pair in enumerate(kv_caches):
        for i, cache in enumerate(pair):
            torch.index_select(cache.view(-1, heads, head_dim), 0, slots, out=on_device[layer, i])
    if on_device is not out:
        out.copy_(on_device)
    return out


def scatter_kv(kv_caches, block_table, num_tokens: int, kv: torch.Tensor) -> None:
    """Write ``kv`` (as gather_kv returns it) into the pool's blocks named by ``block_table``."""
    k0 = kv_caches[0][0]
    num_blocks, block_size, heads, head_dim = k0.shape
    expected = (len(kv_caches), 2, num_tokens, heads, head_dim)
    if tuple(kv.shape) != expected or kv.dtype != k0.dtype:
        raise ValueError(f"KV of shape {tuple(kv.shape)} {kv.dtype} does not fit {expected} {k0.dtype}")
    slots = token_slots(block_table, num_tokens, block_size, num_blocks, k0.device)
    kv = kv.to(k0.device)
    with torch.no_grad():
        for layer, pair in enumerate(kv_caches):
            for i, cache in enumerate(pair):
                cache.view(-1, heads, head_dim).index_copy_(0, slots, kv[layer, i])



class KVConnector(ABC):
    """Moves a request's KV between engines by handle; owns its stats. Bound to one engine's pool."""

    def __init__(self, kv_caches, model_id: str):
        if sys.byteorder != "little":
            raise RuntimeError("KV entries are little-endian; this host is not")
        self.kv_caches = kv_caches
        self.layout = KVLayout.of_pool(model_id, kv_caches)
        self.stats = KVTransferStats()

    @abstractmethod
    def save(self, request_id: str, block_table, num_tokens: int) -> str:
        """Store the request's first num_tokens tokens of KV; returns the handle a loader needs."""

    @abstractmethod
    def load(self, handle: str, block_table, num_tokens: int | None = None) -> None:
        """Fill block_table's blocks from the entry and consume it; KVTransferError when it cannot."""

    @abstractmethod
    def delete(self, handle: str) -> None:
        """Drop an entry nobody will load (idempotent)."""
