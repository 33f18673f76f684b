"""A consumer of a consumer group: the reader of every stream whose entries must be acked.

The tokenizers and the engines share their groups (competing consumers); each detok shard is
a group of one, so that a restarted shard resumes its own pending entries. One group reads each
of these streams, so an acked entry is worthless: it is deleted with its XACK (one MULTI), and
prompts do not linger in Redis up to MAXLEN.

No Redis error escapes ``read`` or ``ack``: a read backs off and returns nothing; an ack that
could not be written is kept and retried before the next read (the entry stays pending meanwhile,
which is safe: handlers are idempotent).
"""

from __future__ import annotations

import logging
import time
from typing import Iterable

import redis

from shared import entries
from shared.bus_auth import BusSigner, ForgedEntry, RefusalLog, refusal_record
from shared.dead_letters import dead_letter
from shared.direct_pipe import DirectPipe
from shared.protocol import Message, ProtocolError, decode
from shared.streams import FIELD, Envelope, Producer, check_block, decode_id, held_connection

log = logging.getLogger(__name__)


class GroupReader:
    """One consumer of one consumer group on one stream.

    It owns the consumer's cursor: first its own pending entries (a restarted consumer resumes
    where it stopped), then new ones; now and then it claims entries left idle by dead consumers.
    It keeps the group alive: NOGROUP (Redis restarted or flushed) re-creates it with backoff.
    """

    def __init__(self, client: redis.Redis, stream: str, group: str, consumer: str, *,
                 claim_idle_ms: int | None = 30_000, dlq: str | None = None,
                 producer: Producer | None = None, max_block_ms: int = 60_000,
                 accept: tuple[type[Message], ...] | None = None, delete_acked: bool = True,
                 signer: BusSigner | None = None):
        self.client = client
        self.signer = signer  # entries without a valid MAC are refused unread (shared/bus_auth.py)
        self.refusals = RefusalLog(stream)
        self.delete_acked = delete_acked  # XDEL with each XACK: this group is the stream's only reader
        self.stream, self.group, self.consumer = stream, group, consumer
        self.accept = accept  # other message types are refused like garbage
        self.claim_idle_ms = claim_idle_ms
        self.dlq = dlq if dlq is not None else stream.split(":", 1)[0] + ":dlq"
        self.producer = producer or Producer(client, signer=signer)
        self.held = held_connection(client, max_block_ms)  # its blocking reads (shared/direct_pipe.py)
        self._draining = True  # own pending entries first
        self._pending_cursor = "0"
        self._claim_cursor = "0-0"
        self._next_claim = 0.0
        self._backoff = 0.0
        self._group_ready = False
        self.num_reclaimed = 0  # entries claimed from dead consumers (a heartbeat figure)
        self._unacked: list[str] = []  # acks that failed (Redis away): retried before the next read

    # ----------------------------------------------------------------- group life
    def ensure_group(self) -> None:
        try:
            self.client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    def _recover(self, exc: Exception) -> None:
        """NOGROUP, a lost connection or any other Redis error: back off (no busy spin, at most
        2 s), then re-create the group."""
        self._backoff = min(2.0, max(0.05, self._backoff * 2))
        log.warning("%s/%s: %s; retrying in %.2fs", self.stream, self.group, exc, self._backoff)
        time.sleep(self._backoff)
        self._group_ready = False
        self._draining, self._pending_cursor, self._claim_cursor = True, "0", "0-0"
        try:
            self.ensure_group()
        except redis.RedisError as again:
            log.warning("%s/%s: cannot re-create group yet: %s", self.stream, self.group, again)

    # ----------------------------------------------------------------- reading
    def read(self, count: int = 64, block_ms: int | None = None) -> list[Envelope]:
        """Up to ``count`` valid messages: own pending, then claimed, then new (blocking up to block_ms)."""
        check_block(block_ms)
        try:
            if not self._group_ready:
                self.ensure_group()
            if self._unacked:
                self._ack_now(self._unacked)
                self._unacked = []
            if self._draining:
                got = self._read_pending(count)
                if got is not None:
                    return got
            claimed = self._maybe_claim(count)
            if claimed:
                return claimed
            resp = DirectPipe(self.held).xreadgroup(self.group, self.consumer, {self.stream: ">"},
                                                    count=count, block=block_ms).execute()[0]
            self._backoff = 0.0
            return self._accept(resp[0][1] if resp else [])
        except redis.ResponseError as exc:
            if "NOGROUP" in str(exc):
                self._unacked = []  # the group and its pending list are gone with the data
            self._recover(exc)
        except redis.RedisError as exc:
            self._recover(exc)
        return []

    def queue_read(self, pipe, count: int = 64, block_ms: int | None = None) -> bool:
        """read(count, block_ms)'s XREADGROUP of new entries queued on ``pipe``
        (Outbox.flush_and_read); False when read() has more to do first (the group to create,
        acks to retry, own pending entries to drain, idle entries to claim)."""
        if not self._group_ready or self._unacked or self._draining or (
                self.claim_idle_ms is not None and time.monotonic() >= self._next_claim):
            return False
        pipe.xreadgroup(self.group, self.consumer, {self.stream: ">"}, count=count, block=block_ms)
        return True

    def take(self, reply) -> list[Envelope]:
        """The envelopes of a queued read's reply; an exception is handled as read() handles it."""
        if isinstance(reply, Exception):
            if isinstance(reply, redis.ResponseError) and "NOGROUP" in str(reply):
                self._unacked = []  # the group and its pending list are gone with the data
            self._recover(reply)
            return []
        self._backoff = 0.0
        return self._accept(reply[0][1] if reply else [])

    def _read_pending(self, count: int) -> list[Envelope] | None:
        resp = self.client.xreadgroup(self.group, self.consumer, {self.stream: self._pending_cursor}, count=count)
        entries = resp[0][1] if resp else []
        if not entries:
            self._draining = False
            return None
        self._pending_cursor = decode_id(entries[-1][0])
        return self._accept(entries)

    def _maybe_claim(self, count: int) -> list[Envelope]:
        if self.claim_idle_ms is None or time.monotonic() < self._next_claim:
            return []
        resp = self.client.xautoclaim(self.stream, self.group, self.consumer, self.claim_idle_ms,
                                      start_id=self._claim_cursor, count=count)
        # Redis 6.2 answers [cursor, entries]; 7.x adds the ids of deleted entries as a third item
        self._claim_cursor = decode_id(resp[0])
        entries, deleted = resp[1], (resp[2] if len(resp) > 2 else [])
        if deleted:
            self.client.xack(self.stream, self.group, *deleted)
        if any(entry_id is None for entry_id, _ in entries):
            self._ack_vanished()  # 6.2 claims deleted entries but answers nil for them
        if self._claim_cursor in ("0-0", "0"):
            self._next_claim = time.monotonic() + max(self.claim_idle_ms / 2000, 0.05)
        if entries:
            self.num_reclaimed += len(entries)
            log.info("%s/%s: %s claimed %d idle entries", self.stream, self.group, self.consumer, len(entries))
        return self._accept(entries)

    def _ack_vanished(self) -> None:
        resp = self.client.xreadgroup(self.group, self.consumer, {self.stream: "0"}, count=10_000)
        gone = [decode_id(entry_id) for entry_id, fields in (resp[0][1] if resp else []) if not fields]
        if gone:
            self.client.xack(self.stream, self.group, *gone)

    def _accept(self, raw_entries: list) -> list[Envelope]:
        """Decode entries; refused messages are dead-lettered here and never returned, and an
        entry left with no valid message is acked."""
        out, refused = [], []
        for entry_id, fields in raw_entries:
            if entry_id is None:
                continue
            entry_id = decode_id(entry_id)
            if fields is None or fields == {}:  # trimmed while pending: nothing left to do
                refused.append(entry_id)
                continue
            try:
                wires = entries.payloads(fields if self.signer is None else self.signer.verify(self.stream, fields))
            except ForgedEntry as exc:  # its reply_to is as forged as the rest: nobody is answered
                self.refusals.refused(entry_id, exc.message)
                self.producer.send_raw(self.dlq, refusal_record(self.stream, entry_id, fields, exc.message))
                refused.append(entry_id)
                continue
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
            self._ack_now(refused)
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
            return self._ack_now(ids)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                log.warning("%s/%s: ack failed: %s", self.stream, self.group, exc)
                self._unacked += ids
            return 0  # NOGROUP: the group (and its pending list) is gone: nothing left to ack
        except redis.RedisError as exc:
            log.warning("%s/%s: ack of %d entries deferred: %s", self.stream, self.group, len(ids), exc)
            self._unacked += ids
            return 0

    def _ack_now(self, ids: list[str]) -> int:
        """XACK (and XDEL: nobody else reads them) in one MULTI; raises what Redis raises."""
        if not self.delete_acked:
            return int(self.client.xack(self.stream, self.group, *ids))
        pipe = self.client.pipeline(transaction=True)
        pipe.xack(self.stream, self.group, *ids)
        pipe.xdel(self.stream, *ids)
        return int(pipe.execute()[0])

    @property
    def num_unacked(self) -> int:
        """Acks waiting for Redis to come back."""
        return len(self._unacked)

    # ----------------------------------------------------------------- inspection
    def num_pending(self) -> int:
        try:
            return int(self.client.xpending(self.stream, self.group)["pending"])
        except redis.ResponseError:
            return 0

    def close(self) -> None:
        self.held.close()
        self.held.pool.disconnect()
