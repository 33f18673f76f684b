"""docker-compose.yml and the Dockerfile: the shape the design promises, and `compose config` when it runs."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
SERVICES = {"redis", "gateway", "tokenizer", "engine", "detok"}


def compose_command() -> list[str] | None:
    """`docker compose` (plugin) or `docker-compose` (standalone), whichever answers `version`."""
    for cmd in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cmd[0]) is None:
            continue
        try:
            ok = subprocess.run([*cmd, "version"], capture_output=True, timeout=30).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return cmd
    return None


def load() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_has_every_service_and_a_scalable_tokenizer():
    services = load()["services"]
    assert set(services) == SERVICES
    tokenizer = services["tokenizer"]
    # `--scale tokenizer=N` fails with a fixed container name or a published host port
    assert "container_name" not in tokenizer and "ports" not in tokenizer
    assert tokenizer["command"][:3] == ["python", "-m", "tokenizer_svc"]
    assert services["gateway"]["ports"] == ["8000:8000"]


def test_services_share_redis_and_the_model_cache():
    compose = load()
    assert "model-cache" in compose["volumes"]
    for name in SERVICES - {"redis"}:
        service = compose["services"][name]
        assert "model-cache:/cache" in service["volumes"], name
        assert service["environment"]["PAGEDSERVE_REDIS_URL"] == "redis://redis:6379/0", name
        assert service["depends_on"]["redis"]["condition"] == "service_healthy", name
        module = service["command"][2]
        assert (ROOT / module / "__main__.py").is_file(), module


def test_dockerfile_copies_every_package():
    text = (ROOT / "Dockerfile").read_text()
    for package in ("shared", "gateway", "tokenizer_svc", "engine_svc", "detok_svc"):
        assert f"COPY {package} ./{package}" in text


def test_compose_config_validates():
    cmd = compose_command()
    if cmd is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed here")
    result = subprocess.run([*cmd, "-f", str(COMPOSE), "config", "--quiet"], capture_output=True, text=True,
                            timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
