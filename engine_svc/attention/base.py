"""The contract every attention backend keeps, and the per-step metadata the model hands it.

KV pool layout (one K and one V tensor per layer)::

    k_cache[num_blocks, block_size, num_kv_heads, head_dim]
             block_id   offset

    token at position p of a sequence lives in slot  block_table[p // block_size] * block_size
                                                    + p % block_size
    (slot_mapping[i] is that slot for the i-th new token; the pool viewed as
     [num_blocks * block_size, num_kv_heads, head_dim] is indexed by slot directly.)

Block 0 is a reserved null block: it pads block tables and is never read unmasked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class AttentionBackend(Protocol):
    """Reads context K/V only through block tables, writes new K/V only through a slot mapping."""

    name: str

    def reshape_and_cache(
        self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """key/value [num_tokens, num_kv_heads, head_dim] -> their slots; a negative slot is skipped."""

    def paged_decode(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
        context_lens: torch.Tensor, scale: float,
    ) -> torch.Tensor:
        """One query token per sequence over its first context_lens[s] cached tokens."""

    def paged_prefill(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
        query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float,
    ) -> torch.Tensor:
        """The new tokens of every sequence, each attending causally over its cached prefix and itself."""

    def copy_blocks(self, k_caches: list, v_caches: list, block_mapping: torch.Tensor) -> None:
        """Copy whole blocks (src, dst) in every layer (copy-on-write)."""

    def decode_kernels(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
        v_cache: torch.Tensor, meta: AttentionMetadata,
    ) -> tuple[Callable, Callable] | None:
        """(write, decode): two callables with reshape_and_cache's and paged_decode's arguments that
        serve this decode step's tensors (every layer's are of one kind) directly, without the
        per-call checks, or None when the backend has no such pair (then the methods above run)."""


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens go and what they read; built once per step, shared by every layer.

    `is_decode` means every sequence brings exactly one new token (then paged_decode runs).
    """

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    context_lens: torch.Tensor  # int32 [num_seqs]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    is_decode: bool
