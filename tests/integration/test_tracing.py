"""One trace per request across the services: the gateway (under uvicorn), the tokenizer, the
engine and a detok shard run in threads of this process on a real redis-server, each with its
own Tracing exporting into one in-memory exporter. A streamed chat request yields one trace whose
spans link gateway -> tokenize (-> chat_template) -> engine (-> queued, prefill -> prefill_chunk,
decode) -> detokenize, and a client's ``traceparent`` is continued."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from detok_svc.processor import DetokProcessor
from detok_svc.service import DetokService
from engine_svc import EngineConfig, LLMEngine
from engine_svc.service import EngineService
from gateway.app import build_app
from gateway.context import GatewayContext
from shared.config import (BusConfig, DetokConfig, EngineServiceConfig, GatewayConfig, TelemetryConfig,
                           TokenizerConfig)
from shared.models import load_tokenizer
from shared.protocol import StreamNames
from shared.redis_server import free_port
from shared.streams import connect
from shared.tracing import make_tracing
from tokenizer_svc.prompts import PromptEncoder
from tokenizer_svc.service import TokenizerService

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
PHASES = {"gateway", "tokenize", "chat_template", "engine", "queued", "prefill", "prefill_chunk", "decode",
          "detokenize"}


@pytest.fixture
def traced_stack(redis_url, prefix, tiny_llama_dir):
    import uvicorn

    exporter = InMemorySpanExporter()
    bus = BusConfig(redis_url=redis_url, prefix=prefix)
    names = StreamNames(prefix)
    tokenizer = load_tokenizer(str(tiny_llama_dir))

    def tracing(service):
        return make_tracing(service, TelemetryConfig(), exporter=exporter)

    services = [
        TokenizerService(TokenizerConfig(bus=bus, service_id="tok-0", block_ms=50),
                         PromptEncoder(tokenizer, 512, names, tracing("tokenizer")), client=connect(redis_url)),
        EngineService(EngineServiceConfig(bus=bus, service_id="engine-0", idle_block_ms=50),
                      LLMEngine(EngineConfig(enforce_eager=True, model=str(tiny_llama_dir), dtype="float32",
                                             kv_cache_memory=4 << 20, max_model_len=512)),
                      client=connect(redis_url), tracing=tracing("engine")),
        DetokService(DetokConfig(bus=bus, service_id="detok-0", block_ms=50), DetokProcessor(tokenizer, names),
                     client=connect(redis_url), tracing=tracing("detok")),
    ]
    port = free_port()
    config = GatewayConfig(bus=bus, port=port, model=str(tiny_llama_dir), served_model_name="tiny", gateway_id="g0")
    app = build_app(config, context=GatewayContext(config, tracing=tracing("gateway")))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threads = [threading.Thread(target=s.run, daemon=True) for s in services]
    threads.append(threading.Thread(target=server.run, daemon=True))
    for t in threads:
        t.start()
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    yield base_url, exporter
    server.should_exit = True
    for s in services:
        s.stop()
    for t in threads:
        t.join(10)


def _stream_chat(base_url: str, headers: dict[str, str]) -> str:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, headers=headers, timeout=60) as resp:
        assert resp.status_code == 200
        return resp.read().decode()


def _spans_of_one_request(exporter, timeout_s: float = 10.0) -> dict[str, list]:
    deadline = time.monotonic() + timeout_s
    while True:
        spans = exporter.get_finished_spans()
        by_name: dict[str, list] = {}
        for span in spans:
            by_name.setdefault(span.name, []).append(span)
        if PHASES <= set(by_name) or time.monotonic() > deadline:
            return by_name
        time.sleep(0.05)


def test_one_trace_spans_every_service_with_correct_parents(traced_stack):
    base_url, exporter = traced_stack
    text = _stream_chat(base_url, {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    assert text.rstrip().endswith("data: [DONE]")
    spans = _spans_of_one_request(exporter)
    assert PHASES <= set(spans), sorted(spans)
    assert {format(s.context.trace_id, "032x") for group in spans.values() for s in group} == {CLIENT_TRACE}
    one = {name: group[0] for name, group in spans.items()}
    assert all(len(spans[name]) == 1 for name in PHASES - {"prefill_chunk"})

    def parent_of(name: str) -> int:
        return one[name].parent.span_id

    assert format(parent_of("gateway"), "016x") == CLIENT_SPAN
    assert parent_of("tokenize") == one["gateway"].context.span_id
    assert parent_of("chat_template") == one["tokenize"].context.span_id
    assert parent_of("engine") == one["tokenize"].context.span_id
    for phase in ("queued", "prefill", "decode"):
        assert parent_of(phase) == one["engine"].context.span_id, phase
    assert all(s.parent.span_id == one["prefill"].context.span_id for s in spans["prefill_chunk"])
    assert parent_of("detokenize") == one["engine"].context.span_id
    engine = one["engine"]
    assert [e.name for e in engine.events] == ["first_token", "finished"]
    assert engine.start_time <= one["queued"].start_time <= one["prefill"].start_time <= one["decode"].start_time
    assert one["decode"].end_time <= engine.end_time
    assert {s.resource.attributes["service.name"] for s in one.values()} == {
        "pagedserve-gateway", "pagedserve-tokenizer", "pagedserve-engine", "pagedserve-detok"}


def test_without_traceparent_the_gateway_starts_the_trace(traced_stack):
    base_url, exporter = traced_stack
    _stream_chat(base_url, {})
    spans = _spans_of_one_request(exporter)
    gateway = spans["gateway"][0]
    assert gateway.parent is None
    assert {s.context.trace_id for group in spans.values() for s in group} == {gateway.context.trace_id}
