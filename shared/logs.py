"""Log set-up for every service (``--log-format text|json``) and the periodic status line.

``StatusLine`` writes one line every ``interval_s`` while its service is busy (and one more
when it falls idle), from counters the service already keeps, so it adds nothing per message.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping

from shared.config import TelemetryConfig


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, service, logger, message (and the exception)."""

    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        line = {"time": round(record.created, 3), "level": record.levelname, "service": self.service,
                "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def configure_logging(service: str, telemetry: TelemetryConfig, level: str | int = logging.INFO) -> None:
    """The root logger of this process, in the format ``telemetry.log_format`` names."""
    handler = logging.StreamHandler()
    if telemetry.log_format == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {service} %(levelname)s %(message)s"))
    logging.basicConfig(level=level.upper() if isinstance(level, str) else level, handlers=[handler], force=True)


class StatusLine:
    """Every ``interval_s`` while busy: ``describe(rates)`` logged at INFO, where ``rates`` are the
    per-second rates of the counters ``totals()`` returns since the last line."""

    def __init__(self, log: logging.Logger, interval_s: float, totals: Callable[[], Mapping[str, float]],
                 describe: Callable[[Mapping[str, float]], str]):
        self.log, self.interval_s = log, interval_s
        self.totals, self.describe = totals, describe
        self._last_time = time.monotonic()
        self._last = dict(totals())
        self._was_busy = False

    def tick(self, busy: bool) -> bool:
        """Log if a period has passed and the service was busy in it; True when it logged."""
        now = time.monotonic()
        if self.interval_s <= 0 or now - self._last_time < self.interval_s:
            return False
        totals = dict(self.totals())
        moved = totals != self._last
        elapsed = now - self._last_time
        rates = {k: (v - self._last.get(k, 0.0)) / elapsed for k, v in totals.items()}
        self._last_time, self._last = now, totals
        logged = busy or moved or self._was_busy
        if logged:
            self.log.info("%s", self.describe(rates))
        self._was_busy = busy or moved
        return logged
