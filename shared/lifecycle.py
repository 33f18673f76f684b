"""How a service process lives: run until signalled (flushing its tracer on the way out), how a
parent waits for a child's HTTP health, and when a parent restarts a child that died
(``RestartTracker``, pure: `serve`'s supervisor feeds it the clock)."""

from __future__ import annotations

import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from shared.config import RestartConfig


def run_until_signalled(service, tracing=None) -> None:
    """SIGTERM and SIGINT end ``service.run()`` through ``service.stop``; the tracer (if any)
    exports what it holds before the process exits."""
    signal.signal(signal.SIGTERM, service.stop)
    signal.signal(signal.SIGINT, service.stop)
    try:
        service.run()
    finally:
        if tracing is not None:
            tracing.shutdown()


def wait_http(url: str, timeout_s: float, keep_waiting: Callable[[], bool] = lambda: True,
              interval_s: float = 0.25) -> bool:
    """Poll ``url`` until it answers 200: False on timeout or once ``keep_waiting()`` says stop
    (the process behind it died, or we were told to stop)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and keep_waiting():
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(interval_s)
    return False


class RestartTracker:
    """One child's restart history: how long to wait before its next start, and whether it keeps
    failing at start-up.

    A death is a start-up failure unless the incarnation was marked healthy (`serve` marks a child
    once the stack has been healthy and the child's own heartbeat is there); ``max_start_failures``
    of them in a row mean the child cannot start: ``exited`` answers None. Every death doubles the
    wait before the next start (``restart_backoff_s`` up to ``restart_backoff_max_s``); a child that
    stayed up ``restart_reset_after_s`` starts over from the first wait, so one crash a day never
    waits 30 s."""

    def __init__(self, config: RestartConfig):
        self.config = config
        self.num_start_failures = 0  # deaths in a row without becoming healthy
        self.num_restarts = 0  # restarts since the backoff last started over
        self.started_at = 0.0
        self.is_healthy = False

    def started(self, now: float) -> None:
        self.started_at, self.is_healthy = now, False

    def healthy(self) -> None:
        self.is_healthy = True
        self.num_start_failures = 0

    def exited(self, now: float) -> float | None:
        """Seconds to wait before the restart, or None: give up (it keeps failing at start-up)."""
        c = self.config
        if not self.is_healthy:
            self.num_start_failures += 1
            if self.num_start_failures >= c.max_start_failures:
                return None
        if now - self.started_at >= c.restart_reset_after_s:
            self.num_restarts = 0
        delay = min(c.restart_backoff_max_s, c.restart_backoff_s * 2 ** min(self.num_restarts, 32))
        self.num_restarts += 1
        return delay
