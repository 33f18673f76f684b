"""How a service process lives: run until signalled (flushing its tracer on the way out), and how
a parent waits for a child's HTTP health."""

from __future__ import annotations

import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable


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
