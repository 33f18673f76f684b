"""The bus's trust boundary under `pagedserve serve` (real processes, the embedded Redis).

The test plays an attacker who holds Redis credentials (the role password, given to serve in
PAGEDSERVE_REDIS_PASSWORD) but not the bus secret (serve makes one per run): entries it forges
on a live gateway's reply stream never reach the client; Redis refuses strangers, and a role's
user cannot flush or read another role's keys; no secret is on a command line.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import redis

from shared.bus_auth import BusSigner
from shared.protocol import FinishReason, Heartbeat, RequestOutput, StreamNames
from shared.redis_server import free_port
from tests.e2e.stack import Stack

ROOT = Path(__file__).resolve().parents[2]
NAMES = StreamNames("ps")
PROMPT = "The trust boundary of a bus is"


def _children(pid: int) -> dict[int, list[str]]:
    """pid -> argv of each child of ``pid``."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out[int(entry.name)] = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
    return out


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(item.split("=", 1) for item in raw if "=" in item)


class Served:
    """One `pagedserve serve` of the tiny model, seen from outside."""

    def __init__(self, model_dir: Path, log_path: Path):
        self.password = secrets.token_urlsafe(24)
        self.port = free_port()
        self.log_path = log_path
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
               "PAGEDSERVE_REDIS_PASSWORD": self.password}
        for name in ("PAGEDSERVE_BUS_SECRET", "PAGEDSERVE_API_KEY", "PAGEDSERVE_REDIS_URL", "PAGEDSERVE_PREFIX"):
            env.pop(name, None)
        self.log = open(log_path, "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shared.cli", "serve", "--model", str(model_dir), "--port", str(self.port),
             "--kv-cache-memory", "64M", "--max-model-len", "1024", "--device", "cpu", "--dtype", "float32",
             "--enforce-eager", "--bus-cpus", "none", "--engine-sched", "normal"],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while "pagedserve: serving" not in self.log_path.read_text():
            assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "serve did not come up:\n" + self.log_path.read_text()[-3000:]
            time.sleep(0.5)
        self.children = _children(self.proc.pid)
        # redis-server retitles itself "redis-server 127.0.0.1:PORT"
        (self.redis_port,) = [int(re.search(r":(\d+)", " ".join(argv)).group(1)) for argv in self.children.values()
                              if "redis-server" in argv[0]]
        (self.engine_pid,) = [pid for pid, argv in self.children.items() if "engine_svc" in argv]

    def role(self, role: str) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.redis_port, username=role, password=self.password)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def served(tiny_llama_dir, tmp_path_factory):
    served = Served(tiny_llama_dir, tmp_path_factory.mktemp("bus-trust") / "serve.log")
    try:
        served.wait_ready()
        yield served
    finally:
        served.stop()


@pytest.fixture
def idle_check(served):
    """The idle invariant after each test, read through the gateway role's user (serve's Redis)."""
    yield
    url = f"redis://gateway:{served.password}@127.0.0.1:{served.redis_port}/0"
    Stack(url, Path("."), Path("."), prefix="ps", may_scan=False).assert_idle(timeout_s=15)


def _client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key="unused", max_retries=0, timeout=120)


def _complete(client: openai.OpenAI, model: str):
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=160, temperature=0, stream=True,
                                     extra_body={"ignore_eos": True})


def test_serve_keeps_secrets_off_command_lines_and_strangers_out(served, idle_check):
    for argv in served.children.values():
        joined = " ".join(argv)
        assert served.password not in joined and "--bus-secret" not in joined and "--redis-password" not in joined
    services = [pid for pid, argv in served.children.items() if "-m" in argv]
    bus_secrets = {_environ(pid).get("PAGEDSERVE_BUS_SECRET") for pid in services}
    assert len(services) == 4 and len(bus_secrets) == 1 and len(bus_secrets.pop()) >= 32  # one per run, shared
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=served.redis_port).ping()
    gateway = served.role("gateway")
    assert gateway.ping()
    for command in (gateway.flushall, lambda: gateway.keys("*"), lambda: gateway.config_get("*"),
                    lambda: gateway.get("ps:kv:anything"), lambda: gateway.xadd("ps:decode:in", {b"m": b"x"})):
        with pytest.raises(redis.exceptions.NoPermissionError):
            command()


def test_forged_reply_entries_never_reach_the_client(served, idle_check):
    client = _client(served)
    model = client.models.list().data[0].id
    reference = "".join(chunk.choices[0].text for chunk in _complete(client, model) if chunk.choices)
    attacker = served.role("gateway")  # Redis credentials, but not the bus secret
    (gateway_field,) = [k.decode() for k in attacker.hgetall(NAMES.heartbeat) if k.startswith(b"gateway-")]
    reply_to = NAMES.gateway_out(gateway_field.removeprefix("gateway-"))

    chunks = iter(_complete(client, model))
    first = next(chunks)
    os.kill(served.engine_pid, signal.SIGSTOP)  # the request stays in flight while the forgeries land
    try:
        forged_at = time.time()
        rid = first.id + "-0"
        no_mac = RequestOutput(request_id=rid, seq=100_000, text_delta="FORGED-NO-MAC")
        wrong_mac = RequestOutput(request_id=rid, seq=100_001, text_delta="FORGED-WRONG-MAC",
                                  finish_reason=FinishReason.STOP)
        forged_ids = {attacker.xadd(reply_to, {b"m": no_mac.to_wire()}).decode(): b"entry has no MAC",
                      attacker.xadd(reply_to, BusSigner("a-guess-at-the-secret").sign(
                          reply_to, {b"m": wrong_mac.to_wire()})).decode(): b"entry MAC does not match"}
        deadline = time.monotonic() + 15
        while True:
            letters = {f[b"id"].decode(): f[b"error"] for _, f in attacker.xrange(NAMES.dlq)
                       if f[b"stream"] == reply_to.encode()}
            beat = attacker.hget(NAMES.heartbeat, gateway_field)
            if letters == forged_ids and beat is not None:
                gateway_beat = Heartbeat.from_wire(beat)
                if gateway_beat.time > forged_at + 0.5:
                    break
            assert time.monotonic() < deadline, f"dead letters {letters} (wanted {forged_ids})"
            time.sleep(0.2)
        assert gateway_beat.stats["num_inboxes"] == 1  # the forged request id was live when they were read
    finally:
        os.kill(served.engine_pid, signal.SIGCONT)
    text = first.choices[0].text + "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    # with the gateway's reader built without its signer (tried once by hand), this text was
    # ' iconsPhyFORGED-NO-MACFORGED-WRONG-MAC' and the stream ended at the forged stop
    assert "FORGED" not in text and text == reference
