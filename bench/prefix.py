"""KV sharing benchmark (issue 4): prefix caching on vs off, and n = 8 sampling vs 8 requests.

    python bench/prefix.py                  # default model, the issue's workload
    python bench/prefix.py --model tiny     # a tiny random model, seconds

Part 1: 64 requests share a 1,024-token prefix, each with its own 32-token suffix, all submitted
at once; mean time to first token and output throughput with prefix caching on and off.
Part 2: KV blocks held at the peak by one n = 8 request (512-token prompt, 64 output tokens)
against 8 independent requests with the same prompt (prefix caching off for both, so only the
fork shares).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_svc import EngineConfig, LLMEngine  # noqa: E402
from shared.protocol import SamplingParams  # noqa: E402


def model_dir(name: str) -> str:
    if name == "default":
        from shared.models import default_model_dir

        return str(default_model_dir())
    if name == "tiny":
        from tests.fixtures.models import build_tiny_model

        path = Path(os.environ.get("PAGEDSERVE_CACHE", Path.home() / ".cache/pagedserve")) / "bench-tiny-llama"
        if not (path / "config.json").exists():
            build_tiny_model("llama", path)
        return str(path)
    return name


def run_shared_prefix(path: str, caching: bool, args) -> dict:
    rng = random.Random(0)
    engine = LLMEngine(EngineConfig(model=path, dtype="float32", enable_prefix_caching=caching,
                                    kv_cache_memory=args.kv_mib << 20, max_num_seqs=64,
                                    max_num_batched_tokens=args.max_num_batched_tokens))
    vocab = min(engine.vocab_size, 30000)
    prefix = [rng.randrange(1, vocab) for _ in range(args.prefix_len)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    for i in range(args.num_requests):
        engine.add_request(f"r{i}", prefix + [rng.randrange(1, vocab) for _ in range(args.suffix_len)], params)
    first: dict[str, float] = {}
    num_tokens = 0
    steps = 0
    while engine.has_work():
        for delta in engine.step():
            first.setdefault(delta.request_id, time.perf_counter() - start)
            num_tokens += len(delta.new_token_ids)
        steps += 1
        if steps % 20 == 0:
            print(f"  caching={'on ' if caching else 'off'} step {steps}: {len(first)}/{args.num_requests} "
                  f"requests started, {num_tokens} tokens", flush=True)
    elapsed = time.perf_counter() - start
    stats = engine.stats()
    return {"mean_ttft": sum(first.values()) / len(first), "tok_s": num_tokens / elapsed,
            "hits": stats["prefix_cache_hits"], "queries": stats["prefix_cache_queries"], "elapsed": elapsed}


def peak_blocks(path: str, fork: bool, args) -> int:
    engine = LLMEngine(EngineConfig(model=path, dtype="float32", enable_prefix_caching=False,
                                    kv_cache_memory=args.kv_mib << 20, max_num_batched_tokens=4096))
    rng = random.Random(1)
    prompt = [rng.randrange(1, min(engine.vocab_size, 30000)) for _ in range(512)]
    if fork:
        engine.add_request("fan", prompt, SamplingParams(n=8, temperature=1.0, seed=0, max_tokens=64, ignore_eos=True))
    else:
        for i in range(8):
            engine.add_request(f"solo{i}", prompt, SamplingParams(temperature=1.0, seed=i, max_tokens=64,
                                                                  ignore_eos=True))
    peak = 0
    while engine.has_work():
        engine.step()
        s = engine.stats()
        peak = max(peak, s["num_total_blocks"] - s["num_free_blocks"])
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="default | tiny | an HF folder")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-mib", type=int, default=1024)
    args = parser.parse_args()
    import torch

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__} threads={torch.get_num_threads()}")
    print("command: python bench/prefix.py " + " ".join(sys.argv[1:]))
    path = model_dir(args.model)
    print(f"model: {path}")
    print(f"\n[1] {args.num_requests} requests, {args.prefix_len}-token shared prefix, "
          f"{args.suffix_len}-token suffixes, {args.output_len} output tokens each")
    off = run_shared_prefix(path, False, args)
    on = run_shared_prefix(path, True, args)
    print(f"{'':24}{'caching off':>14}{'caching on':>14}{'ratio':>10}")
    print(f"{'mean TTFT (s)':24}{off['mean_ttft']:>14.3f}{on['mean_ttft']:>14.3f}"
          f"{off['mean_ttft'] / on['mean_ttft']:>9.1f}x  (target >= 5x lower)")
    print(f"{'output tokens/s':24}{off['tok_s']:>14.1f}{on['tok_s']:>14.1f}{on['tok_s'] / off['tok_s']:>9.1f}x")
    print(f"{'prefix hit rate':24}{'0%':>14}{on['hits'] / max(on['queries'], 1):>14.0%}")

    print("\n[2] KV blocks held at the peak: n = 8 sampling of a 512-token prompt, 64 output tokens")
    forked = peak_blocks(path, True, args)
    solo = peak_blocks(path, False, args)
    print(f"{'8 independent requests':28}{solo:>8} blocks")
    print(f"{'one request with n = 8':28}{forked:>8} blocks   ratio {forked / solo:.3f} (target <= 0.25)")


if __name__ == "__main__":
    main()
