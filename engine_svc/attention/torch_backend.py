"""The torch attention backend: the reference for every other backend, and the CPU path.

Context K/V are gathered from the paged pool through slot indices (block_table[p // B] * B +
p % B) and fed to torch's fused scaled_dot_product_attention. Two details keep it both right
and fast:

- Decode gathers whole blocks (fast contiguous copies), then zeroes only the positions past
  each context length and masks them out, so garbage (even NaN) in unused slots never reaches
  a softmax or a 0 * NaN product. Prefill gathers exactly the context's slots.
- Decode sequences are grouped into a few buckets of similar context length, each padded only
  to its own maximum: one batched call per bucket instead of one per sequence (measured: the
  padding to the global maximum costs more than the handful of extra calls).

The per-step index work is cached and reused by every layer of the step (same tensors in).

On CPU, the K/V rows are written by one C++ call (write_kv), and decode rows go to the C++ kernel of cpu_ops instead when it is available: it reads K/V
in place through the block tables (no gather copy); so do a bfloat16 or float32 pool's prefill
rows on a CPU with AVX2 and FMA (cpu_prefill.cpp, a causal flash attention over the pool, cached
prefix included). The torch path below stays the reference and the fallback (PAGEDSERVE_CPU_KERNELS=0
forces it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine_svc.attention.cpu_ops import decode_kernel_for, kv_writer_for, prefill_kernel_for

BUCKET_FILL = 0.75  # a decode bucket pads no row to more than 1/0.75 of its own length
MAX_BUCKETS = 6


@dataclass(slots=True)
class _DecodeGroup:
    rows: torch.Tensor | None  # int64 indices into the batch (None: all rows, in order)
    blocks: torch.Tensor  # int64 [n, num_blocks]: block ids to gather (null-block padded)
    garbage: torch.Tensor | None  # int64 flat positions (row * L + p) with p >= context_len
    mask: torch.Tensor | None  # bool [n, 1, 1, L]; None when every position is valid


@dataclass(slots=True)
class _DecodeRows:
    """The single-token rows of a prefill batch, served like a decode batch."""

    rows: torch.Tensor  # int64 rows of the flat query
    block_tables: torch.Tensor  # int32 [n, max_blocks]
    context_lens: torch.Tensor  # int32 [n]
    groups: list[_DecodeGroup]


@dataclass(slots=True)
class _PrefillSeq:
    start: int
    end: int
    context_len: int
    blocks: torch.Tensor  # int64 [ceil(context_len / block_size)]
    mask: torch.Tensor | None  # bool [q_len, context_len]; None: plain causal (no cached prefix)


class TorchAttentionBackend:
    """Batched torch ops over the paged pool; owns nothing but what one step's metadata decides (the
    kernels chosen, the gather indices), kept until the next step's."""

    name = "torch"

    def __init__(self) -> None:
        self._memo: dict[str, tuple[tuple, object]] = {}  # slot -> (key, what build() answered)

    # ------------------------------------------------------------------ writes
    def reshape_and_cache(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        if slot_mapping.numel() == 0:
            return
        writer = self._once("write", (slot_mapping, key.dtype, value.dtype, k_cache.dtype, key.is_cpu, k_cache.is_cpu),
                            lambda: kv_writer_for(key, value, k_cache, slot_mapping))
        if writer is not None:  # CPU: one C++ call, no mask, no per-layer index tensors
            writer(key, value, k_cache, v_cache, slot_mapping)
            return
        valid = slot_mapping >= 0
        if not bool(valid.all()):
            key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))

    def copy_blocks(self, k_caches: list, v_caches: list, block_mapping) -> None:
        mapping = torch.as_tensor(block_mapping, dtype=torch.int64).reshape(-1, 2)
        if mapping.numel() == 0:
            return
        mapping = mapping.to(k_caches[0].device)
        src, dst = mapping[:, 0], mapping[:, 1]
        for cache in (*k_caches, *v_caches):
            cache.index_copy_(0, dst, cache.index_select(0, src))

    def decode_kernels(self, query, key, value, k_cache, v_cache, meta):
        """The C++ writer and decode kernel when both serve this step's tensors (CPU), else None."""
        if query.shape[0] == 0:
            return None
        writer = kv_writer_for(key, value, k_cache, meta.slot_mapping)
        kernel = decode_kernel_for(query, k_cache, v_cache, meta.block_tables, meta.context_lens)
        return (writer, kernel) if writer is not None and kernel is not None else None

    # ------------------------------------------------------------------ reads
    def paged_decode(self, query, k_cache, v_cache, block_tables, context_lens, scale):
        if query.shape[0] == 0:
            return torch.empty_like(query)
        kernel = self._once("decode kernel", (block_tables, context_lens, query.dtype, k_cache.dtype, v_cache.dtype,
                                              query.is_cpu, k_cache.is_cpu, v_cache.is_cpu, k_cache.is_contiguous(),
                                              v_cache.is_contiguous()),
                            lambda: decode_kernel_for(query, k_cache, v_cache, block_tables, context_lens))
        if kernel is not None:
            return kernel(query, k_cache, v_cache, block_tables, context_lens, scale)
        key = ("decode", block_tables, block_tables._version, context_lens, context_lens._version, k_cache.shape[1])
        groups = self._once("indices", key, lambda: _decode_groups(block_tables, context_lens, k_cache.shape[1]))
        return _decode(query, k_cache, v_cache, groups, scale)

    def paged_prefill(self, query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale):
        key = ("prefill", block_tables, block_tables._version, context_lens, context_lens._version,
               query_start_loc, query_start_loc._version, k_cache.shape[1])
        plan = self._once("indices", key,
                          lambda: _prefill_plan(block_tables, query_start_loc, context_lens, k_cache.shape[1]))
        decode, seqs = plan
        out = torch.empty_like(query)
        if decode is not None:
            q = query.index_select(0, decode.rows)
            kernel = decode_kernel_for(q, k_cache, v_cache, decode.block_tables, decode.context_lens)
            o = (kernel(q, k_cache, v_cache, decode.block_tables, decode.context_lens, scale) if kernel is not None
                 else _decode(q, k_cache, v_cache, decode.groups, scale))
            out.index_copy_(0, decode.rows, o)
        prefill = prefill_kernel_for(query, k_cache, v_cache) if seqs else None
        if prefill is not None:  # every multi-token row at once, K/V read in place
            prefill(query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, 2, out)
            return out
        for seq in seqs:
            q = query[seq.start : seq.end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
            k, v = (cache.index_select(0, seq.blocks).flatten(0, 1)[: seq.context_len].transpose(0, 1).unsqueeze(0)
                    for cache in (k_cache, v_cache))  # [1, Hkv, ctx, D]: exactly the written slots
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=seq.mask, is_causal=seq.mask is None, scale=scale, enable_gqa=True
            )
            out[seq.start : seq.end] = o[0].transpose(0, 1)
        return out

    def _once(self, slot: str, key: tuple, build):
        """build()'s answer, kept in ``slot`` until ``key`` changes. Every layer of a step passes the
        very same metadata tensors, compared by identity (the key holds them, so no new tensor can
        take their id; a ``_version`` in the key catches an in-place edit), and a pool and rows of
        one kind, compared by value: a kernel is chosen and gather indices are built once per step,
        not once per layer."""
        held = self._memo.get(slot)
        if held is not None and len(held[0]) == len(key) and all(
            a is b if isinstance(a, torch.Tensor) else a == b for a, b in zip(key, held[0])
        ):
            return held[1]
        value = build()
        self._memo[slot] = (key, value)
        return value


def _decode(query, k_cache, v_cache, groups: list[_DecodeGroup], scale: float) -> torch.Tensor:
    block_shape = k_cache.shape[1:]  # [block_size, Hkv, D]
    out = torch.empty_like(query) if len(groups) > 1 or groups[0].rows is not None else None
    for group in groups:
        q = (query if group.rows is None else query.index_select(0, group.rows)).unsqueeze(2)  # [n, H, 1, D]
        n, num_blocks = group.blocks.shape
        k, v = (_gather(cache, group, block_shape).view(n, num_blocks * block_shape[0], *block_shape[1:]).transpose(1, 2)
                for cache in (k_cache, v_cache))  # [n, Hkv, L, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scale, enable_gqa=True)
        if out is None:
            return o.squeeze(2)
        out.index_copy_(0, group.rows, o.squeeze(2))
    return out


def _gather(cache: torch.Tensor, group: _DecodeGroup, block_shape) -> torch.Tensor:
    # Whole blocks (block_size * Hkv * D contiguous values each) copy at memcpy speed; then the
    # few positions past each context length are zeroed, so garbage there (even NaN) cannot
    # leak through a masked softmax (0 * NaN = NaN).
    gathered = cache.index_select(0, group.blocks.view(-1))
    if group.garbage is not None:
        gathered.view(-1, *block_shape[1:]).index_fill_(0, group.garbage, 0)
    return gathered


def _decode_groups(block_tables, context_lens, block_size: int) -> list[_DecodeGroup]:
    # index math in numpy: tiny arrays, where torch's per-op threading overhead dominates
    lens = context_lens.cpu().numpy().astype(np.int64)
    device = block_tables.device
    groups = []
    for rows, max_len in _buckets(lens.tolist()):
        if rows is None:
            bt, row_lens, rows_t = block_tables, lens, None
        else:
            rows_t = torch.tensor(rows, dtype=torch.int64, device=device)
            bt, row_lens = block_tables.index_select(0, rows_t), lens[rows]
        num_blocks = (max_len + block_size - 1) // block_size
        width = num_blocks * block_size
        pad = width - row_lens  # positions [len, width) of each row are garbage
        garbage = np.repeat(np.arange(len(row_lens)) * width + row_lens - np.cumsum(pad) + pad, pad)
        garbage += np.arange(garbage.size)
        has_garbage = garbage.size > 0
        mask = None
        if has_garbage:
            mask = torch.from_numpy(np.arange(width)[None, :] < row_lens[:, None]).to(device)[:, None, None, :]
        groups.append(_DecodeGroup(
            rows=rows_t,
            blocks=bt[:, :num_blocks].long().contiguous(),
            garbage=torch.from_numpy(garbage).to(device) if has_garbage else None,
            mask=mask,
        ))
    return groups


def _buckets(lens: list[int]) -> list[tuple[list[int] | None, int]]:
    """Split rows into groups of similar length: [(row indices or None for all, max length)]."""
    longest = max(lens)
    if min(lens) >= BUCKET_FILL * longest:
        return [(None, longest)]
    order = sorted(range(len(lens)), key=lens.__getitem__, reverse=True)
    buckets: list[tuple[list[int], int]] = []
    for i in order:
        if buckets and (lens[i] >= BUCKET_FILL * buckets[-1][1] or len(buckets) == MAX_BUCKETS):
            buckets[-1][0].append(i)
        else:
            buckets.append(([i], lens[i]))
    return buckets


def _prefill_plan(block_tables, query_start_loc, context_lens, block_size: int):
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    device = block_tables.device
    single, seqs = [], []
    for s, ctx in enumerate(lens):
        start, end = starts[s], starts[s + 1]
        q_len = end - start
        if q_len == 1:
            single.append(s)
            continue
        if q_len == 0:
            continue
        pos = torch.arange(ctx, device=device)
        blocks = block_tables[s, : (ctx + block_size - 1) // block_size].long()
        mask = None
        if ctx != q_len:  # a cached prefix: query i sits at position ctx - q_len + i
            mask = pos[None, :] <= (ctx - q_len) + torch.arange(q_len, device=device)[:, None]
        seqs.append(_PrefillSeq(start, end, ctx, blocks, mask))
    if not single:
        return None, seqs
    rows = torch.tensor(single, dtype=torch.int64, device=device)
    tables, lens = block_tables[rows].contiguous(), context_lens[rows].contiguous()
    return _DecodeRows(query_start_loc[rows].long(), tables, lens, _decode_groups(tables, lens, block_size)), seqs
