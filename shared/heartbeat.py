"""Heartbeats: every service's liveness and load, one field per service in the ``ps:heartbeat`` hash."""

from __future__ import annotations

import logging
import time

import redis

from shared.protocol import Heartbeat, ProtocolError

log = logging.getLogger(__name__)


class HeartbeatWriter:
    """Writes one service's Heartbeat into the ``ps:heartbeat`` hash at most every ``interval_s``."""

    def __init__(self, client: redis.Redis, key: str, service: str, service_id: str, interval_s: float = 1.0):
        self.client, self.key = client, key
        self.service, self.service_id = service, service_id
        self.interval_s = interval_s
        self._next = 0.0

    def beat(self, stats: dict[str, float], *, force: bool = False) -> bool:
        now = time.monotonic()
        if not force and now < self._next:
            return False
        self._next = now + self.interval_s
        msg = Heartbeat(service=self.service, service_id=self.service_id, time=time.time(),
                        stats={k: float(v) for k, v in stats.items()})
        try:
            self.client.hset(self.key, self.service_id, msg.to_wire())
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("heartbeat not written: %s", exc)
        return True

    def remove(self) -> None:
        try:
            self.client.hdel(self.key, self.service_id)
        except (redis.ConnectionError, redis.TimeoutError):
            pass


def read_heartbeats(client: redis.Redis, key: str, *, max_age_s: float | None = None) -> dict[str, Heartbeat]:
    """service id -> its latest Heartbeat (undecodable entries skipped; stale ones too when max_age_s)."""
    out = {}
    now = time.time()
    for service_id, data in client.hgetall(key).items():
        try:
            msg = Heartbeat.from_wire(data)
        except ProtocolError:
            continue
        if max_age_s is None or now - msg.time <= max_age_s:
            out[service_id.decode() if isinstance(service_id, bytes) else service_id] = msg
    return out
