"""`pagedserve`: run the whole stack (`serve`) or one service (`gateway|tokenizer|engine|detok`).

Services start as child processes by module name; this module imports none of them (the
wall in DESIGN.md). Each child leads a process group of its own (what it starts is signalled
with it) but stays in this session, and dies with this process (PR_SET_PDEATHSIG), so neither
Ctrl-C, SIGTERM nor a SIGKILL of `pagedserve` leaves orphans. Staying in one session matters
for scheduling: Linux's autogroups give every session an equal share of the CPU and let a
waking task preempt only within its group, so the engine's SCHED_IDLE (``--engine-sched idle``,
the default) yields the CPU at once to the bus services only when they share its session.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from shared.config import add_engine_args, engine_argv
from shared.placement import MODES, bus_cpus, pin
from shared.redis_server import RedisServer, die_with_parent

SERVICES = {"gateway": "gateway", "tokenizer": "tokenizer_svc", "engine": "engine_svc", "detok": "detok_svc"}
STOP_ORDER = ("gateway", "tokenizer", "engine", "detok")  # stop intake first, output last


@dataclass
class Child:
    """One service process of the stack."""

    name: str
    argv: list[str]
    proc: subprocess.Popen | None = None
    nice: int = 0  # added to the niceness before the child starts (every thread it makes inherits it)
    sched_idle: bool = False  # SCHED_IDLE: a task of this session that wakes up takes the CPU from it at once
    cpus: set[int] | None = None  # pinned to these CPUs (shared/placement.py); None: any

    def start(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", *self.argv], env=env, process_group=0,
                                     preexec_fn=self._prepare)

    def _prepare(self) -> None:  # in the child, after setpgid, before exec
        die_with_parent()
        pin(0, self.cpus)
        if self.nice:
            os.nice(self.nice)
        if self.sched_idle:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))

    @property
    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        """Signal the child's whole process group (what it started dies with it)."""
        if self.proc is None or self.proc.returncode is not None:
            return  # reaped: its pid may belong to someone else now
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedserve serve", description="the whole stack on one machine")
    p.add_argument("--model", default=os.environ.get("PAGEDSERVE_MODEL"),
                   help="HF model folder (default: SmolLM2-135M-Instruct, converted once)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    p.add_argument("--prefix", default="ps")
    p.add_argument("--gateways", type=int, default=1,
                   help="gateway processes sharing the port (SO_REUSEPORT), each with its own reply stream")
    p.add_argument("--tokenizers", type=int, default=1)
    p.add_argument("--detokenizers", type=int, default=1)
    p.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"))
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--engine-nice", type=int, default=0, help="run the engine at this niceness")
    p.add_argument("--engine-sched", choices=("normal", "idle"), default="idle",
                   help="idle (default): SCHED_IDLE, so that the bus services, which need ~1%% of the engine's "
                        "CPU, get a core the moment a step's tokens wake them; normal: when other CPU-bound work "
                        "shares this session and must not starve the engine")
    p.add_argument("--bus-cpus", choices=MODES, default="spread",
                   help="spread (default): each gateway and detok shard on a CPU of its own, Redis and the "
                        "tokenizers with the detok shards, the engine on every CPU (shared/placement.py); "
                        "none: the kernel places them")
    p.add_argument("--startup-timeout", type=float, default=1800.0, help="seconds to wait for /health")
    add_engine_args(p)
    return p


def _resolve_model(model: str | None) -> str:
    if model is not None and os.path.isdir(model):
        return os.path.abspath(model)
    from shared.models import resolve_model  # converts the default model once, before any child needs it

    return str(resolve_model(model))


def build_children(args: argparse.Namespace, redis_url: str, model: str) -> list[Child]:
    common = ["--redis-url", redis_url, "--prefix", args.prefix, "--model", model]
    if args.max_model_len is not None:
        common += ["--max-model-len", str(args.max_model_len)]
    shards = ["--num-detok-shards", str(args.detokenizers)]
    gateway = ["--host", args.host, "--port", str(args.port)]
    if args.served_model_name:
        gateway += ["--served-model-name", args.served_model_name]
    if args.gateways > 1:
        gateway.append("--reuse-port")
    cpus = bus_cpus(args.bus_cpus, args.gateways, args.detokenizers)
    children = [Child(f"gateway-{i}" if args.gateways > 1 else "gateway", ["gateway", *common, *shards, *gateway],
                      cpus=cpus.get(f"gateway-{i}")) for i in range(args.gateways)]
    children += [Child(f"tokenizer-{i}", ["tokenizer_svc", *common, "--service-id", f"tokenizer-{i}"],
                       cpus=cpus.get("tokenizer")) for i in range(args.tokenizers)]
    children.append(Child("engine", ["engine_svc", *common, *shards, "--service-id", "engine-0", *engine_argv(args)],
                          nice=args.engine_nice, sched_idle=args.engine_sched == "idle"))
    children += [Child(f"detok-{k}", ["detok_svc", *common, *shards, "--shard", str(k), "--service-id", f"detok-{k}"],
                       cpus=cpus.get(f"detok-{k}")) for k in range(args.detokenizers)]
    return children


class Supervisor:
    """Owns the children of `serve`: starts them, watches them, stops them all (no orphans)."""

    def __init__(self, children: list[Child]):
        self.children = children
        self.stopping = False

    def start(self, env: dict[str, str]) -> None:
        for child in self.children:
            child.start(env)

    def on_signal(self, signum, _frame) -> None:
        self.stopping = True

    def dead_child(self) -> Child | None:
        return next((c for c in self.children if not c.is_alive), None)

    def wait_healthy(self, url: str, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.stopping and time.monotonic() < deadline:
            if self.dead_child() is not None:
                return False
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        return False

    def watch(self) -> Child | None:
        while not self.stopping:
            dead = self.dead_child()
            if dead is not None:
                return dead
            time.sleep(0.25)
        return None

    def stop(self, grace_s: float = 10.0) -> None:
        for kind in STOP_ORDER:
            for child in self.children:
                if child.name.startswith(kind):
                    child.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children:
            if child.proc is None:
                continue
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"pagedserve: {child.name} did not stop; killing it", file=sys.stderr)
            child.signal(signal.SIGKILL)  # also whatever it left in its process group
            child.proc.wait()


def serve(argv: list[str]) -> int:
    args = serve_parser().parse_args(argv)
    model = _resolve_model(args.model)
    redis_server = None
    if args.redis_url is None:
        redis_server = RedisServer(cpus=bus_cpus(args.bus_cpus, args.gateways, args.detokenizers).get("redis")).start()
    redis_url = args.redis_url or redis_server.url
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.api_key:
        env["PAGEDSERVE_API_KEY"] = args.api_key  # through the environment, not visible in `ps`
    supervisor = Supervisor(build_children(args, redis_url, model))
    signal.signal(signal.SIGINT, supervisor.on_signal)
    signal.signal(signal.SIGTERM, supervisor.on_signal)
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    try:
        supervisor.start(env)
        if supervisor.wait_healthy(f"http://{host}:{args.port}/health", args.startup_timeout):
            print(f"pagedserve: serving {model} at http://{host}:{args.port}/v1 (redis {redis_url})", flush=True)
            dead = supervisor.watch()
        else:
            dead = supervisor.dead_child()
            if dead is None and not supervisor.stopping:
                print("pagedserve: /health did not answer 200 in time", file=sys.stderr)
                return 1
        if dead is not None:
            print(f"pagedserve: {dead.name} exited with {dead.proc.returncode}; stopping", file=sys.stderr)
            return 1
        return 0
    finally:
        supervisor.stop()
        if redis_server is not None:
            redis_server.stop()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = ("serve", *SERVICES)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(f"usage: pagedserve {{{'|'.join(commands)}}} [options]   (pagedserve CMD --help for each)",
              file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        return serve(rest)
    os.execv(sys.executable, [sys.executable, "-m", SERVICES[command], *rest])  # one service, this process
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
