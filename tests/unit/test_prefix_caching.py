"""Prefix caching and n > 1 sharing on real (tiny and default) models."""

import random

import pytest

from engine_svc import EngineConfig, LLMEngine
from shared.protocol import SamplingParams
from tests.invariants import assert_engine_idle


def shared_prefix_workload(vocab_size, num=16, prefix_len=200, seed=0):
    rng = random.Random(seed)
    prefix = [rng.randrange(1, vocab_size) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(1, vocab_size) for _ in range(rng.randint(1, 40))] for _ in range(num)]


def run(model_dir, prompts, caching, max_tokens=16, **overrides):
    engine = LLMEngine(EngineConfig(enforce_eager=True, model=str(model_dir), dtype="float32", enable_prefix_caching=caching,
                                    **{"kv_cache_memory": 64 << 20, "max_num_batched_tokens": 512, **overrides}))
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    stats = engine.stats()
    assert_engine_idle(engine)
    # each prompt is a query once; hits are exactly the tokens the requests report as cached
    assert stats["prefix_cache_queries"] == sum(len(p) for p in prompts)
    assert stats["prefix_cache_hits"] == sum(r.num_cached_tokens for r in results)
    return [r.outputs[0].token_ids for r in results], stats


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_caching_on_equals_off(request, model_fixture):
    model_dir = request.getfixturevalue(model_fixture)
    prompts = shared_prefix_workload(vocab_size=1000)
    off, stats_off = run(model_dir, prompts, caching=False)
    on, stats_on = run(model_dir, prompts, caching=True)
    assert on == off
    assert stats_on["prefix_cache_hits"] > 0 and stats_off["prefix_cache_hits"] == 0


@pytest.mark.slow
def test_caching_on_equals_off_default_model(default_model_dir):
    prompts = shared_prefix_workload(vocab_size=1000, num=16)
    off, _ = run(default_model_dir, prompts, caching=False, max_tokens=8)
    on, stats = run(default_model_dir, prompts, caching=True, max_tokens=8)
    assert on == off and stats["prefix_cache_hits"] > 0


def test_n4_shares_prompt_blocks_and_children_match_seeded_requests(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(enforce_eager=True, model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=64 << 20,
                                    block_size=16, enable_prefix_caching=False))
    prompt = [random.Random(3).randrange(1, 1000) for _ in range(256)]
    params = SamplingParams(n=4, temperature=1.0, seed=77, max_tokens=12, ignore_eos=True)
    engine.add_request("fan", prompt, params)
    outputs = {}
    for delta in engine.step():  # the whole prompt in one step, then 4 children fork off it
        outputs.setdefault(delta.index, []).extend(delta.new_token_ids)
    family = engine.scheduler.requests["fan"]
    assert len(family) == 4
    prompt_blocks = family[0].block_table[:16]  # 256 tokens = 16 full blocks
    assert all(r.block_table[:16] == prompt_blocks for r in family)
    assert all(engine.block_manager.blocks[b].ref_count == 4 for b in prompt_blocks)
    held = engine.block_manager.num_usable_blocks - engine.block_manager.num_free_blocks
    assert held == 16  # the 16 full prompt blocks, once
    while engine.has_work():
        for delta in engine.step():
            outputs.setdefault(delta.index, []).extend(delta.new_token_ids)
    assert_engine_idle(engine)
    for i in range(4):
        alone = SamplingParams(n=1, temperature=1.0, seed=77 + i, max_tokens=12, ignore_eos=True)
        assert engine.generate([prompt], alone)[0].outputs[0].token_ids == outputs[i], f"child {i}"
    assert_engine_idle(engine)
