"""Decode attention on the GPU: the cupy kernel's time and achieved bandwidth against a measured
device-to-device copy, FlashInfer's paged decode (when installed) and the torch backend.

    python bench/gpu_decode.py [--shape llama8b|smollm2] [--iters 20]

Achieved bandwidth = K/V bytes the kernel must read / its time; the copy's = bytes read + written
/ its time (what the memory system sustains). Prints one markdown table (see bench/gpu_check.sh).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {  # num query heads, num kv heads, head size
    "llama8b": (32, 8, 128),
    "smollm2": (9, 3, 64),
}
CASES = [(64, 1024), (64, 4096), (256, 1024), (256, 4096)]
BLOCK_SIZE = 16


def time_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def copy_bandwidth(iters: int) -> float:
    """GB/s of a 2 GiB device-to-device copy, counting bytes read + written."""
    src = torch.empty(1 << 30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), iters)
    return 2 * src.numel() * src.element_size() / ms / 1e6


def make_batch(num_seqs: int, ctx: int, heads: int, kv_heads: int, head_dim: int, dtype):
    blocks_per_seq = math.ceil(ctx / BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq + 1
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype=dtype, device="cuda")
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks - 1, device="cuda")[: num_seqs * blocks_per_seq] + 1  # scattered blocks
    block_tables = perm.view(num_seqs, blocks_per_seq).to(torch.int32)
    context_lens = torch.full((num_seqs,), ctx, dtype=torch.int32, device="cuda")
    query = torch.randn(num_seqs, heads, head_dim, dtype=dtype, device="cuda")
    return query, k_cache, v_cache, block_tables, context_lens


def flashinfer_decode(query, k_cache, v_cache, block_tables, context_lens):
    """A callable running FlashInfer's paged decode on the same pool (NHD layout), or None."""
    try:
        import flashinfer
    except Exception:
        return None
    num_seqs, heads, head_dim = query.shape
    kv_heads, blocks_per_seq = k_cache.shape[2], block_tables.shape[1]
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout="NHD")
    indptr = torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda") * blocks_per_seq
    last = (context_lens - 1) % BLOCK_SIZE + 1
    try:
        wrapper.plan(indptr, block_tables.flatten(), last, heads, kv_heads, head_dim, BLOCK_SIZE,
                     q_data_type=query.dtype, kv_data_type=k_cache.dtype)
    except TypeError:  # older signature
        wrapper.plan(indptr, block_tables.flatten(), last, heads, kv_heads, head_dim, BLOCK_SIZE,
                     data_type=k_cache.dtype)
    return lambda: wrapper.run(query, (k_cache, v_cache))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()

    from engine_svc.attention.cupy_backend import CupyAttentionBackend
    from engine_svc.attention.torch_backend import TorchAttentionBackend

    dtype = getattr(torch, args.dtype)
    heads, kv_heads, head_dim = SHAPES[args.shape]
    copy_gbs = copy_bandwidth(args.iters)
    cupy_backend, torch_backend = CupyAttentionBackend(), TorchAttentionBackend()
    print(f"{torch.cuda.get_device_name()}  shape {args.shape} ({heads}/{kv_heads} heads, head {head_dim}) "
          f"{args.dtype}, block {BLOCK_SIZE}; d2d copy {copy_gbs:.0f} GB/s")
    print("| seqs x ctx | cupy ms | cupy GB/s | % of copy | flashinfer ms | cupy / flashinfer | torch ms | torch / cupy |")
    print("|---|---|---|---|---|---|---|---|")
    for num_seqs, ctx in CASES:
        batch = make_batch(num_seqs, ctx, heads, kv_heads, head_dim, dtype)
        query, k_cache, v_cache, block_tables, context_lens = batch
        kv_bytes = 2 * num_seqs * ctx * kv_heads * head_dim * k_cache.element_size()
        scale = head_dim ** -0.5
        cupy_ms = time_ms(lambda: cupy_backend.paged_decode(*batch, scale), args.iters)
        cupy_gbs = kv_bytes / cupy_ms / 1e6
        try:
            fi = flashinfer_decode(*batch)
            fi_ms = time_ms(fi, args.iters) if fi else None
        except Exception as exc:  # report, do not abort the table
            print(f"flashinfer failed: {exc!r}", file=sys.stderr)
            fi_ms = None
        try:
            torch_ms = time_ms(lambda: torch_backend.paged_decode(*batch, scale), max(3, args.iters // 4))
        except torch.cuda.OutOfMemoryError:
            torch_ms = None
        fi_cell = f"{fi_ms:.3f} | {cupy_ms / fi_ms:.2f}x" if fi_ms else "n/a | n/a"
        torch_cell = f"{torch_ms:.3f} | {torch_ms / cupy_ms:.2f}x" if torch_ms else "OOM | n/a"
        print(f"| {num_seqs} x {ctx} | {cupy_ms:.3f} | {cupy_gbs:.0f} | {100 * cupy_gbs / copy_gbs:.0f}% | "
              f"{fi_cell} | {torch_cell} |", flush=True)
        del batch, query, k_cache, v_cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
