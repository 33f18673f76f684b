"""Prefill/decode disaggregation against the unified engine, in one run on this machine.

Three stacks in turn, each `pagedserve serve` (same bus and gateway) on the default model against a
redis-server this script starts: unified (one engine on every CPU), P/D through Redis (a prefill
engine on one half of the CPUs, a decode engine on the other; KV through ps:kv:*), and P/D
through shared memory (--kv-connector shm). The workload: `--streams` long-running streams
decode (each restarted when it ends) while a `--long-tokens`-token prompt arrives every
`--every` seconds (generating `--long-max-tokens` tokens, so that it is handed off). Printed: the
streams' ITL p50/p99, the long prompts' TTFT, the total output tokens/s, and the KV transfer
figures the engines count (MB/s and ms per request, save and load), with P/D's ratios to unified.

    python bench/pd.py [--seconds 40] [--streams 8] [--every 2] [--long-tokens 1024]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT_DIR, percentile, print_header, print_table, ratio, target  # noqa: E402
from stack import pagedserve_server  # noqa: E402

from shared.heartbeat import read_heartbeats  # noqa: E402
from shared.models import resolve_model  # noqa: E402
from shared.protocol import StreamNames  # noqa: E402
from shared.redis_server import RedisServer, free_port  # noqa: E402


MODEL_NAME = [""]  # the served model's name, read from /v1/models


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder (default: the default model)")
    p.add_argument("--seconds", type=float, default=40.0, help="measured time per stack")
    p.add_argument("--warmup", type=float, default=8.0, help="seconds of the workload before measuring")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--stream-max-tokens", type=int, default=256)
    p.add_argument("--every", type=float, default=2.0, help="a long prompt this often (seconds)")
    p.add_argument("--long-tokens", type=int, default=1024)
    p.add_argument("--long-max-tokens", type=int, default=8)
    p.add_argument("--engine-flags", default="--max-num-seqs 32 --max-num-batched-tokens 2048 --kv-cache-memory 1G")
    p.add_argument("--only", choices=("unified", "pd-redis", "pd-shm"), action="append")
    return p.parse_args(argv)


async def stream_one(client: httpx.AsyncClient, url: str, prompt, max_tokens: int) -> dict:
    """One streamed completion: when it was sent, when each text chunk came, its completion tokens."""
    body = {"model": MODEL_NAME[0], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    out = {"sent": time.monotonic(), "chunks": [], "tokens": 0, "error": None}
    try:
        async with client.stream("POST", url, json=body) as resp:
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    out["error"] = data["error"].get("message")
                if data.get("choices"):
                    out["chunks"].append(time.monotonic())
                if data.get("usage"):
                    out["tokens"] = data["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        out["error"] = repr(exc)
    out["done"] = time.monotonic()
    return out


async def workload(base: str, args, rng: random.Random, vocab: int) -> dict:
    url = base + "/v1/completions"
    limits = httpx.Limits(max_connections=args.streams + 64)
    streams, longs = [], []
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.monotonic()
        measure_from = start + args.warmup
        stop_at = measure_from + args.seconds

        async def stream_worker(i: int) -> None:
            while time.monotonic() < stop_at:
                prompt = f"Stream {i}, part {rng.randrange(10**6)}: tell a long story about rivers."
                streams.append(await stream_one(client, url, prompt, args.stream_max_tokens))

        async def long_prompts() -> None:
            tasks = []
            while time.monotonic() < stop_at:
                prompt = [rng.randrange(100, vocab) for _ in range(args.long_tokens)]  # no prefix-cache hit
                tasks.append(asyncio.ensure_future(stream_one(client, url, prompt, args.long_max_tokens)))
                await asyncio.sleep(args.every)
            longs.extend(await asyncio.gather(*tasks))

        await asyncio.gather(long_prompts(), *(stream_worker(i) for i in range(args.streams)))
    itl = [b - a for s in streams for a, b in zip(s["chunks"], s["chunks"][1:]) if a >= measure_from and b <= stop_at]
    ttft = [r["chunks"][0] - r["sent"] for r in longs if r["chunks"] and r["sent"] >= measure_from]
    tokens = sum(r["tokens"] for r in streams + longs if r["sent"] >= measure_from and r["done"] <= stop_at)
    # tokens of requests that straddle the window: counted by their chunks inside it (a chunk ~ a token)
    tokens += sum(sum(measure_from <= t <= stop_at for t in r["chunks"]) for r in streams + longs
                  if not (r["sent"] >= measure_from and r["done"] <= stop_at))
    errors = [r["error"] for r in streams + longs if r["error"]]
    return {"itl": itl, "ttft": ttft, "tokens_per_s": tokens / args.seconds, "num_long": len(ttft),
            "errors": errors}


def kv_figures(redis_url: str) -> dict[str, float]:
    import redis

    with redis.Redis.from_url(redis_url) as client:
        beats = read_heartbeats(client, StreamNames("ps").heartbeat, service="engine")
    out: dict[str, float] = {}
    for beat in beats.values():
        for key, value in beat.stats.items():
            if key.startswith("kv_"):
                out[key] = out.get(key, 0.0) + value
    return out


def wait_for_engines(redis_url: str, num: int, timeout_s: float = 900) -> None:
    import redis

    deadline = time.monotonic() + timeout_s
    with redis.Redis.from_url(redis_url) as client:
        while len(read_heartbeats(client, StreamNames("ps").heartbeat, service="engine")) < num:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {num} engines beat after {timeout_s:g} s")
            time.sleep(0.5)


def run_stack(name: str, flags: list[str], model: Path, args, log_dir: Path) -> dict:
    with RedisServer() as server:
        port = free_port()
        engine_flags = [*args.engine_flags.split(), *flags]
        srv = pagedserve_server(model, port, server.url, engine_flags, log_dir / f"{name}.log")
        print(f"-- {name}: {srv.command}", flush=True)
        srv.start(timeout_s=900)
        try:
            wait_for_engines(server.url, 2 if "--pd" in flags else 1)  # /health needs only one
            from transformers import AutoConfig

            vocab = AutoConfig.from_pretrained(model).vocab_size
            MODEL_NAME[0] = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"][0]["id"]
            result = asyncio.run(workload(f"http://127.0.0.1:{port}", args, random.Random(0), vocab))
            time.sleep(2.5)  # the engines' last heartbeats
            result["kv"] = kv_figures(server.url)
        finally:
            srv.stop()
    return result


def main() -> None:
    args = parse_args()
    print_header("P/D disaggregation vs the unified engine (bench/pd.py)")
    model = resolve_model(args.model)
    print(f"   model {model}; {args.streams} streams of {args.stream_max_tokens} tokens decoding while a "
          f"{args.long_tokens}-token prompt ({args.long_max_tokens} tokens out) arrives every {args.every:g} s; "
          f"{args.warmup:g} s warm-up, {args.seconds:g} s measured per stack")
    stacks = {"unified": [], "pd-redis": ["--pd", "--kv-connector", "redis"],
              "pd-shm": ["--pd", "--kv-connector", "shm"]}
    log_dir = OUT_DIR / "pd-logs"
    results = {name: run_stack(name, flags, model, args, log_dir) for name, flags in stacks.items()
               if not args.only or name in args.only}
    base = results.get("unified")
    rows = []
    for name, r in results.items():
        p50, p99 = percentile(r["itl"], 50) * 1000, percentile(r["itl"], 99) * 1000
        ttft = percentile(r["ttft"], 50) * 1000
        row = [name, p50, p99, ttft, percentile(r["ttft"], 90) * 1000, r["tokens_per_s"], r["num_long"],
               len(r["errors"])]
        if base is not None:
            row += [ratio(p99, percentile(base["itl"], 99) * 1000), ratio(r["tokens_per_s"], base["tokens_per_s"])]
        rows.append(row)
    header = ["stack", "ITL p50 ms", "ITL p99 ms", "TTFT p50 ms", "TTFT p90 ms", "output tok/s", "long prompts",
              "errors"] + (["p99 ITL vs unified", "tok/s vs unified"] if base is not None else [])
    print_table("Streams' inter-token latency, long prompts' time to first token, total throughput", header, rows)
    kv_rows = []
    for name, r in results.items():
        kv = r["kv"]
        if not kv:
            continue
        mb_s = lambda b, s: b / s / 1e6 if s else float("nan")  # noqa: E731
        per = lambda s, n: s / n * 1000 if n else float("nan")  # noqa: E731
        kv_rows.append([name, int(kv.get("kv_num_saved", 0)), int(kv.get("kv_num_loaded", 0)),
                        kv.get("kv_bytes_loaded", 0) / max(kv.get("kv_num_loaded", 0), 1) / 1e6,
                        mb_s(kv.get("kv_bytes_saved", 0), kv.get("kv_save_seconds", 0)),
                        per(kv.get("kv_save_seconds", 0), kv.get("kv_num_saved", 0)),
                        mb_s(kv.get("kv_bytes_loaded", 0), kv.get("kv_load_seconds", 0)),
                        per(kv.get("kv_load_seconds", 0), kv.get("kv_num_loaded", 0)),
                        int(kv.get("kv_num_fallbacks", 0))])
    if kv_rows:
        print_table("KV transfer (the engines' counters)", ["stack", "saved", "loaded", "MB/request", "save MB/s",
                                                          "save ms/request", "load MB/s", "load ms/request",
                                                          "fallbacks"], kv_rows)
    if base is not None and "pd-redis" in results:
        ok = percentile(results["pd-redis"]["itl"], 99) <= percentile(base["itl"], 99) / 2
        print(f"\ntarget p99 ITL under P/D (Redis) at most half the unified engine's: {target(ok)}")


if __name__ == "__main__":
    main()
