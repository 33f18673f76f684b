"""The engine on the default model: the cupy backend's greedy tokens equal the torch backend's."""

from __future__ import annotations

import pytest

from tests.gpu.conftest_helpers import needs_cupy

pytestmark = [*needs_cupy, pytest.mark.slow]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "1, 2, 3, 4,",
           "Paged attention stores the KV cache in"]


def _greedy(model_dir, backend_name):
    from engine_svc import EngineConfig, LLMEngine
    from shared.protocol import SamplingParams

    # a fixed KV budget (not a share of free memory): the engine of the previous call may not be freed yet
    config = EngineConfig(enforce_eager=True, model=str(model_dir), device="cuda", dtype="float32", attention_backend=backend_name,
                          kv_cache_memory=2 << 30, max_num_batched_tokens=64)  # 64: chunked prefill too
    engine = LLMEngine(config)
    assert engine.runner.backend.name == backend_name
    long_prompt = engine.tokenizer.encode(" ".join(PROMPTS) * 20)  # > 512 tokens: split-K decode
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS] + [long_prompt]
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    return [r.outputs[0].token_ids for r in results]


def test_cupy_backend_greedy_equals_torch_backend(default_model_dir):
    assert _greedy(default_model_dir, "cupy") == _greedy(default_model_dir, "torch")
