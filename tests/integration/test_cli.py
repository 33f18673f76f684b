"""`pagedserve`: serve starts an embedded Redis and every service, answers, and leaves no orphan."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from shared.flags import parse_serve, to_argv
from shared.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]


def _children(pid: int) -> set[int]:
    out = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.add(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _module(pid: int) -> str | None:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return argv[argv.index("-m") + 1] if "-m" in argv else None


def _nice(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


def test_one_service_command_execs_the_module():
    result = subprocess.run([sys.executable, "-m", "shared.cli", "detok", "--help"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and "--shard" in result.stdout


def test_unknown_command_is_refused():
    result = subprocess.run([sys.executable, "-m", "shared.cli", "bogus"], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and "serve" in result.stderr


def test_engine_flags_are_forwarded_with_vllm_names():
    config = parse_serve(["--max-num-seqs", "3", "--no-enable-prefix-caching", "--kv-cache-memory", "1G",
                          "--enable-chunked-prefill"])
    argv = to_argv("engine", config.engine)
    pairs = {(argv[i], argv[i + 1]) for i in range(len(argv) - 1)}
    assert {("--kv-cache-memory", str(1 << 30)), ("--max-num-seqs", "3")} <= pairs
    assert "--no-enable-prefix-caching" in argv and "--enable-chunked-prefill" in argv


def test_serve_answers_then_stops_every_child(tiny_llama_dir, tmp_path):
    port = free_port()
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "shared.cli", "serve", "--model", str(tiny_llama_dir),
                             "--port", str(port), "--kv-cache-memory", "8M", "--max-model-len", "256",
                             "--device", "cpu", "--dtype", "float32", "--enforce-eager", "--detokenizers", "2", "--gateways", "2",
                             "--engine-nice", "3", "--engine-sched", "idle"],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while "pagedserve: serving" not in (tmp_path / "serve.log").read_text():
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "serve did not come up"
            time.sleep(0.5)
        # /health is polled once every child beats, not through the engine's start (4 a second)
        assert (tmp_path / "serve.log").read_text().count('"GET /health HTTP/1.1" 503') <= 2
        children = _children(proc.pid)
        assert len(children) >= 7  # redis, 2 gateways, tokenizer, engine, 2 detoks
        modules = {pid: _module(pid) for pid in children}
        assert list(modules.values()).count("gateway") == 2
        (engine,) = [pid for pid, module in modules.items() if module == "engine_svc"]
        assert _nice(engine) == _nice(os.getpid()) + 3 and os.sched_getscheduler(engine) == os.SCHED_IDLE
        for _ in range(6):  # a fresh connection each: the kernel spreads them over both gateways
            reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                               json={"prompt": "Hello world", "max_tokens": 4, "temperature": 0})
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["completion_tokens"] == 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        time.sleep(0.5)
        assert [pid for pid in children if _alive(pid)] == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
