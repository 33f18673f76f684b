"""The idle invariant every traffic-sending test ends with, for the in-process engine."""


def assert_engine_idle(engine) -> None:
    """Every block free, every ref count zero, nothing waiting or running, no request state."""
    bm = engine.block_manager
    assert not engine.has_work(), engine.stats()
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert not engine.scheduler.requests, list(engine.scheduler.requests)
    assert bm.num_free_blocks == bm.num_usable_blocks, engine.stats()
    assert all(block.ref_count == 0 for block in bm.blocks)


def assert_no_slack(engine) -> None:
    """PagedAttention's promise, checked after a step: each running sequence has allocated
    fewer than one block of slots beyond what it has written."""
    bs = engine.block_manager.block_size
    for request in engine.scheduler.running:
        allocated = len(request.block_table) * bs
        used = request.num_computed_tokens
        assert 0 <= allocated - used < bs, (request.request_id, allocated, used)
