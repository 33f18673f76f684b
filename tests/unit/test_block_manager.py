"""BlockManager: exact block ids, ref counts and free counts (no model, no Redis)."""

import pytest

from engine_svc.block_manager import BlockManager, hash_block_tokens
from engine_svc.request import Request
from shared.protocol import SamplingParams


def make_block_manager(num_blocks=8, block_size=4, caching=True) -> BlockManager:
    return BlockManager(num_blocks, block_size, enable_prefix_caching=caching)


def make_request(tokens, request_id="r", salt=None) -> Request:
    return Request(request_id, list(tokens), SamplingParams(), cache_salt=salt)


def run_prefill(bm: BlockManager, request: Request) -> list:
    """Admit like the scheduler: prefix hits, then slots for the rest; mark it computed."""
    hits = bm.match_prefix(request)
    assert bm.allocate_slots(request, request.num_tokens - len(hits) * bm.block_size, hits, count_prefix_query=True)
    request.num_computed_tokens = request.num_tokens
    return hits


def ref_counts(bm: BlockManager) -> list[int]:
    return [b.ref_count for b in bm.blocks]


def test_allocate_and_free_exact_ids():
    bm = make_block_manager()
    assert bm.num_free_blocks == 7  # block 0 is the null block
    r = make_request(range(6))
    run_prefill(bm, r)
    assert r.block_table == [1, 2]
    assert ref_counts(bm) == [0, 1, 1, 0, 0, 0, 0, 0]
    assert bm.num_free_blocks == 5
    # decode: positions 6, 7 fit in block 2; position 8 needs block 3
    for token in (100, 101, 102):
        r.token_ids.append(token)
        assert bm.allocate_slots(r, 1)
        r.num_computed_tokens += 1
    assert r.block_table == [1, 2, 3]
    bm.free(r)
    assert r.block_table == [] and bm.num_free_blocks == 7
    assert ref_counts(bm) == [0] * 8


def test_null_block_never_handed_out_and_exhaustion():
    bm = make_block_manager(num_blocks=4, block_size=4)
    r = make_request(range(12))
    run_prefill(bm, r)
    assert sorted(r.block_table) == [1, 2, 3]
    s = make_request(range(50, 54), "s")
    assert not bm.allocate_slots(s, 4)  # nothing changed on failure
    assert s.block_table == [] and bm.num_free_blocks == 0


def test_full_prefix_hit_is_capped_at_prompt_minus_one():
    bm = make_block_manager()
    a = make_request(range(9), "a")
    run_prefill(bm, a)
    assert a.block_table == [1, 2, 3]
    bm.free(a)
    b = make_request(range(9), "b")
    hits = run_prefill(bm, b)
    assert [h.block_id for h in hits] == [1, 2]  # 2 full blocks = 8 tokens <= 9 - 1
    assert b.block_table[:2] == [1, 2]
    assert bm.make_prefix_cache_stats().hits == 8
    # a prompt that is exactly two full blocks: only one block may hit (8 - 1 = 7 tokens)
    bm.free(b)
    c = make_request(range(8), "c")
    assert [h.block_id for h in bm.match_prefix(c)] == [1]


def test_partial_block_prompt_is_not_cached():
    bm = make_block_manager()
    a = make_request(range(6), "a")
    run_prefill(bm, a)
    bm.free(a)
    assert len(bm.cached) == 1  # only block 1 (tokens 0-3) is full
    b = make_request(list(range(6)) + [7, 7, 7], "b")
    assert [h.block_id for h in bm.match_prefix(b)] == [1]


def test_lru_eviction_order_and_miss_after_eviction():
    bm = make_block_manager(num_blocks=5, block_size=4)  # 4 usable blocks
    a = make_request(range(0, 9), "a")       # blocks 1, 2 cached (+ block 3 partial)
    run_prefill(bm, a)
    bm.free(a)                                # free queue: 4, 3, 2, 1 (a's tail first)
    assert [b.block_id for b in bm.free_queue] == [4, 3, 2, 1]
    b = make_request(range(100, 108), "b")    # needs 2 blocks: takes 4 then 3
    run_prefill(bm, b)
    assert b.block_table == [4, 3]
    c = make_request(range(200, 204), "c")    # evicts block 2 (a's second block, freed before 1)
    run_prefill(bm, c)
    assert c.block_table == [2]
    a2 = make_request(range(0, 9), "a2")
    assert [h.block_id for h in bm.match_prefix(a2)] == [1]  # block 2's hash was evicted
    d = make_request(range(300, 304), "d")
    run_prefill(bm, d)
    assert d.block_table == [1]
    assert bm.match_prefix(make_request(range(0, 9), "a3")) == []  # a miss after full eviction


def test_fork_cow_and_free_ref_counts():
    bm = make_block_manager()
    parent = make_request(range(6), "p")
    run_prefill(bm, parent)
    child = make_request(range(6), "p")
    bm.fork(parent, child)
    child.num_computed_tokens = 6
    assert child.block_table == [1, 2] and ref_counts(bm)[1:3] == [2, 2]
    # the parent writes position 6 into the shared partial block 2: copy-on-write to block 3
    parent.token_ids.append(50)
    copies = []
    assert bm.allocate_slots(parent, 1, copies=copies)
    assert copies == [(2, 3)] and parent.block_table == [1, 3]
    assert ref_counts(bm)[1:4] == [2, 1, 1]
    # the child is now the only holder of block 2: it writes in place
    child.token_ids.append(60)
    copies = []
    assert bm.allocate_slots(child, 1, copies=copies)
    assert copies == [] and child.block_table == [1, 2]
    bm.free(parent)
    assert ref_counts(bm)[1:4] == [1, 1, 0]
    bm.free(child)
    assert ref_counts(bm) == [0] * 8 and bm.num_free_blocks == 7


def test_salted_requests_do_not_share():
    bm = make_block_manager()
    a = make_request(range(9), "a", salt="tenant-1")
    run_prefill(bm, a)
    bm.free(a)
    assert bm.match_prefix(make_request(range(9), "b", salt="tenant-2")) == []
    assert bm.match_prefix(make_request(range(9), "c")) == []
    assert len(bm.match_prefix(make_request(range(9), "d", salt="tenant-1"))) == 2


def test_hash_has_no_algebraic_collisions():
    tokens = [5, 9, 13, 2]
    base = hash_block_tokens(None, tokens)
    for j in range(len(tokens) - 1):
        shifted = list(tokens)
        shifted[j] += 31
        shifted[j + 1] -= 1
        assert hash_block_tokens(None, shifted) != base
    assert hash_block_tokens(None, tokens) == base  # stable
    assert hash_block_tokens(base, tokens) != base  # chained on the parent
    assert hash_block_tokens(None, tokens, b"salt") != base


def test_two_requests_computing_same_prefix_keep_one_cached_copy():
    bm = make_block_manager()
    a = make_request(range(8), "a")
    b = make_request(range(8), "b")
    run_prefill(bm, a)
    assert bm.allocate_slots(b, 8)  # admitted before a finished: no hit, own blocks
    assert b.block_table == [3, 4]
    assert {blk.block_id for blk in bm.cached.values()} == {1, 2}
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 7


def test_caching_disabled_never_hits():
    bm = make_block_manager(caching=False)
    a = make_request(range(9), "a")
    run_prefill(bm, a)
    bm.free(a)
    assert bm.match_prefix(make_request(range(9), "b")) == [] and not bm.cached


@pytest.mark.parametrize("num_blocks", [1, 0])
def test_pool_needs_two_blocks(num_blocks):
    with pytest.raises(ValueError):
        make_block_manager(num_blocks=num_blocks)
