"""`pagedserve status`: every service of a stack, from the heartbeat hash, as a table or JSON.

Pure functions over ``Heartbeat``s (``rows``, ``table``) and one read of the hash (``main``),
so a test can check the table without Redis and the command without a stack's internals.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping

import redis

from shared.config import StatusConfig
from shared.heartbeat import read_heartbeats
from shared.protocol import Heartbeat

COLUMNS = ("service_id", "role", "host", "pid", "uptime_s", "load", "age_s", "stale")
ROLE_ORDER = {"gateway": 0, "tokenizer": 1, "engine": 2, "detok": 3}


def load(beat: Heartbeat) -> str:
    """The few figures that say how busy a service is."""
    s = beat.stats
    if beat.service == "engine":
        return (f"running {s.get('num_running', 0):g} waiting {s.get('num_waiting', 0):g} "
                f"kv {s.get('kv_cache_usage', 0.0):.0%}")
    if beat.service == "tokenizer":
        return f"{s.get('num_requests', 0):g} requests tokenized"
    return f"{s.get('num_requests', 0):g} requests in flight"


def rows(beats: Mapping[str, Heartbeat], stale_after_s: float, now: float | None = None) -> list[dict]:
    """One row per service, gateways first, then tokenizers, engines, detokenizers."""
    now = time.time() if now is None else now
    out = [{"service_id": service_id, "role": b.service, "host": b.host, "pid": b.pid,
            "uptime_s": round(now - b.start_time, 1) if b.start_time else None, "load": load(b),
            "age_s": round(now - b.time, 1), "stale": now - b.time > stale_after_s, "stats": dict(b.stats)}
           for service_id, b in beats.items()]
    return sorted(out, key=lambda r: (ROLE_ORDER.get(r["role"], 9), r["service_id"]))


def table(service_rows: list[dict]) -> str:
    def cell(row: dict, column: str) -> str:
        value = row[column]
        if column == "stale":
            return "STALE" if value else "ok"
        return "-" if value is None else str(value)

    cells = [[c.upper() for c in COLUMNS]] + [[cell(r, c) for c in COLUMNS] for r in service_rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(text.ljust(w) for text, w in zip(line, widths)).rstrip() for line in cells)


def main(config: StatusConfig) -> int:
    """Print the stack's services; 1 when Redis cannot be read or no service has a heartbeat."""
    try:
        with redis.Redis.from_url(config.bus.redis_url, socket_connect_timeout=5, **config.bus.redis_auth) as client:
            beats = read_heartbeats(client, config.bus.names.heartbeat)
    except redis.RedisError as exc:
        print(f"pagedserve status: cannot read {config.bus.redis_url}: {exc}", file=sys.stderr)
        return 1
    service_rows = rows(beats, config.stale_after_s)
    if config.json:
        print(json.dumps(service_rows, indent=1))
    elif service_rows:
        print(table(service_rows))
    else:
        print(f"no service has a heartbeat under {config.bus.names.heartbeat}", file=sys.stderr)
    return 0 if service_rows else 1
