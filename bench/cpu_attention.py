"""Decode attention on CPU: the C++ kernel (cpu_ops) against the pure-torch path, in one run.

    python bench/cpu_attention.py [--iters 30] [--threads 1 2] [--layers 4]

Default model's head layout (9 query heads, 3 kv heads, head size 64, block 16), float32. Each
call reads a different layer's pool (--layers of them, shuffled blocks), as in the engine, so
K/V come from memory rather than a cache warmed by the previous call. The two paths alternate
call by call, so load from other processes hits both alike; medians are printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_svc.attention import TorchAttentionBackend, cpu_ops  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
CASES = [(64, 100, 600), (256, 450, 550)]  # (num seqs, min context, max context)


def make_case(num_seqs: int, lo: int, hi: int, num_layers: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (num_seqs,), generator=gen, dtype=torch.int32)
    blocks_per_seq = (lens + BLOCK_SIZE - 1) // BLOCK_SIZE
    num_blocks = int(blocks_per_seq.sum()) + 1
    order = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables = torch.zeros(num_seqs, int(blocks_per_seq.max()), dtype=torch.int32)
    offsets = torch.cumsum(blocks_per_seq, 0) - blocks_per_seq
    for s, (off, nb) in enumerate(zip(offsets.tolist(), blocks_per_seq.tolist())):
        tables[s, :nb] = order[off : off + nb]
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    pools = [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)) for _ in range(num_layers)]
    query = torch.randn(num_seqs, NUM_HEADS, HEAD_DIM, generator=gen)
    return query, pools, tables, lens


def run(num_seqs: int, lo: int, hi: int, args) -> dict:
    query, pools, tables, lens = make_case(num_seqs, lo, hi, args.layers)
    kernel, scale = cpu_ops.paged_decode_op(), HEAD_DIM**-0.5

    def torch_path(k, v):
        os.environ[cpu_ops.ENV_SWITCH] = "0"  # read when a backend chooses its kernel: forces the pure-torch path
        try:
            return TorchAttentionBackend().paged_decode(query, k, v, tables, lens, scale)
        finally:
            del os.environ[cpu_ops.ENV_SWITCH]

    paths = {"torch": torch_path, "kernel": lambda k, v: kernel(query, k, v, tables, lens, scale)}
    k, v = pools[0]
    max_diff = (paths["torch"](k, v) - paths["kernel"](k, v)).abs().max().item()
    times = {name: [] for name in paths}
    for i in range(args.iters * len(pools)):
        k, v = pools[i % len(pools)]
        for name, fn in (paths.items() if i % 2 else reversed(paths.items())):
            start = time.perf_counter()
            fn(k, v)
            times[name].append(time.perf_counter() - start)
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    return {"torch": ms["torch"], "kernel": ms["kernel"], "max_diff": max_diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, torch.get_num_threads()])
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    if cpu_ops.paged_decode_op() is None:
        sys.exit("the CPU kernels are unavailable (see the warning above)")
    print(f"heads {NUM_HEADS}/{NUM_KV_HEADS}, head size {HEAD_DIM}, block {BLOCK_SIZE}, float32; median ms per call")
    print("| seqs | context | threads | torch path ms | kernel ms | speedup | max abs diff |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for threads in dict.fromkeys(args.threads):
        torch.set_num_threads(threads)
        for num_seqs, lo, hi in CASES:
            r = run(num_seqs, lo, hi, args)
            print(f"| {num_seqs} | {lo}-{hi} | {threads} | {r['torch']:.2f} | {r['kernel']:.2f} | "
                  f"{r['torch'] / r['kernel']:.2f}x | {r['max_diff']:.1e} |", flush=True)


if __name__ == "__main__":
    main()
