"""The CUDA kernels, run on the CPU by the emulator (tests/cuda_emu), against a float64 reference.

Every case poisons what it must not read (NaN in unused cache slots) and what it must write
(outputs are NaN before the launch: the backend allocates them with torch.empty, and the
emulator's shared memory starts as NaN in every block).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from engine_svc.attention.cupy_backend import CupyAttentionBackend
from engine_svc.attention.torch_backend import TorchAttentionBackend
from tests.cuda_emu.launcher import emulated_launcher
from tests.cuda_emu.paged_data import TOLERANCES, make_paged_kv, reference_decode, reference_prefill

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found: CUDA emulation skipped")

# ragged contexts 1..1100: single token, one partial block, exactly one partition, just past it,
# several partitions with a partly filled last block
DECODE_LENS = [1, 7, 16, 77, 512, 513, 1100, 300]


@pytest.fixture(scope="module")
def launcher():
    return emulated_launcher()


def _nan_poisoned_empty(monkeypatch):
    """torch.empty inside the backend returns NaN-filled tensors, so an unwritten output shows."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)


def _check(out, ref, dtype):
    rtol, atol = TOLERANCES[dtype]
    assert not torch.isnan(out).any(), "an output element was never written (or read a poisoned slot)"
    torch.testing.assert_close(out.double(), ref, rtol=rtol, atol=atol)


# -------------------------------------------------------------------------------- emulator itself
def _ptr(t):
    import numpy as np

    return np.uint64(t.data_ptr())


def test_emulator_poisons_shared_memory_per_block(launcher):
    import numpy as np

    out = torch.zeros(4, 64)
    launcher.launch(None, None, "emu_read_unwritten_shared", (4,), (64,), (_ptr(out), np.int32(1)))
    assert (out[0] == 1).all()  # block 0 wrote its copy
    assert torch.isnan(out[1:]).all()  # the others see the poison, not block 0's values


def test_emulator_shuffles_follow_cuda_semantics(launcher):
    out = torch.zeros(64, 4, dtype=torch.int32)
    launcher.launch(None, None, "emu_shuffles", (1,), (64,), (_ptr(out),))
    lane = torch.arange(64) % 32
    assert torch.equal(out[:, 0], lane ^ 5)
    assert torch.equal(out[:, 1], torch.where(lane % 8 + 3 < 8, lane + 3, lane))
    assert torch.equal(out[:, 2], torch.full((64,), 7))
    assert torch.equal(out[:, 3], (lane // 8 * 8 * 8 + 28).to(torch.int32))


def test_emulator_barriers_and_dynamic_shared(launcher):
    x = torch.randn(3, 96)
    y = torch.full((3, 96), float("nan"))
    launcher.launch(None, None, "emu_block_sum", (3,), (96,), (_ptr(x), _ptr(y)), 96 * 4)
    torch.testing.assert_close(y, x.sum(1, keepdim=True).expand(3, 96), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("mode", "message"), [
    (0, "exited while others wait at __syncthreads"),
    (1, "exited while others wait at __syncthreads"),
    (2, "divergent __syncthreads"),
    (3, "warp operation"),
])
def test_emulator_reports_unmatched_barriers(launcher, mode, message):
    import numpy as np

    with pytest.raises(RuntimeError, match=message):
        launcher.launch(None, None, "emu_bad_sync", (2,), (64,), (np.int32(mode),))


# -------------------------------------------------------------------------------- cache writes
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reshape_and_cache_writes_only_its_slots(launcher, dtype):
    g = torch.Generator().manual_seed(1)
    num_blocks, block_size, kv_heads, head_dim = 9, 16, 2, 64
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    fused = torch.randn(21, 3 * kv_heads, head_dim, generator=g).to(dtype)  # q|k|v: strided rows
    key, value = fused[:, kv_heads : 2 * kv_heads], fused[:, 2 * kv_heads :]
    slots = torch.randperm(num_blocks * block_size - block_size, generator=g)[:21] + block_size
    slots[[3, 11]] = -1  # padding tokens are skipped
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    TorchAttentionBackend().reshape_and_cache(key, value, expect_k, expect_v, slots)
    CupyAttentionBackend(launcher).reshape_and_cache(key, value, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, expect_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, expect_v, rtol=0, atol=0, equal_nan=True)


def test_copy_blocks_copies_every_layer(launcher):
    g = torch.Generator().manual_seed(2)
    caches = [torch.randn(6, 8, 3, 64, generator=g).to(torch.bfloat16) for _ in range(4)]
    k_caches, v_caches = caches[:2], caches[2:]
    expect = [c.clone() for c in caches]
    mapping = torch.tensor([[1, 4], [2, 5], [1, 3]])  # one source shared by two copies (a CoW fork)
    TorchAttentionBackend().copy_blocks(expect[:2], expect[2:], mapping)
    CupyAttentionBackend(launcher).copy_blocks(k_caches, v_caches, mapping)
    for got, want in zip(caches, expect):
        assert torch.equal(got, want)


# -------------------------------------------------------------------------------- attention
DECODE_CASES = [  # dtype, head_dim, block_size, kv_heads, gqa ratio, split-K
    (torch.float32, 128, 16, 2, 3, False),
    (torch.float32, 128, 16, 2, 3, True),
    (torch.float32, 64, 8, 3, 1, True),
    (torch.float16, 128, 32, 1, 3, True),
    (torch.float16, 64, 16, 2, 1, False),
    (torch.bfloat16, 64, 32, 1, 3, False),
    (torch.bfloat16, 128, 8, 2, 1, True),
]


@pytest.mark.parametrize(("dtype", "head_dim", "block_size", "kv_heads", "gqa", "split"), DECODE_CASES)
def test_paged_decode_matches_reference(launcher, monkeypatch, dtype, head_dim, block_size, kv_heads, gqa, split):
    g = torch.Generator().manual_seed(head_dim + block_size + gqa)
    lens = DECODE_LENS if dtype == torch.float32 else DECODE_LENS[::2] + [1100]
    kv = make_paged_kv(lens, num_kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype,
                       generator=g)
    query = torch.randn(len(lens), kv_heads * gqa, head_dim, generator=g).to(dtype)
    scale = head_dim ** -0.5
    _nan_poisoned_empty(monkeypatch)
    backend = CupyAttentionBackend(launcher, split_k=split)
    first = len(launcher.launches)
    out = backend.paged_decode(query, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, scale)
    names = [launch[0] for launch in launcher.launches[first:]]
    assert any(name.startswith("ps_paged_decode_reduce") for name in names) == split
    _check(out, reference_decode(query, kv, scale), dtype)


PREFILL_CASES = [  # dtype, head_dim, block_size, kv_heads, gqa (36: two head chunks of the tiled kernel)
    (torch.float32, 128, 16, 1, 3),
    (torch.float32, 64, 32, 2, 1),
    (torch.float32, 64, 8, 1, 36),
    (torch.float16, 64, 8, 1, 3),
    (torch.float16, 128, 32, 2, 4),
    (torch.bfloat16, 128, 16, 1, 1),
    (torch.bfloat16, 64, 16, 2, 4),
    (torch.bfloat16, 128, 8, 1, 8),
]
# (context, new tokens): a fresh prompt (one tile at GQA 1, three at GQA 3), a chunk over a cached
# prefix of many key tiles, a single token (the single-row kernel), a sequence with no new tokens,
# a chunk crossing block boundaries, several tiles ending mid-sequence, a two-token prompt
PREFILL_SEQS = [(23, 23), (1100, 3), (530, 1), (40, 0), (75, 19), (100, 70), (2, 2)]


def _run_prefill(launcher, monkeypatch, seqs, *, dtype, head_dim, block_size, kv_heads, gqa, seed):
    g = torch.Generator().manual_seed(seed)
    kv = make_paged_kv([c for c, _ in seqs], num_kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
                       dtype=dtype, generator=g)
    query_start_loc = torch.tensor([0] + [sum(q for _, q in seqs[: i + 1]) for i in range(len(seqs))],
                                   dtype=torch.int32)
    # q as the model produces it: a view into the fused qkv projection (rows strided)
    heads = kv_heads * gqa
    fused = torch.randn(int(query_start_loc[-1]), heads + 2 * kv_heads, head_dim, generator=g).to(dtype)
    query = fused[:, :heads]
    scale = head_dim ** -0.5
    _nan_poisoned_empty(monkeypatch)
    first = len(launcher.launches)
    out = CupyAttentionBackend(launcher).paged_prefill(query, kv.k_cache, kv.v_cache, kv.block_tables,
                                                       query_start_loc, kv.context_lens, scale)
    assert [name.rsplit("_", 3)[0] for name, *_ in launcher.launches[first:]] == ["ps_paged_prefill",
                                                                                 "ps_paged_prefill_single"]
    _check(out, reference_prefill(query, kv, query_start_loc, scale), dtype)


@pytest.mark.parametrize(("dtype", "head_dim", "block_size", "kv_heads", "gqa"), PREFILL_CASES)
def test_paged_prefill_matches_reference(launcher, monkeypatch, dtype, head_dim, block_size, kv_heads, gqa):
    _run_prefill(launcher, monkeypatch, PREFILL_SEQS, dtype=dtype, head_dim=head_dim, block_size=block_size,
                 kv_heads=kv_heads, gqa=gqa, seed=7 + head_dim + gqa)


@pytest.mark.parametrize("gqa", [1, 3])
def test_paged_prefill_tiles_cover_many_short_sequences(launcher, monkeypatch, gqa):
    """Lengths around the rows per tile (32 at GQA 1, 10 at GQA 3): the grid bound num_tokens // R
    + num_seqs must reach every sequence's last tile (an unwritten row stays NaN)."""
    q_lens = [31, 33, 2, 63, 1, 0, 64, 9, 11, 10, 21, 1, 2]
    seqs = [(q + extra, q) for q, extra in zip(q_lens, [0, 5, 0, 17, 3, 0, 1, 0, 40, 0, 0, 0, 30])]
    _run_prefill(launcher, monkeypatch, seqs, dtype=torch.float32, head_dim=64, block_size=16, kv_heads=2, gqa=gqa,
                 seed=gqa)


def test_torch_backend_agrees_with_the_dense_reference():
    """The torch backend is every other backend's reference: pin it to the dense one on the same data."""
    g = torch.Generator().manual_seed(3)
    kv = make_paged_kv([5, 600, 33], num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, generator=g)
    query = torch.randn(3, 6, 64, generator=g)
    out = TorchAttentionBackend().paged_decode(query, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.125)
    _check(out, reference_decode(query, kv, 0.125), torch.float32)


def test_fallback_half_types_round_like_cuda(tmp_path):
    """Without a toolkit the emulator uses tests/cuda_emu/fallback: same rounding as CUDA's headers."""
    import subprocess

    from tests.cuda_emu.build import EMU_DIR, cuda_include_dir

    include = cuda_include_dir()
    if include is None:
        pytest.skip("no CUDA toolkit headers to compare the fallback with")
    results = []
    for name, inc in (("cuda", include), ("fallback", EMU_DIR / "fallback")):
        exe = tmp_path / name
        subprocess.run(["g++", "-std=c++20", "-O1", "-I", str(inc), str(EMU_DIR / "fp16_probe.cpp"), "-o", str(exe)],
                       check=True, capture_output=True)
        results.append(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout)
    assert results[0] == results[1]
