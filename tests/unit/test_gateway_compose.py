"""docker-compose.yml and the Dockerfile: the shape the design promises, and `compose config` when it runs."""

from __future__ import annotations

import os
import re
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
    # loopback unless the deployer says otherwise
    assert services["gateway"]["ports"] == ["${PAGEDSERVE_BIND:-127.0.0.1}:${PAGEDSERVE_PORT:-8000}:8000"]


def test_services_share_redis_and_the_model_cache():
    compose = load()
    assert "model-cache" in compose["volumes"]
    for name in SERVICES - {"redis"}:
        service = compose["services"][name]
        assert "model-cache:/cache" in service["volumes"], name
        assert service["environment"]["PAGEDSERVE_REDIS_URL"] == "redis://redis:6379/0", name
        # secrets from the deployer's environment, required (no default a copy-paste would keep)
        for variable in ("PAGEDSERVE_REDIS_PASSWORD", "PAGEDSERVE_BUS_SECRET"):
            assert service["environment"][variable].startswith("${%s:?" % variable), (name, variable)
        assert service["depends_on"]["redis"]["condition"] == "service_healthy", name
        module = service["command"][2]
        assert (ROOT / module / "__main__.py").is_file(), module


def test_one_build_and_a_healthcheck_of_its_own_heartbeat_everywhere():
    services = load()["services"]
    assert [name for name, service in services.items() if "build" in service] == ["gateway"]
    for name in SERVICES - {"redis", "gateway"}:
        assert services[name]["image"] == services["gateway"]["image"], name
        assert services[name]["pull_policy"] == "never", name  # built here, never pulled
    for name in SERVICES - {"redis"}:
        assert services[name]["healthcheck"]["test"] == ["CMD", "python", "-m", "shared.healthcheck", name], name
    assert (ROOT / "shared" / "healthcheck.py").is_file()
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


def test_redis_requires_the_password_without_showing_it_on_a_command_line():
    redis = load()["services"]["redis"]
    assert redis["environment"]["REDISCLI_AUTH"].startswith("${PAGEDSERVE_REDIS_PASSWORD:?")
    script = redis["command"][-1]
    assert "requirepass" in script and "$$REDISCLI_AUTH" in script and "redis-server -" in script
    assert "PAGEDSERVE_REDIS_PASSWORD" not in " ".join(redis["command"])


def dockerfile_stages() -> list[str]:
    """The Dockerfile's text cut at each FROM: [preamble, stage 1, stage 2, ...]."""
    return re.split(r"^FROM ", (ROOT / "Dockerfile").read_text(), flags=re.M)


def test_dockerfile_stages_keep_the_compiler_out_of_the_runtime():
    preamble, deps, kernels, runtime = dockerfile_stages()
    assert "ARG PYTHON_IMAGE=" in preamble
    # the torch index and offline wheels are build arguments, not edits
    assert "ARG TORCH_INDEX_URL=" in deps and '--index-url "$TORCH_INDEX_URL"' in deps
    assert "source=wheels,target=/wheels" in deps and "PIP_FIND_LINKS=/wheels" in deps and "ARG OFFLINE" in deps
    assert (ROOT / "wheels" / ".gitignore").is_file()
    # dependencies from pyproject.toml alone: a code change reuses the layer
    assert "COPY pyproject.toml" in deps and "COPY shared" not in deps
    assert "g++" in kernels and "prebuild('/opt/pagedserve/kernels')" in kernels
    assert "g++" not in runtime and "apt-get" not in runtime
    assert "COPY --from=kernels /opt/pagedserve/kernels" in runtime
    assert "PAGEDSERVE_CPU_KERNELS_DIR=/opt/pagedserve/kernels" in runtime
    assert "--no-index" in runtime  # the code installs without reaching any index


def test_dockerfile_copies_every_package():
    text = (ROOT / "Dockerfile").read_text()
    for package in ("shared", "gateway", "tokenizer_svc", "engine_svc", "detok_svc"):
        assert f"COPY {package} ./{package}" in text


def test_compose_config_validates():
    cmd = compose_command()
    if cmd is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed here")
    env = {**os.environ, "PAGEDSERVE_REDIS_PASSWORD": "0123456789abcdef", "PAGEDSERVE_BUS_SECRET": "s" * 32}
    result = subprocess.run([*cmd, "-f", str(COMPOSE), "config", "--quiet"], capture_output=True, text=True,
                            timeout=60, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr
    del env["PAGEDSERVE_REDIS_PASSWORD"]  # a stack without its password does not start
    result = subprocess.run([*cmd, "-f", str(COMPOSE), "config", "--quiet"], capture_output=True, text=True,
                            timeout=60, cwd=ROOT, env=env)
    assert result.returncode != 0 and "PAGEDSERVE_REDIS_PASSWORD" in result.stderr
