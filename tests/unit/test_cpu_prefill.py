"""The C++ paged prefill kernels (cpu_prefill.cpp: AVX512-BF16, or AVX2 and FMA without it;
cpu_amx_prefill.cpp: AMX tiles, where the CPU has them) against a float32 reference.

The reference gathers each sequence's context and runs torch's SDPA in float32 with an explicit
causal mask shifted by the cached prefix. Every cache slot that no sequence wrote holds NaN, so a
read past a context shows up in the output; block tables are shuffled. On a bfloat16 pool the
kernel rounds the softmax weights to bfloat16 before the values product (AVX512-BF16; the AVX2
one keeps them float32) and the output once, so it is held to a bfloat16 tolerance (an output near 3 has an ulp of 0.016); on a float32 pool
nothing is rounded, and it is held to float32's (1e-5).
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from engine_svc.attention import TorchAttentionBackend, cpu_ops, torch_backend


@pytest.fixture(scope="module")
def prefill():
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler (g++/c++): the CPU kernels cannot be built")
    assert cpu_ops.paged_decode_op() is not None, "a C++ compiler exists but the CPU kernels did not build"
    if not torch.ops.pagedserve_cpu.paged_prefill_supported(64):
        pytest.skip("this CPU has neither AVX2 nor AVX512-BF16: prefill stays on the torch path")
    return torch.ops.pagedserve_cpu.paged_prefill


@pytest.fixture(params=["vector", "amx"])
def kernel(prefill, request):
    """(name, op) of one kernel: the vector one (AVX512-BF16, or AVX2), and the AMX one where this CPU has AMX-BF16
    (paged_prefill takes it for bfloat16 pools there, the vector one elsewhere)."""
    if request.param == "amx" and not torch.ops.pagedserve_cpu.paged_prefill_amx_supported(64):
        pytest.skip("this CPU (or kernel) gives no AMX-BF16 tiles")
    return request.param, getattr(torch.ops.pagedserve_cpu, f"paged_prefill_{request.param}")


def skip_amx_float32(kernel, dtype):
    if kernel[0] == "amx" and dtype == torch.float32:
        pytest.skip("the AMX kernel is bfloat16 only (a float32 pool takes the vector kernel)")


def make_batch(seqs, block_size, num_heads, num_kv_heads, head_dim, seed, dtype=torch.bfloat16, key_growth=0.0):
    """seqs: [(q_len, context_len)]. A NaN pool with each context's K/V in shuffled blocks; key_growth > 0
    scales the key at position t by 1 + key_growth * t (scores that keep outgrowing the early keys')."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-ctx // block_size) for _, ctx in seqs]
    num_blocks = sum(blocks_per_seq) + 4
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, math.nan, dtype=dtype)
    v_cache = torch.full(shape, math.nan, dtype=dtype)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_tables = torch.zeros(len(seqs), max(blocks_per_seq) + 1, dtype=torch.int32)
    for s, ((_, ctx), nb) in enumerate(zip(seqs, blocks_per_seq)):
        blocks = torch.tensor([free.pop() for _ in range(nb)])
        block_tables[s, :nb] = blocks
        pos = torch.arange(ctx)
        slots = blocks[pos // block_size] * block_size + pos % block_size
        growth = (1 + key_growth * pos.float())[:, None, None]
        for cache, factor in ((k_cache, growth), (v_cache, 1.0)):
            cache.view(-1, num_kv_heads, head_dim)[slots] = (
                torch.randn(ctx, num_kv_heads, head_dim, generator=gen) * factor).to(dtype)
    q_lens = [q for q, _ in seqs]
    query_start_loc = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    context_lens = torch.tensor([ctx for _, ctx in seqs], dtype=torch.int32)
    return query, k_cache, v_cache, block_tables, query_start_loc, context_lens


def reference(query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale):
    out = torch.empty(query.shape, dtype=torch.float32)
    block_size = k_cache.shape[1]
    for s, ctx in enumerate(context_lens.tolist()):
        start, end = query_start_loc[s].item(), query_start_loc[s + 1].item()
        blocks = block_tables[s, : -(-ctx // block_size)].long()
        k, v = (cache[blocks].flatten(0, 1)[:ctx].float().transpose(0, 1)[None] for cache in (k_cache, v_cache))
        q = query[start:end].float().transpose(0, 1)[None]
        mask = torch.arange(ctx)[None, :] <= (ctx - (end - start)) + torch.arange(end - start)[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)
    return out


def assert_bf16_close(out, expected):
    err = (out.float() - expected).abs()
    assert not out.isnan().any()
    assert err.max().item() <= 0.02 + 0.01 * expected.abs().max().item(), err.max().item()
    assert err.mean().item() <= 2e-3, err.mean().item()


def assert_matches(out, expected):
    """Within bfloat16 rounding for a bfloat16 output, float32's for a float32 one."""
    if out.dtype == torch.bfloat16:
        assert_bf16_close(out, expected)
    else:
        assert out.dtype == torch.float32 and not out.isnan().any()
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


# lengths around the kernel's 64-key chunks and 16-row tiles, single-token rows, cached prefixes
SEQS = [(1, 1), (5, 5), (63, 63), (64, 64), (65, 65), (17, 300), (1, 90), (100, 1100), (3, 64)]


DTYPES = [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4), (8, 2)])
def test_prefill_kernel_matches_float32_reference(kernel, dtype, block_size, head_dim, num_heads, num_kv_heads):
    skip_amx_float32(kernel, dtype)
    args = make_batch(SEQS, block_size, num_heads, num_kv_heads, head_dim, seed=block_size + head_dim + num_heads,
                      dtype=dtype)
    out = torch.empty_like(args[0])
    kernel[1](*args, head_dim**-0.5, 1, out)
    assert_matches(out, reference(*args, head_dim**-0.5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_long_prompt_matches(kernel, dtype):
    skip_amx_float32(kernel, dtype)
    args = make_batch([(2048, 2048)], 16, 9, 3, 64, seed=1, dtype=dtype)
    out = torch.empty_like(args[0])
    kernel[1](*args, 0.125, 1, out)
    assert_matches(out, reference(*args, 0.125))


@pytest.mark.parametrize("key_growth", [1 / 16, 1 / 256])
def test_scores_that_outgrow_the_first_keys_match(kernel, key_growth):
    """Later keys score tens of units above the first chunk's (the AMX kernel moves its running max
    and rescales what it has summed many times along a row), with a cached prefix and a long prompt."""
    args = make_batch([(100, 1100), (700, 700), (5, 400)], 16, 9, 3, 64, seed=7, key_growth=key_growth)
    out = torch.empty_like(args[0])
    kernel[1](*args, 0.125, 1, out)
    assert_matches(out, reference(*args, 0.125))


def test_rows_below_min_q_len_are_left_alone(kernel):
    args = make_batch([(1, 40), (9, 20), (1, 7)], 16, 6, 2, 64, seed=2)
    out = torch.full_like(args[0], 7.0)
    kernel[1](*args, 0.125, 2, out)
    assert (out[0] == 7.0).all() and (out[10] == 7.0).all()
    assert_bf16_close(out[1:10], reference(*args, 0.125)[1:10])


@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_routes_prefill_to_the_kernel(prefill, monkeypatch, dtype):
    """Mixed prefill batch (decode rows and a cached prefix inside): one kernel call serves every
    multi-token row, the result agrees with the gather + SDPA path within the dtype's rounding."""
    args = make_batch([(7, 30), (1, 500), (40, 40), (1, 77)], 16, 6, 2, 64, seed=3, dtype=dtype)
    calls = []
    real = torch_backend.prefill_kernel_for
    monkeypatch.setattr(torch_backend, "prefill_kernel_for",
                        lambda *a: calls.append(a[0].shape[0]) or real(*a))
    out = TorchAttentionBackend().paged_prefill(*args, 0.125)
    assert calls == [49]
    assert_matches(out, reference(*args, 0.125))
    monkeypatch.setenv(cpu_ops.ENV_SWITCH, "0")
    assert cpu_ops.prefill_kernel_for(args[0], args[1], args[2]) is None
    assert_matches(out, TorchAttentionBackend().paged_prefill(*args, 0.125).float())


def test_only_bfloat16_and_float32_cpu_pools_take_the_kernel(prefill):
    q, pool = torch.randn(4, 4, 64), torch.zeros(4, 16, 2, 64)
    assert cpu_ops.prefill_kernel_for(q, pool, pool) is prefill
    assert cpu_ops.prefill_kernel_for(q.bfloat16(), pool.bfloat16(), pool.bfloat16()) is prefill
    assert cpu_ops.prefill_kernel_for(q.half(), pool.half(), pool.half()) is None
    assert cpu_ops.prefill_kernel_for(q, pool.bfloat16(), pool.bfloat16()) is None  # mixed dtypes
    half = pool.bfloat16()[:, :8]  # not contiguous
    assert cpu_ops.prefill_kernel_for(q.bfloat16(), half, half) is None
    assert not torch.ops.pagedserve_cpu.paged_prefill_supported(40)
    with pytest.raises(RuntimeError, match="one dtype for all"):
        prefill(q, pool.bfloat16(), pool.bfloat16(), torch.zeros(1, 1, dtype=torch.int32),
                torch.tensor([0, 4], dtype=torch.int32), torch.tensor([4], dtype=torch.int32), 0.125, 1, torch.empty_like(q))


def test_bad_metadata_raises_instead_of_reading_outside_the_pool(kernel):
    args = list(make_batch([(4, 4)], 16, 4, 2, 64, seed=4))
    args[3] = torch.tensor([[99, 0]], dtype=torch.int32)  # a block id past the pool
    with pytest.raises(RuntimeError, match="block id out of range"):
        kernel[1](*args, 0.125, 1, torch.empty_like(args[0]))
    args[3] = torch.tensor([[1, 0]], dtype=torch.int32)
    args[5] = torch.tensor([3], dtype=torch.int32)  # 4 queries cannot sit in a context of 3
    with pytest.raises(RuntimeError, match="bad lengths"):
        kernel[1](*args, 0.125, 1, torch.empty_like(args[0]))


def test_the_amx_kernel_refuses_what_it_cannot_serve(prefill):
    args = make_batch([(4, 4)], 16, 4, 2, 64, seed=5, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="paged_prefill_amx: needs AMX-BF16, a bfloat16 pool"):
        torch.ops.pagedserve_cpu.paged_prefill_amx(*args, 0.125, 1, torch.empty_like(args[0]))


def test_the_dispatching_op_agrees_with_the_kernel_it_picks(prefill):
    """paged_prefill on a bfloat16 pool is bit for bit the AMX kernel where there is one, else the vector one."""
    args = make_batch([(70, 90), (33, 33)], 16, 9, 3, 64, seed=6)
    picked = "amx" if torch.ops.pagedserve_cpu.paged_prefill_amx_supported(64) else "vector"
    out, ref = torch.empty_like(args[0]), torch.empty_like(args[0])
    prefill(*args, 0.125, 1, out)
    getattr(torch.ops.pagedserve_cpu, f"paged_prefill_{picked}")(*args, 0.125, 1, ref)
    assert torch.equal(out, ref)
