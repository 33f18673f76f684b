"""The whole serving stack as child processes on one real redis-server, for the end-to-end tests.

``Stack`` starts ``python -m gateway``, N ``python -m tokenizer_svc``, ``python -m engine_svc`` and
``python -m detok_svc`` under a fresh key prefix, waits for /health, and stops them all (SIGTERM,
then SIGKILL) -- no orphans. ``assert_idle()`` is the idle invariant every test ends with.
With ``pd``, a prefill engine (engine-p0) and a decode engine (engine-d0) replace engine-0, and the
idle invariant covers both, their hand-off stream and the KV keys (none may be left).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis
from prometheus_client.parser import text_string_to_metric_families

from shared.heartbeat import parse_heartbeats
from shared.protocol import GROUP_DECODE, GROUP_ENGINE, GROUP_TOKENIZER, Heartbeat, StreamNames
from shared.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Service:
    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None

    def start(self, env: dict[str, str]) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, *self.argv], cwd=ROOT, env=env, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    @property
    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.is_alive:
            self.proc.send_signal(sig)

    def tail(self, num_lines: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-num_lines:])


@dataclass
class Stack:
    """Owns one stack's processes, its key prefix and the gateway's URL."""

    redis_url: str
    model_dir: Path
    log_dir: Path
    num_tokenizers: int = 1
    max_model_len: int | None = None
    served_model_name: str = "tiny"
    engine_args: list[str] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)
    prefix: str = field(default_factory=lambda: f"e2e{os.urandom(4).hex()}")
    port: int = field(default_factory=free_port)
    engine_metrics_port: int = field(default_factory=free_port)  # the engine's own /metrics
    services: list[Service] = field(default_factory=list)
    may_scan: bool = True  # False: read through a role user of serve's ACL (no SCAN; no P/D there)
    pd: bool = False  # prefill/decode disaggregation: engine-p0 and engine-d0 instead of engine-0
    prefill_args: list[str] = field(default_factory=list)  # pd: the prefill engine's own extra flags
    decode_metrics_port: int = field(default_factory=free_port)  # pd: the decode engine's /metrics

    @property
    def engine_ids(self) -> list[str]:
        return ["engine-p0", "engine-d0"] if self.pd else ["engine-0"]

    @property
    def names(self) -> StreamNames:
        return StreamNames(self.prefix)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def engine_metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.engine_metrics_port}/metrics"

    def _common(self) -> list[str]:
        argv = ["--redis-url", self.redis_url, "--prefix", self.prefix, "--model", str(self.model_dir)]
        if self.max_model_len is not None:
            argv += ["--max-model-len", str(self.max_model_len)]
        return argv

    def _add(self, name: str, module: str, *extra: str) -> Service:
        service = Service(name, ["-m", module, *self._common(), *extra], self.log_dir / f"{name}.log")
        self.services.append(service)
        return service

    def _env(self) -> dict[str, str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        env.pop("PAGEDSERVE_API_KEY", None)
        return env

    def start_service(self, name: str, module: str, *extra: str) -> Service:
        """One more service in the running stack (e.g. a second engine)."""
        service = self._add(name, module, *extra)
        service.start(self._env())
        return service

    def start(self, timeout_s: float = 240.0) -> Stack:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = self._env()
        if self.pd:
            self._add("engine-p0", "engine_svc", "--service-id", "engine-p0", "--role", "prefill", "--metrics-port",
                      str(self.engine_metrics_port), *self.engine_args, *self.prefill_args)
            self._add("engine-d0", "engine_svc", "--service-id", "engine-d0", "--role", "decode", "--metrics-port",
                      str(self.decode_metrics_port), *self.engine_args)
        else:
            self._add("engine", "engine_svc", "--service-id", "engine-0", "--metrics-port",
                      str(self.engine_metrics_port), *self.engine_args)
        for i in range(self.num_tokenizers):
            self._add(f"tokenizer-{i}", "tokenizer_svc", "--service-id", f"tokenizer-{i}")
        self._add("detok-0", "detok_svc", "--shard", "0", "--service-id", "detok-0")
        self._add("gateway", "gateway", "--port", str(self.port), "--served-model-name", self.served_model_name,
                  "--gateway-id", "g0", "--log-level", "warning", *self.gateway_args)
        for service in self.services:
            service.start(env)
        try:
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout_s: float) -> None:
        """Until /health is 200 and every tokenizer and detok has written a heartbeat."""
        deadline = time.monotonic() + timeout_s
        wanted = {f"tokenizer-{i}" for i in range(self.num_tokenizers)} | {"detok-0"}
        if self.pd:
            wanted |= set(self.engine_ids)
        while time.monotonic() < deadline:
            dead = [s for s in self.services if not s.is_alive]
            if dead:
                raise RuntimeError(f"{dead[0].name} exited during start-up:\n{dead[0].tail()}")
            try:
                healthy = httpx.get(self.base_url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                healthy = False
            if healthy and wanted <= set(self.heartbeats()):
                return
            time.sleep(0.25)
        raise TimeoutError(f"stack not ready in {timeout_s}s:\n" + self.logs())

    def service(self, name: str) -> Service:
        return next(s for s in self.services if s.name == name)

    def stop(self) -> None:
        for service in self.services:
            service.signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for service in self.services:
            if service.proc is None:
                continue
            try:
                service.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(service.proc.pid, signal.SIGKILL)
                service.proc.wait(timeout=10)
        with redis.Redis.from_url(self.redis_url) as client:
            keys = list(client.scan_iter(match=f"{self.prefix}:*"))
            if keys:
                client.delete(*keys)

    def logs(self) -> str:
        return "\n".join(f"----- {s.name} (alive={s.is_alive})\n{s.tail()}" for s in self.services)

    # ----------------------------------------------------------------- inspection
    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url)

    def heartbeats(self) -> dict[str, Heartbeat]:
        """Every service's last beat (the hash's ``_epoch`` field is not a service)."""
        with self.redis() as client:
            raw = client.hgetall(self.names.heartbeat)
        return parse_heartbeats(raw)

    def engine_stats(self) -> dict[str, float]:
        return self.heartbeats()["engine-0"].stats

    def engine_counters(self) -> dict[str, float]:
        """The engine's counters, live from its own /metrics: name (phase label appended) -> value."""
        text = httpx.get(self.engine_metrics_url, timeout=5).text
        out = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    name = sample.name.removeprefix("pagedserve:")
                    out[f"{name}:{sample.labels['phase']}" if "phase" in sample.labels else name] = sample.value
        return out

    def pending(self) -> dict[str, int]:
        """Pending entries of every consumer group of this stack."""
        out = {}
        with self.redis() as client:
            streams = [(self.names.tokenizer_in, GROUP_TOKENIZER), (self.names.engine_in, GROUP_ENGINE),
                       (self.names.detok_in(0), "detok")]
            for stream, group in streams + ([(self.names.decode_in, GROUP_DECODE)] if self.pd else []):
                try:
                    for info in client.xinfo_groups(stream):
                        out[f"{stream}/{info['name'].decode()}"] = int(info["pending"])
                except redis.ResponseError:  # the stream does not exist yet
                    out[f"{stream}/{group}"] = 0
        return out

    def idle_problems(self, since: float = 0.0) -> list[str]:
        """What breaks the idle invariant; heartbeats older than ``since`` do not count as evidence."""
        beats = self.heartbeats()
        problems = [f"{k}: no heartbeat since the check began" for k, b in beats.items()
                    if b.service in ("engine", "detok", "gateway") and b.time < since]
        for engine_id in self.engine_ids:
            engine = beats.get(engine_id)
            if engine is None:
                problems.append(f"no {engine_id} heartbeat")
                continue
            s = engine.stats
            if s.get("num_free_blocks") != s.get("num_total_blocks"):
                free, total = s.get("num_free_blocks"), s.get("num_total_blocks")
                problems.append(f"{engine_id} blocks in use: {free}/{total} free")
            for key in ("num_running", "num_waiting", "num_requests"):
                if s.get(key, 0):
                    problems.append(f"{engine_id} {key}={s[key]:g}")
        if self.may_scan:
            with self.redis() as client:
                problems += [f"KV entry left: {k.decode()}" for k in client.scan_iter(match=f"{self.prefix}:kv:*")]
        for service_id, beat in beats.items():
            if beat.service in ("detok", "gateway") and beat.stats.get("num_requests", 0):
                problems.append(f"{service_id} holds {beat.stats['num_requests']:g} requests")
            if beat.service == "gateway" and beat.stats.get("num_inboxes", 0):
                problems.append(f"{service_id} holds {beat.stats['num_inboxes']:g} inboxes")
        problems += [f"{k}: {v} pending" for k, v in self.pending().items() if v]
        return problems

    def assert_idle(self, timeout_s: float = 10.0) -> None:
        """The idle invariant: every KV block free, no pending entries, no request state anywhere.

        Heartbeats come every second, so this waits for one to show the final state.
        """
        since = time.time()
        deadline = time.monotonic() + timeout_s
        problems = self.idle_problems(since)
        while problems and time.monotonic() < deadline:
            time.sleep(0.25)
            problems = self.idle_problems(since)
        assert not problems, f"stack not idle after {timeout_s}s: {problems}\n{self.logs()}"
