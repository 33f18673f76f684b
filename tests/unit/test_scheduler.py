"""Scheduler: chunked prefill, budgets, preemption, aborts, n > 1 forks (no model, no Redis)."""

from engine_svc.block_manager import BlockManager
from engine_svc.config import EngineConfig
from engine_svc.request import Request, RequestStatus
from engine_svc.scheduler import Scheduler
from engine_svc.scheduler_output import SamplerOutput
from shared.protocol import FinishReason, SamplingParams


def make_scheduler(num_blocks=16, block_size=4, **overrides) -> Scheduler:
    config = EngineConfig(enforce_eager=True, block_size=block_size, **{"max_num_batched_tokens": 64, "max_num_seqs": 8, **overrides})
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=config.enable_prefix_caching)
    return Scheduler(config, bm, max_model_len=1024, eos_token_ids=[0])


def add(scheduler, request_id, num_prompt, first_token=1, **params) -> Request:
    request = Request(request_id, list(range(first_token, first_token + num_prompt)),
                      SamplingParams(**{"temperature": 0.0, **params}))
    scheduler.add(request)
    return request


def step(scheduler, token=7):
    """One step with a fake sampler that always answers `token`."""
    plan = scheduler.schedule()
    sampled = SamplerOutput({row.key: token for row in plan.sampling})
    return plan, scheduler.update(plan, sampled)


def test_chunked_prefill_splits_long_prompt_under_budget():
    s = make_scheduler(max_num_batched_tokens=8)
    r = add(s, "a", 20, max_tokens=2)
    sizes = []
    for _ in range(3):
        plan, deltas = step(s)
        sizes.append([len(c.token_ids) for c in plan.chunks])
    assert sizes == [[8], [8], [4]]
    assert len(deltas) == 1 and deltas[0].new_token_ids == (7,)
    assert r.num_computed_tokens == 20 and r.num_tokens == 21


def test_decode_and_prefill_share_a_step_and_budget():
    s = make_scheduler(max_num_batched_tokens=10)
    add(s, "a", 3, max_tokens=5)
    step(s)
    add(s, "b", 30, max_tokens=1)
    plan, _ = step(s)
    assert [(c.request_id, len(c.token_ids)) for c in plan.chunks] == [("a", 1), ("b", 9)]
    assert [c.sample for c in plan.chunks] == [True, False]


def test_max_num_seqs_caps_running():
    s = make_scheduler(max_num_seqs=2)
    for i in range(3):
        add(s, f"r{i}", 4, max_tokens=4)
    plan, _ = step(s)
    assert [c.request_id for c in plan.chunks] == ["r0", "r1"] and len(s.waiting) == 1


def test_preemption_takes_newest_and_recomputes():
    s = make_scheduler(num_blocks=5, block_size=4, enable_prefix_caching=False)  # 4 usable blocks
    a = add(s, "a", 4, max_tokens=8, ignore_eos=True)
    b = add(s, "b", 4, max_tokens=8, ignore_eos=True)
    step(s)                 # a: [1], b: [2]; both have 5 tokens -> need a 2nd block each
    step(s)                 # a: 2 blocks, b: 2 blocks -> pool full
    assert s.block_manager.num_free_blocks == 0
    for _ in range(4):
        step(s)             # at 9 tokens each needs a 3rd block: b (newest) is preempted
    assert s.num_preemptions >= 1
    assert b in s.waiting or b.num_computed_tokens < b.num_tokens
    while s.has_work():
        step(s)
    assert a.finish_reason == FinishReason.LENGTH and b.finish_reason == FinishReason.LENGTH
    assert a.output_token_ids == [7] * 8 and b.output_token_ids == [7] * 8
    assert s.block_manager.num_free_blocks == 4 and not s.requests


def test_abort_frees_blocks_and_reports_once():
    s = make_scheduler()
    add(s, "a", 10, max_tokens=100)
    add(s, "w", 10, max_tokens=100, n=1)
    step(s)
    assert s.block_manager.num_free_blocks < 15
    s.abort(["a", "w", "unknown"])
    assert s.block_manager.num_free_blocks == 15 and not s.running and not s.waiting
    plan, deltas = step(s)
    assert sorted(d.request_id for d in deltas) == ["a", "w"]
    assert all(d.finish_reason == FinishReason.ABORT for d in deltas)
    s.abort(["a"])  # idempotent
    assert not s.has_work()


def test_stop_conditions():
    s = make_scheduler()
    r1 = add(s, "eos", 3, max_tokens=10)
    r2 = add(s, "stop-id", 3, max_tokens=10, stop_token_ids=(7,), ignore_eos=True)
    r3 = add(s, "min", 3, max_tokens=10, stop_token_ids=(7,), min_tokens=3, ignore_eos=True)
    step(s, token=0)
    assert r1.finish_reason == FinishReason.STOP and r1.stop_reason is None
    assert not r2.is_finished
    step(s, token=7)
    assert r2.finish_reason == FinishReason.STOP and r2.stop_reason == 7
    assert not r3.is_finished  # 2 outputs < min_tokens 3
    step(s, token=7)
    assert r3.finish_reason == FinishReason.STOP


def test_n_forks_share_prompt_blocks():
    s = make_scheduler(num_blocks=32)
    add(s, "p", 10, n=3, max_tokens=3, temperature=1.0, seed=1)
    plan, deltas = step(s)
    assert len(plan.chunks) == 1 and [row.logits_row for row in plan.sampling] == [0, 0, 0]
    assert sorted(d.index for d in deltas) == [0, 1, 2]
    family = s.requests["p"]
    tables = [r.block_table for r in family]
    assert tables[0] == tables[1] == tables[2]
    assert [s.block_manager.blocks[b].ref_count for b in tables[0]] == [3, 3, 3]
    plan, _ = step(s)  # each child writes position 10 in the shared partial block: 2 copies
    assert len(plan.block_copies) == 2
    assert [s.block_manager.blocks[b].ref_count for b in family[0].block_table[:2]] == [3, 3]
    while s.has_work():
        step(s)
    assert s.block_manager.num_free_blocks == 31


def test_prefix_cache_counters_are_exact_through_retries_and_preemption():
    """queries = prompt tokens of first admissions, hits = tokens served from the cache: a request
    retried at the head of the queue, or re-admitted after a preemption, is not counted again."""
    s = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=64)  # 7 usable blocks
    a = add(s, "a", 20, max_tokens=4, ignore_eos=True)  # 24 tokens: 6 blocks
    b = add(s, "b", 12, first_token=100, max_tokens=2, ignore_eos=True)  # 3 blocks: waits while a runs
    retries = 0
    while not a.is_finished:
        step(s)
        retries += b.status == RequestStatus.WAITING
    assert retries >= 3  # b was matched against the cache on every one of these steps
    while s.has_work():
        step(s)
    stats = s.block_manager.make_prefix_cache_stats()
    assert (stats.queries, stats.hits) == (20 + 12, 0)
    c = add(s, "c", 20, max_tokens=1)  # a's prompt again: its first blocks are still cached
    while s.has_work():
        step(s)
    stats = s.block_manager.make_prefix_cache_stats()
    assert c.num_cached_tokens > 0 and c.num_cached_tokens % 4 == 0
    assert (stats.queries, stats.hits) == (20 + 12 + 20, c.num_cached_tokens)

    p = make_scheduler(num_blocks=5, block_size=4, enable_prefix_caching=False)  # preemption, as above
    x, y = add(p, "x", 4, max_tokens=8, ignore_eos=True), add(p, "y", 4, max_tokens=8, ignore_eos=True)
    while p.has_work():
        step(p)
    assert p.num_preemptions >= 1 and x.is_finished and y.is_finished
    assert p.block_manager.make_prefix_cache_stats().queries == 8  # y's re-admission is not a query
