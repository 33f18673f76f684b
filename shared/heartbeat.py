"""Heartbeats: every service's liveness and load, one field per service in the ``ps:heartbeat`` hash.

The hash's value is built by ``heartbeat_value`` and read by ``parse_heartbeats``, both free of
I/O, so the sync services (``HeartbeatWriter``, ``read_heartbeats``) and the gateway's asyncio
task write and read the same thing with their own clients.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping

import redis

from shared.protocol import Heartbeat, ProtocolError

log = logging.getLogger(__name__)


def heartbeat_value(service: str, service_id: str, stats: Mapping[str, float], start_time: float = 0.0) -> bytes:
    """The hash value of one beat of ``service_id`` (this process, started at ``start_time``), stamped now."""
    return Heartbeat(service=service, service_id=service_id, time=time.time(),
                     stats={k: float(v) for k, v in stats.items()}, host=socket.gethostname(), pid=os.getpid(),
                     start_time=start_time).to_wire()


def parse_heartbeats(raw: Mapping[bytes | str, bytes], *, max_age_s: float | None = None,
                     service: str | None = None) -> dict[str, Heartbeat]:
    """service id -> its Heartbeat, from the hash's fields (HGETALL). Undecodable values are
    skipped; so are beats older than ``max_age_s`` and those of another ``service`` when given."""
    out = {}
    now = time.time()
    for service_id, data in raw.items():
        try:
            beat = Heartbeat.from_wire(data)
        except ProtocolError:
            continue
        if (max_age_s is None or now - beat.time <= max_age_s) and service in (None, beat.service):
            out[service_id.decode() if isinstance(service_id, bytes) else service_id] = beat
    return out


def read_heartbeats(client: redis.Redis, key: str, *, max_age_s: float | None = None,
                    service: str | None = None) -> dict[str, Heartbeat]:
    """``parse_heartbeats`` of the hash ``key``."""
    return parse_heartbeats(client.hgetall(key), max_age_s=max_age_s, service=service)


class HeartbeatWriter:
    """Writes one service's Heartbeat into the ``ps:heartbeat`` hash at most every ``interval_s``."""

    def __init__(self, client: redis.Redis, key: str, service: str, service_id: str, interval_s: float = 1.0):
        self.client, self.key = client, key
        self.service, self.service_id = service, service_id
        self.interval_s = interval_s
        self.start_time = time.time()
        self._next = 0.0

    def beat(self, stats: Mapping[str, float], *, force: bool = False) -> bool:
        now = time.monotonic()
        if not force and now < self._next:
            return False
        self._next = now + self.interval_s
        try:
            self.client.hset(self.key, self.service_id, heartbeat_value(self.service, self.service_id, stats,
                                                                      self.start_time))
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("heartbeat not written: %s", exc)
        return True

    def remove(self) -> None:
        try:
            self.client.hdel(self.key, self.service_id)
        except (redis.ConnectionError, redis.TimeoutError):
            pass
