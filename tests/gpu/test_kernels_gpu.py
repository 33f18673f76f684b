"""The cupy kernels on the device against the float64 reference and the torch backend, at
several sizes (up to 64 sequences x 4k tokens), every dtype, both head sizes, split-K on/off,
tiled prefill at GQA 1, 3, 4 and 36."""

from __future__ import annotations

import pytest
import torch

from tests.cuda_emu.paged_data import TOLERANCES, make_paged_kv, reference_decode, reference_prefill
from tests.gpu.conftest_helpers import needs_cupy

pytestmark = needs_cupy


def _to(kv, device):
    kv.k_cache, kv.v_cache = kv.k_cache.to(device), kv.v_cache.to(device)
    kv.block_tables, kv.context_lens = kv.block_tables.to(device), kv.context_lens.to(device)
    return kv


def _cpu(kv):
    return _to(kv, "cpu")


@pytest.fixture(scope="module")
def backend():
    from engine_svc.attention.cupy_backend import CupyAttentionBackend

    return CupyAttentionBackend()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "block_size", "kv_heads", "gqa"), [(64, 16, 3, 3), (128, 16, 8, 4),
                                                                         (128, 32, 2, 1), (64, 8, 4, 2)])
@pytest.mark.parametrize("split", [False, True, None])
def test_decode_on_device(backend, dtype, head_dim, block_size, kv_heads, gqa, split):
    g = torch.Generator().manual_seed(head_dim * block_size + gqa)
    lens = torch.randint(1, 4097, (64,), generator=g).tolist()
    lens[:3] = [1, 512, 4096]
    kv = _to(make_paged_kv(lens, num_kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype,
                           generator=g), "cuda")
    query = torch.randn(len(lens), kv_heads * gqa, head_dim, generator=g).to(dtype).cuda()
    backend.split_k = split
    out = backend.paged_decode(query, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, head_dim ** -0.5)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    ref = reference_decode(query.cpu(), _cpu(kv), head_dim ** -0.5)
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(out.cpu().double(), ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "block_size", "kv_heads", "gqa"), [(64, 16, 2, 3), (128, 16, 8, 4),
                                                                         (128, 32, 2, 1), (64, 8, 1, 36)])
def test_prefill_on_device(backend, dtype, head_dim, block_size, kv_heads, gqa):
    """Tiled kernel (tiles of 32 / gqa rows, a 36-head group in two chunks) and the single-row kernel."""
    g = torch.Generator().manual_seed(head_dim + gqa)
    # a fresh prompt, chunks over long prefixes, a decode row, no new tokens, a two-token chunk
    seqs = [(600, 600), (2000, 37), (700, 1), (64, 0), (1030, 250), (33, 2)]
    kv = _to(make_paged_kv([c for c, _ in seqs], num_kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
                           dtype=dtype, generator=g), "cuda")
    qsl = torch.tensor([0] + [sum(q for _, q in seqs[: i + 1]) for i in range(len(seqs))], dtype=torch.int32)
    heads = kv_heads * gqa
    fused = torch.randn(int(qsl[-1]), heads + 2 * kv_heads, head_dim, generator=g).to(dtype).cuda()
    query = fused[:, :heads]  # rows strided, as the model's q view into the fused qkv
    out = backend.paged_prefill(query, kv.k_cache, kv.v_cache, kv.block_tables, qsl.cuda(), kv.context_lens, 0.1)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    ref = reference_prefill(query.cpu(), _cpu(kv), qsl, 0.1)
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(out.cpu().double(), ref, rtol=rtol, atol=atol)


def test_cache_writes_on_device(backend):
    from engine_svc.attention.torch_backend import TorchAttentionBackend

    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(64, 16, 2, 128, generator=g).half().cuda() for _ in range(4)]
    expect = [c.clone() for c in caches]
    key, value = torch.randn(2, 100, 2, 128, generator=g).half().cuda().unbind(0)
    slots = (torch.randperm(63 * 16, generator=g)[:100] + 16).cuda()
    slots[::7] = -1
    torch_backend = TorchAttentionBackend()
    torch_backend.reshape_and_cache(key, value, expect[0], expect[2], slots)
    backend.reshape_and_cache(key, value, caches[0], caches[2], slots)
    mapping = torch.tensor([[3, 9], [4, 10], [3, 11]])
    torch_backend.copy_blocks(expect[:2], expect[2:], mapping)
    backend.copy_blocks(caches[:2], caches[2:], mapping)
    torch.cuda.synchronize()
    for got, want in zip(caches, expect):
        assert torch.equal(got, want)
