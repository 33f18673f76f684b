"""`pagedserve`: run the whole stack (`serve`), one service (`gateway|tokenizer|engine|detok`), or
list a running stack's services (`status`, shared/status.py).

Services start as child processes by module name; this module imports none of them (the
wall in DESIGN.md). Each child leads a process group of its own (what it starts is signalled
with it) but stays in this session, and dies with this process (PR_SET_PDEATHSIG), so neither
Ctrl-C, SIGTERM nor a SIGKILL of `pagedserve` leaves orphans. Staying in one session matters
for scheduling: Linux's autogroups give every session an equal share of the CPU and let a
waking task preempt only within its group, so the engine's SCHED_IDLE (``--engine-sched idle``,
the default) yields the CPU at once to the bus services only when they share its session.
A child's settings are its typed config written back as its command line (``shared.flags``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from shared import flags
from shared.bus_auth import generate_secret, secure_serve, url_with_credentials
from shared.config import ServeConfig
from shared.lifecycle import wait_http
from shared.models import resolve_model
from shared.placement import bus_cpus, pin
from shared.redis_server import RedisAcl, RedisServer, die_with_parent

MODULES = {"gateway": "gateway", "tokenizer": "tokenizer_svc", "engine": "engine_svc", "detok": "detok_svc"}
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
    config: object | None = None  # the typed config its command line carries (shared.flags.to_argv)

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


def _child(name: str, command: str, config, **kw) -> Child:
    """A child that starts as ``python -m <module> <its config as flags>``."""
    return Child(name, [MODULES[command], *flags.to_argv(command, config)], config=config, **kw)


def build_children(config: ServeConfig, redis_url: str, model: str) -> list[Child]:
    """Every child of the stack, its config the serve config's template for its kind plus its identity."""
    common = {"redis_url": redis_url, "model": model, "num_detok_shards": config.num_detokenizers}

    def own(command: str, **identity):
        template = getattr(config, command)
        return flags.with_identity(command, flags.fill(template, {**common, **identity}))

    cpus = bus_cpus(config.bus_cpus, config.num_gateways, config.num_detokenizers)
    gateway = own("gateway", reuse_port=config.num_gateways > 1)
    children = [_child(f"gateway-{i}" if config.num_gateways > 1 else "gateway", "gateway", gateway,
                       cpus=cpus.get(f"gateway-{i}")) for i in range(config.num_gateways)]
    children += [_child(f"tokenizer-{i}", "tokenizer", own("tokenizer", service_id=f"tokenizer-{i}"),
                        cpus=cpus.get("tokenizer")) for i in range(config.num_tokenizers)]
    children.append(_child("engine", "engine", own("engine", service_id="engine-0"),
                           nice=config.engine_nice, sched_idle=config.engine_sched == "idle"))
    children += [_child(f"detok-{k}", "detok", own("detok", shard=k, service_id=f"detok-{k}"),
                        cpus=cpus.get(f"detok-{k}")) for k in range(config.num_detokenizers)]
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
        return wait_http(url, timeout_s, lambda: not self.stopping and self.dead_child() is None)

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
    config = flags.parse_serve(argv)
    model = resolve_model(config.model)  # converts the default model once, before any child needs it
    redis_server = None
    if config.redis_url is None:
        cpus = bus_cpus(config.bus_cpus, config.num_gateways, config.num_detokenizers)
        acl = RedisAcl.generate(config.gateway.bus.prefix, config.gateway.bus.redis_password or generate_secret())
        redis_server = RedisServer(cpus=cpus.get("redis"), acl=acl).start()
    # the bus secret and each role's Redis user (README: Security); the URL on the children's
    # command lines carries no credentials
    config, redis_url = secure_serve(config, config.redis_url or redis_server.address,
                                     redis_server.acl if redis_server else None)
    # secrets through the environment, not visible in `ps`
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **flags.to_env("gateway", config.gateway)}
    supervisor = Supervisor(build_children(config, redis_url, model))
    signal.signal(signal.SIGINT, supervisor.on_signal)
    signal.signal(signal.SIGTERM, supervisor.on_signal)
    host, port = config.gateway.host, config.gateway.port
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    try:
        supervisor.start(env)
        if supervisor.wait_healthy(f"http://{host}:{port}/health", config.startup_timeout_s):
            print(f"pagedserve: serving {model} at http://{host}:{port}/v1 (redis {redis_url})", flush=True)
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
    commands = ("serve", "status", *MODULES)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(f"usage: pagedserve {{{'|'.join(commands)}}} [options]   (pagedserve CMD --help for each)",
              file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        return serve(rest)
    if command == "status":
        from shared.status import main as status

        return status(flags.parse("status", rest))
    os.execv(sys.executable, [sys.executable, "-m", MODULES[command], *rest])  # one service, this process
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
