"""One detok shard's loop: read ps:detok:in:{shard}, detokenize, reply to gateways, ack finished requests.

Redis faults: a turn's replies that Redis did not take are held (``Outbox``) and retried with
backoff before anything new is read; the entries they came from are acked only once they are out.
Who is gone is judged from the heartbeats, on evidence only (shared/heartbeat.py): an engine that
stopped cleanly, or whose beat went stale (or missing from a hash that is not fresh from a flush)
while this shard itself had Redis all along -- then its requests fail with a 503; a gateway that
is gone -- then its requests are dropped, their entries acked and their engines told to abort,
and nothing is written to its reply stream (which would re-create it).
"""

from __future__ import annotations

import gc
import logging
import threading
import time

import redis

from detok_svc.processor import DetokProcessor
from shared.config import DetokConfig
from shared.protocol import Admission, TokenDelta
from shared.group_reader import GroupReader
from shared.heartbeat import HeartbeatWriter, hash_age_s, is_stopped, parse_heartbeats
from shared.lifecycle import run_until_signalled
from shared.logs import StatusLine, configure_logging
from shared.models import load_tokenizer
from shared.streams import Outbox, Producer, connect
from shared.tracing import Tracing, make_tracing

log = logging.getLogger(__name__)
GROUP_DETOK = "detok"


class DetokService:
    """Owns shard ``k``: the only consumer of its stream (a group of one, so a restart resumes
    from its pending entries) and the DetokProcessor holding the shard's requests. With
    ``tracing``, a traced request's "detokenize" span runs from its Admission until the
    processor drops it (finished, failed or given up on)."""

    def __init__(self, config: DetokConfig, processor: DetokProcessor, client=None, *,
                 tracing: Tracing | None = None):
        self.config = config
        self.client = client or connect(config.bus.redis_url, **config.bus.redis_auth)
        names = config.bus.names
        # one entry per gateway and engine entry: each reply stream (and engine ctl) has no competing readers
        # and Aborts to the engines
        self.to_gateway = Producer(self.client, config.bus.maxlen, batch=True, signer=config.bus.signer)
        self.from_engine = GroupReader(self.client, names.detok_in(config.shard), GROUP_DETOK,
                                       f"shard-{config.shard}", claim_idle_ms=None, dlq=names.dlq,
                                       producer=self.to_gateway, accept=(TokenDelta, Admission),
                                       signer=config.bus.signer)
        self.heartbeat = HeartbeatWriter(self.client, names.heartbeat, "detok", config.service_id,
                                         config.heartbeat_s, ttl_s=config.bus.heartbeat_ttl_s)
        self.outbox = Outbox(self.to_gateway, self.from_engine)  # entries are acked once their replies are out
        self.processor = processor
        self._prefetched = None  # envelopes read with the last turn's replies (Outbox.flush_and_read)
        self.stopping = threading.Event()
        self.num_outputs = 0
        self.num_messages = 0
        self.tracing = tracing
        self.spans: dict = {}  # request id -> its open span (tracing only)
        self.status = StatusLine(log, config.telemetry.status_log_s,
                                 lambda: {"messages": self.num_messages, "outputs": self.num_outputs},
                                 self._describe)
        self._next_expiry = 0.0
        self._next_engine_check = 0.0
        self._seen_engines: set[str] = set()
        self._gone_streams: set[str] = set()  # reply streams of gateways that are gone: never written
        self.num_dropped = 0  # requests dropped because their gateway is gone

    @classmethod
    def from_config(cls, config: DetokConfig) -> DetokService:
        processor = DetokProcessor(load_tokenizer(config.model, config.tokenizer), config.bus.names)
        gc.freeze()  # the tokenizer lives as long as the process: keep it out of every full collection
        return cls(config, processor, tracing=make_tracing("detok", config.telemetry))

    def run(self) -> None:
        log.info("detok shard %d/%d reading %s", self.config.shard, self.config.num_detok_shards,
                 self.from_engine.stream)
        try:
            while not self.stopping.is_set():
                self.run_once(self.config.block_ms)
            if self._prefetched:  # read with the last replies: handled, not left pending (unless Redis is away)
                self.run_once(None)
        finally:
            self.heartbeat.remove()
            for span in self.spans.values():
                span.end()
            self.spans.clear()

    def run_once(self, block_ms: int | None) -> int:
        if not self.outbox.flush():  # Redis away: hold the last turn's replies, read nothing new
            return 0
        envelopes, self._prefetched = self._prefetched, None
        if envelopes is None:
            envelopes = self.from_engine.read(count=self.config.entries_per_read, block_ms=block_ms)
        outgoing = []
        for env in envelopes:
            if self.tracing is not None and isinstance(env.msg, Admission) and env.msg.trace:
                self._open_span(env.msg)
            try:
                outgoing += self.processor.process(env.id, env.msg)
            except Exception as exc:  # never crash-loop on one bad delta: fail its request instead
                log.exception("delta %s of %s failed", env.id, env.msg.request_id)
                outgoing += self.processor.fail(env.id, env.msg.request_id, exc)
        if time.monotonic() >= self._next_expiry:
            self._next_expiry = time.monotonic() + 10.0
            outgoing += self.processor.expire(self.config.request_idle_timeout_s)
        if self.processor.requests and time.monotonic() >= self._next_engine_check:
            self._next_engine_check = time.monotonic() + self.config.engine_check_s
            outgoing += self._check_peers()
        if self._gone_streams:
            outgoing = [(stream, msg) for stream, msg in outgoing if stream not in self._gone_streams]
        # only entries no unfinished request holds are acked: the rest replay after a crash
        self.outbox.put(outgoing, acks=self.processor.take_ackable())
        if not envelopes or self.stopping.is_set():
            self.outbox.flush()
        else:  # busy: the replies out and the next read in one round trip (acks to send: a plain flush)
            reads = self.outbox.flush_and_read([(self.from_engine, self.config.entries_per_read)], block_ms)[1]
            self._prefetched = reads[0] if reads and reads[0] else None  # nothing came: the next turn reads (and waits) again
        self.num_outputs += len(outgoing)
        self.num_messages += len(envelopes)
        if self.spans:
            self._close_spans()
        self.heartbeat.beat(self.stats())
        self.status.tick(busy=bool(self.processor.requests))
        return len(envelopes)

    def _check_peers(self) -> list:
        """What to send about the requests of dead engines (503s) and of gone gateways (aborts)."""
        try:
            raw = self.client.hgetall(self.config.bus.names.heartbeat)
        except redis.RedisError:
            self.heartbeat.failed()
            return []  # cannot tell: fail nobody
        out = self.processor.fail_engines(dead := self._dead_engines(raw), can_resume=bool(self._seen_engines - dead))
        self._gone_streams = self._gone_gateways(raw)
        for request_id, request in list(self.processor.requests.items()):
            if request.reply_to in self._gone_streams:  # an Abort to its engine; its reply is filtered out
                out += self.processor.fail(request.entry_ids[-1], request_id, RuntimeError("gateway gone"))
                self.num_dropped += 1
        return out

    def _dead_engines(self, raw) -> set[str]:
        """Engines seen alive before that are gone on evidence: stopped cleanly, or stale (missing
        from a hash older than the max age) while this shard had Redis for the max age itself.
        (Only engines once seen: an id this shard never saw beat is no evidence of anything.)"""
        max_age = self.config.engine_max_age_s
        beats = parse_heartbeats(raw, service="engine", stopped=True)
        alive = {k for k, b in beats.items() if time.time() - b.time <= max_age and not is_stopped(b)}
        self._seen_engines |= alive
        trusted = self.heartbeat.healthy_for() >= max_age and hash_age_s(raw) >= max_age
        return {k for k in self._seen_engines - alive
                if (k in beats and is_stopped(beats[k])) or trusted}

    def _gone_gateways(self, raw) -> set[str]:
        """Reply streams of this shard's requests whose gateway is gone: it left (its beat
        stopped, or missing from a hash that is not fresh from a flush), or its beat is older
        than the heartbeat TTL while this shard had Redis that long."""
        ttl = self.config.bus.heartbeat_ttl_s
        prefix = self.config.bus.names.gateway_out("")[:-len(":out")]
        beats = parse_heartbeats(raw, service="gateway", stopped=True)
        settled = hash_age_s(raw) >= 3 * self.config.heartbeat_s + 2.0  # every live gateway has beaten since
        gone = set()
        for stream in {r.reply_to for r in self.processor.requests.values()}:
            beat = beats.get("gateway-" + stream.removeprefix(prefix).removesuffix(":out"))
            if beat is None:
                left = settled
            else:
                left = is_stopped(beat) or (time.time() - beat.time > ttl and self.heartbeat.healthy_for() >= ttl)
            if left:
                gone.add(stream)
        return gone

    def stats(self) -> dict[str, float]:
        return {"num_requests": len(self.processor.requests), "num_outputs": self.num_outputs,
                "num_messages": self.num_messages, "num_reclaimed": self.from_engine.num_reclaimed,
                "num_dropped": self.num_dropped,
                "shard": self.config.shard}

    def _describe(self, rates) -> str:
        return (f"shard {self.config.shard}: {len(self.processor.requests)} requests, "
                f"{rates['messages']:.1f} messages/s in, {rates['outputs']:.1f} outputs/s out")

    def _open_span(self, admission: Admission) -> None:
        if admission.request_id not in self.spans and admission.request_id not in self.processor.finished:
            self.spans[admission.request_id] = self.tracing.start(
                "detokenize", admission.trace, attributes={"pagedserve.request_id": admission.request_id,
                                                           "pagedserve.shard": self.config.shard})

    def _close_spans(self) -> None:
        """End the spans of requests the processor no longer holds."""
        for request_id in [r for r in self.spans if r not in self.processor.requests]:
            self.spans.pop(request_id).end()

    def stop(self, *_args) -> None:
        self.stopping.set()


def main(config: DetokConfig) -> None:
    configure_logging("detok", config.telemetry)
    service = DetokService.from_config(config)
    run_until_signalled(service, service.tracing)
