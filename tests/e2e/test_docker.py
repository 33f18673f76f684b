"""Deployment: the container healthcheck, the runtime image's prebuilt CPU kernels, and the whole
compose stack built and asked a question (where Docker can build images; skipped otherwise)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import redis

from shared.config import BusConfig
from shared.heartbeat import HeartbeatWriter
from shared.redis_server import free_port
from tests.unit.test_gateway_compose import COMPOSE, ROOT, compose_command

BASE_IMAGES = ("python:3.11-slim", "redis:7-alpine")
NO_NETWORK = ("Temporary failure in name resolution", "Network is unreachable", "Could not find a version",
              "No matching distribution", "connection refused", "i/o timeout")


def healthcheck(kind: str, redis_url: str, prefix: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shared.healthcheck", kind, "--redis-url", redis_url,
                           "--prefix", prefix, *extra], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_healthcheck_wants_its_own_kinds_fresh_heartbeat(redis_url, prefix):
    key = BusConfig(prefix=prefix).names.heartbeat
    with redis.Redis.from_url(redis_url) as client:
        HeartbeatWriter(client, key, "tokenizer", "tokenizer-0").beat({"num_requests": 0}, force=True)
        ok = healthcheck("tokenizer", redis_url, prefix)
        assert ok.returncode == 0 and "healthy: tokenizer-0" in ok.stdout, ok.stdout + ok.stderr
        other = healthcheck("engine", redis_url, prefix)  # another kind's beat is no evidence
        assert other.returncode == 1 and "no engine heartbeat" in other.stdout
        time.sleep(1.5)
        stale = healthcheck("tokenizer", redis_url, prefix, "--stale-after", "1")
        assert stale.returncode == 1 and "no tokenizer heartbeat" in stale.stdout
    down = healthcheck("tokenizer", "redis://127.0.0.1:1/0", prefix)
    assert down.returncode == 1 and "cannot read the heartbeats" in down.stdout
    assert healthcheck("bogus", redis_url, prefix).returncode == 2


def test_prebuilt_cpu_kernels_load_without_a_compiler(tmp_path):
    """What the image's runtime stage does: no g++ on PATH, an empty cache, the library for this
    CPU in PAGEDSERVE_CPU_KERNELS_DIR. Without that folder the same process has no kernels."""
    from engine_svc.attention import cpu_ops

    flags = cpu_ops.cpu_flags()
    library = cpu_ops.build(flags, tmp_path / "kernels" / cpu_ops.prebuilt_name(flags))
    assert library.is_file()
    probe = ("from engine_svc.attention import cpu_ops; import os; "
             "print(cpu_ops.paged_decode_op() is not None, sorted(os.listdir(os.environ['PAGEDSERVE_CACHE'])))")
    env = {k: v for k, v in os.environ.items() if k != "CXX"}
    env.update(PATH=str(tmp_path / "no-compiler"), PAGEDSERVE_CACHE=str(tmp_path / "cache"), PAGEDSERVE_CPU_KERNELS="1")
    (tmp_path / "cache").mkdir()
    for folder, expected in ((str(tmp_path / "kernels"), "True []"), (str(tmp_path / "elsewhere"), "False []")):
        out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300,
                             env={**env, "PAGEDSERVE_CPU_KERNELS_DIR": folder})
        assert out.stdout.strip() == expected, out.stdout + out.stderr


# --------------------------------------------------------------------------- the compose stack


def docker_ready() -> tuple[list[str] | None, str]:
    """The compose command when a Docker daemon answers and the base images are here or can be
    pulled; else None and why."""
    cmd = compose_command()
    if cmd is None:
        return None, "neither `docker compose` nor `docker-compose` is installed here"
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        return None, f"no Docker daemon answers: {info.stderr.strip()[-200:]}"
    for image in BASE_IMAGES:
        if subprocess.run(["docker", "image", "inspect", image], capture_output=True, timeout=60).returncode == 0:
            continue
        try:
            pulled = subprocess.run(["docker", "pull", image], capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            return None, f"pulling the base image {image} timed out"
        if pulled.returncode != 0:
            return None, f"the base image {image} is not here and cannot be pulled: {pulled.stderr.strip()[-200:]}"
    return cmd, ""


@pytest.mark.slow
def test_compose_stack_builds_and_answers(tmp_path):
    cmd, why = docker_ready()
    if cmd is None:
        pytest.skip(why)
    port, project = free_port(), f"pstest{uuid.uuid4().hex[:8]}"
    image = f"pagedserve-test:{project}"
    env = {**os.environ, "PAGEDSERVE_REDIS_PASSWORD": uuid.uuid4().hex, "PAGEDSERVE_BUS_SECRET": uuid.uuid4().hex,
           "PAGEDSERVE_PORT": str(port), "PAGEDSERVE_IMAGE": image}
    compose = [*cmd, "-f", str(COMPOSE), "-p", project]

    def run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run([*compose, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)

    try:
        built = run("build", timeout=3600)
        if built.returncode != 0 and any(text in built.stdout + built.stderr for text in NO_NETWORK):
            pytest.skip(f"the image build cannot reach its package index: {built.stderr.strip()[-300:]}")
        assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
        up = run("up", "-d")
        assert up.returncode == 0, up.stderr[-3000:]
        deadline, health = time.monotonic() + 900, {}
        while time.monotonic() < deadline:
            ps = run("ps", "--format", "json")
            rows = [json.loads(line) for line in ps.stdout.splitlines() if line.strip().startswith("{")]
            health = {row["Service"]: row.get("Health", "") for row in rows}
            if len(health) == 5 and set(health.values()) == {"healthy"}:
                break
            time.sleep(5)
        assert set(health.values()) == {"healthy"} and len(health) == 5, (health, run("logs").stdout[-5000:])
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=300, json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32,
            "temperature": 0})
        assert reply.status_code == 200, reply.text
        assert "Paris" in reply.json()["choices"][0]["message"]["content"], reply.text
    finally:
        run("down", "-v", "--remove-orphans")
        subprocess.run(["docker", "image", "rm", "-f", image], capture_output=True, timeout=120)
