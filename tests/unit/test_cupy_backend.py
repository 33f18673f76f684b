"""CupyAttentionBackend's own plumbing (argument order, strides, grids, split-K choice, checks),
run against the CPU-emulated kernels through the injectable launcher - and the engine on a tiny
model giving the same greedy tokens with it as with the torch backend."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from engine_svc.attention.cupy_backend import ATTENTION_SHARED_BYTES, NUM_THREADS, CupyAttentionBackend, prefill_grid
from engine_svc.attention.torch_backend import TorchAttentionBackend
from tests.cuda_emu.launcher import EmuLauncher, emulated_launcher
from tests.cuda_emu.paged_data import make_paged_kv, reference_decode, reference_prefill

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found: CUDA emulation skipped")


@pytest.fixture(scope="module")
def library():
    return emulated_launcher().lib._name


@pytest.fixture
def launcher(library):
    return EmuLauncher(library)  # fresh launch log per test


def _decode_inputs(lens, *, kv_heads=1, gqa=3, head_dim=64, block_size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = make_paged_kv(lens, num_kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
                       dtype=torch.float32, generator=g)
    # q as the model produces it: a view into the fused qkv projection (rows strided)
    heads = kv_heads * gqa
    fused = torch.randn(len(lens), (heads + 2 * kv_heads) * head_dim, generator=g)
    query = fused[:, : heads * head_dim].view(len(lens), heads, head_dim)
    return kv, query


def test_decode_grid_and_strided_query(launcher):
    kv, query = _decode_inputs([5, 700, 1100], kv_heads=2, gqa=2)
    assert query.stride(0) != query.shape[1] * query.shape[2]
    out = CupyAttentionBackend(launcher, split_k=True).paged_decode(
        query, kv.k_cache, kv.v_cache, kv.block_tables, kv.context_lens, 0.125)
    torch.testing.assert_close(out.double(), reference_decode(query, kv, 0.125), rtol=1e-5, atol=1e-5)
    parts = math.ceil(kv.block_tables.shape[1] * 16 / 512)
    assert launcher.launches == [
        ("ps_paged_decode_f32_h64_b16", (3, 2, parts), (NUM_THREADS, 1, 1), ATTENTION_SHARED_BYTES),
        ("ps_paged_decode_reduce_f32_h64", (3, 4, 1), (64, 1, 1), 0),
    ]


def test_split_k_is_chosen_only_for_long_contexts_on_an_unfilled_gpu(launcher):
    backend = CupyAttentionBackend(launcher)  # split_k=None: the heuristic decides
    short, query = _decode_inputs([30, 400])
    backend.paged_decode(query, short.k_cache, short.v_cache, short.block_tables, short.context_lens, 0.1)
    long, query = _decode_inputs([30, 1100])
    backend.paged_decode(query, long.k_cache, long.v_cache, long.block_tables, long.context_lens, 0.1)
    launcher.num_sms = 0  # a "full" GPU: no split even for long contexts
    backend.paged_decode(query, long.k_cache, long.v_cache, long.block_tables, long.context_lens, 0.1)
    assert [name for name, *_ in launcher.launches] == [
        "ps_paged_decode_f32_h64_b16",
        "ps_paged_decode_f32_h64_b16", "ps_paged_decode_reduce_f32_h64",
        "ps_paged_decode_f32_h64_b16",
    ]
    assert launcher.launches[0][1][2] == 1 and launcher.launches[1][1][2] == 3


def test_prefill_grid_and_half_precision_query_of_another_dtype(launcher):
    g = torch.Generator().manual_seed(4)
    kv = make_paged_kv([9, 40], num_kv_heads=1, head_dim=128, block_size=8, dtype=torch.float16, generator=g)
    qsl = torch.tensor([0, 9, 12], dtype=torch.int32)
    query = torch.randn(12, 3, 128, generator=g)  # float32 query over a float16 cache: out stays float32
    out = CupyAttentionBackend(launcher).paged_prefill(query, kv.k_cache, kv.v_cache, kv.block_tables, qsl,
                                                       kv.context_lens, 0.09)
    assert out.dtype == torch.float32
    ref = reference_prefill(query.half(), kv, qsl, 0.09)
    torch.testing.assert_close(out.double(), ref, rtol=2e-3, atol=2e-3)
    # GQA 3: tiles of 10 rows, 12 // 10 + 2 tiles; the single-row kernel: a block per sequence
    assert launcher.launches == [
        ("ps_paged_prefill_f16_h128_b8", (3, 1, 1), (NUM_THREADS, 1, 1), 0),
        ("ps_paged_prefill_single_f16_h128_b8", (2, 1, 1), (NUM_THREADS, 1, 1), ATTENTION_SHARED_BYTES),
    ]


@pytest.mark.parametrize(("shape", "grid"), [
    ((100, 4, 8, 8), (100 // 32 + 4, 8, 1)),  # GQA 1: 32 rows per tile
    ((100, 4, 6, 2), (100 // 10 + 4, 2, 1)),  # GQA 3: 10 rows x 3 heads
    ((100, 4, 64, 2), (100 + 4, 2, 1)),  # GQA 32: one row x 32 heads
    ((100, 4, 36, 1), (100 + 4, 1, 2)),  # GQA 36: one row, heads in two chunks along z
])
def test_prefill_grid_follows_the_gqa_group(shape, grid):
    assert prefill_grid(*shape) == grid


def test_reshape_and_cache_slot_mapping_matches_torch(launcher):
    g = torch.Generator().manual_seed(5)
    k_cache = torch.randn(6, 16, 2, 64, generator=g)
    v_cache = torch.randn(6, 16, 2, 64, generator=g)
    key, value = torch.randn(2, 7, 2, 64, generator=g).unbind(0)
    slots = torch.tensor([16, 17, 40, -1, 95, 33, 18])
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    TorchAttentionBackend().reshape_and_cache(key, value, expect_k, expect_v, slots)
    CupyAttentionBackend(launcher).reshape_and_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)
    assert launcher.launches == [("ps_reshape_and_cache_f32", (7, 1, 1), (NUM_THREADS, 1, 1), 0)]


def test_bad_arguments_are_refused_before_any_launch(launcher):
    kv, query = _decode_inputs([5, 9])
    backend = CupyAttentionBackend(launcher)
    with pytest.raises(TypeError, match="block_tables"):
        backend.paged_decode(query, kv.k_cache, kv.v_cache, kv.block_tables.long(), kv.context_lens, 0.1)
    with pytest.raises(ValueError, match="contiguous"):
        backend.paged_decode(query, kv.k_cache.transpose(0, 1), kv.v_cache.transpose(0, 1), kv.block_tables,
                             kv.context_lens, 0.1)
    with pytest.raises(NotImplementedError, match="head size"):
        backend.paged_decode(query[..., :32], kv.k_cache[..., :32].contiguous(), kv.v_cache[..., :32].contiguous(),
                             kv.block_tables, kv.context_lens, 0.1)
    with pytest.raises(ValueError, match="multiple"):
        backend.paged_decode(query[:, :2], kv.k_cache.expand(-1, -1, 3, -1).contiguous(),
                             kv.v_cache.expand(-1, -1, 3, -1).contiguous(), kv.block_tables, kv.context_lens, 0.1)
    assert launcher.launches == []


def test_emulated_launcher_checks_the_kernel_signature(launcher):
    import numpy as np

    with pytest.raises(TypeError, match="argument 3"):
        launcher.launch(None, None, "ps_copy_blocks", (1,), (32,), (np.uint64(0),) * 3 + (np.int32(1),))


# ------------------------------------------------------------------------------- the engine on it
@pytest.fixture(scope="module")
def tiny_h64_dir(tiny_models_cache):
    """A tiny Llama with head size 64 and GQA 3 (the default model's attention shape)."""
    from tests.fixtures.models import cached_tiny_model

    return cached_tiny_model(tiny_models_cache, "tiny-llama-h64", "llama", hidden_size=192, num_attention_heads=3,
                             num_key_value_heads=1, head_dim=64, intermediate_size=256)


def _greedy(model_dir, backend, prompts):
    from engine_svc import EngineConfig, LLMEngine
    from engine_svc.model_runner import ModelRunner
    from shared.protocol import SamplingParams

    config = EngineConfig(enforce_eager=True, model=str(model_dir), dtype="float32", device="cpu", block_size=16,
                          kv_cache_memory=8 << 20, max_num_batched_tokens=48, max_num_seqs=8)
    engine = LLMEngine(config, runner=ModelRunner(config, str(model_dir), backend=backend))
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    return [r.outputs[0].token_ids for r in results]


def test_engine_greedy_tokens_equal_the_torch_backend(tiny_h64_dir, library):
    import random

    rng = random.Random(0)
    # chunked prefill (48-token budget) over cached prefixes, a shared prompt prefix, one-token prompts
    prefix = [rng.randrange(3, 500) for _ in range(40)]
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 7, 70, 23)] + [prefix + [5], prefix + [9, 4]]
    torch_tokens = _greedy(tiny_h64_dir, TorchAttentionBackend(), prompts)
    cupy_tokens = _greedy(tiny_h64_dir, CupyAttentionBackend(EmuLauncher(library)), prompts)
    assert cupy_tokens == torch_tokens
