"""The engine service: LLMEngine in a Redis loop (admit, abort, step, publish, account, heartbeat).

The only engine module that touches Redis. Entries of ``ps:engine:in`` are acked once their
request is admitted (or refused with an error to its gateway) and the admission is out, so a
crash before that re-delivers them; admission is idempotent on request_id.

Redis faults (README: what survives what): every write goes through an ``Outbox``; when Redis
stalls or is gone, the turn's output is held and retried with backoff, and the engine reads and
computes nothing new meanwhile (no work for nobody, no busy loop). When Redis is back after more
than ``max_outage_s``, or comes back empty (the heartbeat hash's epoch changed: FLUSHALL or a
restart lost the entries in flight, so some deltas may never arrive), every request the engine
holds ends with one 503 error -- sent to its detok shard and straight to its gateway -- instead of
running on with a hole in its text. After each turn of the loop the
scheduler's account (``take_stats()``) feeds this engine's Prometheus figures (served on
``--metrics-port``), its status line and, with tracing on, the spans of finished sequences.

P/D (``--role``): a prefill engine reads ``ps:engine:in`` and, after the step that samples a
request's first token, publishes that token's delta as usual and then the request itself, with
its KV handle, to ``ps:decode:in`` (group ``decode``), which decode engines read instead of
``ps:engine:in``. A decode engine's Admission tells the detok shard who holds the request now. An
abort that reaches the prefill engine after the hand-off deletes the KV entry; one that reaches
the decode engine first (or a refusal there) closes the request at its detok shard, which holds
its state since the first token.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import threading
import time
from collections import OrderedDict

from engine_svc.iteration_stats import FinishedSequence, IterationStats
from engine_svc.metrics import EngineMetrics
from shared.config import ENGINE_ROLES, EngineServiceConfig
from shared.logs import StatusLine, configure_logging
from shared.models import served_model_name
from shared.protocol import (GROUP_DECODE, GROUP_ENGINE, Abort, EngineRequest, ErrorInfo, FinishReason, Message,
                             ProtocolError, RequestOutput, TokenDelta, detok_shard, is_expired)
from shared.heartbeat import HeartbeatWriter
from shared.lifecycle import run_until_signalled
from shared.group_reader import GroupReader
from shared.streams import Outbox, Producer, StreamReader, connect
from shared.tracing import Tracing, make_tracing

log = logging.getLogger(__name__)
MAX_REMEMBERED = 100_000


class RecentIds:
    """A set of request ids seen lately (finished, or aborted before they arrived). Each id is
    kept ``keep_s`` seconds at least -- the longest request deadline, so that a request
    re-delivered or arriving after its abort is recognised as long as it could still be computed
    (after that its deadline drops it anyway) -- and beyond that while fewer than ``limit`` are held."""

    def __init__(self, limit: int = MAX_REMEMBERED, keep_s: float = 0.0, clock=time.monotonic):
        self.ids: OrderedDict[str, float] = OrderedDict()  # id -> when added, oldest first
        self.limit = limit
        self.keep_s = keep_s
        self.clock = clock

    def add(self, request_id: str) -> None:
        now = self.clock()
        self.ids[request_id] = now
        self.ids.move_to_end(request_id)
        while len(self.ids) > self.limit and now - next(iter(self.ids.values())) >= self.keep_s:
            self.ids.popitem(last=False)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.ids


class EngineService:
    """Moves one engine's messages: requests and aborts in, the engine's admissions and deltas
    out to the detok shards, refusals to gateways. The engine owns every request's state."""

    def __init__(self, config: EngineServiceConfig, engine, client=None, *, tracing: Tracing | None = None,
                 metrics: EngineMetrics | None = None):
        self.config = config
        self.engine = engine
        self.client = client or connect(config.bus.redis_url, **config.bus.redis_auth)
        self.names = names = config.bus.names
        # a step's deltas for a shard share entries: a shard has one reader (and gateways read their own)
        self.to_detok = Producer(self.client, config.bus.maxlen, batch=True,  # and errors to gateways
                                 per_entry=config.deltas_per_entry, signer=config.bus.signer)
        # a decode engine's requests come from the prefill engines (P/D), everyone else's from the tokenizers
        intake, group = (names.decode_in, GROUP_DECODE) if config.role == "decode" else (names.engine_in, GROUP_ENGINE)
        self.from_tokenizer = GroupReader(self.client, intake, group, config.service_id,
                                          claim_idle_ms=config.claim_idle_ms, dlq=names.dlq,
                                          producer=self.to_detok, accept=(EngineRequest,), signer=config.bus.signer)
        lookback_ms = int((time.time() - config.ctl_lookback_s) * 1000)
        self.from_ctl = StreamReader(self.client, names.engine_ctl, start=f"{max(lookback_ms, 0)}-0",
                                     signer=config.bus.signer)
        self.heartbeat = HeartbeatWriter(self.client, names.heartbeat, "engine", config.service_id,
                                         config.heartbeat_s, ttl_s=config.bus.heartbeat_ttl_s)
        self.outbox = Outbox(self.to_detok, self.from_tokenizer)  # admissions are acked once they are out
        self._prefetched: list | None = None  # [intake, ctl] envelopes read with the last step's output
        self.reply_to: dict[str, str] = {}  # request id -> its gateway's stream, while the engine holds it
        self.held: dict[str, EngineRequest] = {}  # prefill role: each request as admitted, for its hand-off
        # prefill role: request id -> (its KV handle until an abort deletes it, when handed off, the seq it went on
        # from), kept --ctl-lookback seconds: a re-delivery is dropped, a failover's resubmission (a later seq) is not
        self.handed_off: OrderedDict[str, tuple[str | None, float, int]] = OrderedDict()
        self._num_losses = 0  # bus losses (HeartbeatWriter.num_losses) already answered
        self.finished = RecentIds(keep_s=config.ctl_lookback_s)
        self.aborted = RecentIds(keep_s=config.ctl_lookback_s)  # aborts that arrived before their request
        self.stopping = threading.Event()
        model_name = served_model_name(config.engine.served_model_name, config.engine.model)
        self.metrics = metrics or EngineMetrics(model_name, config.service_id)
        self.tracing = tracing
        self.spans: dict = {}  # request id -> its open engine span (tracing only)
        self.num_admitted = 0
        self.totals = {"prompt_tokens": 0.0, "generation_tokens": 0.0, "prefix_cache_queries": 0.0,
                       "prefix_cache_hits": 0.0}
        self._engine_stats: dict[str, float] = {}
        self._next_sweep = 0.0
        self.status = StatusLine(log, config.telemetry.status_log_s, lambda: self.totals, self._describe)

    # ----------------------------------------------------------------- the loop
    def run(self) -> None:
        log.info("engine %s reading %s", self.config.service_id, self.from_tokenizer.stream)
        try:
            while not self.stopping.is_set():
                self.run_once()
        finally:
            self.heartbeat.remove()
            for span in self.spans.values():
                span.end()
            self.spans.clear()

    def run_once(self) -> None:
        if not self.outbox.flush():  # Redis away: hold the last turn's output, compute nothing new
            return
        if self.outbox.last_outage_s > self.config.max_outage_s:
            self._fail_held(f"the request bus was unreachable for {self.outbox.last_outage_s:.0f}s")
        self.outbox.last_outage_s = 0.0
        idle = not self.engine.has_work()
        prefetched, self._prefetched = self._prefetched, None  # read with the last step's output
        if prefetched is not None:
            self.apply_aborts(prefetched[1])  # first: an abort of a request in this read closes it at admission
        envelopes = prefetched[0] if prefetched is not None else self.from_tokenizer.read(
            count=self.config.batch_size, block_ms=self.config.idle_block_ms if idle else None)  # never 0
        if envelopes:
            # admitted (or refused): acked once that is out, before a long step
            self.outbox.put([item for env in envelopes for item in self.admit(env.msg)], acks=envelopes)
            self.reply_to.update((env.msg.request_id, env.msg.reply_to) for env in envelopes
                                 if self.engine.has_request(env.msg.request_id))
            if self.config.role == "prefill":
                self.held.update((env.msg.request_id, env.msg) for env in envelopes
                                 if self.engine.has_request(env.msg.request_id))
            if not self.outbox.flush():
                return
        if prefetched is None:
            self.apply_aborts(self.from_ctl.read(count=1024))
        if self.engine.has_work():
            self.outbox.put(self.step())
            if self.engine.has_work():  # busy: the output and the next turn's reads in one round trip
                self._prefetched = self.outbox.flush_and_read(
                    [(self.from_tokenizer, self.config.batch_size), (self.from_ctl, 1024)])[1]
            else:
                self.outbox.flush()  # if Redis is away, the next turn holds off until it is back
        self.account()
        self.heartbeat.beat({**self._engine_stats, "metrics_port": self.config.metrics_port,
                             "role": ENGINE_ROLES.index(self.config.role), "num_messages": self.num_admitted, "num_reclaimed": self.from_tokenizer.num_reclaimed})
        if self.heartbeat.num_losses != self._num_losses:
            self._num_losses = self.heartbeat.num_losses
            self._fail_held("the request bus lost its state (Redis was flushed or restarted empty)")
        self.status.tick(busy=self.engine.has_work())

    def _fail_held(self, why: str) -> None:
        """End every request this engine holds with one 503: a final error delta to its detok
        shard (which drops its state) and the same error straight to its gateway, in case the
        shard never learnt of it (its admission lost with the bus's data). A duplicate final
        output is dropped by the gateway."""
        error = ErrorInfo(message=f"{why}; the request was given up, retry it", type="ServiceUnavailableError",
                          code=503)
        deltas = self.engine.fail_all(error)
        direct = {d.request_id: (self.reply_to[d.request_id], RequestOutput(
            request_id=d.request_id, finish_reason=FinishReason.ERROR, error=error))
            for d in deltas if d.request_id in self.reply_to}  # one per request (n > 1: a delta per choice)
        if deltas:
            log.warning("%s: failing %d requests", why, len({d.request_id for d in deltas}))
        self.outbox.put([self._publish(d) for d in deltas] + list(direct.values()))
        self.outbox.flush()

    # ----------------------------------------------------------------- handlers
    def admit(self, req: EngineRequest) -> list[tuple[str, Message]]:
        rid = req.request_id
        if rid in self.finished or self.engine.has_request(rid) or (
                rid in self.handed_off and req.resumed_seq < self.handed_off[rid][2]):
            return []  # a re-delivery: already admitted
        # its client left before it got here: close it, admit nothing (past its deadline as well:
        # then add_request refuses it, and counts it as expired)
        if rid in self.aborted and not is_expired(req.deadline, time.time()):
            self.finished.add(rid)
            if req.prefill_engine_id:  # handed off: its detok shard holds it since the first token
                return self._close_handed_off(req, FinishReason.ABORT)
            return [(req.reply_to, RequestOutput(request_id=rid, finish_reason=FinishReason.ABORT,
                                                 num_choices=req.sampling.n))]
        arrival = self.engine.scheduler.clock()  # the request's queued time, and its span's start
        try:
            admission = self.engine.add_request(rid, req.prompt_token_ids, req.sampling, cache_salt=req.cache_salt,
                                                arrival_time=arrival, deadline=req.deadline,
                                                resumed_token_ids=req.resumed_token_ids, resumed_seq=req.resumed_seq,
                                                kv_handle=req.kv_handle, num_kv_tokens=req.num_kv_tokens)
        except ProtocolError as exc:
            code = getattr(exc, "code", 400)
            error = ErrorInfo(message=exc.message, param=exc.param, code=code,
                              type="ServiceUnavailableError" if code == 503 else "BadRequestError")
            return self._refuse(req, error)
        except Exception as exc:  # a bug must cost one request, not the engine
            log.exception("admitting %s failed", rid)
            return self._refuse(req, ErrorInfo(message=f"engine error: {type(exc).__name__}",
                                               type="InternalServerError", code=500))
        self.num_admitted += 1
        trace = self._open_span(req, arrival) if self.tracing is not None and req.trace else {}
        admission = dataclasses.replace(admission, engine_id=self.config.service_id, reply_to=req.reply_to,
                                        detok=req.detok, trace=trace)
        return [(self._detok_stream(rid), admission)]

    def _detok_stream(self, rid: str) -> str:
        return self.names.detok_in(detok_shard(rid, self.config.num_detok_shards))

    def _refuse(self, req: EngineRequest, error: ErrorInfo) -> list[tuple[str, Message]]:
        self.finished.add(req.request_id)
        if req.prefill_engine_id:
            return self._close_handed_off(req, FinishReason.ERROR, error)
        return [(req.reply_to, RequestOutput(request_id=req.request_id, finish_reason=FinishReason.ERROR,
                                             num_choices=req.sampling.n, error=error))]

    def _close_handed_off(self, req: EngineRequest, reason: FinishReason,
                          error: ErrorInfo | None = None) -> list[tuple[str, Message]]:
        """A hand-off this engine will not run: its KV entry goes, and its detok shard (which took
        its first token) gets the final delta and answers the gateway."""
        if req.kv_handle is not None:
            self.engine.drop_kv([req.kv_handle])
        return [(self._detok_stream(req.request_id), TokenDelta(
            request_id=req.request_id, seq=req.resumed_seq, finish_reason=int(reason), error=error,
            num_prompt_tokens=len(req.prompt_token_ids), num_choices=req.sampling.n))]

    def _hand_offs(self) -> list[tuple[str, Message]]:
        """Prefill role: each request the step handed off goes to the decode engines, after its
        first token's delta (the caller puts it after the step's deltas)."""
        out: list[tuple[str, Message]] = []
        now = time.monotonic()
        for h in self.engine.take_handoffs():
            req = self.held.pop(h.request_id)
            self.reply_to.pop(h.request_id, None)
            self.handed_off[h.request_id] = (h.kv_handle, now, h.next_seq)
            self.handed_off.move_to_end(h.request_id)
            span = self.spans.pop(h.request_id, None)
            if span is not None:
                span.add_event("handed_off")
                span.end()
            out.append((self.names.decode_in, dataclasses.replace(
                req, resumed_token_ids=h.output_token_ids, resumed_seq=h.next_seq, kv_handle=h.kv_handle,
                num_kv_tokens=h.num_kv_tokens, prefill_engine_id=self.config.service_id)))
        keep_s = max(self.config.ctl_lookback_s, self.config.kv_transfer.ttl_s)
        while self.handed_off and now - next(iter(self.handed_off.values()))[1] > keep_s:
            self.handed_off.popitem(last=False)
        return out

    def apply_aborts(self, envelopes) -> None:
        ids = [rid for env in envelopes if isinstance(env.msg, Abort) for rid in env.msg.request_ids]
        for rid in ids:
            handle, when, seq = self.handed_off.get(rid, (None, 0.0, 0))
            if handle is not None:  # its decode engine may not have loaded it yet
                self.engine.drop_kv([handle])
                self.handed_off[rid] = (None, when, seq)
            if rid not in self.finished and not self.engine.has_request(rid):
                self.aborted.add(rid)
        if ids:
            self.engine.abort_request(ids)  # the engine answers with ABORT deltas on its next step

    def step(self) -> list[tuple[str, Message]]:
        try:
            deltas = self.engine.step()
        except Exception as exc:  # a broken step must not leave clients hanging
            log.exception("engine step failed")
            deltas = self.engine.fail_all(ErrorInfo(message=f"engine error: {type(exc).__name__}: {exc}"[:500],
                                                    type="InternalServerError", code=500))
        return [self._publish(delta) for delta in deltas] + self._hand_offs()

    def _publish(self, delta: TokenDelta) -> tuple[str, Message]:
        if delta.finish_reason is not None and not self.engine.has_request(delta.request_id):
            self.finished.add(delta.request_id)
            self.reply_to.pop(delta.request_id, None)
            self.held.pop(delta.request_id, None)
        return self._detok_stream(delta.request_id), delta

    # ----------------------------------------------------------------- metrics, status, traces
    def account(self) -> None:
        """The scheduler's account since the last turn, into the metrics, the totals and the spans."""
        stats = self.engine.take_stats()
        self._engine_stats = engine_stats = self.engine.stats()
        sweep = getattr(self.engine.connector, "sweep", None)  # a store without a TTL of its own (shm)
        if sweep is not None and time.monotonic() >= self._next_sweep:
            self._next_sweep = time.monotonic() + 10.0
            sweep()
        self.metrics.record(stats, engine_stats)
        self.totals["prompt_tokens"] += stats.num_prompt_tokens
        self.totals["generation_tokens"] += stats.num_generation_tokens
        self.totals["prefix_cache_queries"] = engine_stats["prefix_cache_queries"]
        self.totals["prefix_cache_hits"] = engine_stats["prefix_cache_hits"]
        if self.spans and stats.finished:
            self._close_spans(stats)

    def _describe(self, rates) -> str:
        s = self._engine_stats
        queries = rates["prefix_cache_queries"]
        hit_rate = rates["prefix_cache_hits"] / queries if queries else 0.0
        return (f"running {s.get('num_running', 0):g}, waiting {s.get('num_waiting', 0):g}, "
                f"KV usage {s.get('kv_cache_usage', 0.0):.1%}, prompt {rates['prompt_tokens']:.1f} tokens/s, "
                f"generation {rates['generation_tokens']:.1f} tokens/s, prefix-cache hit rate {hit_rate:.1%}")

    def _open_span(self, req: EngineRequest, arrival: float) -> dict[str, str]:
        span = self.tracing.start("engine", req.trace, start_ns=self.tracing.wall_ns(arrival), attributes={
            "pagedserve.request_id": req.request_id, "pagedserve.engine": self.config.service_id,
            "gen_ai.request.n": req.sampling.n, "gen_ai.usage.prompt_tokens": len(req.prompt_token_ids)})
        self.spans[req.request_id] = span
        return self.tracing.carrier(span)

    def _close_spans(self, stats: IterationStats) -> None:
        """Each finished sequence's phases as child spans; a request's span ends with its last sequence."""
        done = set()
        for seq in stats.finished:
            span = self.spans.get(seq.request_id)
            if span is not None:
                self._phase_spans(span, seq)
                done.add(seq.request_id)
        for request_id in done:
            if not self.engine.has_request(request_id):
                self.spans.pop(request_id).end()

    def _phase_spans(self, span, seq: FinishedSequence) -> None:
        t = self.tracing
        index = {"pagedserve.index": seq.index}
        t.span_between("queued", span, seq.arrival_time, seq.scheduled_time or seq.finished_time, index)
        for when in seq.preemption_times:
            span.add_event("preempted", index, timestamp=t.wall_ns(when))
        if seq.scheduled_time is not None:
            prefill = t.span_between("prefill", span, seq.scheduled_time, seq.first_token_time or seq.finished_time,
                                     index)
            for start, end, num_tokens in seq.prefill_chunks:
                t.span_between("prefill_chunk", prefill, start, end, {"pagedserve.num_tokens": num_tokens})
        if seq.first_token_time is not None:
            span.add_event("first_token", index, timestamp=t.wall_ns(seq.first_token_time))
            decode = t.span_between("decode", span, seq.first_token_time, seq.last_token_time, index)
            for start, end in seq.decode_steps:
                t.span_between("decode_step", decode, start, end)
        span.add_event("finished", {**index, "pagedserve.finish_reason": FinishReason(seq.finish_reason).openai,
                                    "gen_ai.usage.completion_tokens": seq.num_generation_tokens},
                       timestamp=t.wall_ns(seq.finished_time))

    def stop(self, *_args) -> None:
        self.stopping.set()


def main(config: EngineServiceConfig) -> None:
    from engine_svc import LLMEngine

    configure_logging("engine", config.telemetry)
    started = time.monotonic()
    engine = LLMEngine(config.engine, record_decode_steps=config.telemetry.collect_detailed_traces, role=config.role)
    if config.role != "both":
        from engine_svc.kv_transfer import make_connector

        model_id = served_model_name(config.engine.served_model_name, config.engine.model)
        engine.connector = make_connector(config.kv_transfer, engine.runner.kv_caches, model_id,
                                          prefix=config.bus.prefix,
                                          client=connect(config.bus.redis_url, **config.bus.redis_auth))
    # the model, the compiled graphs and their compiler hold ~530k objects that live as long as
    # the process: out of every full collection from here on (one took ~0.6 s mid-step, a stall of
    # every stream), as the gateway and the detokenizers do with their tokenizer
    gc.collect()
    gc.freeze()
    log.info("engine loaded in %.1fs (%d objects frozen out of the collector): %s", time.monotonic() - started,
             gc.get_freeze_count(), engine.stats())
    service = EngineService(config, engine, tracing=make_tracing("engine", config.telemetry))
    if config.metrics_port:
        service.metrics.serve(config.metrics_port)
    run_until_signalled(service, service.tracing)
