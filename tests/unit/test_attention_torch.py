"""The torch attention backend against a naive dense per-sequence reference.

The pool is filled with NaN everywhere no sequence has written (block 0 included), so any read
of an unused slot shows up; outputs are poisoned with NaN before the backend fills them.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine_svc.attention import TorchAttentionBackend, cpu_ops, get_backend
from engine_svc.attention.base import AttentionMetadata
from engine_svc.attention.step import PagedAttention
from engine_svc.attention.torch_backend import _buckets

BLOCK_SIZE = 4
HEAD_DIM = 16
NUM_BLOCKS = 64


def make_pool(context_lens, num_kv_heads, seed):
    """A NaN pool with each sequence's context written through shuffled block tables."""
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    k_cache, v_cache = torch.full(shape, math.nan), torch.full(shape, math.nan)
    free = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()
    max_blocks = max(-(-n // BLOCK_SIZE) for n in context_lens) + 1  # +1: padding columns must be ignored
    block_tables = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32)
    dense_k, dense_v = [], []
    for s, n in enumerate(context_lens):
        blocks = [free.pop() for _ in range(-(-n // BLOCK_SIZE))]
        block_tables[s, : len(blocks)] = torch.tensor(blocks)
        k = torch.randn(n, num_kv_heads, HEAD_DIM, generator=gen)
        v = torch.randn(n, num_kv_heads, HEAD_DIM, generator=gen)
        for p in range(n):
            k_cache[blocks[p // BLOCK_SIZE], p % BLOCK_SIZE] = k[p]
            v_cache[blocks[p // BLOCK_SIZE], p % BLOCK_SIZE] = v[p]
        dense_k.append(k)
        dense_v.append(v)
    return k_cache, v_cache, block_tables, dense_k, dense_v


def reference(q, k, v, scale):
    """q [q_len, H, D] at the last q_len positions of k/v [ctx, Hkv, D]; causal, GQA by repeat."""
    q_len, num_heads, _ = q.shape
    ctx, num_kv_heads, _ = k.shape
    k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
    v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    q_pos = torch.arange(ctx - q_len, ctx)[:, None]
    scores = scores.masked_fill(torch.arange(ctx)[None, :] > q_pos, -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every tensor the backend allocates with empty_like starts as NaN."""
    real = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t, *a, **kw: real(t, *a, **kw).fill_(math.nan))


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (6, 2)])
@pytest.mark.parametrize("context_lens", [[1, 7, 16, 33, 5], [12, 12, 11], [40, 2, 3, 1, 38, 20, 9, 17]])
def test_paged_decode_matches_dense_reference(num_heads, num_kv_heads, context_lens, poisoned_outputs):
    k_cache, v_cache, block_tables, dense_k, dense_v = make_pool(context_lens, num_kv_heads, seed=len(context_lens))
    query = torch.randn(len(context_lens), num_heads, HEAD_DIM)
    scale = HEAD_DIM**-0.5
    out = TorchAttentionBackend().paged_decode(query, k_cache, v_cache, block_tables,
                                               torch.tensor(context_lens, dtype=torch.int32), scale)
    assert out.shape == query.shape and out.dtype == query.dtype
    for s in range(len(context_lens)):
        torch.testing.assert_close(out[s], reference(query[s : s + 1], dense_k[s], dense_v[s], scale)[0],
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (6, 2)])
def test_paged_prefill_over_cached_prefix_matches_dense_reference(num_heads, num_kv_heads, poisoned_outputs):
    # (context_len, new tokens): no prefix, a prefix, decode-like rows mixed in, partial last blocks
    shape = [(9, 9), (30, 7), (5, 1), (17, 16), (22, 1), (3, 2)]
    context_lens = [c for c, _ in shape]
    k_cache, v_cache, block_tables, dense_k, dense_v = make_pool(context_lens, num_kv_heads, seed=7)
    q_lens = [q for _, q in shape]
    query = torch.randn(sum(q_lens), num_heads, HEAD_DIM)
    query_start_loc = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    scale = 0.3
    out = TorchAttentionBackend().paged_prefill(query, k_cache, v_cache, block_tables, query_start_loc,
                                                torch.tensor(context_lens, dtype=torch.int32), scale)
    for s, (start, end) in enumerate(zip(query_start_loc[:-1].tolist(), query_start_loc[1:].tolist())):
        torch.testing.assert_close(out[start:end], reference(query[start:end], dense_k[s], dense_v[s], scale),
                                   atol=1e-5, rtol=1e-5)


def test_many_decode_rows_use_several_buckets_and_stay_exact():
    gen = torch.Generator().manual_seed(3)
    context_lens = torch.randint(1, 60, (40,), generator=gen).tolist()
    assert len(_buckets(context_lens)) > 1
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in context_lens) + 1
    shape = (num_blocks, BLOCK_SIZE, 1, HEAD_DIM)
    k_cache, v_cache = torch.full(shape, math.nan), torch.full(shape, math.nan)
    block_tables = torch.zeros(len(context_lens), 16, dtype=torch.int32)
    next_block, expected = 1, []
    query = torch.randn(len(context_lens), 3, HEAD_DIM, generator=gen)
    for s, n in enumerate(context_lens):
        nb = -(-n // BLOCK_SIZE)
        block_tables[s, :nb] = torch.arange(next_block, next_block + nb)
        k, v = torch.randn(n, 1, HEAD_DIM, generator=gen), torch.randn(n, 1, HEAD_DIM, generator=gen)
        k_cache.view(-1, 1, HEAD_DIM)[next_block * BLOCK_SIZE : next_block * BLOCK_SIZE + n] = k
        v_cache.view(-1, 1, HEAD_DIM)[next_block * BLOCK_SIZE : next_block * BLOCK_SIZE + n] = v
        next_block += nb
        expected.append(reference(query[s : s + 1], k, v, 0.25)[0])
    out = TorchAttentionBackend().paged_decode(query, k_cache, v_cache, block_tables,
                                               torch.tensor(context_lens, dtype=torch.int32), 0.25)
    torch.testing.assert_close(out, torch.stack(expected), atol=1e-5, rtol=1e-5)


def test_reshape_and_cache_writes_slots_and_skips_negative():
    backend = TorchAttentionBackend()
    k_cache, v_cache = torch.full((4, BLOCK_SIZE, 2, HEAD_DIM), math.nan), torch.full((4, BLOCK_SIZE, 2, HEAD_DIM), math.nan)
    key, value = torch.randn(3, 2, HEAD_DIM), torch.randn(3, 2, HEAD_DIM)
    backend.reshape_and_cache(key, value, k_cache, v_cache, torch.tensor([13, -1, 4]))
    torch.testing.assert_close(k_cache[3, 1], key[0])
    torch.testing.assert_close(v_cache[1, 0], value[2])
    assert int((~k_cache.isnan()).sum()) == 2 * 2 * HEAD_DIM  # nothing else written


def test_copy_blocks_copies_every_layer():
    backend = TorchAttentionBackend()
    ks = [torch.randn(5, BLOCK_SIZE, 1, HEAD_DIM) for _ in range(2)]
    vs = [torch.randn(5, BLOCK_SIZE, 1, HEAD_DIM) for _ in range(2)]
    before = [t.clone() for t in ks + vs]
    backend.copy_blocks(ks, vs, torch.tensor([[1, 3], [2, 4]]))
    for t, old in zip(ks + vs, before):
        torch.testing.assert_close(t[3], old[1])
        torch.testing.assert_close(t[4], old[2])
        torch.testing.assert_close(t[:3], old[:3])


def test_metadata_cache_notices_in_place_edits():
    k_cache, v_cache, block_tables, dense_k, dense_v = make_pool([5, 9], 1, seed=11)
    backend = TorchAttentionBackend()
    query = torch.randn(2, 1, HEAD_DIM)
    lens = torch.tensor([5, 9], dtype=torch.int32)
    backend.paged_decode(query, k_cache, v_cache, block_tables, lens, 1.0)
    lens[1] = 4  # same tensor object, new content: the cached plan must not be reused
    out = backend.paged_decode(query, k_cache, v_cache, block_tables, lens, 1.0)
    torch.testing.assert_close(out[1], reference(query[1:2], dense_k[1][:4], dense_v[1][:4], 1.0)[0],
                               atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(cpu_ops.paged_decode_op() is None, reason="the CPU kernels did not build here")
def test_decode_kernels_are_chosen_once_a_step_and_serve_every_layer():
    """The op's per-step path: the backend's (write, decode) pair chosen at the first layer of a
    step, called directly by the others; each layer's output and pool writes as the reference's,
    with value a strided view of a fused qkv row (as the model passes it)."""
    context_lens, num_heads, num_kv_heads, layers = [5, 17, 9], 4, 2, 3
    k0, v0, block_tables, dense_k0, dense_v0 = make_pool(context_lens, num_kv_heads, seed=20)
    pools = [(k0 * (1 + layer), v0 - layer, [k * (1 + layer) for k in dense_k0], [v - layer for v in dense_v0])
             for layer in range(layers)]  # one block table for every layer, as in the engine
    asked = []

    class Counting(TorchAttentionBackend):
        def decode_kernels(self, *args):
            pair = super().decode_kernels(*args)
            asked.append((args[-1], pair))
            return pair

    attention = PagedAttention(Counting(), [(k, v) for k, v, *_ in pools], scale=0.25)
    gen = torch.Generator().manual_seed(5)
    for step in range(2):
        lens = [n + step for n in context_lens]
        slots = torch.tensor([int(block_tables[s, (n - 1) // BLOCK_SIZE]) * BLOCK_SIZE + (n - 1) % BLOCK_SIZE
                              for s, n in enumerate(lens)], dtype=torch.int64)
        attention.meta = AttentionMetadata(slot_mapping=slots, block_tables=block_tables,
                                           context_lens=torch.tensor(lens, dtype=torch.int32),
                                           query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
                                           is_decode=True)
        for layer, (k_cache, v_cache, dense_k, dense_v) in enumerate(pools):
            qkv = torch.randn(len(lens), (num_heads + 2 * num_kv_heads) * HEAD_DIM, generator=gen)
            q, k, v = (t.view(len(lens), -1, HEAD_DIM) for t in qkv.split(
                [num_heads * HEAD_DIM, num_kv_heads * HEAD_DIM, num_kv_heads * HEAD_DIM], dim=-1))
            assert not v.is_contiguous()
            out = torch.ops.pagedserve.paged_attention(q, k, v, attention.binding_id, layer)
            for s, n in enumerate(lens):
                dense_k[s], dense_v[s] = torch.cat([dense_k[s][: n - 1], k[s : s + 1]]), torch.cat(
                    [dense_v[s][: n - 1], v[s : s + 1]])
                torch.testing.assert_close(out[s], reference(q[s : s + 1], dense_k[s], dense_v[s], 0.25)[0],
                                           atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(v_cache.view(-1, num_kv_heads, HEAD_DIM)[slots[s]], v[s])
    assert len(asked) == 2 and asked[0][0] is not asked[1][0]  # once a step, not once a layer
    assert all(pair is not None for _, pair in asked)  # the C++ pair, not the checked methods


def test_get_backend():
    assert get_backend("torch", "cpu").name == "torch"
    assert get_backend("auto", "cpu").name == "torch"
    with pytest.raises(ValueError, match="attention_backend"):
        get_backend("flash", "cpu")
    with pytest.raises(ValueError, match="cuda"):
        get_backend("cupy", "cpu")
