"""One engine's Prometheus figures (label ``engine`` = its service id), served on its own port.

The engine owns these facts, so only it counts them: the scheduler and the block manager count
events as they happen (``IterationStats``, ``make_prefix_cache_stats()``) and ``record`` turns
each step's account into increments here, in the engine service's loop. Intervals come from
``FinishedSequence``'s timestamps, all of this process's monotonic clock.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, generate_latest, start_http_server

from engine_svc.iteration_stats import FinishedSequence, IterationStats
from shared.telemetry import N_BUCKETS, REQUEST_LATENCY_BUCKETS, TOKEN_BUCKETS, SeriesMaker

log = logging.getLogger(__name__)
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
DECODE_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                       1.0, 2.5)
EXPIRY_PHASES = ("admission", "waiting", "running")  # where a request past its deadline was dropped


class EngineMetrics:
    """Owns one engine's registry; ``record`` is its only writer (called from the service loop)."""

    def __init__(self, model_name: str, engine_id: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.labels = (model_name, engine_id)
        make = SeriesMaker(self.registry, ["model_name", "engine"], self.labels)
        gauge, counter, histogram = make.gauge, make.counter, make.histogram

        self.num_requests_running = gauge("num_requests_running", "Sequences in the running batch")
        self.num_requests_waiting = gauge("num_requests_waiting", "Sequences waiting (queued or preempted)")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "KV-cache usage, 1 = full")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests whose prefill completed")
        self.generation_tokens = counter("generation_tokens", "Tokens sampled")
        self.num_preemptions = counter("num_preemptions", "Sequences preempted (by recompute)")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens computed per engine step",
                                          STEP_TOKEN_BUCKETS)
        self.decode_step_time = histogram("decode_step_seconds", "Duration of each engine step that only decoded "
                                          "(scheduled to sampled)", DECODE_STEP_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Queued at the engine to first scheduled",
                                    REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "First scheduled to first token",
                                      REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "First token to last token",
                                     REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "First scheduled to last token",
                                        REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per sequence", TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens", "Tokens generated per sequence",
                                                   TOKEN_BUCKETS)
        self.params_n = histogram("request_params_n", "n of each admitted request", N_BUCKETS)
        self.params_max_tokens = histogram("request_params_max_tokens", "max_tokens of each admitted request",
                                           TOKEN_BUCKETS)
        expired = SeriesMaker(self.registry, ["model_name", "engine"]).counter(
            "num_requests_expired", "Requests dropped past their deadline, by phase (admission: refused; waiting: "
            "nothing computed; running: some computed)", extra=("phase",))
        self.num_requests_expired = {phase: expired.labels(*self.labels, phase) for phase in EXPIRY_PHASES}
        self._prefix_cache_seen = (0, 0)
        # P/D: the KV connector's cumulative counts (engine.stats()'s kv_* keys), as counters
        kv = SeriesMaker(self.registry, ["model_name", "engine"])
        moved = kv.counter("kv_transfer_bytes", "KV bytes moved between engines (saved: prefill side, loaded: decode "
                                                "side)", extra=("direction",))
        seconds = kv.counter("kv_transfer_seconds", "Time spent moving KV (save: gather and store; load: fetch, check "
                                                    "and scatter)", extra=("direction",))
        requests = kv.counter("kv_transfer_requests", "Requests whose KV was saved or loaded", extra=("direction",))
        fallbacks = kv.counter("kv_transfer_fallbacks", "Hand-offs whose KV could not be loaded, recomputed instead",
                               extra=("reason",))
        self._kv_counters = {"kv_bytes_saved": moved.labels(*self.labels, "saved"),
                             "kv_bytes_loaded": moved.labels(*self.labels, "loaded"),
                             "kv_save_seconds": seconds.labels(*self.labels, "save"),
                             "kv_load_seconds": seconds.labels(*self.labels, "load"),
                             "kv_num_saved": requests.labels(*self.labels, "saved"),
                             "kv_num_loaded": requests.labels(*self.labels, "loaded")}
        self._kv_fallbacks = fallbacks
        self.kv_save_failures = SeriesMaker(self.registry, ["model_name", "engine"], self.labels).counter(
            "kv_transfer_save_failures", "Hand-offs whose KV could not be saved (the decode side recomputes)")
        self._kv_seen: dict[str, float] = {}

    def record(self, stats: IterationStats, engine_stats: dict[str, float]) -> None:
        """One account of the scheduler (``take_stats()``) and the engine's current state (``stats()``)."""
        self.num_requests_running.set(engine_stats["num_running"])
        self.num_requests_waiting.set(engine_stats["num_waiting"])
        self.kv_cache_usage_perc.set(engine_stats["kv_cache_usage"])
        queries, hits = int(engine_stats["prefix_cache_queries"]), int(engine_stats["prefix_cache_hits"])
        seen_queries, seen_hits = self._prefix_cache_seen
        if queries > seen_queries:  # the block manager keeps totals: the counters take what is new
            self.prefix_cache_queries.inc(queries - seen_queries)
        if hits > seen_hits:
            self.prefix_cache_hits.inc(hits - seen_hits)
        self._prefix_cache_seen = (queries, hits)
        if stats.num_prompt_tokens:
            self.prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.inc(stats.num_generation_tokens)
        if stats.num_preemptions:
            self.num_preemptions.inc(stats.num_preemptions)
        for phase, num in stats.num_expired.items():
            self.num_requests_expired[phase].inc(num)
        self._record_kv(engine_stats)
        for num_tokens in stats.step_tokens:
            self.iteration_tokens.observe(num_tokens)
        for seconds in stats.decode_step_seconds:
            self.decode_step_time.observe(seconds)
        for n, max_tokens in stats.admitted:
            self.params_n.observe(n)
            self.params_max_tokens.observe(max_tokens)
        for seq in stats.finished:
            self._observe_finished(seq)

    def _record_kv(self, engine_stats: dict[str, float]) -> None:
        """The connector keeps totals: each counter takes what is new."""
        for key, value in engine_stats.items():
            if not key.startswith("kv_"):
                continue
            new = value - self._kv_seen.get(key, 0.0)
            if new <= 0:
                continue
            self._kv_seen[key] = value
            if key in self._kv_counters:
                self._kv_counters[key].inc(new)
            elif key.startswith("kv_fallbacks_"):
                self._kv_fallbacks.labels(*self.labels, key.removeprefix("kv_fallbacks_")).inc(new)
            elif key == "kv_num_save_failures":
                self.kv_save_failures.inc(new)

    def _observe_finished(self, seq: FinishedSequence) -> None:
        """A sequence that produced a token is observed in every per-sequence histogram; one that
        never did (aborted or failed before its first token) in none."""
        if seq.first_token_time is None or seq.scheduled_time is None:
            return
        self.queue_time.observe(seq.scheduled_time - seq.arrival_time)
        self.prefill_time.observe(seq.first_token_time - seq.scheduled_time)
        self.decode_time.observe(seq.last_token_time - seq.first_token_time)
        self.inference_time.observe(seq.last_token_time - seq.scheduled_time)
        self.request_prompt_tokens.observe(seq.num_prompt_tokens)
        self.request_generation_tokens.observe(seq.num_generation_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """Expose the registry at http://host:port/metrics from a daemon thread."""
        start_http_server(port, addr=host, registry=self.registry)
        log.info("engine metrics at http://%s:%d/metrics", host, port)
