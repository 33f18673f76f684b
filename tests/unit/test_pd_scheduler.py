"""Scheduler, P/D: the prefill side's hand-off, the decode side's WAITING_FOR_KV admission, load and
fallback, and the handles of requests dropped before their load (no model, no Redis)."""

from engine_svc.request import Request, RequestStatus
from shared.protocol import FinishReason, SamplingParams
from tests.unit.test_scheduler import make_scheduler, step


def handed_off(request_id: str, num_prompt: int, first: int = 1, **params) -> Request:
    """A decode engine's request: the prompt, the first token (99) and the KV of the prompt."""
    prompt = list(range(first, first + num_prompt))
    return Request(request_id, prompt, SamplingParams(**{"temperature": 0.0, **params}), token_ids=prompt + [99],
                   num_deltas_sent=1, kv_handle=request_id, num_kv_tokens=num_prompt)


def test_prefill_side_hands_off_after_the_first_token_and_frees_everything():
    s = make_scheduler(num_blocks=8, block_size=4)
    r = Request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams(temperature=0.0, max_tokens=5), hand_off=True)
    s.add(r)
    _, deltas = step(s)
    assert [(d.request_id, d.seq, d.new_token_ids, d.finish_reason) for d in deltas] == [("a", 0, (7,), None)]
    (h,) = s.take_handoffs()
    assert h is r and r.num_computed_tokens == 9 and r.block_table == [1, 2, 3]
    s.hand_off(r)
    assert s.block_manager.num_free_blocks == 7 and not s.requests and not s.running and not s.has_work()
    assert len(s.block_manager.cached) == 2  # its two full prompt blocks stay in the prefix cache


def test_a_request_that_finishes_at_its_first_token_is_not_handed_off():
    s = make_scheduler()
    s.add(Request("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=1), hand_off=True))
    _, deltas = step(s)
    assert deltas[0].finish_reason == FinishReason.LENGTH and s.take_handoffs() == []


def test_decode_side_loads_into_fresh_blocks_then_decodes_from_the_last_token():
    s = make_scheduler(num_blocks=8, block_size=4)
    r = handed_off("a", 9, max_tokens=4)
    s.add(r)
    assert r.status == RequestStatus.WAITING_FOR_KV
    plan = s.schedule()
    assert plan.chunks == []  # not scheduled before its load
    (load,) = s.take_kv_loads()
    assert load is r and r.block_table == [1, 2, 3] and s.block_manager.cached == {}  # nothing registered yet
    s.kv_loaded(r, True)
    assert r.status == RequestStatus.RUNNING and r.num_computed_tokens == 9 and r.kv_handle is None
    plan, deltas = step(s)
    assert [(c.request_id, c.token_ids, c.num_computed_tokens) for c in plan.chunks] == [("a", [99], 9)]
    assert [(d.seq, d.new_token_ids) for d in deltas] == [(1, (7,))]
    assert len(s.block_manager.cached) == 2  # the loaded full blocks are registered by the next allocation


def test_a_failed_load_frees_its_blocks_unregistered_and_recomputes():
    s = make_scheduler(num_blocks=8, block_size=4)
    r = handed_off("a", 9, max_tokens=4)
    s.add(r)
    (load,) = s.take_kv_loads()
    s.kv_loaded(load, False)
    assert r.status == RequestStatus.WAITING and r.block_table == [] and s.block_manager.num_free_blocks == 7
    assert s.block_manager.cached == {}  # garbage blocks never become prefix-cache hits
    plan, deltas = step(s)
    assert [(c.num_computed_tokens, len(c.token_ids)) for c in plan.chunks] == [(0, 10)]  # prompt + first token
    assert [(d.seq, d.new_token_ids) for d in deltas] == [(1, (7,))]


def test_loads_wait_for_blocks_and_for_the_sequence_cap():
    s = make_scheduler(num_blocks=5, block_size=4, max_num_seqs=8)  # 4 usable blocks
    a, b = handed_off("a", 9), handed_off("b", 9, first=50)
    s.add(a)
    s.add(b)
    assert s.take_kv_loads() == [a]  # b's 3 blocks do not fit beside a's 3
    s.kv_loaded(a, True)
    assert s.take_kv_loads() == [] and b.status == RequestStatus.WAITING_FOR_KV and b.block_table == []
    capped = make_scheduler(max_num_seqs=1)
    c, d = handed_off("c", 3), handed_off("d", 3, first=50)
    capped.add(c)
    capped.add(d)
    assert capped.take_kv_loads() == [c]


def test_a_request_dropped_before_its_load_hands_out_its_handle_once():
    s = make_scheduler()
    s.add(handed_off("a", 5))
    s.add(handed_off("b", 5, first=50))
    s.abort(["a"])
    assert s.take_dropped_handles() == ["a"] and s.take_dropped_handles() == []
    (load,) = s.take_kv_loads()
    s.kv_loaded(load, True)
    s.abort(["b"])  # loaded: the entry was consumed, nothing to delete
    assert s.take_dropped_handles() == []
    assert s.block_manager.num_free_blocks == s.block_manager.num_usable_blocks and not s.requests
