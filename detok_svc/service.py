"""One detok shard's loop: read ps:detok:in:{shard}, detokenize, reply to gateways, ack finished requests."""

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
from shared.heartbeat import HeartbeatWriter, read_heartbeats
from shared.lifecycle import run_until_signalled
from shared.logs import StatusLine, configure_logging
from shared.models import load_tokenizer
from shared.streams import Producer, connect
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
        self.client = client or connect(config.bus.redis_url)
        names = config.bus.names
        # one entry per gateway and engine entry: each reply stream (and engine ctl) has no competing readers
        self.to_gateway = Producer(self.client, config.bus.maxlen, batch=True)  # and Aborts to the engines
        self.from_engine = GroupReader(self.client, names.detok_in(config.shard), GROUP_DETOK,
                                       f"shard-{config.shard}", claim_idle_ms=None, dlq=names.dlq,
                                       producer=self.to_gateway, accept=(TokenDelta, Admission))
        self.heartbeat = HeartbeatWriter(self.client, names.heartbeat, "detok", config.service_id,
                                         config.heartbeat_s)
        self.processor = processor
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

    @classmethod
    def from_config(cls, config: DetokConfig) -> DetokService:
        processor = DetokProcessor(load_tokenizer(config.model, config.tokenizer), config.bus.names)
        gc.freeze()  # the tokenizer lives as long as the process: keep it out of every full collection
        return cls(config, processor, tracing=make_tracing("detok", config.telemetry))

    def run(self) -> None:
        self.from_engine.ensure_group()
        log.info("detok shard %d/%d reading %s", self.config.shard, self.config.num_detok_shards,
                 self.from_engine.stream)
        try:
            while not self.stopping.is_set():
                self.run_once(self.config.block_ms)
        finally:
            self.heartbeat.remove()
            for span in self.spans.values():
                span.end()
            self.spans.clear()

    def run_once(self, block_ms: int | None) -> int:
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
            outgoing += self.processor.fail_engines(self._dead_engines())
        self.to_gateway.send_many(outgoing)
        self.num_outputs += len(outgoing)
        self.num_messages += len(envelopes)
        if self.spans:
            self._close_spans()
        # only entries no unfinished request holds: the rest replay after a crash
        self.from_engine.ack(self.processor.take_ackable())
        self.heartbeat.beat(self.stats())
        self.status.tick(busy=bool(self.processor.requests))
        return len(envelopes)

    def _dead_engines(self) -> set[str]:
        """Engines seen alive before whose heartbeat is now stale or gone. (Only engines once seen:
        an id this shard never saw beat is no evidence of anything.)"""
        try:
            alive = set(read_heartbeats(self.client, self.config.bus.names.heartbeat,
                                        max_age_s=self.config.engine_max_age_s, service="engine"))
        except (redis.ConnectionError, redis.TimeoutError):
            return set()  # cannot tell: fail nobody
        self._seen_engines |= alive
        return self._seen_engines - alive

    def stats(self) -> dict[str, float]:
        return {"num_requests": len(self.processor.requests), "num_outputs": self.num_outputs,
                "num_messages": self.num_messages, "num_reclaimed": self.from_engine.num_reclaimed,
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
