"""`python -m shared.healthcheck KIND`: exit 0 when this host's KIND service (gateway, tokenizer,
engine or detok) has a fresh heartbeat, 1 otherwise, with one line saying why.

For container healthchecks (docker-compose.yml): a container's hostname is its own, so "a beat
from this host" is the service in this container. The bus settings come from the same flags and
PAGEDSERVE_* variables as the service's (``pagedserve status``'s config).
"""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Mapping

import redis

from shared import flags
from shared.heartbeat import is_stopped, read_heartbeats
from shared.protocol import Heartbeat

KINDS = ("gateway", "tokenizer", "engine", "detok")


def own_beat(beats: Mapping[str, Heartbeat], kind: str, host: str, max_age_s: float,
             now: float | None = None) -> Heartbeat | None:
    """The freshest beat of ``kind`` from ``host`` no older than ``max_age_s``, if any (a clean
    shutdown's last beat does not count)."""
    now = time.time() if now is None else now
    mine = [b for b in beats.values()
            if b.service == kind and b.host == host and now - b.time <= max_age_s and not is_stopped(b)]
    return max(mine, key=lambda b: b.time, default=None)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in KINDS:
        print(f"usage: python -m shared.healthcheck {{{'|'.join(KINDS)}}} [pagedserve status flags]", file=sys.stderr)
        return 2
    kind, config = argv[0], flags.parse("status", argv[1:])
    host = socket.gethostname()
    try:
        with redis.Redis.from_url(config.bus.redis_url, socket_connect_timeout=3, socket_timeout=3,
                                  **config.bus.redis_auth) as client:
            beats = read_heartbeats(client, config.bus.names.heartbeat)
    except redis.RedisError as exc:
        print(f"unhealthy: cannot read the heartbeats: {exc}")
        return 1
    beat = own_beat(beats, kind, host, config.stale_after_s)
    if beat is None:
        print(f"unhealthy: no {kind} heartbeat from {host} in the last {config.stale_after_s:g} s")
        return 1
    print(f"healthy: {beat.service_id} (pid {beat.pid}) beat {time.time() - beat.time:.1f} s ago")
    return 0


if __name__ == "__main__":
    sys.exit(main())
