"""The engine service: LLMEngine in a Redis loop (admit, abort, step, publish, heartbeat).

The only engine module that touches Redis. Entries of ``ps:engine:in`` are acked once their
request is admitted (or refused with an error to its gateway), so a crash before that
re-delivers them; admission is idempotent on request_id.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from shared.config import EngineServiceConfig
from shared.protocol import (GROUP_ENGINE, Abort, DetokParams, EngineRequest, ErrorInfo, FinishReason, Message,
                             ProtocolError, RequestOutput, TokenDelta, detok_shard)
from shared.heartbeat import HeartbeatWriter
from shared.group_reader import GroupReader
from shared.streams import Producer, StreamReader, connect

log = logging.getLogger(__name__)
MAX_REMEMBERED = 100_000


@dataclass(slots=True)
class _Route:
    """Where a request's deltas go, and which of its choices have announced themselves or finished."""

    reply_to: str
    detok: DetokParams
    num_choices: int
    last_seq: dict[int, int] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)


class _Recent:
    """A bounded set of request ids seen lately (finished, or aborted before they arrived)."""

    def __init__(self, limit: int = MAX_REMEMBERED):
        self.ids: OrderedDict[str, None] = OrderedDict()
        self.limit = limit

    def add(self, request_id: str) -> None:
        self.ids[request_id] = None
        self.ids.move_to_end(request_id)
        if len(self.ids) > self.limit:
            self.ids.popitem(last=False)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.ids


class EngineService:
    """Owns one engine's bus endpoints and the route of every request it holds."""

    def __init__(self, config: EngineServiceConfig, engine, client=None):
        self.config = config
        self.engine = engine
        self.client = client or connect(config.bus.redis_url)
        self.names = names = config.bus.names
        # a step's deltas for a shard share entries: a shard has one reader (and gateways read their own)
        self.to_detok = Producer(self.client, config.bus.maxlen, batch=True,  # and errors to gateways
                                 per_entry=config.deltas_per_entry)
        self.from_tokenizer = GroupReader(self.client, names.engine_in, GROUP_ENGINE, config.service_id,
                                          claim_idle_ms=config.claim_idle_ms, dlq=names.dlq,
                                          producer=self.to_detok, accept=(EngineRequest,))
        lookback_ms = int((time.time() - config.ctl_lookback_s) * 1000)
        self.from_ctl = StreamReader(self.client, names.engine_ctl, start=f"{max(lookback_ms, 0)}-0")
        self.heartbeat = HeartbeatWriter(self.client, names.heartbeat, "engine", config.service_id,
                                         config.heartbeat_s)
        self.routes: dict[str, _Route] = {}
        self.finished = _Recent()
        self.aborted = _Recent()  # aborts that arrived before their request
        self.stopping = threading.Event()

    # ----------------------------------------------------------------- the loop
    def run(self) -> None:
        self.from_tokenizer.ensure_group()
        log.info("engine %s reading %s", self.config.service_id, self.from_tokenizer.stream)
        try:
            while not self.stopping.is_set():
                self.run_once()
        finally:
            self.heartbeat.remove()

    def run_once(self) -> None:
        idle = not self.engine.has_work()
        envelopes = self.from_tokenizer.read(count=self.config.batch_size,
                                             block_ms=self.config.idle_block_ms if idle else None)  # never 0
        if envelopes:
            self.to_detok.send_many([item for env in envelopes for item in self.admit(env.msg)])
            self.from_tokenizer.ack(envelopes)  # admitted (or refused): safe to forget, before a long step
        self.apply_aborts(self.from_ctl.read(count=1024))
        if self.engine.has_work():
            self.to_detok.send_many(self.step())
        self.heartbeat.beat(self.stats())

    # ----------------------------------------------------------------- handlers
    def admit(self, req: EngineRequest) -> list[tuple[str, Message]]:
        rid = req.request_id
        if rid in self.routes or rid in self.finished or self.engine.has_request(rid):
            return []  # a re-delivery: already admitted
        if rid in self.aborted:  # its client left before it got here: close it, admit nothing
            self.finished.add(rid)
            return [(req.reply_to, RequestOutput(request_id=rid, finish_reason=FinishReason.ABORT,
                                                 num_choices=req.sampling.n))]
        try:
            self.engine.add_request(rid, req.prompt_token_ids, req.sampling, cache_salt=req.cache_salt)
        except ProtocolError as exc:
            code = getattr(exc, "code", 400)
            error = ErrorInfo(message=exc.message, param=exc.param, code=code,
                              type="ServiceUnavailableError" if code == 503 else "BadRequestError")
            return self._refuse(req, error)
        except Exception as exc:  # a bug must cost one request, not the engine
            log.exception("admitting %s failed", rid)
            return self._refuse(req, ErrorInfo(message=f"engine error: {type(exc).__name__}",
                                               type="InternalServerError", code=500))
        self.routes[rid] = _Route(req.reply_to, req.detok, req.sampling.n)
        return [self._announce(rid)]

    def _announce(self, rid: str) -> tuple[str, Message]:
        """A token-less delta (seq -1) that tells the request's detok shard it is admitted and by
        which engine, so that if this engine dies before the first token the shard fails the request
        at once instead of its client waiting for the idle timeout."""
        route = self.routes[rid]
        delta = TokenDelta(request_id=rid, seq=-1, engine_id=self.config.service_id, num_choices=route.num_choices,
                           reply_to=route.reply_to, detok=route.detok)
        return self._detok_stream(rid), delta

    def _detok_stream(self, rid: str) -> str:
        return self.names.detok_in(detok_shard(rid, self.config.num_detok_shards))

    def _refuse(self, req: EngineRequest, error: ErrorInfo) -> list[tuple[str, Message]]:
        self.finished.add(req.request_id)
        return [(req.reply_to, RequestOutput(request_id=req.request_id, finish_reason=FinishReason.ERROR,
                                             num_choices=req.sampling.n, error=error))]

    def apply_aborts(self, envelopes) -> None:
        ids = [rid for env in envelopes if isinstance(env.msg, Abort) for rid in env.msg.request_ids]
        for rid in ids:
            if rid not in self.routes and rid not in self.finished:
                self.aborted.add(rid)
        if ids:
            self.engine.abort_request(ids)  # the engine answers with ABORT deltas on its next step

    def step(self) -> list[tuple[str, Message]]:
        try:
            deltas = self.engine.step()
        except Exception as exc:  # a broken step must not leave clients hanging
            log.exception("engine step failed")
            return self._fail_all(exc)
        out = [item for delta in deltas for item in self._route(delta)]
        aborted = {d.request_id for d in deltas if d.finish_reason == FinishReason.ABORT}
        for rid in aborted & self.routes.keys():  # choices never forked still need their final delta
            out += self._close(rid, FinishReason.ABORT)
        return out

    # ----------------------------------------------------------------- deltas
    def _route(self, delta: TokenDelta, error: ErrorInfo | None = None) -> list[tuple[str, Message]]:
        route = self.routes.get(delta.request_id)
        if route is None:
            return []
        first = delta.index not in route.last_seq
        route.last_seq[delta.index] = delta.seq
        msg = delta if not first else _with(delta, reply_to=route.reply_to, detok=route.detok)
        if error is not None:
            msg = _with(msg, error=error)
        if delta.finish_reason is not None:
            route.finished.add(delta.index)
            if len(route.finished) >= route.num_choices:
                del self.routes[delta.request_id]
                self.finished.add(delta.request_id)
        return [(self._detok_stream(delta.request_id), msg)]

    def _close(self, rid: str, reason: FinishReason, error: ErrorInfo | None = None) -> list[tuple[str, Message]]:
        """Final deltas for every choice of ``rid`` that has not finished yet."""
        route = self.routes[rid]
        out = []
        for index in range(route.num_choices):
            if index in route.finished:
                continue
            delta = TokenDelta(request_id=rid, seq=route.last_seq.get(index, -1) + 1, index=index,
                               finish_reason=reason, engine_id=self.config.service_id, num_choices=route.num_choices)
            out += self._route(delta, error)
        return out

    def _fail_all(self, exc: Exception) -> list[tuple[str, Message]]:
        error = ErrorInfo(message=f"engine error: {type(exc).__name__}: {exc}"[:500], type="InternalServerError",
                          code=500)
        rids = list(self.routes)
        try:
            self.engine.abort_request(rids)
        except Exception:
            log.exception("abort after a failed step failed too")
        return [item for rid in rids for item in self._close(rid, FinishReason.ERROR, error)]

    # ----------------------------------------------------------------- status
    def stats(self) -> dict[str, float]:
        return {**self.engine.stats(), "num_routes": len(self.routes)}

    def stop(self, *_args) -> None:
        self.stopping.set()


def _with(delta: TokenDelta, **changes) -> TokenDelta:
    return dataclasses.replace(delta, **changes)


def main(config: EngineServiceConfig, engine_kwargs: dict) -> None:
    from engine_svc import EngineConfig, LLMEngine

    started = time.monotonic()
    engine = LLMEngine(EngineConfig(**engine_kwargs))
    log.info("engine loaded in %.1fs: %s", time.monotonic() - started, engine.stats())
    service = EngineService(config, engine)
    signal.signal(signal.SIGTERM, service.stop)
    signal.signal(signal.SIGINT, service.stop)
    service.run()
