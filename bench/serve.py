"""Serving, side by side: pagedserve's whole stack (gateway -> tokenizer -> engine -> detok over Redis)
vs the in-process LLMEngine, and vs `transformers serve --continuous-batching`.

    .venv/bin/python bench/serve.py                   # default model (long)
    .venv/bin/python bench/serve.py --model tiny      # random 2-layer Llama with the default tokenizer
    .venv/bin/python bench/serve.py --model tiny --num-requests 32 --max-output 32 --levels 1,8

Part 1, at --concurrency (64): output tokens/s of the stack over the in-process engine (target
>= 0.9), and per token the time from the engine publishing it to the client reading it (the
Redis hops + detokenizer + gateway; target median < 2 ms), read from the stream entry ids.
Part 2, at each of --levels (1, 8, 32): output tokens/s, TTFT and ITL p50/p99 of pagedserve's
stack and of `transformers serve`, same text prompts, greedy, each request running to its length.
Everything listens on 127.0.0.1; request counts and time are bounded. The measuring client
stays off the gateways' CPUs (`--client-cpus apart`, as a remote client would): left to the
scheduler it is pulled next to the gateway by every chunk's wake-up and takes turns with it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (OUT_DIR, Progress, make_workload, model_shape, percentile, print_header, print_table,  # noqa: E402
                    pyplot, resolve_bench_model, save_figure, target)
from loadgen import ROW_HEADER, Result, Spec, Summary, run_closed_loop, summarize  # noqa: E402
from stack import (StreamTap, hop_latencies, pagedserve_server, process_cpu,  # noqa: E402
                   transformers_server)

BLOCK_SIZE = 16


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="default | tiny | PATH to an HF folder")
    p.add_argument("--num-requests", type=int, default=128, help="requests of part 1")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight in part 1")
    p.add_argument("--levels", default="1,8,32", help="concurrencies of part 2 (comma-separated; empty: skip)")
    p.add_argument("--requests-per-level", type=float, default=2.0,
                   help="part 2 sends max(2, this x concurrency) requests per level")
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds per measured phase")
    p.add_argument("--port", type=int, default=0, help="first port (default: free ones)")
    p.add_argument("--skip", action="append", default=[], choices=["inprocess", "stack", "transformers"])
    p.add_argument("--engine-nice", type=int, default=0,
                   help="`pagedserve serve --engine-nice`: the light bus services then get a core first when a "
                        "step's tokens arrive")
    p.add_argument("--tap-split", action="store_true",
                   help="follow the reply streams live to split the trip at the detokenizer (costs the stack CPU)")
    p.add_argument("--engine-sched", choices=("normal", "idle"), default="idle",
                   help="`pagedserve serve --engine-sched`")
    p.add_argument("--gateways", type=int, default=1, help="`pagedserve serve --gateways`")
    p.add_argument("--detokenizers", type=int, default=1, help="`pagedserve serve --detokenizers`")
    p.add_argument("--bus-cpus", choices=("spread", "none"), default="spread",
                   help="`pagedserve serve --bus-cpus` (the Redis this script starts is placed the same way)")
    p.add_argument("--client-cpus", choices=("apart", "any"), default="apart",
                   help="apart: the client runs on the CPUs no gateway is pinned to (both servers); any: anywhere")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------- in-process engine
def run_inprocess(model_dir: Path, specs: list[Spec], concurrency: int, engine_cfg: dict,
                  time_limit_s: float) -> tuple[list[Result], float]:
    """The same closed loop as the HTTP clients, on an LLMEngine in this process."""
    from engine_svc import EngineConfig, LLMEngine
    from shared.protocol import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", device="cpu", **engine_cfg))
    engine.generate([specs[0].prompt[:8]], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
    pending, results = list(reversed(specs)), {}
    progress = Progress("in-process", sum(s.max_tokens for s in specs))
    start = time.time()
    deadline = start + time_limit_s

    def admit() -> None:
        spec = pending.pop()
        request_id = f"q{len(results)}"
        results[request_id] = Result(sent=time.time())
        engine.add_request(request_id, spec.prompt,
                           SamplingParams(temperature=0.0, max_tokens=spec.max_tokens, ignore_eos=True))

    while pending and len(results) < concurrency:
        admit()
    while engine.has_work():
        deltas = engine.step()
        now = time.time()
        for d in deltas:
            r = results[d.request_id]
            if d.new_token_ids:
                r.chunk_times.append(now)
                r.num_tokens += len(d.new_token_ids)
                progress.update(len(d.new_token_ids), f"{len(results)}/{len(specs)} requests")
            if d.finish_reason is not None:
                r.done = now
                if pending and now < deadline:
                    admit()
    return list(results.values()), time.time() - start


# ---------------------------------------------------------------------------- the stack
def engine_flags(cfg: dict) -> list[str]:
    return ["--dtype", "float32", "--device", "cpu", "--kv-cache-memory", str(cfg["kv_cache_memory"]),
            "--max-num-seqs", str(cfg["max_num_seqs"]), "--max-num-batched-tokens", str(cfg["max_num_batched_tokens"])]


def stack_part1(server_url: str, model: str, specs: list[Spec], args, tap: StreamTap, pids: list[int]):
    """Part 1 through HTTP; also the CPU seconds each process spent meanwhile (the client is this one)."""
    progress = Progress("stack", sum(s.max_tokens for s in specs))
    extra = {"ignore_eos": True, "stream_options": {"include_usage": True}}
    cpu0, self0 = process_cpu(pids), _self_cpu()
    results, seconds = run_closed_loop(server_url, model, specs, args.concurrency, extra=extra,
                                       time_limit_s=args.time_limit, progress=progress)
    cpu1, self1 = process_cpu(pids), _self_cpu()
    cpu = {k: v - cpu0.get(k, 0.0) for k, v in cpu1.items()}
    cpu["bench client"] = self1 - self0
    time.sleep(0.5)  # let the tap read the last entries
    tap.stop()
    return results, seconds, hop_latencies(tap, results), cpu


@contextlib.contextmanager
def client_placement(args):
    """While measuring: this thread (the client's event loop) on the CPUs no gateway is pinned to."""
    from shared.placement import bus_cpus

    before = os.sched_getaffinity(0)
    gateways = set().union(*(c for k, c in bus_cpus(args.bus_cpus, args.gateways, args.detokenizers).items()
                             if k.startswith("gateway")))
    apart = before - gateways
    if args.client_cpus == "apart" and apart:
        os.sched_setaffinity(0, apart)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _self_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def level_specs(specs: list[Spec], level: int, factor: float) -> list[Spec]:
    return specs[: max(2, math.ceil(factor * level))]


def run_levels(name: str, url: str, model: str, specs: list[Spec], levels: list[int], args, extra) -> list[Summary]:
    out = []
    for level in levels:
        chosen = level_specs(specs, level, args.requests_per_level)
        progress = Progress(f"{name} c={level}", sum(s.max_tokens for s in chosen))
        results, seconds = run_closed_loop(url, model, chosen, level, extra=extra, time_limit_s=args.time_limit,
                                           progress=progress)
        out.append(summarize(name, level, results, seconds))
    return out


def transformers_extra() -> dict:
    """ignore_eos for transformers serve: its per-request generation_config with EOS disabled (-1)."""
    return {"generation_config": lambda spec: json.dumps({"eos_token_id": -1, "do_sample": False,
                                                          "max_new_tokens": spec.max_tokens})}


# ---------------------------------------------------------------------------- report
def hop_rows(hops: dict[str, list[float]]) -> list[list]:
    rows = []
    for name, xs in hops.items():
        if not xs:
            continue  # the split needs --tap-split
        ms = [x * 1e3 for x in xs]
        rows.append([name, len(ms), percentile(ms, 50), percentile(ms, 90), percentile(ms, 99)])
    return rows


def plot(part1: list[Summary], part2: list[Summary], hops: dict[str, list[float]], name: str) -> None:
    """Top: part 1 (stack vs in-process) and the bus's latency per token; bottom: part 2 (vs
    transformers serve). CDFs, log ms."""
    plt = pyplot()
    parts = [(summaries, title) for summaries, title in ((part1, "part 1"), (part2, "part 2")) if summaries]
    if not parts:
        return
    hops = hops if hops and hops.get("engine->client") else {}
    num_cols = 3 if hops else 2
    fig, axes = plt.subplots(len(parts), num_cols, figsize=(6 * num_cols, 4 * len(parts)), squeeze=False)
    for row, (summaries, title) in enumerate(parts):
        for col, attr, what in ((0, "ttfts", "time to first token"), (1, "itls", "inter-token latency")):
            ax = axes[row][col]
            for s in summaries:
                xs = sorted(x * 1e3 for x in getattr(s, attr) if x > 0)
                if xs:
                    ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post",
                            label=f"{s.name} c={s.concurrency}", linestyle="--" if "transformers" in s.name else "-")
            _cdf_axes(ax, f"{title}: {what} (CDF)",
                      "share of requests" if attr == "ttfts" else "share of gaps between text chunks")
        if num_cols == 3 and row > 0:
            axes[row][2].axis("off")
    if hops:
        ax = axes[0][2]
        for path, xs in hops.items():
            xs = sorted(x * 1e3 for x in xs if x > 0)
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=path)
        ax.axvline(2.0, color="grey", linestyle=":", label="target median 2 ms")
        ax.axhline(0.5, color="grey", linewidth=0.5)
        _cdf_axes(ax, "part 1: per token, engine XADD -> client read (CDF)", "share of tokens", log=False)
    save_figure(fig, name)


def _cdf_axes(ax, title: str, ylabel: str, log: bool = True) -> None:
    if log:
        ax.set_xscale("log")
    ax.set_xlabel("ms (log)" if log else "ms")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def report(part1: list[Summary], hops, cpu: dict[str, float], part2: list[Summary], levels: list[int]) -> dict:
    figures = {}
    if part1:
        print_table("Part 1: the whole stack vs the in-process engine, same requests (token-id prompts, ignore_eos)",
                    ROW_HEADER, [s.row() for s in part1])
    if len(part1) == 2:
        inproc, stack = part1
        share = stack.tokens_per_s / inproc.tokens_per_s
        figures["stack_over_inprocess"] = share
        print(f"  stack / in-process output tokens/s: {share:.2f} (target >= 0.9: {target(share >= 0.9)})")
    if hops and not hops.get("engine->client"):
        print("  per-token hops: no samples (the detok streams' entries are deleted once consumed: the tap must "
              "follow them live, --tap-split)")
    elif hops:
        print_table("Per token: engine publishes it -> client reads it (Redis hops + detokenizer + gateway), ms",
                    ["path", "tokens", "p50", "p90", "p99"], hop_rows(hops))
        med = percentile([x * 1e3 for x in hops["engine->client"]], 50)
        figures["hop_ms_p50"] = med
        print(f"  median added per token: {med:.2f} ms (target < 2 ms: {target(med < 2.0)}); stream ids have 1 ms "
              "resolution (+0.5 ms applied)")
    if cpu and part1:
        stack = part1[-1]
        print_table(f"CPU seconds per process during part 1 ({stack.seconds:.1f} s wall, {stack.num_tokens} tokens; "
                    f"{len(os.sched_getaffinity(0))} cores)", ["process", "CPU s", "CPU ms per token", "cores busy"],
                    [[name, sec, sec * 1e3 / max(stack.num_tokens, 1), sec / stack.seconds]
                     for name, sec in sorted(cpu.items(), key=lambda kv: -kv[1])])
    if part2:
        print_table("Part 2: pagedserve stack vs transformers serve --continuous-batching (same text prompts, greedy, "
                    "every request runs to max_tokens)", ROW_HEADER, [s.row() for s in part2])
        by = {(s.name, s.concurrency): s for s in part2}
        for level in levels:
            ours, peer = by.get(("pagedserve", level)), by.get(("transformers serve", level))
            if ours and peer:
                r = ours.tokens_per_s / peer.tokens_per_s
                p99_ours, p99_peer = percentile(ours.itls, 99) * 1e3, percentile(peer.itls, 99) * 1e3
                figures[f"c{level}"] = {"tokens_per_s_ratio": r, "itl_p99_ms": [p99_ours, p99_peer]}
                goal = f" (target at 32: >= 2x {target(r >= 2)}, lower p99 ITL {target(p99_ours < p99_peer)})" \
                    if level == 32 else ""
                print(f"  c={level}: ours / transformers tokens/s {r:.2f}x; ITL p99 {p99_ours:.1f} vs "
                      f"{p99_peer:.1f} ms{goal}")
    return figures


# ---------------------------------------------------------------------------- main
def run_stack(args, model_dir: Path, cfg: dict, id_specs: list[Spec], text_specs: list[Spec], levels: list[int]):
    """`pagedserve serve` against a redis-server of our own: part 1 (with the stream tap), then part 2."""
    from shared.placement import bus_cpus
    from shared.redis_server import RedisServer, free_port

    with RedisServer(cpus=bus_cpus(args.bus_cpus, args.gateways, args.detokenizers).get("redis")) as redis_server:
        port = args.port or free_port()
        flags = [*engine_flags(cfg), "--engine-nice", str(args.engine_nice), "--engine-sched", args.engine_sched,
                 "--gateways", str(args.gateways),
                 "--detokenizers", str(args.detokenizers), "--bus-cpus", args.bus_cpus]
        server = pagedserve_server(model_dir, port, redis_server.url, flags, OUT_DIR / "serve-pagedserve.log")
        print(f"   stack: {server.command}", flush=True)
        url = f"http://127.0.0.1:{port}"
        with server:
            server.start(timeout_s=900)
            model_name = _served_model(url)
            run_closed_loop(url, model_name, [Spec(id_specs[0].prompt[:8], 2)], 1)  # warm-up
            tap = StreamTap(redis_server.url, num_detok_shards=args.detokenizers, live=args.tap_split).start()
            with client_placement(args):
                res, secs, hops, cpu = stack_part1(url, model_name, id_specs, args, tap,
                                                   [server.proc.pid, redis_server.process.pid])
                part2 = run_levels("pagedserve", url, model_name, text_specs, levels, args,
                                   {"ignore_eos": True, "stream_options": {"include_usage": True}})
    return summarize("pagedserve stack", args.concurrency, res, secs), hops, cpu, part2


def run_transformers(args, model_dir: Path, num_blocks: int, text_specs: list[Spec], levels: list[int]):
    from shared.redis_server import free_port

    port = free_port()
    server = transformers_server(model_dir, port, block_size=BLOCK_SIZE, num_blocks=num_blocks,
                                 max_batch_tokens=args.max_num_batched_tokens, log_path=OUT_DIR / "serve-transformers.log")
    print(f"   peer: HF_HUB_OFFLINE=1 {server.command}", flush=True)
    url = f"http://127.0.0.1:{port}"
    with server:
        server.start(timeout_s=900)
        run_closed_loop(url, str(model_dir), [Spec("Hello", 2)], 1, extra=transformers_extra())  # warm-up
        with client_placement(args):  # the same CPUs as for pagedserve
            return run_levels("transformers serve", url, str(model_dir), text_specs, levels, args, transformers_extra())


def main(argv=None) -> int:
    from transformers import AutoTokenizer

    args = parse_args(argv)
    print_header("bench/serve.py: pagedserve stack vs in-process engine vs transformers serve")
    model_dir = resolve_bench_model(args.model)
    shape = model_shape(model_dir)
    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    wl = make_workload(args.num_requests, (args.min_prompt, args.max_prompt), (args.min_output, args.max_output),
                       shape["vocab_size"], args.seed)
    kv_tokens = args.concurrency * wl.max_len
    num_blocks = math.ceil(kv_tokens / BLOCK_SIZE) + 1
    cfg = {"kv_cache_memory": num_blocks * BLOCK_SIZE * shape["kv_bytes_per_token"],
           "max_num_seqs": max(args.concurrency, *levels, 1), "max_num_batched_tokens": args.max_num_batched_tokens}
    id_specs = [Spec(p, n) for p, n in zip(wl.prompts, wl.output_lens)]
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    num_text = max((len(level_specs(id_specs, lv, args.requests_per_level)) for lv in levels), default=0)
    text_specs = [Spec(tok.decode(s.prompt), s.max_tokens) for s in id_specs[:num_text]]
    print(f"   model: {model_dir}\n   workload: {wl.describe()}; part 1 at concurrency {args.concurrency}; "
          f"part 2 levels {levels}\n   engine: {' '.join(engine_flags(cfg))} (KV for {kv_tokens} tokens)", flush=True)
    part1, hops, part2, cpu = [], {}, [], {}
    if "inprocess" not in args.skip:
        res, secs = run_inprocess(model_dir, id_specs, args.concurrency, cfg, args.time_limit)
        part1.append(summarize("in-process LLMEngine", args.concurrency, res, secs))
        gc.collect()
    if "stack" not in args.skip:
        stack, hops, cpu, part2 = run_stack(args, model_dir, cfg, id_specs, text_specs, levels)
        part1.append(stack)
    if "transformers" not in args.skip and levels:
        part2 += run_transformers(args, model_dir, num_blocks, text_specs, levels)
    figures = report(part1, hops, cpu, part2, levels)
    plot(part1, part2, hops, f"serve-{Path(args.model).name}.png")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


def _served_model(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as resp:
        return json.loads(resp.read())["data"][0]["id"]


if __name__ == "__main__":
    sys.exit(main())
