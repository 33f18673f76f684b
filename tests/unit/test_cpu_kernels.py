"""The C++ CPU decode kernel (engine_svc/attention/cpu_kernels.cpp) against the pure-torch path.

Every cache slot that no sequence wrote holds NaN (block 0 included), so a read past a context
length shows up as NaN in the output; block tables are shuffled so blocks are not in pool order.
"""

from __future__ import annotations

import functools
import logging
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from engine_svc import EngineConfig, LLMEngine, cpu_info
from engine_svc.attention import TorchAttentionBackend, cpu_ops, torch_backend
from shared.protocol import SamplingParams

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="no C++ compiler (g++/c++): the CPU kernels cannot be built")


@pytest.fixture(scope="module")
def kernel():
    op = cpu_ops.paged_decode_op()
    assert op is not None, "a C++ compiler exists but the CPU kernels did not build (see the warning above)"
    return op


def make_pool(context_lens, block_size, num_kv_heads, head_dim, seed, dtype=torch.float32):
    """A NaN pool holding each sequence's random K/V in shuffled blocks, plus spare padding columns."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 8  # some blocks stay unused (NaN), like block 0
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.full(shape, math.nan, dtype=dtype), torch.full(shape, math.nan, dtype=dtype)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_tables = torch.zeros(len(context_lens), max(blocks_per_seq) + 2, dtype=torch.int32)
    for s, (n, nb) in enumerate(zip(context_lens, blocks_per_seq)):
        blocks = torch.tensor([free.pop() for _ in range(nb)])
        block_tables[s, :nb] = blocks
        pos = torch.arange(n)
        slots = blocks[pos // block_size] * block_size + pos % block_size
        for cache in (k_cache, v_cache):
            cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
    return k_cache, v_cache, block_tables


def ragged_lens(block_size, seed):
    """1, the 1100 maximum, exact block multiples and one past them, and random lengths in between."""
    gen = torch.Generator().manual_seed(seed)
    return [1, 1100, 3 * block_size, 3 * block_size + 1, block_size - 1] + torch.randint(2, 1100, (5,), generator=gen).tolist()


def reference_decode(monkeypatch, *args):
    monkeypatch.setenv(cpu_ops.ENV_SWITCH, "0")
    try:
        return TorchAttentionBackend().paged_decode(*args)
    finally:
        monkeypatch.delenv(cpu_ops.ENV_SWITCH)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2)])
def test_kernel_matches_torch_path(kernel, monkeypatch, block_size, head_dim, num_heads, num_kv_heads):
    lens = ragged_lens(block_size, seed=block_size + head_dim)
    k_cache, v_cache, block_tables = make_pool(lens, block_size, num_kv_heads, head_dim, seed=head_dim)
    query = torch.randn(len(lens), num_heads, head_dim)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    args = (query, k_cache, v_cache, block_tables, context_lens, head_dim**-0.5)
    out = kernel(*args)
    assert out.shape == query.shape and out.dtype == query.dtype and not out.isnan().any()
    torch.testing.assert_close(out, reference_decode(monkeypatch, *args), rtol=1e-5, atol=1e-6)


def test_kernel_head_size_without_specialisation(kernel, monkeypatch):
    lens = [1, 17, 40, 333]
    k_cache, v_cache, block_tables = make_pool(lens, 16, 2, 40, seed=5)
    args = (torch.randn(4, 6, 40), k_cache, v_cache, block_tables, torch.tensor(lens, dtype=torch.int32), 0.2)
    torch.testing.assert_close(kernel(*args), reference_decode(monkeypatch, *args), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_pool_accumulates_in_float32(kernel, dtype):
    lens = [5, 300, 1100]
    k_cache, v_cache, block_tables = make_pool(lens, 16, 3, 64, seed=9, dtype=dtype)
    query = torch.randn(3, 9, 64).to(dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    out = kernel(query, k_cache, v_cache, block_tables, context_lens, 0.125)
    assert out.dtype == dtype
    expected = kernel(query.float(), k_cache.float(), v_cache.float(), block_tables, context_lens, 0.125)
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)  # one rounding of the output


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (6, 2, 64), (4, 4, 64),
                                                           (12, 3, 128), (10, 2, 64), (6, 2, 96)])
@pytest.mark.parametrize("batch", ["small", "large"])
def test_bfloat16_pool_in_place_every_gqa_layout(kernel, num_heads, num_kv_heads, head_dim, batch):
    """The bfloat16 path (register accumulators for groups of 1-4, a general loop beyond, a runtime
    head size; rows gathered 256 positions at a time) against the same inputs in float32: one bf16
    rounding of the output and of the attention weights apart. A small batch is split into one work
    item per kv head, a large one (>= 4 sequences per thread) into whole sequences."""
    lens = [1, 15, 16, 17, 160, 1100]
    if batch == "large":
        lens = lens + [255, 256, 257, 511, 513, 2, 33, 700] + torch.randint(
            1, 600, (10,), generator=torch.Generator().manual_seed(head_dim)).tolist()
    k_cache, v_cache, block_tables = make_pool(lens, 16, num_kv_heads, head_dim, seed=num_heads, dtype=torch.bfloat16)
    query = torch.randn(len(lens), num_heads, head_dim).bfloat16()
    context_lens = torch.tensor(lens, dtype=torch.int32)
    out = kernel(query, k_cache, v_cache, block_tables, context_lens, head_dim**-0.5)
    expected = kernel(query.float(), k_cache.float(), v_cache.float(), block_tables, context_lens, head_dim**-0.5)
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 64), (12, 3, 128),
                                                           (8, 2, 64), (16, 4, 128), (12, 3, 96)])
@pytest.mark.parametrize("batch", ["small", "large"])
def test_float32_pool_every_gqa_layout_matches_torch(kernel, monkeypatch, num_heads, num_kv_heads, head_dim, batch):
    """The float32 path (AVX-512 FMAs: register accumulators for GQA groups of 1-4 up to 24 vectors,
    one head at a time beyond; on an AVX2-only CPU score_rows and accumulate_rows for head sizes 64
    and 128; a runtime head size through the generic loops) against the torch
    reference at float32's level, over chunk edges (256 positions) and both work splits."""
    lens = [1, 15, 16, 17, 160, 1100]
    if batch == "large":
        lens = lens + [255, 256, 257, 511, 513, 2, 33, 700] + torch.randint(
            1, 600, (10,), generator=torch.Generator().manual_seed(head_dim)).tolist()
    k_cache, v_cache, block_tables = make_pool(lens, 16, num_kv_heads, head_dim, seed=num_heads)
    args = (torch.randn(len(lens), num_heads, head_dim), k_cache, v_cache, block_tables,
            torch.tensor(lens, dtype=torch.int32), head_dim**-0.5)
    torch.testing.assert_close(kernel(*args), reference_decode(monkeypatch, *args), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 96])
@pytest.mark.parametrize("batch", ["small", "large"])
def test_query_rows_read_in_place_from_the_fused_qkv(kernel, dtype, head_dim, batch):
    """The query as the model hands it over, the first columns of the fused qkv projection (rows
    wider than its heads): the same output, bit for bit, as from a contiguous copy; a layout
    whose heads are not dense is copied first and still answers the same."""
    num_heads, num_kv_heads = 9, 3
    lens = [1, 17, 160, 300] * (8 if batch == "large" else 1)
    k_cache, v_cache, block_tables = make_pool(lens, 16, num_kv_heads, head_dim, seed=head_dim, dtype=dtype)
    qkv = torch.randn(len(lens), (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    query = qkv[:, :num_heads * head_dim].view(len(lens), num_heads, head_dim)
    assert not query.is_contiguous()
    args = (k_cache, v_cache, block_tables, torch.tensor(lens, dtype=torch.int32), head_dim**-0.5)
    expected = kernel(query.contiguous(), *args)
    out = kernel(query, *args)
    assert out.is_contiguous() and torch.equal(out, expected)
    heads_apart = torch.randn(len(lens), head_dim, num_heads).to(dtype).transpose(1, 2)  # stride(1) == 1
    assert torch.equal(kernel(heads_apart, *args), kernel(heads_apart.contiguous(), *args))


def test_prefill_decode_rows_use_the_kernel_and_match(kernel, monkeypatch):
    lens, q_lens = [30, 500, 9, 77], [7, 1, 9, 1]  # rows 1 and 3 are decode rows inside a prefill batch
    k_cache, v_cache, block_tables = make_pool(lens, 16, 2, 64, seed=3)
    query = torch.randn(sum(q_lens), 6, 64)
    query_start_loc = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    args = (query, k_cache, v_cache, block_tables, query_start_loc, torch.tensor(lens, dtype=torch.int32), 0.125)
    calls = spy_kernel_calls(monkeypatch)
    out = TorchAttentionBackend().paged_prefill(*args)
    assert calls == [2]
    monkeypatch.setenv(cpu_ops.ENV_SWITCH, "0")
    torch.testing.assert_close(out, TorchAttentionBackend().paged_prefill(*args), rtol=1e-5, atol=1e-6)


def spy_kernel_calls(monkeypatch) -> list[int]:
    """Records the batch size of every call that the backend hands to the kernel."""
    calls: list[int] = []
    real = torch_backend.decode_kernel_for

    def spy(query, *rest):
        op = real(query, *rest)
        if op is not None:
            calls.append(query.shape[0])
        return op

    monkeypatch.setattr(torch_backend, "decode_kernel_for", spy)
    return calls


def test_engine_greedy_tokens_same_with_kernel_on_and_off(kernel, monkeypatch, tiny_llama_dir):
    prompts = [list(range(3, 3 + n)) for n in (1, 5, 40, 130, 17, 300)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens = {}
    calls = spy_kernel_calls(monkeypatch)
    for switch in ("1", "0"):
        monkeypatch.setenv(cpu_ops.ENV_SWITCH, switch)
        engine = LLMEngine(EngineConfig(enforce_eager=True, model=str(tiny_llama_dir), dtype="float32", block_size=16,
                                        kv_cache_memory=16 << 20, max_num_batched_tokens=128))
        tokens[switch] = [r.outputs[0].token_ids for r in engine.generate(prompts, params)]
        if switch == "1":
            assert calls, "the engine never used the kernel"
    assert tokens["1"] == tokens["0"]


def test_failed_build_falls_back_with_one_warning(monkeypatch, caplog):
    def broken_build():
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(cpu_ops, "build", broken_build)
    with caplog.at_level(logging.WARNING, logger="pagedserve.attention"):
        assert cpu_ops._load.__wrapped__() is None
    assert [r.levelno for r in caplog.records] == [logging.WARNING] and "no compiler here" in caplog.text


def test_switch_and_unsupported_inputs_keep_the_torch_path(kernel, monkeypatch):
    q, pool = torch.randn(2, 4, 64), torch.zeros(4, 16, 2, 64)
    meta = (torch.ones(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32))
    assert cpu_ops.decode_kernel_for(q, pool, pool, *meta) is kernel
    assert cpu_ops.decode_kernel_for(q, pool[:, :8], pool[:, :8], *meta) is None  # non-contiguous pool
    assert cpu_ops.decode_kernel_for(q.double(), pool.double(), pool.double(), *meta) is None
    assert cpu_ops.decode_kernel_for(q, pool, pool, meta[0].long(), meta[1]) is None
    monkeypatch.setenv(cpu_ops.ENV_SWITCH, "0")
    assert cpu_ops.decode_kernel_for(q, pool, pool, *meta) is None


def test_bad_metadata_raises_instead_of_reading_outside_the_pool(kernel):
    q, pool = torch.randn(1, 2, 64), torch.zeros(4, 16, 2, 64)
    with pytest.raises(RuntimeError, match="block id out of range"):
        kernel(q, pool, pool, torch.tensor([[7]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32), 1.0)
    with pytest.raises(RuntimeError, match="context_lens"):
        kernel(q, pool, pool, torch.tensor([[1]], dtype=torch.int32), torch.tensor([0], dtype=torch.int32), 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 5, 700])  # 700: rows over the threads
def test_kv_write_matches_the_masked_index_copy(kernel, monkeypatch, dtype, num_tokens):
    """write_kv against the torch path: padding rows (slot -1) skipped, value a strided slice of a
    fused qkv output, every other slot untouched (NaN stays NaN)."""
    gen = torch.Generator().manual_seed(num_tokens)
    shape = (64, 16, 3, 64)
    qkv = torch.randn(num_tokens, 9 * 64 + 2 * 3 * 64, generator=gen).to(dtype)
    key = qkv[:, 9 * 64:12 * 64].contiguous().view(num_tokens, 3, 64)
    value = qkv[:, 12 * 64:].view(num_tokens, 3, 64)  # strided rows, as the model hands them over
    slots = torch.randperm(64 * 16, generator=gen)[:num_tokens]
    slots[::4] = -1
    pools = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(cpu_ops.ENV_SWITCH, switch)
        k_cache, v_cache = torch.full(shape, math.nan, dtype=dtype), torch.full(shape, math.nan, dtype=dtype)
        TorchAttentionBackend().reshape_and_cache(key, value, k_cache, v_cache, slots)
        pools[switch] = (k_cache, v_cache)
    monkeypatch.setenv(cpu_ops.ENV_SWITCH, "1")
    assert cpu_ops.kv_writer_for(key, value, pools["1"][0], slots) is not None  # the kernel served "1"
    for ours, ref in zip(pools["1"], pools["0"]):
        assert torch.equal(ours.isnan(), ref.isnan())
        assert torch.equal(ours.nan_to_num(), ref.nan_to_num())
    written = pools["1"][1].view(-1, 3, 64)[slots[slots >= 0]]
    assert torch.equal(written, value[slots >= 0])


def test_kv_write_checks_every_slot_before_writing(kernel):
    key = torch.randn(3, 2, 64)
    k_cache, v_cache = torch.zeros(4, 16, 2, 64), torch.zeros(4, 16, 2, 64)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.pagedserve_cpu.write_kv(key, key, k_cache, v_cache, torch.tensor([5, 64, 7]))
    assert not k_cache.any() and not v_cache.any()  # nothing written: row 0's slot was valid
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.pagedserve_cpu.write_kv(key.double(), key.double(), k_cache, v_cache, torch.tensor([0, 1, 2]))
    assert cpu_ops.kv_writer_for(key.double(), key.double(), k_cache, torch.tensor([0, 1, 2])) is None
    assert cpu_ops.kv_writer_for(key, key, k_cache, torch.tensor([0, 1, 2], dtype=torch.int32)) is None


@pytest.mark.parametrize("op", ["linear", "linear_vector", "linear_amx"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, 3, 8, 9, 16, 17, 24, 33, 40, 64, 65, 128, 129])
@pytest.mark.parametrize("num_out", [70, 96])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("packed", [False, True, "float32"])
@pytest.mark.parametrize("out_dtype", [None, torch.float32], ids=["out-x", "out-f32"])
def test_small_batch_linear_matches_torch(kernel, op, dtype, num_rows, num_out, with_bias, packed, out_dtype):
    """cpu_gemv.cpp and cpu_amx.cpp against a float64 reference on random inputs. linear_vector: the
    GEMV loop (rows past 8 in tiles; float32 from 8 rows and bfloat16 from 25 go to oneDNN, from the
    weight's packed copy when given its handle; without AVX-512, bfloat16 up to 64 rows widened to
    float32 in registers, and past them float32 from a float32 packed copy, as packed="float32" forces
    here and a CPU whose oneDNN has no bfloat16 packs, and float32 up to 32 rows in the same loop);
    linear_amx:
    bfloat16 tiles for up to 128 rows (groups of 32 past 32) and whole blocks of 16 outputs (where the CPU
    has AMX-BF16);
    linear: the tiles where they serve, else linear_vector. The output is fresh, so an unwritten element
    would be garbage. out_dtype float32 (a model's logits): the same sums, unrounded; rounded to
    bfloat16 they are the bfloat16 output exactly."""
    amx_serves = dtype == torch.bfloat16 and num_rows <= 128 and num_out % 16 == 0
    if op == "linear_amx" and not torch.ops.pagedserve_cpu.amx_available():
        pytest.skip("this CPU (or kernel) gives no AMX-BF16 tiles")
    if op == "linear_amx" and packed:
        pytest.skip("the tiles read the plain weight: linear_amx takes no packed copy")
    if packed == "float32" and dtype != torch.bfloat16:
        pytest.skip("a float32 copy stands in for a bfloat16 weight only")
    if out_dtype is not None and dtype == torch.float32 and (num_rows % 8 != 1 or with_bias):
        pytest.skip("float32 out of float32 rows: the same call, a few shapes are enough")
    op_linear = getattr(torch.ops.pagedserve_cpu, op)
    linear = functools.partial(op_linear, out_dtype=out_dtype)
    gen = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, 96, generator=gen).to(dtype)
    weight = torch.randn(num_out, 96, generator=gen).to(dtype)  # 70 rows: a partial block of 32 (and of 16)
    bias = torch.randn(num_out, generator=gen).to(dtype) if with_bias else None
    if op == "linear_amx" and not amx_serves:
        with pytest.raises(RuntimeError, match="linear_amx: needs bfloat16"):
            linear(x.view(1, num_rows, 96), weight, bias)
        return

    def run(fn) -> torch.Tensor:  # with a fresh packed copy where asked, released after
        if not packed:
            return fn(x.view(1, num_rows, 96), weight, bias)
        widened = packed == "float32" or not cpu_ops.onednn_packs(dtype)  # as cpu_ops.PackedWeights packs
        handle = torch.ops.pagedserve_cpu.pack_linear_weight(weight.float() if widened else weight, 64)
        try:
            return fn(x.view(1, num_rows, 96), weight, bias, handle)
        finally:
            torch.ops.pagedserve_cpu.release_linear_weight(handle)

    out = run(linear)
    assert out.shape == (1, num_rows, num_out) and out.dtype == (out_dtype or dtype)
    ref = torch.nn.functional.linear(x.double(), weight.double(), None if bias is None else bias.double())
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=5e-2)  # bf16: one rounding
    torch.testing.assert_close(out[0].double(), ref, **tol)
    if out_dtype is not None and dtype == torch.bfloat16:
        assert torch.equal(out.bfloat16(), run(op_linear))
    if (op == "linear" and amx_serves and torch.ops.pagedserve_cpu.amx_available()
            and num_rows <= torch.ops.pagedserve_cpu.amx_rows()):
        assert torch.equal(out, torch.ops.pagedserve_cpu.linear_amx(x.view(1, num_rows, 96), weight, bias,
                                                                    out_dtype=out_dtype))


@pytest.mark.parametrize("num_rows", [1, 7, 16])
def test_bfloat16_linear_into_float32_is_not_rounded(kernel, num_rows):
    """A bfloat16 model's logits: up to 16 token rows every loop serves (AVX512-BF16, AVX2 widened,
    AMX tiles), and each sums in float32 and stores that sum, not its bfloat16 rounding."""
    if not {"avx2", "fma"} <= cpu_info.cpu_flags():
        pytest.skip("no vector loop on this CPU: at::linear's bfloat16 output")
    gen = torch.Generator().manual_seed(num_rows)
    x, weight = torch.randn(num_rows, 96, generator=gen).bfloat16(), torch.randn(80, 96, generator=gen).bfloat16()
    handle = torch.ops.pagedserve_cpu.pack_linear_weight(weight if cpu_ops.onednn_packs(torch.bfloat16) else weight.float(), 64)
    try:
        out = torch.ops.pagedserve_cpu.linear(x, weight, None, handle, torch.float32)
    finally:
        torch.ops.pagedserve_cpu.release_linear_weight(handle)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), x.double() @ weight.double().T, rtol=1e-5, atol=1e-4)
    assert (out != out.bfloat16().float()).float().mean() > 0.9  # nearly every sum needs more than 8 bits
    with pytest.raises(RuntimeError, match="out_dtype is x's dtype or float32"):
        torch.ops.pagedserve_cpu.linear(x, weight, None, -1, torch.float16)


def test_amx_rows_limit_decides_the_path(kernel):
    """`linear` hands a bfloat16 batch to the tiles up to amx_rows() token rows and to linear_vector
    past it; the limit takes 0..128 only. calibrate_amx_rows measures it on a model's matrices once
    for their shapes, sets it, and answers None (setting nothing) where it cannot use the tiles."""
    ops = torch.ops.pagedserve_cpu
    before = ops.amx_rows()
    gen = torch.Generator().manual_seed(3)
    x, weight = torch.randn(40, 96, generator=gen).bfloat16(), torch.randn(64, 96, generator=gen).bfloat16()
    handle = ops.pack_linear_weight(weight if cpu_ops.onednn_packs(torch.bfloat16) else weight.float(), 64)
    try:
        with pytest.raises(RuntimeError, match="set_amx_rows: 0..128"):
            ops.set_amx_rows(129)
        assert cpu_ops.calibrate_amx_rows([(weight.float(), handle)]) is None  # float32: not for the tiles
        assert ops.amx_rows() == before
        ops.set_amx_rows(32)
        assert torch.equal(ops.linear(x, weight, None, handle), ops.linear_vector(x, weight, None, handle))
        if not ops.amx_available():
            assert cpu_ops.calibrate_amx_rows([(weight, handle)]) is None
            return
        ops.set_amx_rows(64)
        assert torch.equal(ops.linear(x, weight, None, handle), ops.linear_amx(x, weight, None))
        rows = cpu_ops.calibrate_amx_rows([(weight, handle)] * 4)
        assert rows in (0, *cpu_ops.AMX_ROWS_TRIED) and ops.amx_rows() == rows
        ops.set_amx_rows(7)
        assert cpu_ops.calibrate_amx_rows([(weight, handle)] * 4) == rows and ops.amx_rows() == rows  # measured once
    finally:
        ops.release_linear_weight(handle)
        ops.set_amx_rows(before)


def test_packed_weights_are_checked_and_released(kernel, tiny_llama_dir):
    """A packed copy answers only for a matrix of the shape and dtype it was packed from; a released
    handle answers for nothing (and is reused); a model's copies are released with the model."""
    import gc

    from engine_svc.models import load_model

    ops = torch.ops.pagedserve_cpu
    gc.collect()  # earlier tests' models that are garbage already: theirs go now, not during this test
    before = ops.num_packed_weights()
    weight, x = torch.randn(96, 64).bfloat16(), torch.randn(40, 64).bfloat16()
    # where oneDNN has no bfloat16, a float32 copy, which answers for a bfloat16 weight (not for float16)
    widened = not cpu_ops.onednn_packs(torch.bfloat16)
    handle = ops.pack_linear_weight(weight.float() if widened else weight, 64)
    assert ops.num_packed_weights() == before + 1
    with pytest.raises(RuntimeError, match="packed from another matrix"):
        if widened:
            ops.linear(x.half(), torch.randn(96, 64).half(), None, handle)
        else:
            ops.linear(x.float(), torch.randn(96, 64), None, handle)  # float32: not what was packed
    with pytest.raises(RuntimeError, match="packed from another matrix"):
        ops.linear(x, torch.randn(48, 64).bfloat16(), None, handle)
    ops.release_linear_weight(handle)
    with pytest.raises(RuntimeError, match="no packed weight"):
        ops.linear(x, weight, None, handle)
    with pytest.raises(RuntimeError, match="no packed weight"):
        ops.release_linear_weight(handle)
    assert ops.num_packed_weights() == before and ops.pack_linear_weight(weight.float(), 64) == handle  # the slot reused
    ops.release_linear_weight(handle)

    model = load_model(tiny_llama_dir, dtype=torch.bfloat16, device="cpu")
    assert ops.num_packed_weights() == before + 4 * len(model.layers) + 1  # four a layer, the LM head
    del model
    gc.collect()
    assert ops.num_packed_weights() == before


@pytest.mark.parametrize("num_rows", [70, 128])
def test_amx_linear_in_slices_of_token_rows(kernel, num_rows):
    """K = 1,536 (the default model's down projection): the packed x of 64 rows fills the tiles' L2
    slice, so 70 and 128 rows run as two slices, the last one partial."""
    if not torch.ops.pagedserve_cpu.amx_available():
        pytest.skip("this CPU (or kernel) gives no AMX-BF16 tiles")
    gen = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, 1536, generator=gen).bfloat16()
    weight, bias = torch.randn(48, 1536, generator=gen).bfloat16(), torch.randn(48, generator=gen).bfloat16()
    ref = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    torch.testing.assert_close(torch.ops.pagedserve_cpu.linear_amx(x, weight, bias).double(), ref, rtol=1e-2, atol=0.3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [96, 100, 130])  # whole words, a partial last word, wider than the bitmask
def test_token_bitmask_matches_a_torch_reference(kernel, dtype, vocab):
    """cpu_bitmask.cpp against an unpacked-bit reference on random masks: words all set, all clear
    and mixed; only the listed rows change; ids past the bitmask's 32 * words are forbidden."""
    gen = torch.Generator().manual_seed(vocab)
    num_words = 3 if vocab != 130 else 4  # 130 > 4 * 32: the last two ids have no bit
    words = torch.randint(-(1 << 31), 1 << 31, (6, num_words), generator=gen, dtype=torch.int64)
    words[0], words[1, 0], words[2, 1] = -1, 0, -1  # all allowed, a clear word, a set word
    bitmask = words.to(torch.int32)
    logits = torch.randn(6, vocab, generator=gen).to(dtype)
    rows = [0, 1, 2, 4]
    out = logits.clone()
    cpu_ops.bitmask_op()(out, bitmask, torch.tensor(rows))
    bits = ((words.unsqueeze(-1) >> torch.arange(32)) & 1).view(6, -1).bool()
    allowed = torch.zeros(6, vocab, dtype=torch.bool)
    allowed[:, :min(vocab, bits.shape[1])] = bits[:, :vocab]
    expected = logits.clone()
    expected[rows] = logits[rows].masked_fill(~allowed[rows], float("-inf"))
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_answers_as_torch_argmax(kernel, dtype):
    """Greedy sampling's argmax (cpu_sampling.cpp): the first maximal index, a NaN row's first NaN,
    an all -inf row's 0, rows of every length around the 16-lane width; bfloat16 rows (many ties)
    as their float32 copy answers."""
    op = cpu_ops.argmax_op()
    gen = torch.Generator().manual_seed(3)
    for vocab in (1, 15, 16, 17, 100, 49152):
        logits = torch.randn(37, vocab, generator=gen).to(dtype)
        logits[1] = -math.inf
        logits[2, vocab // 2] = math.nan
        logits[3, -1] = math.nan
        if vocab > 2:
            logits[4, 1] = logits[4, -1] = logits[4].max() + 1  # a tie: the first one wins
            logits[5, 0] = math.inf
            logits[6] = 0.0  # all equal
        got = op(logits)
        assert got.dtype == torch.int64
        assert torch.equal(got, logits.float().argmax(dim=-1)), vocab
    assert torch.equal(op(logits[:, ::2]), logits[:, ::2].float().argmax(dim=-1))  # a strided view


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("threads", [1, 2])
def test_large_batch_answers_each_sequence_as_it_would_alone(kernel, dtype, threads):
    """A large batch runs as whole-sequence items, each one's rows prepared during the one before
    and the next gather prefetched while a chunk computes; a single sequence runs as one item per kv
    head. Same arithmetic per head, so each row of the batch must equal that sequence run alone,
    bit for bit, whichever thread takes which items."""
    lens = [300, 1, 17, 256, 257, 513, 40, 2, 600, 128, 129, 5]
    k_cache, v_cache, block_tables = make_pool(lens, 16, 3, 64, seed=7, dtype=dtype)
    query = torch.randn(len(lens), 9, 64).to(dtype)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch = kernel(query, k_cache, v_cache, block_tables, context_lens, 0.125)
        alone = [kernel(query[i:i + 1], k_cache, v_cache, block_tables[i:i + 1], context_lens[i:i + 1], 0.125)
                 for i in range(len(lens))]
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(batch, torch.cat(alone))


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in float64 from the bfloat16 inputs, rounded to bfloat16 once."""
    gate, up = gate_up.double().chunk(2, dim=-1)
    return (gate * torch.sigmoid(gate) * up).to(torch.bfloat16)


@pytest.mark.parametrize("shape", [(0, 3072), (1, 3072), (5, 34), (3, 4, 80), (300, 2 * 1536), (7, 2)])
def test_silu_mul_rounds_as_a_float64_reference(kernel, shape):
    """cpu_activation.cpp's silu(gate) * up for a bfloat16 MLP: row lengths with a short 16-lane tail
    (17, 40, 1) and without, leading dimensions kept, rows over the threads (300), gates from -90
    to 90 (exp saturates at both ends: a gate below -87 gives a result below 1e-30, where only that
    it is tiny is checked). Computed in float32 and rounded once, it must equal the float64 result
    rounded to bfloat16 except where that lies within a few float32 ulps of a rounding boundary: at
    most one element in 10,000, and there one bfloat16 step apart."""
    op = cpu_ops.silu_mul_op()
    if op is None:
        pytest.skip("this build has no AVX512-BF16 code (the model then takes torch's ops)")
    gen = torch.Generator().manual_seed(sum(shape))
    gate_up = (torch.randn(shape, generator=gen) * 4).bfloat16()
    if gate_up.numel():
        gate_up.view(-1)[:: 97] = 90.0
        gate_up.view(-1)[1:: 101] = -90.0
    out, expected = op(gate_up), silu_mul_reference(gate_up)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == torch.bfloat16
    tiny = expected.float().abs() < 1e-30
    assert (out.float().abs()[tiny] < 1e-30).all()
    differ = (out != expected) & ~tiny
    assert differ.sum().item() <= max(1, out.numel() // 10_000), differ.sum().item()
    step = expected.float().abs() * 2**-7  # one bfloat16 step at each magnitude
    assert ((out.float() - expected.float()).abs() <= step * 1.01)[~tiny].all()
    if len(shape) == 2 and shape[0]:
        assert torch.equal(op(gate_up[:1]), out[:1])  # a row alone: the same bits


def test_silu_mul_rejects_what_it_cannot_compute(kernel):
    op = cpu_ops.silu_mul_op()
    if op is None:
        pytest.skip("this build has no AVX512-BF16 code")
    with pytest.raises(RuntimeError, match="silu_mul: needs bfloat16"):
        op(torch.randn(2, 8))
    with pytest.raises(RuntimeError, match="silu_mul: the last dimension must be even"):
        op(torch.randn(2, 7).bfloat16())
    strided = torch.randn(4, 2, 64).bfloat16()[:, 0]  # rows 128 elements apart: made contiguous first
    assert torch.equal(op(strided), op(strided.contiguous()))


def test_bfloat16_cpu_model_takes_the_fused_activation(kernel, tiny_llama_dir):
    """A bfloat16 model on CPU computes silu(gate) * up through the op wherever this build has it (one
    rounding, as inductor's fused kernel; torch's eager ops round twice); float32 models keep torch's
    ops, whose results the HF parity tests pin."""
    from engine_svc.models import load_model
    from engine_svc.models.llama import silu_and_mul

    fused = cpu_ops.silu_mul_op() is not None
    assert all(layer.is_silu_mul_fused == fused for layer in load_model(tiny_llama_dir, dtype=torch.bfloat16,
                                                                     device="cpu").layers)
    assert not any(layer.is_silu_mul_fused for layer in load_model(tiny_llama_dir, dtype=torch.float32,
                                                                device="cpu").layers)
    x = (torch.randn(6, 2 * 64) * 3).bfloat16()
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(silu_and_mul(x, False), F.silu(gate) * up)
    if fused:
        assert (silu_and_mul(x, True) != silu_mul_reference(x)).sum() <= 1
