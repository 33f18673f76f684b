"""The pieces of observability that need no stack: the status line, JSON logs, the status table,
the gateway's per-choice successes and W3C carriers (no Redis, no model)."""

from __future__ import annotations

import json
import logging

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from shared.config import TelemetryConfig
from shared.logs import JsonFormatter, StatusLine
from shared.protocol import Heartbeat
from shared.status import rows, table
from shared.telemetry import GatewayMetrics, render_bus
from shared.tracing import make_tracing


def test_status_line_logs_rates_while_busy_and_once_after(monkeypatch, caplog):
    now = [0.0]
    monkeypatch.setattr("shared.logs.time.monotonic", lambda: now[0])
    totals = {"tokens": 0.0}
    line = StatusLine(logging.getLogger("t"), 5.0, lambda: totals, lambda r: f"{r['tokens']:.1f} tokens/s")
    caplog.set_level(logging.INFO)
    now[0], totals["tokens"] = 4.0, 40.0
    assert not line.tick(busy=True)  # not a period yet
    now[0], totals["tokens"] = 5.0, 50.0
    assert line.tick(busy=True)
    now[0] = 10.0
    assert line.tick(busy=False)  # the period it fell idle in
    now[0] = 15.0
    assert not line.tick(busy=False)
    assert [r.getMessage() for r in caplog.records] == ["10.0 tokens/s", "0.0 tokens/s"]


def test_json_log_lines():
    record = logging.LogRecord("engine_svc.service", logging.INFO, "f", 1, "running %d", (3,), None)
    line = json.loads(JsonFormatter("engine").format(record))
    assert {k: line[k] for k in ("level", "service", "logger", "message")} == {
        "level": "INFO", "service": "engine", "logger": "engine_svc.service", "message": "running 3"}


def test_status_rows_mark_stale_beats_and_order_by_role():
    beats = {"engine-0": Heartbeat(service="engine", service_id="engine-0", time=95.0, host="h", pid=7,
                                   start_time=40.0, stats={"num_running": 2, "kv_cache_usage": 0.25}),
             "gateway-g0": Heartbeat(service="gateway", service_id="gateway-g0", time=99.5, host="h", pid=6,
                                     start_time=50.0)}
    out = rows(beats, stale_after_s=2.0, now=100.0)
    assert [(r["service_id"], r["uptime_s"], r["age_s"], r["stale"]) for r in out] == [
        ("gateway-g0", 50.0, 0.5, False), ("engine-0", 60.0, 5.0, True)]
    assert out[1]["load"] == "running 2 waiting 0 kv 25%"
    lines = table(out).splitlines()
    assert lines[0].split() == ["SERVICE_ID", "ROLE", "HOST", "PID", "UPTIME_S", "LOAD", "AGE_S", "STALE"]
    assert lines[1].endswith("ok") and lines[2].endswith("STALE")


def test_gateway_counts_one_success_per_choice_and_latencies_once():
    metrics = GatewayMetrics("tiny")
    metrics.observe_request(finish_reasons=["stop", "length"], e2e_s=1.0, ttft_s=0.25, itl_s=[0.1, 0.2])
    metrics.observe_request(finish_reasons=["abort"])
    samples = {(s.name, s.labels.get("finished_reason")): s.value
               for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    assert {r: samples[("pagedserve:request_success_total", r)] for r in ("stop", "length", "abort", "error")} == {
        "stop": 1, "length": 1, "abort": 1, "error": 0}
    assert samples[("pagedserve:e2e_request_latency_seconds_count", None)] == 1
    assert samples[("pagedserve:inter_token_latency_seconds_count", None)] == 2


def test_bus_exposition_parses():
    text = render_bus({"streams": {"ps:engine:in": 3}, "groups": {("ps:engine:in", "engine"): {"pending": 1,
                                                                                               "consumers": 2}},
                       "dead_letters": 4, "replicas": {("tokenizer", "tok-0"): {"num_messages": 9.0}}}).decode()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples == {"pagedserve:bus_stream_length": 3, "pagedserve:bus_group_pending": 1,
                       "pagedserve:bus_group_consumers": 2, "pagedserve:bus_dead_letters": 4,
                       "pagedserve:bus_messages_total": 9, "pagedserve:bus_reclaimed_entries_total": 0}


def test_tracing_is_off_without_an_endpoint_and_carriers_continue_a_trace():
    assert make_tracing("gateway", TelemetryConfig()) is None
    exporter = InMemorySpanExporter()
    tracing = make_tracing("gateway", TelemetryConfig(), exporter=exporter)
    parent = tracing.start("a", {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})
    carrier = tracing.carrier(parent)
    assert carrier["traceparent"].startswith("00-4bf92f3577b34da6a3ce929d0e0e4736-")
    child = tracing.start("b", carrier)
    child.end()
    parent.end()
    b, a = exporter.get_finished_spans()
    assert b.parent.span_id == a.context.span_id and a.parent.span_id == 0x00f067aa0ba902b7
