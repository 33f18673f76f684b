"""Random paged-KV test data and a dense float64 attention reference for the kernel tests.

The pools are built the way a long-running server leaves them: blocks handed out in shuffled,
non-contiguous order, the last block of each sequence partly filled, and every slot that no
sequence owns (block 0, spare blocks, the tails of last blocks) holding NaN, so a kernel that
reads one unmasked slot produces NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedKV:
    """One layer's K/V pool plus the block tables and lengths of the sequences living in it."""

    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks], padded with the null block 0
    context_lens: torch.Tensor  # int32 [num_seqs]

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1]

    def gather(self, seq: int, cache: torch.Tensor) -> torch.Tensor:
        """[context_len, num_kv_heads, head_dim] of one sequence, through its block table."""
        pos = torch.arange(int(self.context_lens[seq]))
        blocks = self.block_tables[seq].long()[pos // self.block_size]
        return cache[blocks, pos % self.block_size]


def make_paged_kv(context_lens: list[int], *, num_kv_heads: int, head_dim: int, block_size: int,
                  dtype: torch.dtype, generator: torch.Generator, spare_blocks: int = 3) -> PagedKV:
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = 1 + sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    order = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()  # never block 0
    max_blocks = max(blocks_per_seq) + 1  # one column of pure padding
    block_tables = torch.zeros((len(context_lens), max_blocks), dtype=torch.int32)
    for s, n in enumerate(context_lens):
        table = [order.pop() for _ in range(blocks_per_seq[s])]
        block_tables[s, : len(table)] = torch.tensor(table, dtype=torch.int32)
        pos = torch.arange(n)
        blocks, offsets = torch.tensor(table, dtype=torch.long)[pos // block_size], pos % block_size
        k_cache[blocks, offsets] = torch.randn(n, num_kv_heads, head_dim, generator=generator).to(dtype)
        v_cache[blocks, offsets] = torch.randn(n, num_kv_heads, head_dim, generator=generator).to(dtype)
    return PagedKV(k_cache, v_cache, block_tables, torch.tensor(context_lens, dtype=torch.int32))


def dense_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """float64 softmax(q k^T * scale) v; query row i sees keys 0..positions[i]; GQA by repetition."""
    group = query.shape[1] // key.shape[1]
    q = query.double()
    k = key.double().repeat_interleave(group, dim=1)
    v = value.double().repeat_interleave(group, dim=1)
    logits = torch.einsum("nhd,chd->nhc", q, k) * scale
    visible = torch.arange(key.shape[0])[None, :] <= positions[:, None]
    logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
    return torch.einsum("nhc,chd->nhd", torch.softmax(logits, dim=-1), v)


def reference_decode(query: torch.Tensor, kv: PagedKV, scale: float) -> torch.Tensor:
    rows = []
    for s in range(query.shape[0]):
        n = int(kv.context_lens[s])
        rows.append(dense_attention(query[s : s + 1], kv.gather(s, kv.k_cache), kv.gather(s, kv.v_cache),
                                    torch.tensor([n - 1]), scale))
    return torch.cat(rows)


def reference_prefill(query: torch.Tensor, kv: PagedKV, query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    out = torch.empty(query.shape, dtype=torch.float64)
    for s in range(kv.context_lens.shape[0]):
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        if start == end:
            continue
        n = int(kv.context_lens[s])
        positions = torch.arange(n - (end - start), n)
        out[start:end] = dense_attention(query[start:end], kv.gather(s, kv.k_cache), kv.gather(s, kv.v_cache),
                                         positions, scale)
    return out


TOLERANCES = {  # (rtol, atol) against the float64 reference: one output rounding of the dtype
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
