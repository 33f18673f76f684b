"""`make bench`: the quick benchmarks in one run, bounded in time, one markdown report.

    .venv/bin/python bench/all.py [--budget-min 15]

Runs, one after the other, each in its own process (float32, OMP_WAIT_POLICY=PASSIVE as before):
- bench/throughput.py on a smaller workload (64 requests, outputs 16-128): ours vs HF static
  batching (transformers' generate_batch, 2-3x slower still, only in the script's own run);
- bench/prefix.py with 32 requests sharing the prefix: prefix caching off vs on, and KV sharing of n > 1;
- bench/serve.py (64 requests, outputs 16-128, one pass per level, the live stream tap): the stack
  vs the in-process engine and vs `transformers serve`.
Each script prints its tables and writes its plots under docs/bench/ as it does alone; every
table is also collected (bench/common.py: PAGEDSERVE_BENCH_MARKDOWN) into bench/out/bench.md, with
each step's command and wall time and the total against the budget. The sweeps and the vLLM
comparison are their own targets (make bench-sweep, bench-vllm, bench-tokenizers, bench-soak).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import MARKDOWN_ENV, OUT_DIR, machine_lines, print_header  # noqa: E402

HERE = Path(__file__).resolve().parent
STEPS = [
    # lighter than the scripts alone, so that the run stays within 15 minutes on a slow day of this VM
    # (18.1 min with every peer and 64 requests each; generate_batch alone took 196 s of 402 with 48)
    ["throughput.py", "--num-requests", "64", "--max-output", "128", "--skip", "generate-batch"],
    ["prefix.py", "--num-requests", "32"],
    # --tap-split: the per-token hop times need the tap to follow the detok streams live (consumed
    # entries are deleted)
    ["serve.py", "--num-requests", "64", "--max-output", "128", "--requests-per-level", "1", "--tap-split"],
]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-min", type=float, default=15.0, help="the wall time the whole run should stay within")
    args = p.parse_args(argv)
    print_header("make bench: throughput, prefix caching, serving")
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    report = OUT_DIR / "bench.md"
    report.write_text("# make bench\n\n" + "".join(f"- {line}\n" for line in machine_lines()))
    env = {**os.environ, MARKDOWN_ENV: str(report), "OMP_WAIT_POLICY": "PASSIVE"}
    start, failed = time.perf_counter(), []
    for step in STEPS:
        command = [sys.executable, str(HERE / step[0]), *step[1:]]
        with report.open("a") as out:
            out.write(f"\n## `{shlex.join(['python', 'bench/' + step[0], *step[1:]])}`\n")
        t0 = time.perf_counter()
        print(f"\n### {shlex.join(step)}", flush=True)
        code = subprocess.run(command, env=env).returncode
        seconds = time.perf_counter() - t0
        print(f"### {step[0]}: {seconds:.0f} s (exit {code})", flush=True)
        with report.open("a") as out:
            out.write(f"\n{step[0]}: {seconds:.0f} s, exit status {code}\n")
        if code:
            failed.append(step[0])
    total = time.perf_counter() - start
    verdict = "within" if total <= args.budget_min * 60 else "OVER"
    line = f"total {total / 60:.1f} min: {verdict} the {args.budget_min:g}-minute budget"
    with report.open("a") as out:
        out.write(f"\n**{line}**" + (f"; failed: {', '.join(failed)}" if failed else "") + "\n")
    print(f"\n{line}\nreport: {report}", flush=True)
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
