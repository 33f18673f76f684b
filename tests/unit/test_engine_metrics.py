"""The engine's figures are exact: after a known workload (prefix hits, one forced preemption,
two aborts) every counter equals its known count and every histogram holds the known number of
observations. The in-process engine on the tiny model, its Prometheus registry read back through
prometheus_client's own parser; no Redis."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_svc import EngineConfig, LLMEngine
from engine_svc.metrics import EngineMetrics
from shared.protocol import FinishReason, SamplingParams
from tests.invariants import assert_engine_idle

ENGINE_NAMES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                "generation_tokens_total", "num_preemptions_total", "prefix_cache_queries_total",
                "prefix_cache_hits_total", "iteration_tokens_total", "request_queue_time_seconds",
                "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                "request_prompt_tokens", "request_generation_tokens", "request_params_n",
                "request_params_max_tokens", "decode_step_seconds")


class CountingRunner:
    """The engine's runner, counting what it is asked to compute (an independent witness)."""

    def __init__(self, runner):
        self.runner = runner
        self.num_steps = 0
        self.num_tokens = 0
        self.num_decode_steps = 0  # every chunk one token (prompts here are never chunked that fine)

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute(self, plan):
        self.num_steps += 1
        self.num_tokens += sum(len(c.token_ids) for c in plan.chunks)
        self.num_decode_steps += bool(plan.chunks) and all(len(c.token_ids) == 1 for c in plan.chunks)
        return self.runner.execute(plan)


@pytest.fixture
def engine(tiny_llama_dir):
    from engine_svc.model_runner import ModelRunner

    # 8 usable blocks of 16: two sequences of 16 + 100 tokens cannot both finish without one preemption
    config = EngineConfig(enforce_eager=True, model=str(tiny_llama_dir), dtype="float32", block_size=16,
                          num_gpu_blocks_override=9, max_num_seqs=4, max_num_batched_tokens=1024)
    return LLMEngine(config, runner=CountingRunner(ModelRunner(config, str(tiny_llama_dir))))


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _run(engine, metrics, steps: int | None = None) -> list:
    deltas = []
    while engine.has_work() and (steps is None or steps > 0):
        deltas += engine.step()
        metrics.record(engine.take_stats(), engine.stats())
        steps = None if steps is None else steps - 1
    return deltas


def _samples(metrics: EngineMetrics) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            assert sample.labels.get("engine") == "engine-7" and sample.labels["model_name"] == "tiny"
            if "le" not in sample.labels:
                out[sample.name.removeprefix("pagedserve:")] = sample.value
    return out


def test_counters_and_histograms_are_exact_after_a_known_workload(engine):
    assert engine.block_manager.num_usable_blocks == 8
    metrics = EngineMetrics("tiny", "engine-7")
    shared_prompt = [(i * 7) % 500 + 3 for i in range(40)]
    engine.add_request("a", shared_prompt, _params(5))
    _run(engine, metrics)
    engine.add_request("b", shared_prompt, _params(5))  # 2 full blocks (32 tokens) from the cache
    _run(engine, metrics)
    engine.add_request("x", [(i * 11) % 500 + 3 for i in range(16)], _params(100))
    engine.add_request("y", [(i * 13) % 500 + 5 for i in range(16)], _params(100))
    _run(engine, metrics)
    engine.add_request("c", [(i * 17) % 500 + 7 for i in range(16)], _params(50))
    _run(engine, metrics, steps=3)  # its prompt and first token, then two more tokens
    engine.add_request("d", [(i * 19) % 500 + 9 for i in range(16)], _params(50))
    engine.abort_request(["c", "d"])  # c after 3 tokens, d before it ever ran
    finals = _run(engine, metrics)
    assert {(d.request_id, d.finish_reason) for d in finals} == {("c", FinishReason.ABORT), ("d", FinishReason.ABORT)}
    assert_engine_idle(engine)

    s = _samples(metrics)
    assert s["prompt_tokens_total"] == 40 + 40 + 16 + 16 + 16  # d's prefill never ran
    assert s["generation_tokens_total"] == 5 + 5 + 100 + 100 + 3
    assert s["num_preemptions_total"] == 1
    assert s["prefix_cache_queries_total"] == 40 + 40 + 16 + 16 + 16
    assert s["prefix_cache_hits_total"] == 32
    assert s["num_requests_running"] == s["num_requests_waiting"] == s["kv_cache_usage_perc"] == 0
    runner = engine.runner
    assert s["iteration_tokens_total_count"] == runner.num_steps
    assert s["iteration_tokens_total_sum"] == runner.num_tokens
    assert 0 < s["decode_step_seconds_count"] == runner.num_decode_steps < runner.num_steps
    assert 0 < s["decode_step_seconds_sum"] < 60
    for name in ("queue_time_seconds", "prefill_time_seconds", "decode_time_seconds", "inference_time_seconds",
                 "prompt_tokens", "generation_tokens"):
        assert s[f"request_{name}_count"] == 5, name  # a, b, x, y, c: every sequence with a first token
    assert s["request_prompt_tokens_sum"] == 40 + 40 + 16 + 16 + 16
    assert s["request_generation_tokens_sum"] == 5 + 5 + 100 + 100 + 3
    assert s["request_params_n_count"] == 6 and s["request_params_n_sum"] == 6
    assert s["request_params_max_tokens_sum"] == 5 + 5 + 100 + 100 + 50 + 50
    assert [n for n in ENGINE_NAMES if n not in s and f"{n}_count" not in s] == []


def test_phases_are_stamped_with_the_schedulers_clock(tiny_llama_dir):
    """queue, prefill and decode times are differences of the scheduler's clock at the events."""
    now = [100.0]
    config = EngineConfig(enforce_eager=True, model=str(tiny_llama_dir), dtype="float32")
    engine = LLMEngine(config)
    engine.scheduler.clock = lambda: now[0]
    metrics = EngineMetrics("tiny", "engine-7")
    engine.add_request("a", [5, 6, 7, 8], _params(3))  # queued at 100
    now[0] = 102.0  # scheduled at 102, first token at 102 (the clock does not move within a step)
    engine.step()
    now[0] = 102.5
    engine.step()
    now[0] = 104.0
    engine.step()  # third token: finished at 104
    finished = engine.take_stats().finished
    assert [(f.arrival_time, f.scheduled_time, f.first_token_time, f.last_token_time, f.finished_time)
            for f in finished] == [(100.0, 102.0, 102.0, 104.0, 104.0)]
    metrics._observe_finished(finished[0])
    s = _samples(metrics)
    assert (s["request_queue_time_seconds_sum"], s["request_prefill_time_seconds_sum"],
            s["request_decode_time_seconds_sum"], s["request_inference_time_seconds_sum"]) == (2.0, 0.0, 2.0, 2.0)
