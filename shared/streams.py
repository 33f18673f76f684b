"""The Redis Streams bus: producers, consumer-group readers and plain readers (sync and asyncio).

An entry holds the messages one send put on one stream (``shared/entries.py``); readers hand
out one Envelope per message, carrying its entry's id. Writers trim with ``MAXLEN ~``. A
``GroupReader`` never hands its caller an undecodable message: it answers the message's
``reply_to`` with an error when it can and copies it to the dead-letter stream; an entry with
nothing valid left is acked at once.
Blocking reads run on a connection of their own whose socket timeout outlasts the block.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterable

import redis
import redis.asyncio as aioredis

from shared import entries
from shared.dead_letters import dead_letter
from shared.protocol import Message, ProtocolError, decode

log = logging.getLogger(__name__)

FIELD = entries.FIELD
DEFAULT_MAXLEN = 100_000


@dataclass(frozen=True, slots=True)
class Envelope:
    """One message of a stream entry: the entry's id and the validated message."""

    id: str
    msg: Message


def _id(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def _check_block(block_ms: int | None) -> int | None:
    if block_ms is not None and block_ms <= 0:
        raise ValueError("block_ms must be None (poll) or positive; BLOCK 0 would wait forever")
    return block_ms


def _outlasting(client, block_ms: int) -> dict:
    """The client's connection settings, with a socket timeout that outlasts a block_ms wait."""
    kwargs = dict(client.connection_pool.connection_kwargs)
    timeout = kwargs.get("socket_timeout")
    if timeout is not None:
        kwargs["socket_timeout"] = max(timeout, block_ms / 1000 + 5)
    return kwargs


def blocking_client(client: redis.Redis, block_ms: int = 60_000) -> redis.Redis:
    """A client on its own pool, same server, whose socket timeout outlasts any block we issue."""
    pool = redis.ConnectionPool(connection_class=client.connection_pool.connection_class,
                                **_outlasting(client, block_ms))
    return redis.Redis(connection_pool=pool)


def async_blocking_client(client: aioredis.Redis, block_ms: int = 60_000) -> aioredis.Redis:
    pool = aioredis.ConnectionPool(connection_class=client.connection_pool.connection_class,
                                   **_outlasting(client, block_ms))
    return aioredis.Redis(connection_pool=pool)


def connect(redis_url: str, **kwargs) -> redis.Redis:
    """A client for the bus: bytes in, bytes out (messages are MessagePack), short socket timeouts."""
    kwargs.setdefault("socket_timeout", 10)
    kwargs.setdefault("socket_connect_timeout", 5)
    kwargs.setdefault("health_check_interval", 30)
    return redis.Redis.from_url(redis_url, decode_responses=False, **kwargs)


def async_connect(redis_url: str, **kwargs) -> aioredis.Redis:
    kwargs.setdefault("socket_timeout", 10)
    kwargs.setdefault("socket_connect_timeout", 5)
    return aioredis.Redis.from_url(redis_url, decode_responses=False, **kwargs)


# --------------------------------------------------------------------------- producers


class Producer:
    """Writes messages to streams, every XADD trimmed and a send's XADDs pipelined. ``batch``:
    a send's messages for one stream share one entry (for streams without competing readers)."""

    def __init__(self, client: redis.Redis, maxlen: int = DEFAULT_MAXLEN, *, batch: bool = False):
        self.client = client
        self.maxlen = maxlen
        self.batch = batch

    def send(self, stream: str, msg: Message) -> str:
        return _id(self.client.xadd(stream, {FIELD: msg.to_wire()}, maxlen=self.maxlen, approximate=True))

    def send_many(self, items: Iterable[tuple[str, Message]]) -> list[str]:
        """The ids of the entries written (batched: one per stream, not per message)."""
        packed = entries.pack(items, self.batch)
        if not packed:
            return []
        if len(packed) == 1:
            return [_id(self.client.xadd(packed[0][0], packed[0][1], maxlen=self.maxlen, approximate=True))]
        pipe = self.client.pipeline(transaction=False)
        for stream, fields in packed:
            pipe.xadd(stream, fields, maxlen=self.maxlen, approximate=True)
        return [_id(x) for x in pipe.execute()]

    def send_raw(self, stream: str, fields: dict) -> str:
        """XADD of arbitrary fields (dead letters keep the refused bytes as they came)."""
        return _id(self.client.xadd(stream, fields, maxlen=self.maxlen, approximate=True))


class AsyncProducer:
    """Producer over redis.asyncio, for the gateway."""

    def __init__(self, client: aioredis.Redis, maxlen: int = DEFAULT_MAXLEN, *, batch: bool = False):
        self.client = client
        self.maxlen = maxlen
        self.batch = batch

    async def send(self, stream: str, msg: Message) -> str:
        return _id(await self.client.xadd(stream, {FIELD: msg.to_wire()}, maxlen=self.maxlen, approximate=True))

    async def send_many(self, items: Iterable[tuple[str, Message]]) -> list[str]:
        packed = entries.pack(items, self.batch)
        if not packed:
            return []
        pipe = self.client.pipeline(transaction=False)
        for stream, fields in packed:
            pipe.xadd(stream, fields, maxlen=self.maxlen, approximate=True)
        return [_id(x) for x in await pipe.execute()]


def _decode_entry(stream: str, entry_id: str, fields: dict | None) -> list[Envelope]:
    """A plain reader's view of an entry: its valid messages; the rest are logged and skipped."""
    try:
        wires = entries.payloads(fields)
    except ProtocolError as exc:
        log.warning("%s: skipping invalid entry %s: %s", stream, entry_id, exc.message)
        return []
    out = []
    for wire in wires:
        try:
            out.append(Envelope(entry_id, decode(wire)))
        except ProtocolError as exc:
            log.warning("%s: skipping an invalid message of entry %s: %s", stream, entry_id, exc.message)
    return out


# --------------------------------------------------------------------------- group reader


class GroupReader:
    """One consumer of one consumer group on one stream.

    It owns the consumer's cursor: first its own pending entries (a restarted consumer resumes
    where it stopped), then new ones; now and then it claims entries left idle by dead consumers.
    It keeps the group alive: NOGROUP (Redis restarted or flushed) re-creates it with backoff.
    """

    def __init__(self, client: redis.Redis, stream: str, group: str, consumer: str, *,
                 claim_idle_ms: int | None = 30_000, dlq: str | None = None,
                 producer: Producer | None = None, max_block_ms: int = 60_000,
                 accept: tuple[type[Message], ...] | None = None):
        self.client = client
        self.stream, self.group, self.consumer = stream, group, consumer
        self.accept = accept  # other message types are refused like garbage
        self.claim_idle_ms = claim_idle_ms
        self.dlq = dlq if dlq is not None else stream.split(":", 1)[0] + ":dlq"
        self.producer = producer or Producer(client)
        self.blocking = blocking_client(client, max_block_ms)
        self._draining = True  # own pending entries first
        self._pending_cursor = "0"
        self._claim_cursor = "0-0"
        self._next_claim = 0.0
        self._backoff = 0.0
        self._group_ready = False

    # ----------------------------------------------------------------- group life
    def ensure_group(self) -> None:
        try:
            self.client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    def _recover(self, exc: Exception) -> None:
        """NOGROUP or a lost connection: back off (no busy spin), then re-create the group."""
        self._backoff = min(2.0, max(0.05, self._backoff * 2))
        log.warning("%s/%s: %s; retrying in %.2fs", self.stream, self.group, exc, self._backoff)
        time.sleep(self._backoff)
        self._group_ready = False
        self._draining, self._pending_cursor, self._claim_cursor = True, "0", "0-0"
        try:
            self.ensure_group()
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError) as again:
            log.warning("%s/%s: cannot re-create group yet: %s", self.stream, self.group, again)

    # ----------------------------------------------------------------- reading
    def read(self, count: int = 64, block_ms: int | None = None) -> list[Envelope]:
        """Up to ``count`` valid messages: own pending, then claimed, then new (blocking up to block_ms)."""
        _check_block(block_ms)
        try:
            if not self._group_ready:
                self.ensure_group()
            if self._draining:
                got = self._read_pending(count)
                if got is not None:
                    return got
            claimed = self._maybe_claim(count)
            if claimed:
                return claimed
            resp = self.blocking.xreadgroup(self.group, self.consumer, {self.stream: ">"},
                                            count=count, block=block_ms)
            self._backoff = 0.0
            return self._accept(resp[0][1] if resp else [])
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self._recover(exc)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            self._recover(exc)
        return []

    def _read_pending(self, count: int) -> list[Envelope] | None:
        resp = self.client.xreadgroup(self.group, self.consumer, {self.stream: self._pending_cursor}, count=count)
        entries = resp[0][1] if resp else []
        if not entries:
            self._draining = False
            return None
        self._pending_cursor = _id(entries[-1][0])
        return self._accept(entries)

    def _maybe_claim(self, count: int) -> list[Envelope]:
        if self.claim_idle_ms is None or time.monotonic() < self._next_claim:
            return []
        resp = self.client.xautoclaim(self.stream, self.group, self.consumer, self.claim_idle_ms,
                                      start_id=self._claim_cursor, count=count)
        # Redis 6.2 answers [cursor, entries]; 7.x adds the ids of deleted entries as a third item
        self._claim_cursor = _id(resp[0])
        entries, deleted = resp[1], (resp[2] if len(resp) > 2 else [])
        if deleted:
            self.client.xack(self.stream, self.group, *deleted)
        if any(entry_id is None for entry_id, _ in entries):
            self._ack_vanished()  # 6.2 claims deleted entries but answers nil for them
        if self._claim_cursor in ("0-0", "0"):
            self._next_claim = time.monotonic() + max(self.claim_idle_ms / 2000, 0.05)
        if entries:
            log.info("%s/%s: %s claimed %d idle entries", self.stream, self.group, self.consumer, len(entries))
        return self._accept(entries)

    def _ack_vanished(self) -> None:
        resp = self.client.xreadgroup(self.group, self.consumer, {self.stream: "0"}, count=10_000)
        gone = [_id(entry_id) for entry_id, fields in (resp[0][1] if resp else []) if not fields]
        if gone:
            self.client.xack(self.stream, self.group, *gone)

    def _accept(self, raw_entries: list) -> list[Envelope]:
        """Decode entries; refused messages are dead-lettered here and never returned, and an
        entry left with no valid message is acked."""
        out, refused = [], []
        for entry_id, fields in raw_entries:
            if entry_id is None:
                continue
            entry_id = _id(entry_id)
            if fields is None or fields == {}:  # trimmed while pending: nothing left to do
                refused.append(entry_id)
                continue
            try:
                wires = entries.payloads(fields)
            except ProtocolError as exc:
                dead_letter(self.producer, self.dlq, self.stream, entry_id, fields.get(FIELD), exc.message)
                refused.append(entry_id)
                continue
            good = [env for wire in wires if (env := self._accept_one(entry_id, wire)) is not None]
            if good:
                out += good
            else:
                refused.append(entry_id)
        if refused:
            self.client.xack(self.stream, self.group, *refused)
        return out

    def _accept_one(self, entry_id: str, wire: bytes) -> Envelope | None:
        try:
            msg = decode(wire)
            if self.accept is not None and not isinstance(msg, self.accept):
                raise ProtocolError(f"{type(msg).__name__} does not belong on {self.stream}")
        except ProtocolError as exc:
            dead_letter(self.producer, self.dlq, self.stream, entry_id, wire, exc.message)
            return None
        return Envelope(entry_id, msg)

    def ack(self, envelopes: Iterable[Envelope | str]) -> int:
        ids = list(dict.fromkeys(e.id if isinstance(e, Envelope) else e for e in envelopes))  # entries, once
        if not ids:
            return 0
        try:
            return int(self.client.xack(self.stream, self.group, *ids))
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            return 0  # the group (and its pending list) is gone: nothing left to ack

    # ----------------------------------------------------------------- inspection
    def num_pending(self) -> int:
        try:
            return int(self.client.xpending(self.stream, self.group)["pending"])
        except redis.ResponseError:
            return 0

    def close(self) -> None:
        self.blocking.close()


# --------------------------------------------------------------------------- plain readers


def _start_id(last_id: bytes | str | None) -> str:
    return _id(last_id) if last_id else "0-0"


class StreamReader:
    """A private cursor over one stream (XREAD): for fan-out (engine ctl) and reply streams."""

    def __init__(self, client: redis.Redis, stream: str, start: str = "$", max_block_ms: int = 60_000):
        self.client = client
        self.stream = stream
        self.blocking = blocking_client(client, max_block_ms)
        # resolve "$" now, so entries written between construction and the first read are seen
        self.last_id = self._resolve(start)

    def _resolve(self, start: str) -> str:
        if start != "$":
            return start
        try:
            return _start_id(self.client.xinfo_stream(self.stream)["last-generated-id"])
        except redis.ResponseError:  # no such stream yet
            return "0-0"

    def read(self, count: int = 256, block_ms: int | None = None) -> list[Envelope]:
        _check_block(block_ms)
        try:
            resp = self.blocking.xread({self.stream: self.last_id}, count=count, block=block_ms)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("%s: %s", self.stream, exc)
            time.sleep(0.2)
            return []
        return self._accept(resp[0][1] if resp else [])

    def _accept(self, raw_entries: list) -> list[Envelope]:
        out = []
        for entry_id, fields in raw_entries:
            self.last_id = _id(entry_id)
            out += _decode_entry(self.stream, self.last_id, fields)
        return out

    def close(self) -> None:
        self.blocking.close()


class AsyncStreamReader:
    """StreamReader over redis.asyncio: the gateway's reply-stream reader."""

    def __init__(self, client: aioredis.Redis, stream: str, start: str = "0-0", max_block_ms: int = 60_000):
        self.client = client
        self.stream = stream
        self.blocking = async_blocking_client(client, max_block_ms)
        self.last_id = start

    async def resolve_start(self) -> None:
        """Call once before reading when constructed with start="$" (resolves it to an id)."""
        if self.last_id != "$":
            return
        try:
            self.last_id = _start_id((await self.client.xinfo_stream(self.stream))["last-generated-id"])
        except aioredis.ResponseError:
            self.last_id = "0-0"

    async def read(self, count: int = 256, block_ms: int | None = None) -> list[Envelope]:
        _check_block(block_ms)
        await self.resolve_start()
        resp = await self.blocking.xread({self.stream: self.last_id}, count=count, block=block_ms)
        out = []
        for entry_id, fields in (resp[0][1] if resp else []):
            self.last_id = _id(entry_id)
            out += _decode_entry(self.stream, self.last_id, fields)
        return out

    async def close(self) -> None:
        await self.blocking.aclose()
