"""One trace per request across the services: OpenTelemetry spans joined by W3C trace context.

The gateway opens a request's span (continuing the client's ``traceparent`` when it sends one)
and puts its context on the ``GenerateRequest`` (``trace``, a W3C carrier); the tokenizer's span
is its child and travels on the ``EngineRequest``; the engine's on the ``Admission``, which the
detokenizer's span continues. Each service holds its own ``Tracing`` (its own TracerProvider,
no process-global state), built by ``make_tracing`` only when ``--otlp-traces-endpoint`` is
given: with tracing off every service holds None and no message carries a context.

The engine records its phases as they happen (``IterationStats``, its monotonic clock) and
writes their spans when a sequence finishes, so a step costs nothing per token for tracing;
``Tracing.wall_ns`` turns those monotonic times into the wall-clock nanoseconds spans carry.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from shared.config import TelemetryConfig

_PROPAGATOR = TraceContextTextMapPropagator()


class Tracing:
    """One service's tracer: starts spans under a carrier's context and writes carriers.

    ``provider`` is owned here (``shutdown`` flushes it); ``detailed`` asks the engine for a
    span per step (``--collect-detailed-traces``)."""

    def __init__(self, provider: TracerProvider, *, detailed: bool = False):
        self.provider = provider
        self.tracer = provider.get_tracer("pagedserve")
        self.detailed = detailed
        # wall = monotonic + offset, fixed at start, so intervals keep the monotonic clock's exactness
        self._offset_ns = time.time_ns() - time.monotonic_ns()

    def start(self, name: str, parent: Mapping[str, str] | Span | None = None, *,
              start_ns: int | None = None, kind: SpanKind = SpanKind.INTERNAL,
              attributes: Mapping | None = None) -> Span:
        """A span under ``parent`` (a W3C carrier, a span, or None for a new trace)."""
        if isinstance(parent, Span):
            context = trace.set_span_in_context(parent)
        else:
            context = _PROPAGATOR.extract(parent) if parent else None
        return self.tracer.start_span(name, context=context, kind=kind, attributes=attributes, start_time=start_ns)

    def span_between(self, name: str, parent: Span, start_s: float, end_s: float,
                     attributes: Mapping | None = None) -> Span:
        """A finished child span of ``parent`` over two monotonic times (seconds)."""
        span = self.start(name, parent, start_ns=self.wall_ns(start_s), attributes=attributes)
        span.end(end_time=self.wall_ns(end_s))
        return span

    def wall_ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._offset_ns

    @staticmethod
    def carrier(span: Span) -> dict[str, str]:
        """``span``'s context as W3C headers (``traceparent``), for a message's ``trace`` field."""
        out: dict[str, str] = {}
        _PROPAGATOR.inject(out, context=trace.set_span_in_context(span))
        return out

    def shutdown(self) -> None:
        self.provider.shutdown()


def make_tracing(service: str, telemetry: TelemetryConfig, exporter: SpanExporter | None = None) -> Tracing | None:
    """The service's Tracing when ``--otlp-traces-endpoint`` is set (or an ``exporter`` is given,
    e.g. a test's in-memory one, exported synchronously); None otherwise."""
    if exporter is None and not telemetry.otlp_traces_endpoint:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": f"pagedserve-{service}"}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=telemetry.otlp_traces_endpoint)))
    return Tracing(provider, detailed=telemetry.collect_detailed_traces)
