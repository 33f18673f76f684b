"""Metrics (Prometheus) with vLLM's metric names under `pagedserve:`.

``Metrics`` owns its own ``CollectorRegistry`` (no process-global state), so a test or a second
gateway in one process gets its own set.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the gateway)

PREFIX = "pagedserve:"


_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
FINISH_REASONS = ("stop", "length", "abort", "error")


class Metrics:
    """The Prometheus series a gateway exposes, named as vLLM names them with `pagedserve:`.

    Gauges mirror the engines' heartbeats (``update_from_heartbeats``); counters and histograms
    are fed by the gateway as requests finish (``observe_request``).
    """

    def __init__(self, model_name: str = "", registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, labels, registry=r)

        def counter(name, doc, extra=()):
            return Counter(PREFIX + name, doc, labels + list(extra), registry=r)

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r)

        self.num_requests_running = gauge("num_requests_running", "Requests in the engines' running batch")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting in the engines")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "KV-cache usage, 1 = full")
        self.num_engines = gauge("num_engines", "Engines with a fresh heartbeat")
        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.request_success = counter("request_success", "Finished requests", ["finished_reason"])
        self.num_preemptions = counter("num_preemptions", "Preemptions in the engines")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Tokens looked up in the prefix cache")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Tokens found in the prefix cache")
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Inter-token latency", _ITL_BUCKETS)
        self.time_per_output_token = histogram("time_per_output_token_seconds", "Mean time per output token",
                                               _ITL_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "End-to-end request latency",
                                             _LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request", _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens", "Generated tokens per request",
                                                   _TOKEN_BUCKETS)
        self._engine_totals: dict[str, dict[str, float]] = {}

    def observe_request(self, *, prompt_tokens: int, generation_tokens: int, finish_reason: str,
                        e2e_s: float, ttft_s: float | None = None, itl_s: Iterable[float] = ()) -> None:
        m = self.model_name
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(generation_tokens)
        self.request_success.labels(m, finish_reason).inc()
        self.e2e_request_latency.labels(m).observe(e2e_s)
        self.request_prompt_tokens.labels(m).observe(prompt_tokens)
        self.request_generation_tokens.labels(m).observe(generation_tokens)
        if ttft_s is not None:
            self.time_to_first_token.labels(m).observe(ttft_s)
            if generation_tokens > 1:
                self.time_per_output_token.labels(m).observe((e2e_s - ttft_s) / (generation_tokens - 1))
        itl = self.inter_token_latency.labels(m)
        for gap in itl_s:
            itl.observe(gap)

    def update_from_heartbeats(self, engine_stats: Mapping[str, Mapping[str, float]]) -> None:
        """engine id -> Heartbeat.stats of every live engine: sets the gauges, advances the counters."""
        m = self.model_name
        stats = list(engine_stats.values())
        self.num_engines.labels(m).set(len(stats))
        self.num_requests_running.labels(m).set(sum(s.get("num_running", 0) for s in stats))
        self.num_requests_waiting.labels(m).set(sum(s.get("num_waiting", 0) for s in stats))
        usage = [s.get("kv_cache_usage", 0.0) for s in stats]
        self.kv_cache_usage_perc.labels(m).set(sum(usage) / len(usage) if usage else 0.0)
        for engine_id, s in engine_stats.items():  # engines report totals; counters take increments
            seen = self._engine_totals.setdefault(engine_id, {})
            for key, metric in (("num_preemptions", self.num_preemptions),
                                ("prefix_cache_queries", self.prefix_cache_queries),
                                ("prefix_cache_hits", self.prefix_cache_hits)):
                total = float(s.get(key, 0.0))
                delta = total - seen.get(key, 0.0)
                if delta > 0:
                    metric.labels(m).inc(delta)
                seen[key] = total

    def render(self) -> bytes:
        return generate_latest(self.registry)
