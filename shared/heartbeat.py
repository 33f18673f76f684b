"""Heartbeats: every service's liveness and load, one field per service in the ``ps:heartbeat`` hash.

The hash's value is built by ``heartbeat_value`` and read by ``parse_heartbeats``, both free of
I/O, so the sync services (``HeartbeatWriter``, ``read_heartbeats``) and the gateway's asyncio
task write and read the same thing with their own clients.

What counts as evidence that a service is gone (README: what survives what):
- its beat is older than the reader's max age -- but only when the reader itself has reached
  Redis for that long (after an outage every beat is old, and nobody is dead for it);
- its beat carries the ``stopped`` marker a clean shutdown leaves (``HeartbeatWriter.remove``);
- its field is missing while the hash is older than a few beats (``hash_age_s``: the ``_epoch``
  field every writer sets with HSETNX). Right after FLUSHALL or an empty Redis restart the hash
  is young and missing fields prove nothing.
Beats older than a TTL are deleted by the live writers (the hash has no per-field TTL on Redis
6.2/7.0), in a transaction that fails if the hash changed since it was read, so a dead service
disappears from `pagedserve status` and /metrics and a live one is never deleted.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping

import redis

from shared.protocol import Heartbeat, ProtocolError

log = logging.getLogger(__name__)

EPOCH_FIELD = b"_epoch"  # when this hash was (re)created, wall clock: not a service
STOPPED = "stopped"  # stats key of the last beat a clean shutdown writes
DEFAULT_TTL_S = 60.0

def heartbeat_value(service: str, service_id: str, stats: Mapping[str, float], start_time: float = 0.0) -> bytes:
    """The hash value of one beat of ``service_id`` (this process, started at ``start_time``), stamped now."""
    return Heartbeat(service=service, service_id=service_id, time=time.time(),
                     stats={k: float(v) for k, v in stats.items()}, host=socket.gethostname(), pid=os.getpid(),
                     start_time=start_time).to_wire()


def is_stopped(beat: Heartbeat) -> bool:
    """The last beat of a service that shut down cleanly."""
    return beat.stats.get(STOPPED, 0.0) > 0


def _is_epoch(field: bytes | str) -> bool:
    return (field.encode() if isinstance(field, str) else field) == EPOCH_FIELD


def parse_heartbeats(raw: Mapping[bytes | str, bytes], *, max_age_s: float | None = None,
                     service: str | None = None, stopped: bool = False) -> dict[str, Heartbeat]:
    """service id -> its Heartbeat, from the hash's fields (HGETALL). Undecodable values are
    skipped; so are beats older than ``max_age_s`` and those of another ``service`` when given,
    and the markers of stopped services unless ``stopped``."""
    out = {}
    now = time.time()
    for service_id, data in raw.items():
        if _is_epoch(service_id):
            continue
        try:
            beat = Heartbeat.from_wire(data)
        except ProtocolError:
            continue
        fresh = max_age_s is None or now - beat.time <= max_age_s
        if fresh and (stopped or not is_stopped(beat)) and service in (None, beat.service):
            out[service_id.decode() if isinstance(service_id, bytes) else service_id] = beat
    return out


def hash_age_s(raw: Mapping[bytes | str, bytes]) -> float:
    """How long the heartbeat hash has existed (0 when it has no epoch: just flushed or never written)."""
    for field, value in raw.items():
        if _is_epoch(field):
            try:
                return max(0.0, time.time() - float(value))
            except ValueError:
                return 0.0
    return 0.0


def read_heartbeats(client: redis.Redis, key: str, *, max_age_s: float | None = None,
                    service: str | None = None, stopped: bool = False) -> dict[str, Heartbeat]:
    """``parse_heartbeats`` of the hash ``key``."""
    return parse_heartbeats(client.hgetall(key), max_age_s=max_age_s, service=service, stopped=stopped)


def expire_heartbeats(client: redis.Redis, key: str, ttl_s: float) -> list[str]:
    """Delete the beats older than ``ttl_s`` (stopped markers included), unless the hash changed
    since they were read (WATCH: a service may have beaten meanwhile; plain transactions, no
    scripting, so the ACL roles of shared/redis_server.py may do it); the ids deleted."""
    with client.pipeline(transaction=True) as pipe:
        for _ in range(3):
            try:
                pipe.watch(key)
                now, old = time.time(), []
                for field, data in pipe.hgetall(key).items():
                    try:
                        if not _is_epoch(field) and now - Heartbeat.from_wire(data).time > ttl_s:
                            old.append(field)
                    except ProtocolError:
                        continue
                if not old:
                    pipe.unwatch()
                    return []
                pipe.multi()
                pipe.hdel(key, *old)
                pipe.execute()
            except redis.WatchError:  # a beat landed between the read and the delete: read again
                continue
            gone = [f.decode() if isinstance(f, bytes) else f for f in old]
            log.info("expired the heartbeats of %s (older than %gs)", ", ".join(gone), ttl_s)
            return gone
    return []


class Punctuality:
    """Whether one service's periodic writes to Redis land on time: ``healthy_for()`` is how long
    they have succeeded without a failure or a gap. A gap longer than ``max(3 * interval,
    interval + 2 s)`` between two writes, or since the last one, means a stall (Redis's or this
    process's -- a host paused, a long step): every heartbeat read across it looks stale, so a
    reader's staleness verdicts count only once the writes have been on time for long enough."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic):
        self.max_gap_s = max(3 * interval_s, interval_s + 2.0)
        self.clock = clock
        self._healthy_since: float | None = None
        self._last_ok: float | None = None  # monotonic: when the last write landed

    def healthy_for(self) -> float:
        """Seconds since the writes began landing on time again (0 after a failure, and while the
        next write is overdue: a stall is in progress right now)."""
        now = self.clock()
        if self._healthy_since is None or self._last_ok is None or now - self._last_ok > self.max_gap_s:
            return 0.0
        return now - self._healthy_since

    def landed(self) -> None:
        now = self.clock()
        if self._last_ok is not None and now - self._last_ok > self.max_gap_s:
            self._healthy_since = None  # this write came late: a stall ended just now
        self._last_ok = now
        if self._healthy_since is None:
            self._healthy_since = now

    def failed(self) -> None:
        self._healthy_since = None


class HeartbeatWriter:
    """Writes one service's Heartbeat into the ``ps:heartbeat`` hash at most every ``interval_s``.

    It also owns this service's view of the bus's health: ``healthy_for()`` (how long its writes
    have succeeded without a failure: a reader's staleness verdicts count only within it), and
    ``num_losses`` (how often the hash's epoch had changed when it wrote again: the hash was
    flushed or Redis restarted empty -- entries in flight were lost with it; a field merely
    expired by others while this service was stalled changes nothing). Every ``ttl_s / 4``
    it deletes the beats older than ``ttl_s``, once it has itself reached Redis for ``ttl_s``.
    """

    def __init__(self, client: redis.Redis, key: str, service: str, service_id: str, interval_s: float = 1.0,
                 ttl_s: float = DEFAULT_TTL_S):
        self.client, self.key = client, key
        self.service, self.service_id = service, service_id
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self.start_time = time.time()
        self.num_losses = 0
        self._next = 0.0
        self._next_expiry = 0.0
        self._epoch: bytes | None = None  # the hash's epoch at the last beat: a new one means it was lost
        self.punctuality = Punctuality(interval_s)

    def healthy_for(self) -> float:
        """Seconds this writer's beats have landed on time (``Punctuality``)."""
        return self.punctuality.healthy_for()

    def failed(self) -> None:
        """The service saw Redis fail: staleness is no evidence until it has had Redis for a while."""
        self.punctuality.failed()

    def beat(self, stats: Mapping[str, float], *, force: bool = False) -> bool:
        now = time.monotonic()
        if not force and now < self._next:
            return False
        self._next = now + self.interval_s
        pipe = self.client.pipeline(transaction=False)
        pipe.hsetnx(self.key, EPOCH_FIELD, repr(time.time()))
        pipe.hset(self.key, self.service_id, heartbeat_value(self.service, self.service_id, stats, self.start_time))
        pipe.hget(self.key, EPOCH_FIELD)
        try:
            _, _, epoch = pipe.execute()
        except redis.RedisError as exc:
            log.warning("heartbeat not written: %s", exc)
            self.failed()
            return True
        self.punctuality.landed()
        if self._epoch is not None and epoch != self._epoch:
            self.num_losses += 1
            log.warning("%s: the heartbeat hash was re-created: Redis was flushed or restarted empty", self.service_id)
        self._epoch = epoch
        now = time.monotonic()
        if now >= self._next_expiry and self.healthy_for() >= self.ttl_s:
            self._next_expiry = now + self.ttl_s / 4
            try:
                expire_heartbeats(self.client, self.key, self.ttl_s)
            except redis.RedisError as exc:
                log.warning("heartbeats not expired: %s", exc)
        return True

    def remove(self) -> None:
        """A clean shutdown: a last beat marked stopped (readers take it as gone at once; it
        expires with the TTL) -- a field merely missing is no proof of anything."""
        try:
            self.client.hset(self.key, self.service_id,
                             heartbeat_value(self.service, self.service_id, {STOPPED: 1.0}, self.start_time))
        except redis.RedisError:
            pass
