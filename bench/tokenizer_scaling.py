"""Tokenizer scaling (`make bench-tokenizers`): a tokenization-heavy workload through the whole
stack with 1, 2 and 4 tokenizer replicas, on this host and on a "second host".

    .venv/bin/python bench/tokenizer_scaling.py                         # tiny model, 1/2/4, both placements
    .venv/bin/python bench/tokenizer_scaling.py --model default --replicas 1,2 --hosts local

Workload: chat completions of one user message of real text (--prompt-tokens of the standard
library's docstrings, bench/textdata.py, a different window per request) through the model's chat
template, max_tokens 1, greedy, prefix caching off (`--no-enable-prefix-caching`), --concurrency
requests in flight for --duration seconds after a warm-up, by a closed-loop client in this
process (bench/loadgen.py's streamed request). The default model is `tiny` (random 2-layer Llama
with the default model's tokenizer): its forward costs little, so the engine is not the
bottleneck; `--model default` shows where SmolLM2's prefill caps it instead.

Placements (--hosts):
- local: `pagedserve serve --tokenizers R --bus-cpus none` (the kernel places every process;
  serve's default, spread, pins all tokenizers to one CPU, which on two cores leaves them nothing
  to scale onto);
- netns: the tokenizers on a "second host", a network namespace with its own address, joined to
  this one by a veth pair (bench/netns.py); Redis, started here with its ACL users and bound to
  the host side's address, is the only thing they reach. `pagedserve serve --tokenizers 0
  --redis-url ...` runs the rest; each tokenizer runs as `python -m tokenizer_svc` inside the
  namespace with the tokenizer role's user, its password and the bus secret in its environment
  (README: Security). The namespace is removed afterwards, whatever happens.

Figures per run: completed requests/s; the engine's idle share (its main thread sampled every
--sample-ms: waiting in a socket read or poll for the bus = idle; running, runnable or in a futex =
busy); CPU ms per request of each service (all their threads, from /proc), and the CPU share of
the whole machine they add up to, which says when the two cores, not the tokenizers, are the cap.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (OUT_DIR, REPO_ROOT, machine_lines, print_header, print_table, pyplot,  # noqa: E402
                    resolve_bench_model, stop_group)
from loadgen import _one  # noqa: E402
from netns import NetNamespace  # noqa: E402
from stack import _descendants, process_cpu  # noqa: E402
from vllm_peer import PeerServer, free_port  # noqa: E402

RUN_DIR = OUT_DIR / "tokenizer_scaling"
NAME = "bench"
# x86-64 syscalls the engine's main thread waits for the bus in: read, poll, select, recvfrom, epoll
# and the p-variants. Any other (futex: OpenMP barriers, the GIL) counts as busy.
BUS_WAITS = {0, 7, 23, 45, 232, 270, 271, 281}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="tiny | default | an HF folder")
    p.add_argument("--replicas", default="1,2,4")
    p.add_argument("--hosts", default="local,netns")
    p.add_argument("--modes", default="stage,stack",
                   help="stage: the tokenizers alone on a preloaded backlog (bench/tokenizer_stage.py); stack: the "
                        "whole stack under a closed-loop HTTP client")
    p.add_argument("--stage-requests", type=int, default=4000, help="backlog of the stage mode")
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--duration", type=float, default=15.0, help="seconds measured per run")
    p.add_argument("--warmup", type=int, default=64, help="requests before measuring")
    p.add_argument("--sample-ms", type=float, default=5.0)
    p.add_argument("--bus-cpus", default="none", help="serve's --bus-cpus")
    p.add_argument("--serve-args", default="", help="extra `pagedserve serve` arguments")
    p.add_argument("--tag", default="")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------- the client
def closed_loop(port: int, texts: list[str], concurrency: int, duration_s: float, first: int = 0) -> dict:
    """Send chat requests (max_tokens 1) with `concurrency` in flight for `duration_s` (0: len(texts) requests)."""
    body = {"model": NAME, "max_tokens": 1, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    counter = iter(range(first, 10**9))
    ok, errors = [], []

    async def worker(deadline: float):
        while not duration_s or time.time() < deadline:
            i = next(counter)
            if not duration_s and i - first >= len(texts):
                return
            msg = {**body, "messages": [{"role": "user", "content": texts[i % len(texts)]}]}
            r = await _one("127.0.0.1", port, "/v1/chat/completions", msg)
            (errors if r.error else ok).append(r.error or r.done - r.sent)

    async def run():
        deadline = time.time() + duration_s
        await asyncio.gather(*(worker(deadline) for _ in range(concurrency)))

    t0 = time.time()
    asyncio.run(run())
    return {"seconds": time.time() - t0, "completed": len(ok), "errors": errors[:5], "num_errors": len(errors),
            "latency_s": sorted(ok), "next": next(counter)}


class IdleSampler:
    """Samples what the engine's main thread is doing (/proc/PID/syscall) every `every_s`, in a thread."""

    def __init__(self, pid: int, every_s: float):
        self.path, self.every_s = Path(f"/proc/{pid}/syscall"), every_s
        self.idle = self.total = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                first = self.path.read_text().split(" ", 1)[0]
            except OSError:
                continue
            self.total += 1
            self.idle += first.strip().isdigit() and int(first) in BUS_WAITS

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @property
    def share(self) -> float:
        return self.idle / self.total if self.total else float("nan")


# ---------------------------------------------------------------------------- one run
def serve_argv(model: Path, port: int, replicas: int, args, redis_url: str | None = None) -> list[str]:
    return [str(Path(sys.executable).with_name("pagedserve")), "serve", "--model", str(model), "--served-model-name",
            NAME, "--host", "127.0.0.1", "--port", str(port), "--tokenizers", str(replicas),
            "--no-enable-prefix-caching", "--bus-cpus", args.bus_cpus, "--startup-timeout", "300",
            *(["--redis-url", redis_url] if redis_url else []), *shlex.split(args.serve_args)]


def engine_pid(root: int) -> int:
    for pid in _descendants(root):
        try:
            if b"engine_svc" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    raise RuntimeError("no engine_svc process under pagedserve serve")


def measure(server: PeerServer, port: int, texts: list[str], extra_pids: list[int], args) -> dict:
    """Warm up, then the measured closed loop with the engine sampled and every process's CPU counted."""
    warm = closed_loop(port, texts[:args.warmup], min(args.concurrency, args.warmup), 0)
    if warm["num_errors"]:
        raise RuntimeError(f"warm-up failed: {warm['errors']}")
    roots = [server.proc.pid, *extra_pids]
    cpu0, self0 = process_cpu(roots), os.times()
    with IdleSampler(engine_pid(server.proc.pid), args.sample_ms / 1e3) as sampler:
        run = closed_loop(port, texts, args.concurrency, args.duration, first=args.warmup)
    cpu1, self1 = process_cpu(roots), os.times()
    cpu = {k: cpu1.get(k, 0.0) - cpu0.get(k, 0.0) for k in cpu1}
    cpu["client (bench process)"] = (self1.user + self1.system) - (self0.user + self0.system)
    n = max(run["completed"], 1)
    return {"requests_per_s": run["completed"] / run["seconds"], "completed": run["completed"],
            "num_errors": run["num_errors"], "errors": run["errors"], "seconds": run["seconds"],
            "engine_idle_share": sampler.share, "engine_samples": sampler.total,
            "p50_latency_ms": run["latency_s"][len(run["latency_s"]) // 2] * 1e3 if run["latency_s"] else None,
            "cpu_ms_per_request": {k: v * 1e3 / n for k, v in sorted(cpu.items()) if v > 0},
            "machine_cpu_share": sum(cpu.values()) / run["seconds"] / len(os.sched_getaffinity(0))}


def run_local(model: Path, replicas: int, texts: list[str], args) -> dict:
    port = free_port()
    server = PeerServer(f"serve-t{replicas}", serve_argv(model, port, replicas, args), f"http://127.0.0.1:{port}/health",
                        RUN_DIR / f"local-t{replicas}{args.tag}.log", {"HF_HUB_OFFLINE": "1"})
    with server:
        server.start(300)
        return {"command": server.command, **measure(server, port, texts, [], args)}


def run_netns(model: Path, replicas: int, texts: list[str], ns: NetNamespace, args) -> dict:
    from shared.bus_auth import generate_secret
    from shared.redis_server import RedisAcl, RedisServer

    acl = RedisAcl.generate("ps")
    secret = generate_secret()
    port = free_port()
    with RedisServer(host=ns.host_address, acl=acl) as redis:
        bare = f"redis://{ns.host_address}:{redis.port}/0"
        # the stack's own services log in as the admin here (serve gives one user to all of them when
        # it does not start Redis itself); the remote tokenizers as the tokenizer role
        env = {"HF_HUB_OFFLINE": "1", "PAGEDSERVE_REDIS_USERNAME": "default",
               "PAGEDSERVE_REDIS_PASSWORD": acl.admin_password, "PAGEDSERVE_BUS_SECRET": secret}
        server = PeerServer(f"serve-netns-t{replicas}", serve_argv(model, port, 0, args, bare),
                            f"http://127.0.0.1:{port}/health", RUN_DIR / f"netns-t{replicas}{args.tag}.log", env)
        tok_env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "PAGEDSERVE_REDIS_USERNAME": "tokenizer",
                   "PAGEDSERVE_REDIS_PASSWORD": acl.role_passwords["tokenizer"], "PAGEDSERVE_BUS_SECRET": secret}
        tokenizers = []
        try:
            for i in range(replicas):
                argv = ns.exec_argv([sys.executable, "-m", "tokenizer_svc", "--redis-url", bare, "--model", str(model),
                                     "--service-id", f"tokenizer-ns-{i}"])
                log = open(RUN_DIR / f"netns-t{replicas}-tokenizer-{i}{args.tag}.log", "wb")
                tokenizers.append(subprocess.Popen(argv, cwd=REPO_ROOT, env=tok_env, stdout=log, stderr=subprocess.STDOUT,
                                                   process_group=0))
            with server:
                server.start(300)
                figures = measure(server, port, texts, [redis.process.pid, *(t.pid for t in tokenizers)], args)
        finally:
            for proc in tokenizers:
                stop_group(proc)
    return {"command": server.command, "tokenizer_command": shlex.join(argv), **figures}


# ---------------------------------------------------------------------------- report
def report(meta: dict, results: dict, plot: bool) -> None:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    rows, nproc = [], len(os.sched_getaffinity(0))
    for host, by_replicas in results.items():
        base = by_replicas.get("1", {}).get("requests_per_s")
        for r, f in by_replicas.items():
            if "error" in f:
                rows.append([host, r, "error", f["error"][-120:], "", "", "", ""])
                continue
            cpu = f["cpu_ms_per_request"]
            tok = sum(v for k, v in cpu.items() if "tokenizer" in k)
            rows.append([host, r, f"{f['requests_per_s']:.1f}", f"{f['requests_per_s'] / base:.2f}x" if base else "n/a",
                         f"{f['engine_idle_share']:.0%}" if "engine_idle_share" in f else "no engine",
                         f"{f.get('machine_cpu_share', sum(cpu.values()) * f['requests_per_s'] / 1e3 / nproc):.0%}",
                         f"{tok:.2f}",
                         f"{sum(cpu.values()):.2f}"])
    header = ["host", "tokenizers", "req/s", "vs 1", "engine idle", "CPU used (2 cores)", "tokenizer CPU ms/req",
              "all CPU ms/req"]
    lines = ["# Tokenizer scaling", ""] + [f"- {x}" for x in machine_lines()] + [f"- {meta['workload']}", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    lines += ["", "CPU ms per request by process:", ""]
    for host, by_replicas in results.items():
        for r, f in by_replicas.items():
            if "cpu_ms_per_request" in f:
                lines.append(f"- {host}, {r} tokenizer(s): " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                                          f["cpu_ms_per_request"].items()))
    (OUT_DIR / f"tokenizer_scaling{meta['tag']}.md").write_text("\n".join(lines) + "\n")
    (OUT_DIR / f"tokenizer_scaling{meta['tag']}.json").write_text(json.dumps({"meta": meta, "results": results},
                                                                              indent=1) + "\n")
    if plot:
        print_table("tokenizer scaling", header, rows)
        _plot(meta, results)


def _plot(meta: dict, results: dict) -> None:
    plt = pyplot()
    fig, (ax_rps, ax_idle) = plt.subplots(1, 2, figsize=(10, 3.8))
    for host, by_replicas in results.items():
        ok = {int(r): f for r, f in by_replicas.items() if "requests_per_s" in f}
        xs = sorted(ok)
        ax_rps.plot(xs, [ok[x]["requests_per_s"] for x in xs], marker="o", label=host)
        if all("engine_idle_share" in ok[x] for x in xs):
            ax_idle.plot(xs, [100 * ok[x]["engine_idle_share"] for x in xs], marker="o", label=host)
    for ax, title in ((ax_rps, "requests/s"), (ax_idle, "engine idle, % of time")):
        ax.set_xlabel("tokenizer replicas")
        ax.set_xticks([int(r) for r in meta["replicas"]])
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    ax_rps.legend(fontsize=8)
    fig.suptitle(meta["workload"][:150], fontsize=8)
    path = REPO_ROOT / "docs" / "bench" / f"tokenizer-scaling{meta['tag']}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


def run_one(mode: str, host: str, model: Path, replicas: int, texts: list[str], args) -> dict:
    from tokenizer_stage import run_stage

    if host == "local":
        if mode == "stage":
            return run_stage(model, replicas, texts[:args.stage_requests], None, RUN_DIR)
        return run_local(model, replicas, texts, args)
    with NetNamespace("psbench-tok") as ns:  # removed on the way out, whatever happens
        if mode == "stage":
            return run_stage(model, replicas, texts[:args.stage_requests], ns, RUN_DIR)
        return run_netns(model, replicas, texts, ns, args)


def main(argv=None) -> None:
    args = parse_args(argv)
    print_header("tokenizer scaling: tokenization-heavy chat requests, 1 output token")
    from transformers import AutoTokenizer

    from textdata import corpus_ids, text_windows

    model = resolve_bench_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    num_texts = max(args.warmup + 4000, args.stage_requests)
    texts = text_windows(tokenizer, corpus_ids(tokenizer), num_texts, args.prompt_tokens, seed=0)
    replicas = [int(r) for r in args.replicas.split(",") if r]
    hosts = [h for h in args.hosts.split(",") if h]
    meta = {"command": shlex.join([Path(sys.executable).name, *sys.argv]), "replicas": replicas, "tag": args.tag,
            "workload": f"model {args.model}; chat, one user message of {args.prompt_tokens} tokens of real text, "
                        f"max_tokens 1, prefix caching off, {args.concurrency} in flight for {args.duration:g} s; "
                        f"serve --bus-cpus {args.bus_cpus}"}
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    for mode, host in ((m, h) for m in args.modes.split(",") if m for h in hosts):
        for r in replicas:
            t0 = time.perf_counter()
            label = f"{mode}, {host}"
            print(f"[{label}] {r} tokenizer(s) ...", file=sys.stderr, flush=True)
            try:
                figures = run_one(mode, host, model, r, texts, args)
            except RuntimeError as exc:
                figures = {"error": str(exc)[-2000:]}
            results.setdefault(label, {})[str(r)] = figures
            print(f"[{label}] {r} tokenizer(s): {json.dumps({k: v for k, v in figures.items() if 'command' not in k})[:400]}"
                  f" ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
            report(meta, results, plot=False)
    report(meta, results, plot=True)


if __name__ == "__main__":
    main()
