"""The tokenizer replica's loop: read a batch from ps:tokenizer:in, encode it, publish, ack.

Redis faults: the reader backs off on its own; a batch whose output Redis did not take is held
(``Outbox``) and retried with backoff before anything new is read, and acked only once it is out."""

from __future__ import annotations

import gc
import logging
import threading

from shared.config import TokenizerConfig
from shared.protocol import GROUP_TOKENIZER, ErrorInfo, FinishReason, GenerateRequest, Message, RequestOutput
from shared.group_reader import GroupReader
from shared.heartbeat import HeartbeatWriter
from shared.lifecycle import run_until_signalled
from shared.logs import StatusLine, configure_logging
from shared.models import load_tokenizer, model_max_len, resolve_model
from shared.streams import Outbox, Producer, connect
from shared.tracing import make_tracing
from tokenizer_svc.prompts import PromptEncoder

log = logging.getLogger(__name__)


class TokenizerService:
    """Owns one consumer of group "tokenizer" and a PromptEncoder; keeps no per-request state."""

    def __init__(self, config: TokenizerConfig, encoder: PromptEncoder, client=None):
        self.config = config
        self.client = client or connect(config.bus.redis_url, **config.bus.redis_auth)
        names = config.bus.names
        # and to gateways (errors, echo)
        self.to_engine = Producer(self.client, config.bus.maxlen, signer=config.bus.signer)
        self.from_gateway = GroupReader(self.client, names.tokenizer_in, GROUP_TOKENIZER, config.service_id,
                                        claim_idle_ms=config.claim_idle_ms, dlq=names.dlq,
                                        producer=self.to_engine, accept=(GenerateRequest,), signer=config.bus.signer)
        self.heartbeat = HeartbeatWriter(self.client, names.heartbeat, "tokenizer", config.service_id,
                                         config.heartbeat_s, ttl_s=config.bus.heartbeat_ttl_s)
        self.outbox = Outbox(self.to_engine, self.from_gateway)
        self.encoder = encoder
        self.stopping = threading.Event()
        self.num_requests = 0
        self.status = StatusLine(log, config.telemetry.status_log_s, lambda: {"requests": self.num_requests},
                                 lambda rates: f"tokenized {rates['requests']:.1f} requests/s")

    @classmethod
    def from_config(cls, config: TokenizerConfig) -> TokenizerService:
        """The engine's cap (``max_model_len``, parsed from the same flag as the engine's), else the model's."""
        max_len = config.max_model_len or model_max_len(resolve_model(config.model))
        tokenizer = load_tokenizer(config.model, config.tokenizer)
        tracing = make_tracing("tokenizer", config.telemetry)
        return cls(config, PromptEncoder(tokenizer, max_len, config.bus.names, tracing))

    def run(self) -> None:
        log.info("tokenizer %s reading %s", self.config.service_id, self.from_gateway.stream)
        try:
            while not self.stopping.is_set():
                self.run_once(self.config.block_ms)
        finally:
            self.heartbeat.remove()

    def run_once(self, block_ms: int | None) -> int:
        if not self.outbox.flush():  # Redis away: the last batch is held, nothing new is read
            return 0
        envelopes = self.from_gateway.read(count=self.config.batch_size, block_ms=block_ms)
        if envelopes:
            # acked after publishing: a crash before this re-delivers
            self.outbox.put(self._encode([e.msg for e in envelopes]), acks=envelopes)
            self.outbox.flush()
            self.num_requests += len(envelopes)
        self.heartbeat.beat({"num_requests": self.num_requests, "num_messages": self.num_requests,
                             "num_reclaimed": self.from_gateway.num_reclaimed})
        self.status.tick(busy=bool(envelopes))
        return len(envelopes)

    def _encode(self, requests: list[GenerateRequest]) -> list[tuple[str, Message]]:
        """The batch at once; if that breaks (a bug, a template crash), one by one, and the request
        that still breaks gets a 500 instead of crashing this replica on every re-delivery."""
        try:
            return self.encoder.encode_batch(requests)
        except Exception:
            log.exception("batch of %d failed; encoding one by one", len(requests))
        out: list[tuple[str, Message]] = []
        for request in requests:
            try:
                out += self.encoder.encode_batch([request])
            except Exception as exc:
                log.exception("request %s failed", request.request_id)
                error = ErrorInfo(message=f"tokenizer error: {type(exc).__name__}", type="InternalServerError",
                                  code=500)
                out.append((request.reply_to, RequestOutput(request_id=request.request_id, error=error,
                                                            finish_reason=FinishReason.ERROR)))
        return out

    def stop(self, *_args) -> None:
        self.stopping.set()


def main(config: TokenizerConfig) -> None:
    configure_logging("tokenizer", config.telemetry)
    service = TokenizerService.from_config(config)
    gc.freeze()  # the tokenizer and its chat templates live as long as the process: out of every full collection
    run_until_signalled(service, service.encoder.tracing)
