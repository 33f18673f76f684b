"""PagedAttention as one opaque torch op, so a compiled forward can call it.

A compiled graph carries tensors of a fixed rank and Python constants; a step's attention
metadata (block tables, context lengths, where each sequence starts) changes shape and meaning
every step, and the KV pool is written in place. So the model calls one custom op,

    torch.ops.pagedserve.paged_attention(q, k, v, binding_id, layer) -> out

whose implementation looks up the `PagedAttention` it is bound to (by the integer the model
holds) and runs the backend there: write k/v through the slot mapping, then decode or prefill
over the pool. The compiler sees only "q, k, v in, a tensor of q's shape out" (the fake
implementation below) and fuses everything around it, as vLLM's piecewise graphs do around
its attention. The binding table is the one piece of module state: a custom op's arguments
cannot hold a Python object, so the model holds an id and the runner registers what it means.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from engine_svc.attention.base import AttentionBackend, AttentionMetadata

_BINDINGS: weakref.WeakValueDictionary[int, PagedAttention] = weakref.WeakValueDictionary()
_NEXT_ID = itertools.count(1)


class PagedAttention:
    """Owns nothing but the binding of one model's layers to a backend, its KV pool and the
    current step's metadata (set by the runner before each forward)."""

    def __init__(self, backend: AttentionBackend, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], scale: float):
        self.backend, self.kv_caches, self.scale = backend, kv_caches, scale
        self.meta: AttentionMetadata | None = None
        self.binding_id = next(_NEXT_ID)
        _BINDINGS[self.binding_id] = self

    def run(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        meta, backend = self.meta, self.backend
        if meta is None:
            raise RuntimeError("paged attention called outside a step (no metadata bound)")
        k_cache, v_cache = self.kv_caches[layer]
        backend.reshape_and_cache(key, value, k_cache, v_cache, meta.slot_mapping)
        if meta.is_decode:
            return backend.paged_decode(query, k_cache, v_cache, meta.block_tables, meta.context_lens, self.scale)
        return backend.paged_prefill(query, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                     meta.context_lens, self.scale)


@torch.library.custom_op("pagedserve::paged_attention", mutates_args=())
def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, binding_id: int,
                    layer: int) -> torch.Tensor:
    """query [T, H, D], key/value [T, Hkv, D] -> [T, H, D]; writes key/value into the bound pool.

    Declared without mutated arguments on purpose: the pool is not an argument (it is reached
    through the binding), so the compiler neither copies nor reorders it; the op's output is
    used by the next layer, which keeps every call in order and alive.
    """
    binding = _BINDINGS.get(binding_id)
    if binding is None:
        raise RuntimeError(f"no paged attention bound to id {binding_id}")
    out = binding.run(layer, query.contiguous(), key, value.contiguous())
    return out if out.is_contiguous() else out.contiguous()


@paged_attention.register_fake
def _(query, key, value, binding_id, layer):
    return query.new_empty(query.shape)


__all__ = ["PagedAttention", "paged_attention"]
