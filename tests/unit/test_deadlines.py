"""Request deadlines: every hop drops a request past its deadline before working on it.

The scheduler drops expired waiting and running requests before a step computes them (one final
ERROR delta per unfinished choice, blocks freed, counted by phase); the engine refuses an expired
request at admission; the engine service remembers aborts as long as a deadline can last; the
tokenizer answers an expired request without tokenizing it; the gateway reads the client's
``request_timeout`` and refuses a bad one with a 400. No Redis here.
"""

from __future__ import annotations

import math
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_svc.block_manager import BlockManager
from engine_svc.config import EngineConfig
from engine_svc.metrics import EngineMetrics
from engine_svc.request import Request
from engine_svc.scheduler import EXPIRED, Scheduler
from engine_svc.scheduler_output import SamplerOutput
from engine_svc.service import RecentIds
from shared.protocol import (EngineRequest, FinishReason, GenerateRequest, ProtocolError, RequestOutput,
                             SamplingParams, StreamNames, check_deadline, decode, is_expired)
from tests.invariants import assert_engine_idle
from tests.unit.doubles import CountingTokenizer
from tests.unit.test_gateway_flow import make_client, words  # noqa: F401 (make_client is a fixture)

T0 = 1_700_000_000.0  # the fake wall clock's start (unix time)


class FakeWallClock:
    def __init__(self):
        self.now = T0

    def __call__(self) -> float:
        return self.now


def make_scheduler(num_blocks=16, block_size=4, **overrides) -> tuple[Scheduler, FakeWallClock]:
    config = EngineConfig(enforce_eager=True, block_size=block_size,
                          **{"max_num_batched_tokens": 64, "max_num_seqs": 8, **overrides})
    wall = FakeWallClock()
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=config.enable_prefix_caching)
    return Scheduler(config, bm, max_model_len=1024, eos_token_ids=[0], wall_clock=wall), wall


def add(scheduler, request_id, num_prompt, deadline, **params) -> Request:
    request = Request(request_id, list(range(1, 1 + num_prompt)),
                      SamplingParams(**{"temperature": 0.0, "ignore_eos": True, **params}), deadline=deadline)
    scheduler.add(request)
    return request


def step(scheduler, token=7):
    plan = scheduler.schedule()
    sampled = SamplerOutput({row.key: token for row in plan.sampling})
    return plan, scheduler.update(plan, sampled)


# ---------------------------------------------------------------------------------- the scheduler


def test_an_expired_waiting_request_is_dropped_before_any_of_it_is_computed():
    s, wall = make_scheduler(max_num_seqs=1)
    add(s, "a", 4, deadline=T0 + 100, max_tokens=50)
    add(s, "b", 4, deadline=T0 + 1, max_tokens=5)  # waits behind "a" (one sequence at a time)
    plan, _ = step(s)
    assert [c.request_id for c in plan.chunks] == ["a"] and [r.request_id for r in s.waiting] == ["b"]
    wall.now = T0 + 1  # the deadline itself is past it
    plan, deltas = step(s)
    assert [c.request_id for c in plan.chunks] == ["a"]
    dropped = [d for d in deltas if d.request_id == "b"]
    assert len(dropped) == 1 and dropped[0].finish_reason == FinishReason.ERROR and dropped[0].error == EXPIRED
    assert dropped[0].new_token_ids == () and "b" not in s.requests and not s.waiting
    stats = s.take_stats()
    assert stats.num_expired == {"waiting": 1} and stats.num_prompt_tokens == 4  # "a"'s prompt only
    assert [(f.request_id, f.finish_reason, f.scheduled_time) for f in stats.finished] == \
        [("b", FinishReason.ERROR, None)]


def test_an_expired_running_request_stops_and_frees_its_blocks():
    s, wall = make_scheduler(num_blocks=16, block_size=4)
    free_at_start = s.block_manager.num_free_blocks
    add(s, "a", 6, deadline=T0 + 5, max_tokens=100)
    for _ in range(3):
        step(s)
    request = s.requests["a"][0]
    assert request.num_output_tokens == 3 and s.block_manager.num_free_blocks < free_at_start
    s.take_stats()
    wall.now = T0 + 5.5
    plan, deltas = step(s)
    assert plan.is_empty
    assert [(d.request_id, d.finish_reason, d.error) for d in deltas] == [("a", FinishReason.ERROR, EXPIRED)]
    assert s.block_manager.num_free_blocks == free_at_start and not s.has_work() and not s.requests
    assert s.take_stats().num_expired == {"running": 1}
    assert request.num_output_tokens == 3  # nothing computed after the deadline


def test_every_choice_of_an_expired_request_gets_one_final_delta():
    s, wall = make_scheduler()
    add(s, "n3", 4, deadline=T0 + 2, n=3, max_tokens=10)
    step(s)  # the prompt, then three sequences sharing its blocks
    assert len(s.requests["n3"]) == 3
    wall.now = T0 + 3
    _, deltas = step(s)
    assert sorted((d.index, d.finish_reason) for d in deltas) == [(i, FinishReason.ERROR) for i in range(3)]
    assert all(d.error == EXPIRED for d in deltas)
    assert s.block_manager.num_free_blocks == s.block_manager.num_usable_blocks
    assert s.take_stats().num_expired == {"running": 1}  # once per request, not per choice


def test_a_request_without_a_deadline_never_expires_and_a_finished_one_is_not_counted():
    s, wall = make_scheduler()
    add(s, "forever", 4, deadline=0.0, max_tokens=3)
    add(s, "quick", 4, deadline=T0 + 10, max_tokens=1)
    step(s)  # "quick" finishes at its first token
    wall.now = T0 + 1e6
    while s.has_work():
        step(s)
    assert s.requests == {} and s.take_stats().num_expired == {}


def test_admission_refuses_an_expired_request_with_a_503_and_counts_it():
    s, wall = make_scheduler()
    s.refuse_expired(0.0)
    s.refuse_expired(T0 + 0.5)
    with pytest.raises(ProtocolError) as info:
        s.refuse_expired(T0 - 0.5)
    assert info.value.code == 503 and "deadline" in info.value.message
    assert s.take_stats().num_expired == {"admission": 1}


# ---------------------------------------------------------------------------------- the engine


class CountingRunner:
    """The engine's runner, counting the tokens it is asked to compute (an independent witness)."""

    def __init__(self, runner):
        self.runner = runner
        self.num_tokens = 0

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute(self, plan):
        self.num_tokens += sum(len(c.token_ids) for c in plan.chunks)
        return self.runner.execute(plan)


def _expired_counts(metrics: EngineMetrics) -> dict[str, float]:
    return {s.labels["phase"]: s.value for family in text_string_to_metric_families(metrics.render().decode())
            for s in family.samples if s.name == "pagedserve:num_requests_expired_total"}


def test_the_engine_drops_expired_work_and_its_metrics_count_it(tiny_llama_dir):
    from engine_svc import LLMEngine
    from engine_svc.model_runner import ModelRunner

    config = EngineConfig(enforce_eager=True, model=str(tiny_llama_dir), dtype="float32", block_size=16,
                          num_gpu_blocks_override=9, max_num_seqs=1, max_num_batched_tokens=1024)
    engine = LLMEngine(config, runner=CountingRunner(ModelRunner(config, str(tiny_llama_dir))))
    wall = FakeWallClock()
    engine.scheduler.wall_clock = wall
    metrics = EngineMetrics("tiny", "engine-7")
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    with pytest.raises(ProtocolError) as info:  # already expired: refused before it is queued
        engine.add_request("late", [5] * 10, params, deadline=T0 - 1)
    assert info.value.code == 503 and not engine.has_request("late")
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ProtocolError) as info:
            engine.add_request("bad", [5] * 10, params, deadline=bad)
        assert info.value.param == "deadline"

    engine.add_request("running", [5] * 10, params, deadline=T0 + 10)
    engine.add_request("waiting", [6] * 12, params, deadline=T0 + 5)  # max_num_seqs=1: it waits
    deltas = []
    for _ in range(4):
        deltas += engine.step()
    computed = engine.runner.num_tokens
    assert computed == 10 + 3  # the running prompt and three decode steps; nothing of "waiting"
    wall.now = T0 + 20
    deltas += engine.step()
    metrics.record(engine.take_stats(), engine.stats())
    assert engine.runner.num_tokens == computed and not engine.has_work()
    finals = {d.request_id: d for d in deltas if d.finish_reason is not None}
    assert {rid: (d.finish_reason, d.error) for rid, d in finals.items()} == {
        "running": (FinishReason.ERROR, EXPIRED), "waiting": (FinishReason.ERROR, EXPIRED)}
    assert _expired_counts(metrics) == {"admission": 1.0, "waiting": 1.0, "running": 1.0}
    assert_engine_idle(engine)


# ---------------------------------------------------------------------------------- the engine service


def test_recent_ids_keep_every_id_for_keep_s_then_only_up_to_the_limit():
    now = [0.0]
    ids = RecentIds(limit=2, keep_s=600.0, clock=lambda: now[0])
    for i in range(5):
        ids.add(f"r{i}")
        now[0] += 100.0
    assert all(f"r{i}" in ids for i in range(5))  # younger than keep_s: kept past the limit
    now[0] = 1000.0
    ids.add("r5")  # r0..r3 are older than 600 s now: beyond the limit, they go
    assert [f"r{i}" in ids for i in range(6)] == [False] * 4 + [True] * 2


# ---------------------------------------------------------------------------------- the wire and the tokenizer


def test_the_deadline_crosses_the_wire_and_every_hop_can_check_it():
    request = GenerateRequest(request_id="r", reply_to="g", prompt="hi", deadline=T0 + 2.5)
    assert decode(request.to_wire()).deadline == T0 + 2.5
    assert decode(GenerateRequest(request_id="r", reply_to="g", prompt="hi").to_wire()).deadline == 0.0
    assert check_deadline(0.0) == 0.0 and check_deadline(T0) == T0
    for bad in (-1.0, math.inf, -math.inf, math.nan):
        with pytest.raises(ProtocolError):
            check_deadline(bad)
    assert not is_expired(0.0, T0) and not is_expired(T0 + 1, T0) and is_expired(T0, T0)


def test_the_tokenizer_answers_an_expired_request_without_tokenizing_it(default_model_dir):
    from transformers import AutoTokenizer

    from tokenizer_svc.prompts import PromptEncoder

    tokenizer = CountingTokenizer(AutoTokenizer.from_pretrained(default_model_dir))
    encoder = PromptEncoder(tokenizer, 2048, StreamNames("x"))
    late = GenerateRequest(request_id="late", reply_to="g", prompt="hello there", deadline=time.time() - 0.01)
    out = encoder.encode_batch([late])
    assert tokenizer.num_calls == 0 and len(out) == 1
    stream, reply = out[0]
    assert stream == "g" and isinstance(reply, RequestOutput) and reply.finish_reason == FinishReason.ERROR
    assert reply.error.code == 503 and "deadline" in reply.error.message
    bad = GenerateRequest(request_id="bad", reply_to="g", prompt="hi", deadline=-5.0)
    (_, refused), = encoder.encode_batch([bad])
    assert refused.error.code == 400 and refused.error.param == "deadline"
    deadline = time.time() + 60
    (stream, forwarded), = encoder.encode_batch([GenerateRequest(request_id="ok", reply_to="g", prompt="hi",
                                                                  deadline=deadline)])
    assert isinstance(forwarded, EngineRequest) and forwarded.deadline == deadline and tokenizer.num_calls == 1


# ---------------------------------------------------------------------------------- the gateway


def test_the_gateway_sets_each_deadline_from_the_server_timeout_or_the_clients_shorter_one(make_client):
    client, ctx = make_client(words, idle_timeout_s=30.0)
    before = time.time()
    assert client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2}).status_code == 200
    assert client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                     "request_timeout": 2.5}).status_code == 200
    after = time.time()
    first, second, chat = ctx.submitted
    assert all(r.deadline - r.arrival_time == pytest.approx(30.0) for r in (first, second))
    assert before + 30 <= first.deadline <= second.deadline <= after + 30
    assert chat.deadline - chat.arrival_time == pytest.approx(2.5) and before <= chat.arrival_time <= after


@pytest.mark.parametrize("value", [0, -1, 30.5, 1e309, "2", True, None])
def test_a_bad_request_timeout_is_a_400_naming_it_and_costs_nothing(make_client, value):
    client, ctx = make_client(words, idle_timeout_s=30.0)
    body = {"prompt": "a", "max_tokens": 2, "request_timeout": value}
    resp = client.post("/v1/completions", json=body) if value != 1e309 else client.post(
        "/v1/completions", content=b'{"prompt": "a", "max_tokens": 2, "request_timeout": 1e309}',
        headers={"content-type": "application/json"})
    if value is None:  # null: the server's timeout, as when it is left out
        assert resp.status_code == 200 and ctx.submitted[0].deadline - ctx.submitted[0].arrival_time == 30.0
        return
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "request_timeout"
    assert ctx.submitted == [] and ctx.aborted == []


def test_silence_until_the_deadline_is_a_503_and_an_abort(make_client):
    client, ctx = make_client(lambda r: [], idle_timeout_s=30.0)
    started = time.monotonic()
    resp = client.post("/v1/completions", json={"prompt": "a", "request_timeout": 0.3})
    elapsed = time.monotonic() - started
    assert resp.status_code == 503 and "deadline" in resp.json()["error"]["message"]
    assert 0.3 <= elapsed < 5.0  # slack for a loaded machine
    assert ctx.aborted == [(ctx.submitted[0].request_id,)] and ctx.collector.num_pending == 0
