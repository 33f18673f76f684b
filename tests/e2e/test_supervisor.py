"""`pagedserve serve` supervises: each child SIGKILLed in turn is restarted and the stack answers
again within 30 s, without restarting serve; a child that cannot start stops serve, named."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import redis

from shared.heartbeat import read_heartbeats
from shared.protocol import GROUP_ENGINE, GROUP_TOKENIZER, StreamNames
from shared.redis_server import free_port
from tests.integration.test_cli import _alive, _children, _module

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--kv-cache-memory", "8M", "--max-model-len", "256", "--device", "cpu", "--dtype", "float32",
        "--enforce-eager"]
MODULE_OF = {"gateway": "gateway", "tokenizer": "tokenizer_svc", "engine": "engine_svc", "detok": "detok_svc"}


def start_serve(args: list[str], log_path: Path) -> subprocess.Popen:
    log = open(log_path, "w")
    try:
        return subprocess.Popen([sys.executable, "-m", "shared.cli", "serve", *args], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    finally:
        log.close()


def wait_for(log_path: Path, text: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in log_path.read_text():
        assert proc.poll() is None, log_path.read_text()[-4000:]
        assert time.monotonic() < deadline, f"no {text!r} in {timeout_s} s:\n{log_path.read_text()[-4000:]}"
        time.sleep(0.25)


def child_pid(serve_pid: int, kind: str) -> int:
    (pid,) = [p for p in _children(serve_pid) if _module(p) == MODULE_OF[kind]]
    return pid


def complete(port: int) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                      json={"prompt": "Hello world", "max_tokens": 4, "temperature": 0})


def answers_within(port: int, since: float, limit_s: float) -> tuple[float, list[str]]:
    """Seconds after ``since`` until a new request succeeded; what failed meanwhile."""
    failures = []
    while time.monotonic() - since < limit_s:
        try:
            reply = complete(port)
            if reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4:
                return time.monotonic() - since, failures
            failures.append(f"{reply.status_code} {reply.text[:200]}")
        except httpx.HTTPError as exc:
            failures.append(repr(exc))
        time.sleep(0.5)
    raise AssertionError(f"no answer within {limit_s} s of the kill: {failures[-5:]}")


def idle_problems(redis_url: str, prefix: str) -> list[str]:
    """The idle invariant, for whatever incarnations are alive: fresh beats only (the dead ones'
    removed), one per service, every KV block free, no request anywhere, nothing pending."""
    names = StreamNames(prefix)
    with redis.Redis.from_url(redis_url) as client:
        beats = read_heartbeats(client, names.heartbeat)
        problems = [f"{sid}: beat {time.time() - b.time:.1f} s old" for sid, b in beats.items()
                    if time.time() - b.time > 5]
        roles = sorted(b.service for b in beats.values())
        if roles != ["detok", "engine", "gateway", "tokenizer"]:
            problems.append(f"heartbeats {sorted(beats)}")
        for sid, b in beats.items():
            s = b.stats
            if b.service == "engine" and (s.get("num_free_blocks") != s.get("num_total_blocks")
                                         or s.get("num_running") or s.get("num_waiting")):
                problems.append(f"{sid}: {s}")
            if b.service in ("gateway", "detok") and (s.get("num_requests") or s.get("num_inboxes")):
                problems.append(f"{sid}: {s}")
        for stream, group in ((names.tokenizer_in, GROUP_TOKENIZER), (names.engine_in, GROUP_ENGINE),
                              (names.detok_in(0), "detok")):
            problems += [f"{stream}: {g['pending']} pending" for g in client.xinfo_groups(stream) if g["pending"]]
    return problems


def test_every_child_sigkilled_in_turn_comes_back(tiny_llama_dir, redis_url, prefix, tmp_path):
    port, log_path = free_port(), tmp_path / "serve.log"
    proc = start_serve(["--model", str(tiny_llama_dir), "--port", str(port), "--redis-url", redis_url,
                        "--prefix", prefix, "--restart-backoff", "0.5", *TINY], log_path)
    try:
        wait_for(log_path, "pagedserve: serving", proc, 300)
        assert complete(port).status_code == 200
        everyone = set(_children(proc.pid))
        for kind in ("gateway", "tokenizer", "engine", "detok"):
            victim = child_pid(proc.pid, kind)
            os.kill(victim, signal.SIGKILL)
            killed_at = time.monotonic()
            took_s, failures = answers_within(port, killed_at, 30.0)
            assert proc.poll() is None, log_path.read_text()[-4000:]
            successor = child_pid(proc.pid, kind)
            assert successor != victim and not _alive(victim)
            print(f"{kind}: answered {took_s:.1f} s after the kill ({len(failures)} failed tries)")
            everyone |= set(_children(proc.pid))
        log = log_path.read_text()
        for name in ("gateway", "tokenizer-0", "engine", "detok-0"):
            assert f"pagedserve: {name} killed by SIGKILL" in log, log[-4000:]
        deadline = time.monotonic() + 20  # the successors' first beats remove the dead ones'
        while (problems := idle_problems(redis_url, prefix)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert problems == [], problems
        with redis.Redis.from_url(redis_url) as client:
            assert b"engine-0-r1" in client.hkeys(StreamNames(prefix).heartbeat)  # a fresh engine identity
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        time.sleep(0.5)
        assert [pid for pid in everyone if _alive(pid)] == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_child_that_cannot_start_stops_serve_naming_it(tiny_llama_dir, tmp_path):
    log_path = tmp_path / "serve.log"
    started = time.monotonic()
    proc = start_serve(["--model", str(tiny_llama_dir), "--port", str(free_port()), "--restart-backoff", "0.5",
                        *TINY, "--dtype", "bogus"], log_path)
    try:
        assert proc.wait(timeout=180) == 1
        took_s = time.monotonic() - started
        log = log_path.read_text()
        assert "pagedserve: engine failed 3 times in a row before it was healthy (last: exit code 1" in log, log
        assert "the last lines engine wrote to stderr" in log and "bogus" in log.rsplit("stderr:", 1)[1]
        assert log.count("pagedserve: engine exit code 1") == 2  # two restarts, then the end
        assert "pagedserve: serving" not in log
        print(f"serve stopped {took_s:.1f} s after it started")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def stream_text(port: int, on_chunk=None) -> tuple[str, list[str], str | None]:
    """A streamed greedy completion: its text, finish reasons and the error event if any;
    ``on_chunk(n)`` is called after the n-th text chunk."""
    text, reasons, error, chunks = [], [], None, 0
    body = {"prompt": "Hello world", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]["message"]
                continue
            for choice in event["choices"]:
                text.append(choice["text"])
                if choice.get("finish_reason"):
                    reasons.append(choice["finish_reason"])
            chunks += 1
            if on_chunk is not None:
                on_chunk(chunks)
    return "".join(text), reasons, error


def test_a_stream_survives_its_engines_restart(tiny_llama_dir, redis_url, prefix, tmp_path):
    """The engine SIGKILLed mid-stream under serve: the restarted engine (a new id) takes the
    request over (the detok shard's resume) and the stream completes with the fault-free text."""
    port, log_path = free_port(), tmp_path / "serve.log"
    proc = start_serve(["--model", str(tiny_llama_dir), "--port", str(port), "--redis-url", redis_url,
                        "--prefix", prefix, "--restart-backoff", "0.5", *TINY], log_path)
    try:
        wait_for(log_path, "pagedserve: serving", proc, 300)
        reference, reasons, error = stream_text(port)
        assert reasons == ["length"] and error is None
        victim = child_pid(proc.pid, "engine")
        killed = []

        def kill_early(n: int) -> None:
            if n == 3 and not killed:
                os.kill(victim, signal.SIGKILL)
                killed.append(time.monotonic())

        text, reasons, error = stream_text(port, kill_early)
        print(f"stream ended {time.monotonic() - killed[0]:.1f} s after the kill")
        assert error is None and reasons == ["length"], (error, reasons, log_path.read_text()[-3000:])
        assert text == reference
        assert "pagedserve: engine killed by SIGKILL" in log_path.read_text()
        deadline = time.monotonic() + 20
        while (problems := idle_problems(redis_url, prefix)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert problems == [], problems
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
