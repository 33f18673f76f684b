"""Soak: the stack under steady load for minutes while its parts fail, as an operator would see it.

    python bench/soak.py                      # 10 minutes, default model (issue 14's soak)
    python bench/soak.py --duration 120       # a shorter run (the faults keep their share of the time)

One redis-server (on a port of its own, so that it can be frozen and restarted), a gateway, two
tokenizers, two engines and a detokenizer, each its own process. First a closed-loop probe
measures the stack's capacity (requests/s of the soak's request shape); then an open loop sends
Poisson arrivals at ``--load`` (70%) of it for ``--duration`` seconds: streaming chat and text
completions, 10% of them abandoned by their client after the first chunk, 1% malformed. On a
timeline fixed as fractions of the run: one tokenizer is SIGKILLed (10%), one engine is
SIGKILLed mid-generation (30%: its requests fail over to the other) and started again (40%),
Redis is frozen with SIGSTOP for 15 s (50%) and killed and restarted empty on the same port (70%).

Every request ends in exactly one outcome (completed, abandoned by design, 400 for the malformed
ones, an HTTP error, an error event mid-stream, a client timeout, a transport error). At the end
it prints the outcomes, each service's RSS at start and end, the pending entries of every group
(expected 0) and every live engine's free KV blocks (expected all), and plots the outcomes over
time with the faults marked (docs/bench/soak.png). The RSS at the end of a restarted engine is its successor's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_lines, print_header, print_table, pyplot, resolve_bench_model  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PLOT_PATH = REPO / "docs" / "bench" / "soak.png"
sys.path.insert(0, str(REPO))
from shared.heartbeat import read_heartbeats  # noqa: E402
from shared.protocol import StreamNames  # noqa: E402
from shared.redis_server import RedisServer, free_port  # noqa: E402

PREFIX = "soak"
PROMPTS = ["Write a short poem about the sea.", "List three uses of copper.", "What is a hash table?",
           "Explain photosynthesis to a child.", "Give me a recipe for pancakes.", "Why is the sky blue?",
           "Name five rivers in Europe.", "What does a compiler do?", "Describe a cat in two sentences.",
           "How do vaccines work?"]
MALFORMED = [b'{"model": "soak", "messages": [', b'{"model": "soak", "messages": [{"role": "user", "content": "hi"}], '
             b'"max_tokens": -5}', b'{"model": "soak", "prompt": "x", "temperature": "hot"}',
             b'{"model": "soak", "messages": "not a list"}']  # the served model: each is refused for its own fault


# ---------------------------------------------------------------------------- processes
@dataclass
class Proc:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str]
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", *self.argv], cwd=REPO, env=self.env, stdout=log,
                                     stderr=subprocess.STDOUT, process_group=0)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            if sig == signal.SIGKILL:
                self.proc.wait()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.kill()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rss_mb(self) -> float:
        if not self.alive:
            return float("nan")
        total = 0
        for pid in [self.proc.pid, *_children(self.proc.pid)]:
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
            except OSError:
                pass
        return total / 1024


def _children(pid: int) -> list[int]:
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    out = [int(k) for k in kids]
    for k in list(out):
        out += _children(k)
    return out


class SoakStack:
    """The processes of the soak and the Redis they share (restartable on one port)."""

    def __init__(self, model: Path, log_dir: Path, dtype: str):
        self.model, self.log_dir, self.dtype = model, log_dir, dtype
        log_dir.mkdir(parents=True, exist_ok=True)
        self.redis_port = free_port()
        self.redis = RedisServer(port=self.redis_port)
        self.port = free_port()
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
                    "OMP_NUM_THREADS": "1"}
        self.env.pop("PAGEDSERVE_API_KEY", None)
        self.procs: dict[str, Proc] = {}

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _add(self, name: str, module: str, *extra: str) -> Proc:
        common = ["--redis-url", self.redis_url, "--prefix", PREFIX, "--model", str(self.model)]
        proc = Proc(name, [module, *common, *extra], self.log_dir / f"{name}.log", self.env)
        self.procs[name] = proc
        return proc

    def start(self) -> None:
        self.redis.start()
        for i in range(2):
            self._add(f"engine-{i}", "engine_svc", "--service-id", f"engine-{i}", "--dtype", self.dtype,
                      "--kv-cache-memory", "512M")
            self._add(f"tokenizer-{i}", "tokenizer_svc", "--service-id", f"tokenizer-{i}")
        self._add("detok-0", "detok_svc", "--shard", "0", "--service-id", "detok-0")
        self._add("gateway", "gateway", "--port", str(self.port), "--gateway-id", "g0", "--served-model-name",
                  "soak", "--log-level", "warning", "--request-timeout", "60")
        for proc in self.procs.values():
            proc.start()
        self.wait_ready(600)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = [p.name for p in self.procs.values() if not p.alive]
            if dead:
                raise RuntimeError(f"{dead} exited during start-up; logs in {self.log_dir}")
            beats = self.heartbeats()
            if {"engine-0", "engine-1", "tokenizer-0", "tokenizer-1", "detok-0"} <= set(beats):
                try:
                    if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.5)
        raise TimeoutError(f"the soak stack was not ready in {timeout_s}s; logs in {self.log_dir}")

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url, socket_timeout=2, socket_connect_timeout=2)

    def heartbeats(self) -> dict:
        try:
            with self.client() as c:
                return read_heartbeats(c, StreamNames(PREFIX).heartbeat, max_age_s=10)
        except redis.RedisError:
            return {}

    def restart_redis_empty(self) -> None:
        self.redis.stop()
        self.redis = RedisServer(port=self.redis_port)
        self.redis.start()

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.stop()
        self.redis.stop()

    # ------------------------------------------------------------------ the end state
    def pending(self) -> dict[str, int]:
        out = {}
        with self.client() as c:
            for key in c.scan_iter(match=f"{PREFIX}:*", _type="stream"):
                try:
                    for info in c.xinfo_groups(key):
                        out[f"{key.decode()}/{info['name'].decode()}"] = int(info["pending"])
                except redis.ResponseError:
                    pass
        return out


# ---------------------------------------------------------------------------- the client
@dataclass
class Outcome:
    start: float
    kind: str  # chat | completion | malformed
    outcome: str = ""
    ttft: float | None = None
    detail: str = ""


def _body(kind: str, rng: random.Random) -> dict:
    prompt = rng.choice(PROMPTS)
    common = {"model": "soak", "max_tokens": rng.randint(16, 48), "stream": True, "temperature": 0.0}
    if kind == "chat":
        return {**common, "messages": [{"role": "user", "content": prompt}]}
    return {**common, "prompt": prompt}


async def one_request(client: httpx.AsyncClient, rec: Outcome, rng: random.Random, abandon: bool,
                      timeout_s: float) -> None:
    path = "/v1/chat/completions" if rec.kind != "completion" else "/v1/completions"
    try:
        async with asyncio.timeout(timeout_s):
            if rec.kind == "malformed":
                resp = await client.post(path, content=rng.choice(MALFORMED),
                                         headers={"content-type": "application/json"})
                rec.outcome = "400 (malformed, expected)" if resp.status_code == 400 else f"http {resp.status_code}"
                return
            async with client.stream("POST", path, json=_body(rec.kind, rng)) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    rec.outcome, rec.detail = f"http {resp.status_code}", resp.text[:200]
                    return
                finished = False
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        rec.outcome, rec.detail = "error event", str(chunk["error"].get("message"))[:200]
                        return
                    if rec.ttft is None:
                        rec.ttft = time.monotonic() - rec.start
                        if abandon:
                            rec.outcome = "abandoned by client"
                            return  # leaving the block closes the connection mid-stream
                    finished |= any(c.get("finish_reason") for c in chunk.get("choices", ()))
                rec.outcome = "completed" if finished else "stream ended without finish"
    except TimeoutError:
        rec.outcome = "client timeout"
    except httpx.HTTPError as exc:
        rec.outcome, rec.detail = "transport error", f"{type(exc).__name__}: {exc}"[:200]


async def closed_loop(base_url: str, seconds: float, concurrency: int, seed: int) -> float:
    """Requests/s of the soak's request shape at a concurrency that saturates the engines."""
    rng = random.Random(seed)
    done = 0
    end = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        async def worker():
            nonlocal done
            while time.monotonic() < end:
                rec = Outcome(time.monotonic(), rng.choice(["chat", "completion"]))
                await one_request(client, rec, rng, abandon=False, timeout_s=120)
                done += rec.outcome == "completed"

        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.monotonic() - t0)


async def open_loop(stack: SoakStack, rate: float, seconds: float, seed: int, faults) -> list[Outcome]:
    rng = random.Random(seed)
    records: list[Outcome] = []
    tasks = []
    t0 = time.monotonic()
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=httpx.Timeout(90, connect=10),
                                 limits=limits) as client:
        fault_task = asyncio.ensure_future(faults(t0))
        next_report = t0 + 15
        while (now := time.monotonic()) - t0 < seconds:
            roll = rng.random()
            kind = "malformed" if roll < 0.01 else rng.choice(["chat", "completion"])
            rec = Outcome(now, kind)
            records.append(rec)
            tasks.append(asyncio.ensure_future(one_request(client, rec, rng, abandon=rng.random() < 0.10,
                                                           timeout_s=120)))
            if now >= next_report:
                counts = Counter(r.outcome or "in flight" for r in records)
                print(f"  [soak] {now - t0:6.0f}s/{seconds:.0f}s sent {len(records)}: "
                      + ", ".join(f"{k} {v}" for k, v in counts.most_common()), file=sys.stderr, flush=True)
                next_report = now + 15
            await asyncio.sleep(rng.expovariate(rate))
        print("  [soak] load stopped; waiting for the last requests", file=sys.stderr, flush=True)
        await asyncio.gather(*tasks)
        await fault_task
    return records


def make_faults(stack: SoakStack, duration: float, marks: list[tuple[float, str]]):
    plan = [(0.10, "tokenizer-1 SIGKILL"), (0.30, "engine-0 SIGKILL"), (0.40, "engine-0 restarted"),
            (0.50, "Redis SIGSTOP 15 s"), (0.70, "Redis killed, restarted empty")]

    async def run(t0: float) -> None:
        for fraction, what in plan:
            await asyncio.sleep(max(0.0, t0 + fraction * duration - time.monotonic()))
            marks.append((time.monotonic() - t0, what))
            print(f"  [soak] fault at {time.monotonic() - t0:.0f}s: {what}", file=sys.stderr, flush=True)
            if what.startswith("tokenizer-1"):
                stack.procs["tokenizer-1"].kill()
            elif what == "engine-0 SIGKILL":
                stack.procs["engine-0"].kill()
            elif what == "engine-0 restarted":
                stack.procs["engine-0"].start()
            elif what.startswith("Redis SIGSTOP"):
                stack.redis.process.send_signal(signal.SIGSTOP)
                await asyncio.sleep(15)
                stack.redis.process.send_signal(signal.SIGCONT)
            else:  # in this thread: redis-server dies with the thread that started it (PR_SET_PDEATHSIG)
                stack.restart_redis_empty()

    return run


# ---------------------------------------------------------------------------- report
def plot(records: list[Outcome], marks, duration: float):
    plt = pyplot()
    t0 = min(r.start for r in records)
    bucket = max(5.0, duration / 60)
    kinds = sorted({r.outcome for r in records})
    series = defaultdict(lambda: defaultdict(int))
    for r in records:
        series[r.outcome][int((r.start - t0) // bucket)] += 1
    n = int(duration // bucket) + 1
    xs = [i * bucket for i in range(n)]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    ax.stackplot(xs, *[[series[k][i] / bucket for i in range(n)] for k in kinds], labels=kinds, step="post")
    ax.set_ylabel("requests/s by outcome (by send time)")
    ax.legend(loc="upper left", fontsize=8)
    ttft = [(r.start - t0, r.ttft) for r in records if r.ttft is not None]
    ax2.scatter([t for t, _ in ttft], [v for _, v in ttft], s=3)
    ax2.set_yscale("log")
    ax2.set_ylabel("TTFT (s)")
    ax2.set_xlabel("seconds into the soak")
    for at, what in marks:
        for a in (ax, ax2):
            a.axvline(at, color="red", linestyle="--", linewidth=0.8)
        ax.annotate(what, (at, ax.get_ylim()[1] * 0.95), rotation=90, fontsize=7, va="top", color="red")
    fig.suptitle("pagedserve soak: outcomes and TTFT under faults")
    fig.tight_layout()
    PLOT_PATH.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT_PATH, dpi=110)
    print(f"plot: {PLOT_PATH}")
    return PLOT_PATH


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    parser.add_argument("--load", type=float, default=0.7, help="fraction of the measured capacity (default 0.7)")
    parser.add_argument("--probe-s", type=float, default=40.0, help="seconds of the capacity probe")
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", type=Path, default=REPO / "bench" / "logs" / "soak")
    args = parser.parse_args()

    print_header("soak: steady load with faults")
    for line in machine_lines():
        print(line)
    model = resolve_bench_model(args.model)
    stack = SoakStack(model, args.log_dir, args.dtype)
    print(f"starting the stack (logs in {args.log_dir}) ...", file=sys.stderr, flush=True)
    stack.start()
    try:
        rss_start = {name: p.rss_mb() for name, p in stack.procs.items()}
        print(f"probing capacity for {args.probe_s:.0f}s (closed loop, 16 streams) ...", file=sys.stderr, flush=True)
        capacity = asyncio.run(closed_loop(stack.base_url, args.probe_s, 16, args.seed))
        rate = capacity * args.load
        print(f"capacity {capacity:.2f} requests/s; soak at {rate:.2f} requests/s for {args.duration:.0f}s",
              flush=True)
        marks: list[tuple[float, str]] = []
        records = asyncio.run(open_loop(stack, rate, args.duration, args.seed + 1,
                                        make_faults(stack, args.duration, marks)))
        settle_deadline = time.monotonic() + 60
        while True:  # the end state: heartbeats show it within a second or two once all is done
            beats = stack.heartbeats()
            engines = {k: b.stats for k, b in beats.items() if b.service == "engine"}
            pending = stack.pending()
            busy = [k for k, s in engines.items() if s.get("num_free_blocks") != s.get("num_total_blocks")
                    or s.get("num_running") or s.get("num_waiting")]
            held = {k: b.stats.get("num_requests", 0) + b.stats.get("num_inboxes", 0) for k, b in beats.items()
                    if b.service in ("detok", "gateway")}
            if (not busy and not any(pending.values()) and not any(held.values())) or time.monotonic() > settle_deadline:
                break
            time.sleep(1)
        rss_end = {name: p.rss_mb() for name, p in stack.procs.items()}
    finally:
        stack.stop()

    counts = Counter(r.outcome for r in records)
    by_kind = Counter((r.kind, r.outcome) for r in records)
    print_table(f"outcomes of {len(records)} requests (each exactly one)", ["outcome", "requests", "share"],
                [[k, v, f"{v / len(records):.1%}"] for k, v in counts.most_common()])
    print_table("outcomes by kind", ["kind", "outcome", "requests"],
                [[k, o, v] for (k, o), v in sorted(by_kind.items())])
    examples = {}
    for r in records:
        if r.detail and r.outcome not in examples:
            examples[r.outcome] = r.detail
    for outcome, detail in examples.items():
        print(f"  e.g. {outcome}: {detail}")
    print_table("faults", ["at (s)", "fault"], [[f"{t:.0f}", w] for t, w in marks])
    print_table("RSS per service (MB)", ["service", "start", "end"],
                [[k, rss_start.get(k, float("nan")), rss_end.get(k, float("nan"))] for k in stack.procs])
    print_table("end state", ["check", "value", "expected"],
                [["pending entries (all groups)", sum(pending.values()), 0],
                 *[[f"{k} free KV blocks", f"{s.get('num_free_blocks', 0):g}/{s.get('num_total_blocks', 0):g}",
                    "all"] for k, s in sorted(engines.items())],
                 *[[f"{k} requests held", f"{v:g}", 0] for k, v in sorted(held.items())]])
    plot(records, marks, args.duration)
    unexpected = {k: v for k, v in counts.items()
                  if k in ("client timeout", "transport error", "stream ended without finish", "")}
    malformed_ok = all(r.outcome == "400 (malformed, expected)" for r in records if r.kind == "malformed")
    ok = (not unexpected and malformed_ok and not any(pending.values()) and not busy and not any(held.values()))
    print(f"\nverdict: {'PASS' if ok else 'FAIL'} (unexpected outcomes {unexpected or 'none'}; malformed all 400: "
          f"{malformed_ok}; idle at the end: {not busy and not any(pending.values()) and not any(held.values())})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
