"""Small kernel cases for the ThreadSanitizer flavour of the emulation, and the child process that runs them.

python is not built with TSan, so the tsan library only loads into a process that has the TSan
runtime preloaded; tests/unit/test_kernels_tsan.py starts this module that way:

    LD_PRELOAD=$(g++ -print-file-name=libtsan.so) python -m tests.cuda_emu.tsan_cases LIB CASE...

Before each case the child writes "=== case NAME" to stderr, where TSan writes its reports, so
the parent can tell which case a report belongs to; after each, one JSON line on stdout:
{"case": NAME, "error": null or what went wrong}. Cases are kept small (blocks of 128 OS threads
each, a few blocks per launch): under TSan every shuffle is a round of futex wake-ups.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import numpy as np
import torch

from engine_svc.attention.cupy_backend import CupyAttentionBackend
from engine_svc.attention.torch_backend import TorchAttentionBackend
from tests.cuda_emu.launcher import EmuLauncher
from tests.cuda_emu.paged_data import TOLERANCES, make_paged_kv, reference_decode, reference_prefill

MARKER = "=== case "


def _ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    rtol, atol = TOLERANCES[dtype]
    assert not torch.isnan(out).any(), "an output element was never written (or read a poisoned slot)"
    torch.testing.assert_close(out.double(), ref, rtol=rtol, atol=atol)


# ------------------------------------------------------------------------------- the kernels
def reshape_and_cache_f16(launcher: EmuLauncher) -> None:
    g = torch.Generator().manual_seed(11)
    k_cache = torch.full((4, 16, 2, 64), float("nan"), dtype=torch.float16)
    v_cache = k_cache.clone()
    key, value = (torch.randn(5, 2, 64, generator=g).to(torch.float16) for _ in range(2))
    slots = torch.tensor([17, 3 * 16 + 2, -1, 20, 63])
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    TorchAttentionBackend().reshape_and_cache(key, value, expect_k, expect_v, slots)
    CupyAttentionBackend(launcher).reshape_and_cache(key, value, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, expect_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, expect_v, rtol=0, atol=0, equal_nan=True)


def copy_blocks_bf16(launcher: EmuLauncher) -> None:
    g = torch.Generator().manual_seed(12)
    caches = [torch.randn(5, 8, 2, 64, generator=g).to(torch.bfloat16) for _ in range(4)]
    expect = [c.clone() for c in caches]
    mapping = torch.tensor([[1, 4], [1, 3]])  # one source, two copies (a copy-on-write fork)
    TorchAttentionBackend().copy_blocks(expect[:2], expect[2:], mapping)
    CupyAttentionBackend(launcher).copy_blocks(caches[:2], caches[2:], mapping)
    assert all(torch.equal(got, want) for got, want in zip(caches, expect))


def _decode(launcher, lens, *, dtype, head_dim, block_size, kv_heads, gqa, split, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    kv = make_paged_kv(lens, num_kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype,
                       generator=g)
    query = torch.randn(len(lens), kv_heads * gqa, head_dim, generator=g).to(dtype)
    first = len(launcher.launches)
    out = CupyAttentionBackend(launcher, split_k=split).paged_decode(query, kv.k_cache, kv.v_cache, kv.block_tables,
                                                                     kv.context_lens, head_dim ** -0.5)
    names = [launch[0] for launch in launcher.launches[first:]]
    assert any(name.startswith("ps_paged_decode_reduce") for name in names) == split
    _check(out, reference_decode(query, kv, head_dim ** -0.5), dtype)


def decode_f32(launcher: EmuLauncher) -> None:
    """No split-K; 5 query heads per KV head: two head chunks, so the end-of-chunk barrier runs."""
    _decode(launcher, [1, 530], dtype=torch.float32, head_dim=64, block_size=16, kv_heads=1, gqa=5, split=False,
            seed=13)


def decode_split_f16(launcher: EmuLauncher) -> None:
    """Split-K over two partitions (one block exits at once), then the reduce kernel."""
    _decode(launcher, [3, 515], dtype=torch.float16, head_dim=64, block_size=8, kv_heads=1, gqa=3, split=True,
            seed=14)


def _prefill(launcher, seqs, *, dtype, head_dim, gqa, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    kv = make_paged_kv([c for c, _ in seqs], num_kv_heads=1, head_dim=head_dim, block_size=16, dtype=dtype,
                       generator=g)
    query_start_loc = torch.tensor([0] + [sum(q for _, q in seqs[: i + 1]) for i in range(len(seqs))],
                                   dtype=torch.int32)
    query = torch.randn(int(query_start_loc[-1]), gqa, head_dim, generator=g).to(dtype)
    out = CupyAttentionBackend(launcher).paged_prefill(query, kv.k_cache, kv.v_cache, kv.block_tables,
                                                       query_start_loc, kv.context_lens, head_dim ** -0.5)
    _check(out, reference_prefill(query, kv, query_start_loc, head_dim ** -0.5), dtype)


def prefill_bf16(launcher: EmuLauncher) -> None:
    """Tiles of 16 rows (GQA 2) over key tiles of 16: the 20-token chunk takes two tiles of three key
    tiles each, so every barrier of the tile loop orders a reuse of shared memory; the one-token
    sequence goes through the single-row kernel."""
    _prefill(launcher, [(5, 5), (40, 20), (9, 1)], dtype=torch.bfloat16, head_dim=128, gqa=2, seed=15)


def prefill_f32(launcher: EmuLauncher) -> None:
    """Tiles of 32 rows over key tiles of 32 (head size 64); the second tile of the 34-token chunk
    has 2 rows, so three of its warps skip the arithmetic and only meet the barriers."""
    _prefill(launcher, [(50, 34), (3, 2)], dtype=torch.float32, head_dim=64, gqa=1, seed=17)


# ------------------------------------------------------------------------------- the emulator itself
def emulator_selftests(launcher: EmuLauncher) -> None:
    """Poisoned shared memory per block, shuffle semantics and barriers, as in the fiber runtime."""
    out = torch.zeros(3, 64)
    launcher.launch(None, None, "emu_read_unwritten_shared", (3,), (64,), (_ptr(out), np.int32(1)))
    assert (out[0] == 1).all() and torch.isnan(out[1:]).all()
    out = torch.zeros(64, 4, dtype=torch.int32)
    launcher.launch(None, None, "emu_shuffles", (1,), (64,), (_ptr(out),))
    lane = torch.arange(64) % 32
    assert torch.equal(out[:, 0], lane ^ 5) and torch.equal(out[:, 2], torch.full((64,), 7))
    assert torch.equal(out[:, 1], torch.where(lane % 8 + 3 < 8, lane + 3, lane))
    assert torch.equal(out[:, 3], (lane // 8 * 8 * 8 + 28).to(torch.int32))
    x, y = torch.randn(2, 96), torch.full((2, 96), float("nan"))
    launcher.launch(None, None, "emu_block_sum", (2,), (96,), (_ptr(x), _ptr(y)), 96 * 4)
    torch.testing.assert_close(y, x.sum(1, keepdim=True).expand(2, 96), rtol=1e-5, atol=1e-5)


def unmatched_barriers(launcher: EmuLauncher) -> None:
    """Every emu_bad_sync mode is reported as a launch error, not hung."""
    expected = {0: "exited while others wait at __syncthreads", 1: "exited while others wait at __syncthreads",
                2: "divergent __syncthreads", 3: "warp operation"}
    for mode, message in expected.items():
        try:
            launcher.launch(None, None, "emu_bad_sync", (2,), (64,), (np.int32(mode),))
        except RuntimeError as e:
            assert message in str(e), f"mode {mode}: {e}"
        else:
            raise AssertionError(f"emu_bad_sync mode {mode} was not reported")


def _neighbour_read(launcher: EmuLauncher, mode: int, cross_warp: int) -> None:
    x = torch.randn(64, generator=torch.Generator().manual_seed(16))
    y = torch.full((64,), float("nan"))
    launcher.launch(None, None, "emu_neighbour_read", (1,), (64,), (_ptr(x), _ptr(y), np.int32(mode),
                                                                    np.int32(cross_warp)))
    if mode == 3 or (mode == 2 and not cross_warp):  # ordered: the read must see the neighbour's write
        t = torch.arange(64)
        assert torch.equal(y, x[(t + 32) % 64 if cross_warp else t ^ 1])


# mode, cross_warp -> a race TSan must report (True) or must not (False); see selftest_kernels.cu
NEIGHBOUR_READS = {"no_sync": (0, 0, True), "shuffle_only": (1, 0, True), "syncwarp": (2, 0, False),
                   "syncwarp_across_warps": (2, 1, True), "syncthreads": (3, 0, False),
                   "syncthreads_across_warps": (3, 1, False)}

KERNEL_CASES = {f.__name__: f for f in (reshape_and_cache_f16, copy_blocks_bf16, decode_f32, decode_split_f16,
                                        prefill_bf16, prefill_f32)}
EMULATOR_CASES = {f.__name__: f for f in (emulator_selftests, unmatched_barriers)}
CASES = {**KERNEL_CASES, **EMULATOR_CASES}
CASES.update({f"neighbour_read_{name}": (lambda launcher, m=m, c=c: _neighbour_read(launcher, m, c))
              for name, (m, c, _) in NEIGHBOUR_READS.items()})


def main(library: str, names: list[str]) -> None:
    launcher = EmuLauncher(library)
    if launcher.mode != "threads":
        raise SystemExit(f"{library} is not a thread-mode emulation library")
    for name in names:
        os.write(2, f"{MARKER}{name}\n".encode())
        try:
            CASES[name](launcher)
            error = None
        except Exception:  # noqa: BLE001 - reported to the parent, which fails the test
            error = traceback.format_exc()
        print(json.dumps({"case": name, "error": error}), flush=True)
    os.write(2, f"{MARKER}(end)\n".encode())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
