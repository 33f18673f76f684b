"""The Redis Streams bus: producers and plain readers (sync and asyncio); the consumer-group
reader is in ``shared.group_reader``.

An entry holds the messages one send put on one stream (``shared/entries.py``); readers hand
out one Envelope per message, carrying its entry's id. Writers trim with ``MAXLEN ~``. A
``GroupReader`` never hands its caller an undecodable message: it answers the message's
``reply_to`` with an error when it can and copies it to the dead-letter stream; an entry with
nothing valid left is acked at once.
Blocking reads run on a connection of their own whose socket timeout outlasts the block.
No reader lets a Redis error escape (it backs off and reads nothing); a service's writes go
through an ``Outbox``, which keeps what Redis did not take and retries it with backoff.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterable

import redis
import redis.asyncio as aioredis

from shared import entries
from shared.bus_auth import BusSigner, ForgedEntry, RefusalLog, refusal_record
from shared.direct_pipe import AsyncHeldConnection, DirectPipe, HeldConnection
from shared.protocol import Message, ProtocolError, decode

log = logging.getLogger(__name__)

FIELD = entries.FIELD
DEFAULT_MAXLEN = 100_000


@dataclass(frozen=True, slots=True)
class Envelope:
    """One message of a stream entry: the entry's id and the validated message."""

    id: str
    msg: Message


def decode_id(raw: bytes | str) -> str:
    """A stream entry id as Redis returns it (bytes, or str on a decoding client) as str."""
    return raw.decode() if isinstance(raw, bytes) else raw


def check_block(block_ms: int | None) -> int | None:
    """``block_ms`` if it is a valid XREAD/XREADGROUP block time (None: poll)."""
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


def held_connection(client: redis.Redis, block_ms: int = 60_000) -> HeldConnection:
    """A connection of its own (on a pool of its own), same server, for a loop's blocking reads:
    its socket timeout outlasts any block we issue."""
    pool = redis.ConnectionPool(connection_class=client.connection_pool.connection_class,
                                **_outlasting(client, block_ms))
    return HeldConnection(pool)


def async_held_connection(client: aioredis.Redis, block_ms: int = 60_000) -> AsyncHeldConnection:
    """A connection of its own, same server, for a loop's blocking reads: each read times out after
    the client's socket timeout or block_ms + 5 s, whichever is longer, and its writes (a few bytes
    to a socket Redis reads at once) take no timer: with a socket timeout, redis-py's asyncio
    connection sends through ``asyncio.wait_for``, a task per command."""
    kwargs = _outlasting(client, block_ms)
    read_timeout_s = kwargs.pop("socket_timeout", None)
    pool = aioredis.ConnectionPool(connection_class=client.connection_pool.connection_class, socket_timeout=None,
                                   **kwargs)
    return AsyncHeldConnection(pool, read_timeout_s=read_timeout_s)


def connect(redis_url: str, **kwargs) -> redis.Redis:
    """A client for the bus: bytes in, bytes out (messages are MessagePack), short socket timeouts."""
    kwargs.setdefault("socket_timeout", 10)
    kwargs.setdefault("socket_connect_timeout", 5)
    kwargs.setdefault("health_check_interval", 30)
    return redis.Redis.from_url(redis_url, decode_responses=False, **kwargs)


# --------------------------------------------------------------------------- producers


class Producer:
    """Writes messages to streams, every XADD trimmed and a send's XADDs pipelined. ``batch``:
    a send's messages for one stream share entries of up to ``per_entry`` (for streams without
    competing readers)."""

    def __init__(self, client: redis.Redis, maxlen: int = DEFAULT_MAXLEN, *, batch: bool = False,
                 per_entry: int = entries.MAX_PER_ENTRY, signer: BusSigner | None = None):
        self.client = client
        self.maxlen = maxlen
        self.batch = batch
        self.per_entry = per_entry
        self.signer = signer  # every entry carries its MAC (shared/bus_auth.py); None: unsigned

    def send(self, stream: str, msg: Message) -> str:
        fields = _signed(self.signer, stream, {FIELD: msg.to_wire()})
        return decode_id(self.client.xadd(stream, fields, maxlen=self.maxlen, approximate=True))

    def send_many(self, items: Iterable[tuple[str, Message]]) -> list[str]:
        """The ids of the entries written (batched: one per stream and per_entry messages)."""
        pipe = self.client.pipeline(transaction=False)
        if not self.queue_many(pipe, items):
            return []
        return [decode_id(x) for x in pipe.execute()]

    def queue_many(self, pipe, items: Iterable[tuple[str, Message]]) -> int:
        """send_many's XADDs queued on ``pipe`` (executed by its owner); how many were queued."""
        packed = _signed_entries(self.signer, entries.pack(items, self.batch, self.per_entry))
        for stream, fields in packed:
            pipe.xadd(stream, fields, maxlen=self.maxlen, approximate=True)
        return len(packed)

    def send_raw(self, stream: str, fields: dict) -> str:
        """XADD of arbitrary fields (dead letters keep the refused bytes as they came)."""
        return decode_id(self.client.xadd(stream, _signed(self.signer, stream, fields), maxlen=self.maxlen,
                                          approximate=True))


def _signed(signer: BusSigner | None, stream: str, fields: dict) -> dict:
    return fields if signer is None else signer.sign(stream, fields)


def _signed_entries(signer: BusSigner | None, packed: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    return packed if signer is None else [(stream, signer.sign(stream, fields)) for stream, fields in packed]


class Outbox:
    """A service's outgoing messages, and the entries to ack once they are out, until Redis has
    taken them.

    ``flush()`` sends what is kept (pipelined, in order), then acks; when Redis fails it keeps
    everything, sleeps a backoff (50 ms doubling to ``max_backoff_s``: never a busy loop) and
    answers False. A service reads and computes nothing new while its outbox holds anything, so
    an outage costs one turn's output in memory, and nothing is acked before it is sent (a crash
    meanwhile re-delivers). A resend after a partial failure may repeat entries: every reader is
    idempotent (request_id, seq). ``down_for()``: how long the current outage has lasted."""

    def __init__(self, producer: Producer, reader=None, *, max_backoff_s: float = 2.0):
        self.producer = producer
        self.reader = reader  # a GroupReader (its ack never raises), or None
        self.held = HeldConnection(producer.client.connection_pool)  # flush_and_read's (shared/direct_pipe.py)
        self.max_backoff_s = max_backoff_s
        self.items: list[tuple[str, Message]] = []
        self.acks: list = []
        self.num_failures = 0
        self.last_outage_s = 0.0  # how long the last outage that held messages lasted (its caller may reset it)
        self._backoff = 0.0
        self._down_since: float | None = None
        self._next_log = 0.0

    def put(self, items: Iterable[tuple[str, Message]], acks: Iterable = ()) -> None:
        self.items += items
        self.acks += acks

    def __bool__(self) -> bool:
        return bool(self.items or self.acks)

    def down_for(self) -> float:
        return 0.0 if self._down_since is None else time.monotonic() - self._down_since

    def flush(self) -> bool:
        """True when everything is out (or nothing was kept)."""
        if self.items:
            try:
                self.producer.send_many(self.items)
            except redis.RedisError as exc:
                self._failed(exc)
                return False
            self.items = []
        if self.acks and self.reader is not None:
            self.reader.ack(self.acks)
        self.acks = []
        if self._down_since is not None:
            self.last_outage_s = self.down_for()
            log.info("Redis took the held messages after %.1fs", self.last_outage_s)
        self._backoff, self._down_since = 0.0, None
        return True

    def flush_and_read(self, reads: list[tuple[object, int]],
                       block_ms: int | None = None) -> tuple[bool, list[list[Envelope]] | None]:
        """flush(), with the next read of each reader in ``reads`` ([(reader, count)], readers with
        ``queue_read``/``take``/``held``) in the same pipeline: one round trip instead of
        1 + len(reads). Answers (flush()'s answer, each reader's envelopes); the envelopes are None
        when the reads were not made -- acks to send, a reader with more to do than a plain read,
        or Redis failing before any reply -- and then the caller reads as before. With
        ``block_ms`` (one reader) the read waits for entries that long, on the reader's blocking
        connection: the round trip then ends when the next input arrives.

        The reads are taken even when a send failed (their entries are this consumer's now); the
        sends are then held and retried like flush()'s."""
        if self.acks:
            return self.flush(), None
        if block_ms is not None and len(reads) != 1:
            raise ValueError("a blocking flush_and_read takes one reader")
        pipe = DirectPipe(reads[0][0].held if block_ms is not None else self.held)
        num_sends = self.producer.queue_many(pipe, self.items)  # the output first, then the reads
        if not all(reader.queue_read(pipe, count, check_block(block_ms)) for reader, count in reads):
            return self.flush(), None  # the filled pipe is dropped unsent
        try:
            replies = pipe.execute(raise_on_error=False)
        except redis.RedisError as exc:  # the connection itself: nothing is known to have run
            self._failed(exc)
            return False, None
        results = [reader.take(reply) for (reader, _), reply in zip(reads, replies[num_sends:])]
        failed = next((r for r in replies[:num_sends] if isinstance(r, Exception)), None)
        if failed is not None:
            self._failed(failed)
            return False, results
        self.items = []
        return self.flush(), results  # nothing left to send: this only closes an outage's account

    def _failed(self, exc: Exception) -> None:
        self.num_failures += 1
        now = time.monotonic()
        if self._down_since is None:
            self._down_since = now
        if now >= self._next_log:
            self._next_log = now + 10.0
            log.warning("cannot write to Redis (%s: %s); holding %d messages, retrying with backoff",
                        type(exc).__name__, exc, len(self.items))
        self._backoff = min(self.max_backoff_s, max(0.05, self._backoff * 2))
        time.sleep(self._backoff)


class AsyncProducer:
    """Producer over redis.asyncio, for the gateway."""

    def __init__(self, client: aioredis.Redis, maxlen: int = DEFAULT_MAXLEN, *, batch: bool = False,
                 signer: BusSigner | None = None):
        self.client = client
        self.maxlen = maxlen
        self.batch = batch
        self.signer = signer

    async def send(self, stream: str, msg: Message) -> str:
        fields = _signed(self.signer, stream, {FIELD: msg.to_wire()})
        return decode_id(await self.client.xadd(stream, fields, maxlen=self.maxlen, approximate=True))

    async def send_many(self, items: Iterable[tuple[str, Message]]) -> list[str]:
        packed = _signed_entries(self.signer, entries.pack(items, self.batch))
        if not packed:
            return []
        pipe = self.client.pipeline(transaction=False)
        for stream, fields in packed:
            pipe.xadd(stream, fields, maxlen=self.maxlen, approximate=True)
        return [decode_id(x) for x in await pipe.execute()]


def _checked(reader, entry_id: str, fields: dict | None) -> dict | None:
    """A plain reader's check of an entry's MAC (none without a signer): its fields, or None when
    it is refused (counted, and its dead letter queued in ``reader.dead_letters``)."""
    if reader.signer is None:
        return fields
    try:
        return reader.signer.verify(reader.stream, fields)
    except ForgedEntry as exc:
        reader.refusals.refused(entry_id, exc.message)
        reader.dead_letters.append(refusal_record(reader.stream, entry_id, fields, exc.message))
        return None


def _dlq_of(stream: str) -> str:
    return stream.split(":", 1)[0] + ":dlq"


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


# --------------------------------------------------------------------------- plain readers


def _start_id(last_id: bytes | str | None) -> str:
    return decode_id(last_id) if last_id else "0-0"


class StreamReader:
    """A private cursor over one stream (XREAD): for fan-out (engine ctl) and reply streams."""

    def __init__(self, client: redis.Redis, stream: str, start: str = "$", max_block_ms: int = 60_000, *,
                 signer: BusSigner | None = None, dlq: str | None = None):
        self.client = client
        self.stream = stream
        self.signer = signer  # entries without a valid MAC are refused (shared/bus_auth.py)
        self.dlq = dlq or _dlq_of(stream)
        self.refusals = RefusalLog(stream)
        self.dead_letters: list[dict] = []
        self.held = held_connection(client, max_block_ms)  # its reads (shared/direct_pipe.py)
        # resolve "$" now, so entries written between construction and the first read are seen
        self.last_id = self._resolve(start)

    def _resolve(self, start: str) -> str:
        if start != "$":
            return start
        try:
            return _start_id(self.client.xinfo_stream(self.stream)["last-generated-id"])
        except redis.ResponseError:  # no such stream yet
            return "0-0"
        except redis.RedisError as exc:  # Redis away: resolved at the first read that reaches it
            log.warning("%s: %s", self.stream, exc)
            return "$"

    def read(self, count: int = 256, block_ms: int | None = None) -> list[Envelope]:
        check_block(block_ms)
        try:
            if self.last_id == "$":
                self.last_id = self._resolve("$")
            resp = DirectPipe(self.held).xread({self.stream: self.last_id}, count=count, block=block_ms).execute()[0]
        except redis.RedisError as exc:  # stalled, restarting, flushed: never worth dying for
            log.warning("%s: %s", self.stream, exc)
            time.sleep(0.2)
            return []
        return self._accept(resp[0][1] if resp else [])

    def queue_read(self, pipe, count: int = 256, block_ms: int | None = None) -> bool:
        """read(count, block_ms)'s XREAD queued on ``pipe`` (Outbox.flush_and_read); False when
        the cursor is not resolved yet (then read() does that)."""
        if self.last_id == "$":
            return False
        pipe.xread({self.stream: self.last_id}, count=count, block=block_ms)
        return True

    def take(self, reply) -> list[Envelope]:
        """The envelopes of a queued read's reply (an exception: logged, nothing read)."""
        if isinstance(reply, Exception):
            log.warning("%s: %s", self.stream, reply)
            return []
        return self._accept(reply[0][1] if reply else [])

    def _accept(self, raw_entries: list) -> list[Envelope]:
        out = []
        for entry_id, fields in raw_entries:
            self.last_id = decode_id(entry_id)
            if (fields := _checked(self, self.last_id, fields)) is not None:
                out += _decode_entry(self.stream, self.last_id, fields)
        if self.dead_letters:
            self._write_dead_letters()
        return out

    def _write_dead_letters(self) -> None:
        try:
            producer = Producer(self.client, signer=self.signer)
            while self.dead_letters:
                producer.send_raw(self.dlq, self.dead_letters[0])
                self.dead_letters.pop(0)
        except redis.RedisError as exc:  # kept for the next read
            log.warning("%s: dead letters not written yet: %s", self.stream, exc)

    def close(self) -> None:
        self.held.close()
        self.held.pool.disconnect()


class AsyncStreamReader:
    """StreamReader over redis.asyncio: the gateway's reply-stream reader."""

    def __init__(self, client: aioredis.Redis, stream: str, start: str = "0-0", max_block_ms: int = 60_000, *,
                 signer: BusSigner | None = None, dlq: str | None = None):
        self.client = client
        self.stream = stream
        self.signer = signer  # entries without a valid MAC are refused (shared/bus_auth.py)
        self.dlq = dlq or _dlq_of(stream)
        self.refusals = RefusalLog(stream)
        self.dead_letters: list[dict] = []
        self.held = async_held_connection(client, max_block_ms)  # a read per token: shared/direct_pipe.py
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
        check_block(block_ms)
        await self.resolve_start()
        resp = (await self.held.run(DirectPipe().xread({self.stream: self.last_id}, count=count, block=block_ms)))[0]
        out = []
        for entry_id, fields in (resp[0][1] if resp else []):
            self.last_id = decode_id(entry_id)
            if (fields := _checked(self, self.last_id, fields)) is not None:
                out += _decode_entry(self.stream, self.last_id, fields)
        try:
            while self.dead_letters:
                await self.client.xadd(self.dlq, _signed(self.signer, self.dlq, self.dead_letters[0]),
                                       maxlen=DEFAULT_MAXLEN, approximate=True)
                self.dead_letters.pop(0)
        except redis.RedisError as exc:  # kept for the next read; this read's messages still count
            log.warning("%s: dead letters not written yet: %s", self.stream, exc)
        return out

    async def close(self) -> None:
        await self.held.close()
        await self.held.pool.aclose()
