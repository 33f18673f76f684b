"""Prometheus figures under vLLM's names with the prefix `pagedserve:`, each with one owner.

A figure is counted in the process where its event happens, exactly once, so summing a series
over every scraped endpoint gives the stack's total whatever the number of gateways:

- each gateway (``GatewayMetrics``, its ``/metrics``): what only the client's side sees — time
  to first token, inter-token latency, end-to-end latency, and each choice's finish reason as
  the client got it (a stop string is found by the detokenizer, a departure by the gateway);
- each engine (``engine_svc/metrics.py``, its own ``--metrics-port``, label ``engine``): the
  running and waiting requests, KV usage, tokens, preemptions, prefix-cache queries and hits,
  and the per-phase histograms (queue, prefill, decode, inference), timed with its own clock;
- the bus (``BusCollector``, a gateway's ``/metrics/bus``): read from Redis at scrape time
  (stream lengths, group pending and consumers, dead letters) and from the heartbeats (each
  replica's message and reclaim totals); the same from any gateway, so scrape it from one.

Each ``*Metrics`` owns its ``CollectorRegistry`` (no process-global state).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the gateway)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "pagedserve:"

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort", "error")


class SeriesMaker:
    """Makes a registry's series under PREFIX with one set of label names (``extra`` adds some to
    a counter); with ``values`` given, each series comes bound to them (``.labels(*values)``)."""

    def __init__(self, registry: CollectorRegistry, label_names: list[str], values: tuple | None = None):
        self.registry, self.label_names, self.values = registry, label_names, values

    def gauge(self, name: str, doc: str):
        return self._bind(Gauge(PREFIX + name, doc, self.label_names, registry=self.registry))

    def counter(self, name: str, doc: str, extra: tuple[str, ...] = ()):
        return self._bind(Counter(PREFIX + name, doc, [*self.label_names, *extra], registry=self.registry))

    def histogram(self, name: str, doc: str, buckets):
        return self._bind(Histogram(PREFIX + name, doc, self.label_names, buckets=buckets, registry=self.registry))

    def _bind(self, series):
        return series.labels(*self.values) if self.values is not None else series


class GatewayMetrics:
    """The figures one gateway owns, fed as each HTTP request ends (``observe_request``)."""

    def __init__(self, model_name: str = "", registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        make = SeriesMaker(self.registry, ["model_name"])
        histogram = make.histogram
        self.request_success = make.counter("request_success", "Finished choices, by the reason the client got",
                                            extra=("finished_reason",))
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Arrival at the gateway to first output",
                                             LATENCY_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Time between outputs of a request",
                                             ITL_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "Arrival at the gateway to its end",
                                             REQUEST_LATENCY_BUCKETS)
        for reason in FINISH_REASONS:  # present from the start, as vLLM's are
            self.request_success.labels(model_name, reason)

    def observe_request(self, *, finish_reasons: Iterable[str], e2e_s: float | None = None,
                        ttft_s: float | None = None, itl_s: Iterable[float] = ()) -> None:
        """One HTTP request ended: a success per choice, and its latencies (None: not observed)."""
        m = self.model_name
        for reason in finish_reasons:
            self.request_success.labels(m, reason).inc()
        if e2e_s is not None:
            self.e2e_request_latency.labels(m).observe(e2e_s)
        if ttft_s is not None:
            self.time_to_first_token.labels(m).observe(ttft_s)
        itl = self.inter_token_latency.labels(m)
        for gap in itl_s:
            itl.observe(gap)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class BusCollector:
    """The bus as figures, from one snapshot (``BusSnapshot``) taken at scrape time: per stream
    its length, per group its pending entries and consumers, per replica its message and
    reclaim totals (from the heartbeats). A custom collector: nothing here counts, it reports."""

    def __init__(self, snapshot: Mapping):
        self.snapshot = snapshot

    def collect(self):
        s = self.snapshot
        length = GaugeMetricFamily(PREFIX + "bus_stream_length", "Entries in a stream", labels=["stream"])
        for stream, n in s.get("streams", {}).items():
            length.add_metric([stream], n)
        pending = GaugeMetricFamily(PREFIX + "bus_group_pending", "Entries delivered, not yet acked",
                                    labels=["stream", "group"])
        consumers = GaugeMetricFamily(PREFIX + "bus_group_consumers", "Consumers of a group", labels=["stream", "group"])
        for (stream, group), info in s.get("groups", {}).items():
            pending.add_metric([stream, group], info["pending"])
            consumers.add_metric([stream, group], info["consumers"])
        dead = GaugeMetricFamily(PREFIX + "bus_dead_letters", "Entries in the dead-letter stream")
        dead.add_metric([], s.get("dead_letters", 0))
        messages = CounterMetricFamily(PREFIX + "bus_messages", "Messages a replica handled (rate(): per second)",
                                       labels=["role", "service_id"])
        reclaimed = CounterMetricFamily(PREFIX + "bus_reclaimed_entries", "Entries a replica claimed from dead ones",
                                        labels=["role", "service_id"])
        for (role, service_id), beat in s.get("replicas", {}).items():
            messages.add_metric([role, service_id], beat.get("num_messages", 0.0))
            reclaimed.add_metric([role, service_id], beat.get("num_reclaimed", 0.0))
        yield from (length, pending, consumers, dead, messages, reclaimed)


def render_bus(snapshot: Mapping) -> bytes:
    registry = CollectorRegistry()
    registry.register(BusCollector(snapshot))
    return generate_latest(registry)
