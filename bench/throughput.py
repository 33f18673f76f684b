"""Offline throughput, one workload, side by side: pagedserve's LLMEngine vs HF `generate` with
static padded batches vs transformers' continuous batching (`generate_batch`).

    .venv/bin/python bench/throughput.py                      # default model, 128 requests (long)
    .venv/bin/python bench/throughput.py --model tiny         # random 2-layer Llama, same shapes of work
    .venv/bin/python bench/throughput.py --num-requests 16 --max-output 32   # a quick look

Also prints the KV memory story (peak usage and its waste vs max-length preallocation, how many
requests run at once on a fixed KV budget), the share of the machine's matmul ceiling reached at
the largest batch, and the engine's own CPU time per step at 256 running requests (fake runner).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (Progress, Workload, count_parameters, make_workload, matmul_gflops, model_shape,  # noqa: E402
                    print_header, print_table, pyplot, ratio, resolve_bench_model, save_figure, target)
from peers import PeerRun, run_generate_batch, run_hf_static  # noqa: E402
from probe import SECTIONS, StepProbe, compute_probe, concurrency_report, overhead_report  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="default | tiny | PATH to an HF folder")
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--max-batch", type=int, default=64,
                   help="max sequences per step: our max_num_seqs, HF's static batch size, generate_batch's cap")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-budget-tokens", type=int, default=None,
                   help="KV cache size in tokens (default: max-batch x the workload's longest request, "
                        "i.e. what max-length preallocation needs for max-batch requests)")
    p.add_argument("--overhead-seqs", type=int, default=256, help="running requests for the overhead probe")
    p.add_argument("--skip", action="append", default=[], choices=["hf-static", "generate-batch", "overhead"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights, activations and KV cache of every system")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads for every system (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------- our engine
def run_engine(model_dir: Path, workload: Workload, args, kv_budget_tokens: int, shape: dict):
    from engine_svc import EngineConfig, LLMEngine
    from shared.protocol import SamplingParams

    block_size = 16
    num_blocks = math.ceil(kv_budget_tokens / block_size) + 1  # + the null block
    config = EngineConfig(model=str(model_dir), dtype=args.dtype, device="cpu", block_size=block_size,
                          kv_cache_memory=num_blocks * block_size * shape["kv_bytes_per_token"],
                          max_num_seqs=args.max_batch, max_num_batched_tokens=args.max_num_batched_tokens)
    engine = LLMEngine(config)
    probe = StepProbe(engine)
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(workload.num_requests)}
    progress = Progress("pagedserve", workload.num_output_tokens)
    timeline, done = [(0.0, 0)], 0
    start = time.perf_counter()
    for i, (prompt, n) in enumerate(zip(workload.prompts, workload.output_lens)):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    while engine.has_work():
        deltas = probe.step()
        new = 0
        for d in deltas:
            outputs[d.request_id].extend(d.new_token_ids)
            new += len(d.new_token_ids)
        done += new
        timeline.append((time.perf_counter() - start, done))
        rec = probe.records[-1]
        progress.update(new, f"running {rec.num_running} kv {engine.stats()['kv_cache_usage']:.0%}")
    seconds = time.perf_counter() - start
    stats = engine.stats()
    run = PeerRun("pagedserve LLMEngine", seconds, done, timeline,
                  [outputs[f"r{i}"] for i in range(workload.num_requests)],
                  [f"block_size={block_size} num_blocks={num_blocks} max_num_seqs={args.max_batch} "
                   f"max_num_batched_tokens={args.max_num_batched_tokens} preemptions={stats['num_preemptions']}"])
    return run, probe


# ---------------------------------------------------------------------------- memory and concurrency
def kv_report(records, workload: Workload, shape: dict) -> tuple[list[list], float]:
    peak = max(records, key=lambda r: r.allocated_slots)
    waste = 1 - peak.used_slots / peak.allocated_slots if peak.allocated_slots else 0.0
    mib = shape["kv_bytes_per_token"] / 2**20
    prealloc_wl = peak.num_running * workload.max_len
    prealloc_model = peak.num_running * shape["max_model_len"]
    return [
        ["paged (ours), allocated at peak", peak.allocated_slots, peak.allocated_slots * mib, peak.num_running, ""],
        ["paged (ours), used at peak", peak.used_slots, peak.used_slots * mib, peak.num_running,
         f"waste {waste:.2%} (target <= 4%: {target(waste <= 0.04)})"],
        [f"preallocate workload max ({workload.max_len})", prealloc_wl, prealloc_wl * mib, peak.num_running,
         f"{prealloc_wl / peak.allocated_slots:.1f}x ours" if peak.allocated_slots else ""],
        [f"preallocate max_model_len ({shape['max_model_len']})", prealloc_model, prealloc_model * mib,
         peak.num_running, f"{prealloc_model / peak.allocated_slots:.1f}x ours" if peak.allocated_slots else ""],
    ], waste


# ---------------------------------------------------------------------------- compute and overhead
def compute_report(records, gflops: float, params: int) -> list[list]:
    """From the run itself: decode-only steps at the largest batch (long contexts, attention included)."""
    ceiling = gflops * 1e9 / (2 * params)
    decode = [r for r in records if r.is_decode]
    if not decode:
        return [["no decode-only step in the run", "", "", ""]]
    largest = max(r.num_seqs for r in decode)
    top = [r for r in decode if r.num_seqs == largest]
    step_s = statistics.median(r.seconds for r in top)
    model_s = statistics.median(r.model_seconds for r in top)
    return [
        [f"in the run: decode steps at batch {largest} ({len(top)} steps), whole step", largest / step_s,
         f"{largest / step_s / ceiling:.1%}", ""],
        ["in the run: same steps, model forward + logits only", largest / model_s, f"{largest / model_s / ceiling:.1%}",
         ""],
    ]


# ---------------------------------------------------------------------------- main
def agreement(ours: PeerRun, peer: PeerRun) -> str:
    """Greedy outputs that match the peer's token for token (float32 rounding may flip a few)."""
    if not peer.outputs:
        return "n/a"
    same = sum(a == b for a, b in zip(ours.outputs, peer.outputs))
    return f"{same}/{len(ours.outputs)} identical"


def plot(runs: list[PeerRun], name: str) -> None:
    plt = pyplot()
    fig, (bars, lines) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r.name for r in runs]
    values = [r.tokens_per_s for r in runs]
    bars.barh(names, values, color=["tab:green"] + ["tab:gray"] * (len(runs) - 1))
    for y, v in enumerate(values):
        bars.text(v, y, f" {v:.1f}", va="center")
    bars.set_xlabel("output tokens/s")
    bars.invert_yaxis()
    bars.set_title("throughput (same workload, same run)")
    for r in runs:
        if r.timeline:
            xs, ys = zip(*r.timeline)
            lines.plot(xs, ys, label=r.name, drawstyle="steps-post")
    lines.set_xlabel("seconds")
    lines.set_ylabel("output tokens delivered")
    lines.legend()
    lines.set_title("output tokens over time")
    save_figure(fig, name)


def run_systems(args, model_dir: Path, workload: Workload, shape: dict, kv_budget: int):
    """Ours, then each peer, on the same workload; the matmul speed before and after."""
    gflops = [matmul_gflops(dtype=args.dtype)]
    ours, probe = run_engine(model_dir, workload, args, kv_budget, shape)
    runs = [ours]
    if "hf-static" not in args.skip:
        runs.append(run_hf_static(model_dir, workload, args.max_batch, dtype=args.dtype))
    if "generate-batch" not in args.skip:
        runs.append(run_generate_batch(model_dir, workload, max_batch=args.max_batch,
                                       max_batch_tokens=args.max_num_batched_tokens, kv_budget_tokens=kv_budget,
                                       dtype=args.dtype))
    gflops.append(matmul_gflops(dtype=args.dtype))
    return runs, probe, gflops


def print_throughput(runs: list[PeerRun]) -> None:
    ours = runs[0]
    rows = [[r.name, r.num_output_tokens, r.seconds, r.tokens_per_s, ratio(ours.tokens_per_s, r.tokens_per_s),
             agreement(ours, r) if r is not ours else "", "; ".join(r.notes)] for r in runs]
    print_table("Output tokens/s (target: ours >= 3x each peer)",
                ["system", "output tokens", "seconds", "tokens/s", "ours / it", "greedy outputs vs ours", "config"],
                rows)
    for r in runs[1:]:
        print(f"  ours vs {r.name}: {ratio(ours.tokens_per_s, r.tokens_per_s)} "
              f"(target >= 3x: {target(ours.tokens_per_s >= 3 * r.tokens_per_s)})")


def print_memory(args, records, workload: Workload, shape: dict, kv_budget: int) -> float:
    kv_rows, waste = kv_report(records, workload, shape)
    print_table("KV cache at the peak of our run (1 slot = 1 token of K and V in every layer)",
                ["layout", "slots", "MiB", "running", "note"], kv_rows)
    sim = make_workload(max(256, 4 * args.num_requests), (args.min_prompt, args.max_prompt),
                        (args.min_output, args.max_output), shape["vocab_size"], args.seed + 1)
    print_table(f"Requests running at once on the same KV budget ({kv_budget} tokens), no cap on sequences "
                f"(scheduler on a fake runner, {sim.num_requests} requests of the same distribution)",
                ["layout", "requests"], concurrency_report(sim, kv_budget, shape, args.max_num_batched_tokens))
    return waste


def print_compute(args, probe: StepProbe, records, gflops: list[float], params: int, shape: dict,
                  seconds: float) -> float:
    gf = max(gflops)
    probe_rows, share = compute_probe(probe, args.max_batch, shape["vocab_size"], params, dtype=args.dtype)
    print_table(f"Compute: 2 x {params / 1e6:.1f}M FLOPs per token; matmul {gflops[0]:.0f} GFLOP/s before the runs, "
                f"{gflops[1]:.0f} after (the run's rows use the larger, {gf / 2 / params * 1e9:.1f} tokens/s)",
                ["what", "tokens/s", "share of ceiling", "target >= 60%"], probe_rows + compute_report(records, gf, params))
    totals = {s: sum(r.sections.get(s, 0.0) for r in records) for s in SECTIONS}
    totals["step total"] = sum(r.seconds for r in records)
    print_table("Where our time went (whole run, seconds; attention is part of forward)", ["section", "seconds", "share"],
                [[s, t, f"{t / seconds:.1%}"] for s, t in totals.items()])
    return share


def print_overhead(args, shape: dict) -> float:
    if "overhead" in args.skip:
        return float("nan")
    rows, overhead = overhead_report(args.overhead_seqs, shape, args.max_num_batched_tokens)
    print_table(f"Engine's own CPU time per decode step at {args.overhead_seqs} running requests "
                f"(fake runner: real scheduler, block manager, input preparation and sampler; no model), "
                f"ms; target < 2 ms: {target(overhead < 2.0)}", ["section", "ms (median)"], rows)
    return overhead


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print_header("bench/throughput.py: offline throughput, pagedserve vs HF static batching vs generate_batch")
    model_dir = resolve_bench_model(args.model)
    shape = model_shape(model_dir, args.dtype)
    params = count_parameters(model_dir)
    workload = make_workload(args.num_requests, (args.min_prompt, args.max_prompt),
                             (args.min_output, args.max_output), shape["vocab_size"], args.seed)
    kv_budget = args.kv_budget_tokens or args.max_batch * workload.max_len
    print(f"   model: {model_dir} ({params / 1e6:.1f}M parameters), {args.dtype}")
    print(f"   workload: {workload.describe()}, greedy; max batch {args.max_batch}, max batched tokens "
          f"{args.max_num_batched_tokens}, KV budget {kv_budget} tokens "
          f"({kv_budget * shape['kv_bytes_per_token'] / 2**20:.1f} MiB)", flush=True)
    runs, probe, gflops = run_systems(args, model_dir, workload, shape, kv_budget)
    records = list(probe.records)  # the run's steps only (the compute probe adds more)
    print_throughput(runs)
    waste = print_memory(args, records, workload, shape, kv_budget)
    share = print_compute(args, probe, records, gflops, params, shape, runs[0].seconds)
    overhead = print_overhead(args, shape)
    suffix = "" if args.dtype == "float32" else f"-{args.dtype}"
    plot(runs, f"throughput-{Path(args.model).name}{suffix}.png")
    if args.json:
        args.json.write_text(json.dumps({"tokens_per_s": {r.name: r.tokens_per_s for r in runs},
                                         "kv_waste_at_peak": waste, "compute_share": share,
                                         "overhead_ms": overhead, "matmul_gflops": gflops}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
