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

`serve` supervises (``Supervisor``): a child that dies is restarted after a backoff
(``shared.lifecycle.RestartTracker``); the stack stops only on SIGINT/SIGTERM, or when a child
dies ``--max-start-failures`` times in a row before it is healthy (its own heartbeat, once the
stack answered /health), with a message naming it, its exit status and its last stderr lines.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from shared import flags
from shared.bus_auth import generate_secret, secure_serve, url_with_credentials
from shared.config import RestartConfig, ServeConfig
from shared.heartbeat import read_heartbeats
from shared.lifecycle import RestartTracker, wait_http
from shared.models import resolve_model
from shared.placement import bus_cpus, engine_cpus, pin
from shared.protocol import GROUP_DECODE, GROUP_ENGINE, StreamNames
from shared.redis_server import RedisAcl, RedisServer, die_with_parent

MODULES = {"gateway": "gateway", "tokenizer": "tokenizer_svc", "engine": "engine_svc", "detok": "detok_svc"}
STOP_ORDER = ("gateway", "tokenizer", "engine", "detok")  # stop intake first, output last
STDERR_TAIL_LINES = 20  # of a child's stderr, kept for the message when it cannot start


@dataclass
class Child:
    """One service process of the stack, restarted by the Supervisor: each start is an incarnation.
    Its stderr passes through this process, which keeps the last lines for a post-mortem."""

    name: str
    command: str  # gateway | tokenizer | engine | detok
    config: object  # the typed config its command line carries (shared.flags.to_argv)
    proc: subprocess.Popen | None = None
    nice: int = 0  # added to the niceness before the child starts (every thread it makes inherits it)
    sched_idle: bool = False  # SCHED_IDLE: a task of this session that wakes up takes the CPU from it at once
    cpus: set[int] | None = None  # pinned to these CPUs (shared/placement.py); None: any
    # a new service id per incarnation: an engine's requests are tied to its id (Admission.engine_id),
    # and a restarted engine under the old id would hide the death from the detokenizers
    fresh_identity: bool = False
    first_id: str = ""
    num_starts: int = 0
    stderr_tail: deque = field(default_factory=lambda: deque(maxlen=STDERR_TAIL_LINES))
    _pump: threading.Thread | None = None

    def renew_identity(self) -> tuple[str, str]:
        """Before a restart: the next service id (``engine-0-r1``, ...); returns (old id, new id)."""
        old = self.config.service_id
        self.first_id = self.first_id or old
        self.config = flags.fill(self.config, {"service_id": f"{self.first_id}-r{self.num_starts}"})
        return old, self.config.service_id

    @property
    def argv(self) -> list[str]:
        return [MODULES[self.command], *flags.to_argv(self.command, self.config)]

    def start(self, env: dict[str, str]) -> None:
        self.num_starts += 1
        self.stderr_tail = deque(maxlen=STDERR_TAIL_LINES)
        self.proc = subprocess.Popen([sys.executable, "-m", *self.argv], env=env, process_group=0,
                                     stderr=subprocess.PIPE, preexec_fn=self._prepare)
        self._pump = threading.Thread(target=_pump, args=(self.proc.stderr, self.stderr_tail), daemon=True,
                                      name=f"stderr-{self.name}")
        self._pump.start()

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

    def reap(self) -> int | None:
        """The exit status when the child has just died (None while it runs, or when already
        reaped). What it started is killed first: its zombie still holds the process group's id."""
        if self.proc is None or self.proc.returncode is not None:
            return None
        try:
            if os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                return None
        except ChildProcessError:
            pass
        self.signal(signal.SIGKILL)
        code = self.proc.wait()
        if self._pump is not None:
            self._pump.join(timeout=2)  # the last lines it wrote, before anyone reads the tail
        return code

    def signal(self, sig: int) -> None:
        """Signal the child's whole process group (what it started dies with it)."""
        if self.proc is None or self.proc.returncode is not None:
            return  # reaped: its pid may belong to someone else now
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def tail(self) -> str:
        return b"".join(self.stderr_tail).decode(errors="replace").rstrip()


def _pump(stream, tail: deque) -> None:
    """Copy a child's stderr to ours line by line, keeping the last lines in ``tail``."""
    out = sys.stderr.buffer
    for line in iter(stream.readline, b""):
        tail.append(line)
        try:
            out.write(line)
            out.flush()
        except (OSError, ValueError):
            pass
    stream.close()


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _child(name: str, command: str, config, **kw) -> Child:
    """A child that starts as ``python -m <module> <its config as flags>``."""
    return Child(name, command, config, **kw)


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
    children += _engines(config, own)
    children += [_child(f"detok-{k}", "detok", own("detok", shard=k, service_id=f"detok-{k}"),
                        cpus=cpus.get(f"detok-{k}")) for k in range(config.num_detokenizers)]
    return children


def _engines(config: ServeConfig, own) -> list[Child]:
    """One engine on every CPU; with --pd, prefill engines then decode engines, each on CPUs of its own."""
    idle = config.engine_sched == "idle"
    if not config.pd:
        return [_child("engine", "engine", own("engine", service_id="engine-0"), fresh_identity=True,
                       nice=config.engine_nice, sched_idle=idle)]
    if config.num_prefill_engines < 1 or config.num_decode_engines < 1:
        raise SystemExit("--pd needs at least one prefill and one decode engine")
    roles = ["prefill"] * config.num_prefill_engines + ["decode"] * config.num_decode_engines
    cpus = engine_cpus(len(roles))
    names = [f"engine-{role[0]}{i}" for role in ("prefill", "decode")
             for i in range(roles.count(role))]  # engine-p0, ..., engine-d0, ...
    return [_child(name, "engine", own("engine", service_id=name, role=role), fresh_identity=True,
                   nice=config.engine_nice, sched_idle=idle, cpus=cpus[k])
            for k, (name, role) in enumerate(zip(names, roles))]


class BusView:
    """What the supervisor reads and repairs on the bus, for children it knows to be dead: which
    of this host's pids beat (a child is healthy once its own beat is there), the beats of dead
    incarnations (removed once a successor beats: `pagedserve status` and the detokenizers then
    see them gone), and the entries a dead engine had read but not acknowledged (handed to its
    successor at once, instead of waiting for a consumer group's idle claim). Redis trouble
    changes nothing: a child is then not yet marked healthy, entries wait for the idle claim."""

    def __init__(self, redis_url: str, names: StreamNames):
        self.client = redis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
        self.names = names
        self.host = socket.gethostname()

    def pids(self) -> dict[int, str]:
        """pid -> service id of every heartbeat written from this host."""
        try:
            beats = read_heartbeats(self.client, self.names.heartbeat)
        except redis.RedisError:
            return {}
        return {b.pid: service_id for service_id, b in beats.items() if b.host == self.host}

    def remove_beats(self, service_ids: list[str]) -> None:
        try:
            self.client.hdel(self.names.heartbeat, *service_ids)
        except redis.RedisError:
            pass

    def hand_over(self, dead: str, successor: str) -> int:
        """Move the dead engine consumer's pending entries to its successor (which reads its own
        pending entries first) and forget the dead consumer; how many moved. A decode engine's
        are in ps:decode:in (P/D)."""
        moved = 0
        for stream, group in ((self.names.engine_in, GROUP_ENGINE), (self.names.decode_in, GROUP_DECODE)):
            try:
                pending = self.client.xpending_range(stream, group, "-", "+", 100_000, consumername=dead)
                ids = [p["message_id"] for p in pending]
                if ids:
                    self.client.xclaim(stream, group, successor, 0, ids, justid=True)
                    moved += len(ids)
                self.client.xgroup_delconsumer(stream, group, dead)
            except redis.RedisError:
                pass  # no such group (yet): nothing of the dead engine's there
        return moved

    def close(self) -> None:
        self.client.close()


class Supervisor:
    """Owns the children of `serve`: starts them, restarts the ones that die (RestartTracker's
    backoff), and stops them all when asked or when one keeps failing at start-up (no orphans)."""

    def __init__(self, children: list[Child], restart: RestartConfig, bus: BusView | None = None):
        self.children = children
        self.trackers = {c.name: RestartTracker(restart) for c in children}
        self.bus = bus
        self.restart_at: dict[str, float] = {}  # dead child -> when it starts again
        self.dead_pids: dict[int, str] = {}  # pid of a dead incarnation -> its child's name
        self.is_ready = False  # the stack has answered /health once
        self.stopping = False
        self.env: dict[str, str] = {}

    def start(self, env: dict[str, str]) -> None:
        self.env = env
        for child in self.children:
            self._start(child)

    def _start(self, child: Child) -> None:
        if child.fresh_identity and child.num_starts:
            dead, successor = child.renew_identity()
            moved = self.bus.hand_over(dead, successor) if self.bus is not None else 0
            if moved:
                print(f"pagedserve: {moved} requests {dead} had read but not admitted go to {successor}",
                      file=sys.stderr)
        child.start(self.env)
        self.trackers[child.name].started(time.monotonic())

    def on_signal(self, signum, _frame) -> None:
        self.stopping = True

    def run(self, health_url: str, startup_timeout_s: float, on_ready: Callable[[], None]) -> int:
        """Watch the children until told to stop (0) or one keeps failing at start-up, or the stack
        is not healthy within ``startup_timeout_s`` (1)."""
        deadline = time.monotonic() + startup_timeout_s
        next_beat_check = 0.0
        while not self.stopping:
            now = time.monotonic()
            for child in self.children:
                code = child.reap()
                if code is not None and not self._died(child, code, now):
                    return 1
            for name, when in list(self.restart_at.items()):
                if when <= now and not self.stopping:
                    del self.restart_at[name]
                    self._start(next(c for c in self.children if c.name == name))
            if not self.is_ready:
                if self._all_beating() and wait_http(health_url, 0.5, lambda: not self.stopping):
                    self.is_ready = True
                    on_ready()
                elif now > deadline:
                    beating = self.bus.pids() if self.bus is not None else {}
                    silent = [c.name for c in self.children if c.is_alive and c.proc.pid not in beating]
                    print(f"pagedserve: /health did not answer 200 within {startup_timeout_s:g} s; without a "
                          f"heartbeat: {', '.join(silent) or 'none'}", file=sys.stderr)
                    return 1
            if self.is_ready and now >= next_beat_check:
                next_beat_check = now + 1.0
                self._mark_healthy()
            time.sleep(0.25)
        return 0

    def _all_beating(self) -> bool:
        """Every live child's own heartbeat is on the bus (always, without a bus view): until then
        /health answers 503 anyway, and polling it would only fill the log with the gateway's
        access lines (four a second through an engine's compile)."""
        if self.bus is None:
            return True
        beating = self.bus.pids()
        return all(child.proc.pid in beating for child in self.children if child.is_alive)

    def _died(self, child: Child, code: int, now: float) -> bool:
        """Schedule the restart of a child that died; False when it keeps failing at start-up."""
        tracker = self.trackers[child.name]
        uptime = now - tracker.started_at
        delay = tracker.exited(now)
        if delay is None:
            print(f"pagedserve: {child.name} failed {tracker.num_start_failures} times in a row before it was "
                  f"healthy (last: {describe_exit(code)} after {uptime:.1f} s); stopping", file=sys.stderr)
            tail = child.tail()
            if tail:
                print(f"pagedserve: the last lines {child.name} wrote to stderr:\n{tail}", file=sys.stderr)
            return False
        self.dead_pids[child.proc.pid] = child.name
        self.restart_at[child.name] = now + delay
        print(f"pagedserve: {child.name} {describe_exit(code)} after {uptime:.1f} s; restarting it in "
              f"{delay:.1f} s", file=sys.stderr, flush=True)
        return True

    def _mark_healthy(self) -> None:
        """A child whose own heartbeat is there is healthy; its dead predecessors' beats go."""
        if self.bus is None:
            return
        beating = self.bus.pids()
        for child in self.children:
            tracker = self.trackers[child.name]
            if not tracker.is_healthy and child.is_alive and child.proc.pid in beating:
                tracker.healthy()
                stale = [beating[pid] for pid, name in self.dead_pids.items() if name == child.name and pid in beating]
                if stale:
                    self.bus.remove_beats(stale)
                self.dead_pids = {pid: name for pid, name in self.dead_pids.items() if name != child.name}

    def stop(self, grace_s: float = 10.0) -> None:
        for kind in STOP_ORDER:
            for child in self.children:
                if child.name.startswith(kind):
                    child.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children:
            if child.proc is None or child.proc.returncode is not None:
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
    children = build_children(config, redis_url, model)
    bus = config.gateway.bus
    view = BusView(redis_server.url if redis_server else
                   url_with_credentials(redis_url, bus.redis_username, bus.redis_password), bus.names)
    supervisor = Supervisor(children, config.restart, view)
    signal.signal(signal.SIGINT, supervisor.on_signal)
    signal.signal(signal.SIGTERM, supervisor.on_signal)
    host, port = config.gateway.host, config.gateway.port
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host

    def ready() -> None:
        print(f"pagedserve: serving {model} at http://{host}:{port}/v1 (redis {redis_url})", flush=True)

    try:
        supervisor.start(env)
        return supervisor.run(f"http://{host}:{port}/health", config.startup_timeout_s, ready)
    finally:
        supervisor.stop()
        view.close()
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
