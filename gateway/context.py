"""What one gateway process holds while it serves: Redis, the bus ends, the collector, the tokenizer."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis

from gateway.collector import Collector
from gateway.config import gateway_id, served_model_name
from gateway.errors import APIError
from gateway.health import HealthPoller, Readiness, readiness
from shared.config import GatewayConfig, GatewayLimits
from shared.heartbeat import Punctuality, hash_age_s, heartbeat_value, parse_heartbeats
from shared.models import load_tokenizer, model_max_len, resolve_model
from shared.protocol import (GROUP_ENGINE, GROUP_TOKENIZER, Abort, ErrorInfo, FinishReason, GenerateRequest,
                             RequestOutput)
from shared.streams import AsyncProducer, AsyncStreamReader
from shared.tracing import Tracing, make_tracing

log = logging.getLogger(__name__)

BEAT_INTERVAL_S = 1.0  # the gateway's heartbeat, and its look at the engines' while it holds requests


class GatewayContext:
    """Owns the gateway's connections and the work in flight.

    Built without I/O (``GatewayContext(config)``); ``open()`` connects and starts the collector,
    ``close()`` stops it and deletes the reply stream. Aborts are sent from background tasks
    held here, so a client's departure can never cancel the Abort that frees its blocks.
    ``limits`` replaces ``config.limits`` (tests tighten them without rebuilding the config).
    ``tracing`` replaces the one ``--otlp-traces-endpoint`` makes at ``open()`` (tests export in memory).
    """

    def __init__(self, config: GatewayConfig, limits: GatewayLimits | None = None, *,
                 tracing: Tracing | None = None):
        self.config = config
        self.limits = limits or config.limits
        self.model_name = served_model_name(config)
        self.names = config.bus.names
        self.gateway_id = gateway_id(config)
        self.reply_to = self.names.gateway_out(self.gateway_id)
        self.client: aioredis.Redis | None = None
        self.producer: AsyncProducer | None = None
        self.collector: Collector | None = None
        self.num_in_flight = 0
        self.health: HealthPoller | None = None
        # the prompt limits checked before anything is published: the configured (or, once the
        # tokenizer is loaded, the model's) max_model_len, and the longest text that could fit it
        self.max_model_len: int | None = config.max_model_len
        self.max_prompt_chars: int | None = None
        self._tokenizer: asyncio.Future | None = None
        self._background: set[asyncio.Task] = set()
        self._heartbeat: asyncio.Task | None = None
        self.punctuality = Punctuality(BEAT_INTERVAL_S)  # whether this gateway's own beats land on time
        self.start_time = time.time()
        self.tracing = tracing
        self.service_id = f"gateway-{self.gateway_id}"

    async def open(self) -> None:
        if self.tracing is None:
            self.tracing = make_tracing("gateway", self.config.telemetry)
        # a blocking pool: a burst beyond redis_max_connections waits for a connection (up to
        # redis_pool_timeout_s) instead of failing with "Too many connections"
        pool = aioredis.BlockingConnectionPool.from_url(
            self.config.bus.redis_url, max_connections=self.limits.redis_max_connections,
            timeout=self.limits.redis_pool_timeout_s, socket_connect_timeout=5, socket_timeout=10,
            **self.config.bus.redis_auth)
        self.client = aioredis.Redis(connection_pool=pool)
        self.health = HealthPoller(aioredis.Redis.from_url(self.config.bus.redis_url, socket_connect_timeout=1,
                                                           socket_timeout=2, **self.config.bus.redis_auth),
                                   self.names.heartbeat, interval_s=self.limits.health_poll_s,
                                   timeout_s=max(1.0, 2 * self.limits.health_poll_s))
        self.health.start()
        self.producer = AsyncProducer(self.client, maxlen=self.config.bus.maxlen, signer=self.config.bus.signer)
        reader = AsyncStreamReader(self.client, self.reply_to, start="0-0", signer=self.config.bus.signer)
        self.collector = Collector(reader, trim=self._trim)
        self.collector.start()
        if self.config.model is not None:  # warm it up now; the default model is resolved lazily
            self._tokenizer = asyncio.ensure_future(self._load_tokenizer())
            # what is alive now lives as long as the process: out of the collector's sight, so that
            # full collections do not walk the tokenizer's objects again and again (~3 us per token)
            self._tokenizer.add_done_callback(lambda _: gc.freeze())
        self._heartbeat = asyncio.get_running_loop().create_task(self._beat_forever(), name="gateway-heartbeat")
        log.info("gateway %s reads %s", self.gateway_id, self.reply_to)

    async def close(self) -> None:
        if self.health is not None:
            await self.health.stop()
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            await asyncio.gather(self._heartbeat, return_exceptions=True)
        if self._background:
            await asyncio.wait(self._background, timeout=2)
        if self.collector is not None:
            await self.collector.stop()
            await self.collector.reader.close()
        if self.client is not None:
            try:
                await self.client.delete(self.reply_to)
                await self.client.hdel(self.names.heartbeat, self.service_id)
            except Exception as exc:  # Redis gone: nothing to clean up
                log.warning("could not delete %s: %s", self.reply_to, exc)
            await self.client.aclose()
        if self.tracing is not None:
            self.tracing.shutdown()

    # ----------------------------------------------------------------- the bus
    async def submit(self, requests: Sequence[GenerateRequest]) -> None:
        try:
            await self.producer.send_many([(self.names.tokenizer_in, r) for r in requests])
        except Exception as exc:  # the pool stayed busy past redis_pool_timeout_s, or Redis is down
            log.warning("request %s not published: %s", requests[0].request_id, exc)
            raise APIError(503, "the request bus is busy or unreachable; retry later") from None

    async def _trim(self, last_id: str) -> None:
        await self.client.xtrim(self.reply_to, minid=last_id, approximate=True)

    def abort(self, request_ids: Sequence[str], reason: str) -> None:
        task = asyncio.get_running_loop().create_task(self._send_abort(tuple(request_ids), reason))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send_abort(self, request_ids: tuple[str, ...], reason: str) -> None:
        try:
            await self.producer.send(self.names.engine_ctl, Abort(request_ids=request_ids, reason=reason))
        except Exception as exc:
            log.warning("abort of %s not sent: %s", request_ids, exc)

    async def _beat_forever(self) -> None:
        """Like every service: a Heartbeat in ps:heartbeat, with the requests this gateway holds;
        and while it holds any, a look at the engines' heartbeats (``fail_if_no_engine``)."""
        while True:
            if self.collector.num_pending:
                await self.fail_if_no_engine()
            beat = heartbeat_value("gateway", self.service_id, {"num_requests": self.num_in_flight,
                                                                "num_inboxes": self.collector.num_pending,
                                                                "num_dropped": self.collector.num_dropped},
                                   self.start_time)
            try:
                await self.client.hset(self.names.heartbeat, self.service_id, beat)
            except Exception as exc:  # Redis restarting: the next beat will do
                self.punctuality.failed()
                log.warning("heartbeat not written: %s", exc)
            else:
                self.punctuality.landed()  # late (Redis, this process or its host stalled): evidence starts again
            await asyncio.sleep(BEAT_INTERVAL_S)

    async def fail_if_no_engine(self) -> int:
        """With no engine heartbeat younger than ``heartbeat_max_age_s`` (the engines died or were
        stopped), fail every request in flight with a 503 now instead of at its deadline.
        Returns how many were failed.

        Judged from the health poll's last reading (no Redis call of its own), and only on evidence
        old enough to mean something: no verdict while Redis does not answer, while the heartbeat
        hash is younger than the age limit (just flushed, or Redis restarted empty: the engines
        have not beaten into it yet), or while this gateway's own beats have not landed on time
        for that long (a stall -- of Redis, of this process or of its whole host -- makes every
        beat read across it look stale; this check runs first thing after one, before the beat
        that notices it, so ``Punctuality`` counts an overdue beat as a stall in progress)."""
        max_age = self.limits.heartbeat_max_age_s
        raw = self.health.raw if self.health is not None else None
        if raw is None or self.punctuality.healthy_for() < max_age:
            return 0
        if hash_age_s(raw) < max_age or parse_heartbeats(raw, max_age_s=max_age, service="engine"):
            return 0
        error = ErrorInfo(message=f"no engine is alive (no heartbeat in {self.limits.heartbeat_max_age_s:g}s)",
                          type="ServiceUnavailableError", code=503)
        request_ids = list(self.collector.inboxes)
        for request_id in request_ids:
            self.collector.deliver(RequestOutput(request_id=request_id, finish_reason=FinishReason.ERROR, error=error))
        if request_ids:
            log.warning("no engine alive: failed %d requests in flight", len(request_ids))
        return len(request_ids)

    def readiness(self) -> Readiness:
        """/health's answer, from the background poll's last reading (no Redis call here)."""
        return readiness(self.health.raw if self.health is not None else None,
                         num_detok_shards=self.config.num_detok_shards, max_age_s=self.limits.heartbeat_max_age_s)

    # ----------------------------------------------------------------- traces, request logs, the bus's figures
    def trace_requests(self, requests: Sequence[GenerateRequest], headers: Mapping[str, str] | None):
        """The HTTP request's span (continuing the client's ``traceparent``) and the requests
        carrying its context; (None, requests) with tracing off."""
        if self.tracing is None:
            return None, requests
        span = self.tracing.start("gateway", {k: v for k, v in (headers or {}).items() if k in ("traceparent",
                                                                                                  "tracestate")},
                                  attributes={"pagedserve.request_id": requests[0].request_id,
                                              "gen_ai.response.model": self.model_name,
                                              "pagedserve.num_prompts": len(requests)})
        carrier = self.tracing.carrier(span)
        return span, [dataclasses.replace(r, trace=carrier) for r in requests]

    def log_request(self, submission, span) -> None:
        if self.config.telemetry.enable_log_requests:
            r = submission.requests[0]
            log.info("request %s: %d prompt(s), n=%d, max_tokens=%s, stream from %s%s", r.request_id,
                     len(submission.requests), r.sampling.n, r.sampling.max_tokens, self.gateway_id,
                     f", trace {span.get_span_context().trace_id:032x}" if span is not None else "")

    def end_request(self, submission, status: int, reasons: Sequence[str], span) -> None:
        """The request's span ends (and its log line is written) with the HTTP status and the reasons."""
        if self.config.telemetry.enable_log_requests:
            usage = submission.usage()
            log.info("request %s finished: status %d, %s, %d prompt + %d completion tokens (%d cached), %.3fs",
                     submission.requests[0].request_id, status, ",".join(reasons), usage.prompt_tokens,
                     usage.completion_tokens, usage.prompt_tokens_details.cached_tokens if
                     usage.prompt_tokens_details else 0, time.monotonic() - submission.start_time)
        if span is not None:
            span.set_attribute("http.response.status_code", status)
            span.set_attribute("pagedserve.finish_reasons", list(reasons))
            span.end()

    async def bus_snapshot(self) -> dict:
        """Every stream's length, every group's pending entries and consumers, the dead letters,
        and each replica's message and reclaim totals from its heartbeat (telemetry.BusCollector)."""
        names = self.names
        beats = parse_heartbeats(await self.client.hgetall(names.heartbeat))
        shards = {int(b.stats.get("shard", 0)) for b in beats.values() if b.service == "detok"}
        grouped = [(names.tokenizer_in, GROUP_TOKENIZER), (names.engine_in, GROUP_ENGINE)] + \
                  [(names.detok_in(k), "detok") for k in sorted(shards | {0})]
        streams = [s for s, _ in grouped] + [names.engine_ctl, names.dlq] + \
                  [names.gateway_out(b.service_id.removeprefix("gateway-")) for b in beats.values()
                   if b.service == "gateway"]
        pipe = self.client.pipeline(transaction=False)
        for stream in streams:
            pipe.xlen(stream)
        lengths = await pipe.execute()
        groups = {}
        for stream, _ in grouped:
            try:
                infos = await self.client.xinfo_groups(stream)
            except Exception:  # the stream does not exist yet
                continue
            for info in infos:
                name = info["name"].decode() if isinstance(info["name"], bytes) else info["name"]
                groups[(stream, name)] = {"pending": int(info["pending"]), "consumers": int(info["consumers"])}
        return {"streams": dict(zip(streams, lengths)), "groups": groups,
                "dead_letters": lengths[streams.index(names.dlq)],
                "replicas": {(b.service, sid): b.stats for sid, b in beats.items()}}

    # ----------------------------------------------------------------- the local tokenizer
    async def tokenizer(self) -> Any:
        """The model's HF tokenizer, loaded once off the event loop (for /tokenize, /detokenize)."""
        if self._tokenizer is None:
            self._tokenizer = asyncio.ensure_future(self._load_tokenizer())
        try:
            return await asyncio.shield(self._tokenizer)
        except Exception as exc:
            raise APIError(503, f"cannot load the tokenizer: {exc}") from None

    async def _load_tokenizer(self) -> Any:
        tokenizer = await asyncio.to_thread(load_tokenizer, self.config.model, self.config.tokenizer)
        if self.max_model_len is None:
            self.max_model_len = await asyncio.to_thread(model_max_len, resolve_model(self.config.model))
        self.max_prompt_chars = self.max_model_len * await asyncio.to_thread(longest_token_chars, tokenizer)
        return tokenizer


def longest_token_chars(tokenizer) -> int:
    """The most characters of text one token can stand for: a text longer than max_model_len times
    this cannot fit max_model_len tokens, and is refused without tokenizing it. (Byte-level BPE and
    SentencePiece vocabularies spell each token with at most one character per character of text;
    the tokenizer service applies the same rule, tokenizer_svc/prompts.py.)"""
    return max(1, max(map(len, tokenizer.get_vocab()), default=1))
