"""The engine's greedy tokens and logprobs against HF transformers on the same weights."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_svc import EngineConfig, LLMEngine
from shared.protocol import SamplingParams
from tests.invariants import assert_engine_idle, assert_no_slack


def load_hf(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # the engine runs with ignore_eos
    model.generation_config.pad_token_id = 0
    return model.eval()


def hf_greedy(model, prompt, max_tokens):
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def random_workload(vocab_size, num_prompts=32, seed=0):
    rng = random.Random(seed)
    lengths = [1, 300] + [rng.randint(1, 300) for _ in range(num_prompts - 2)]
    max_tokens = [128, 1] + [rng.randint(1, 128) for _ in range(num_prompts - 2)]
    prompts = [[rng.randrange(1, vocab_size) for _ in range(n)] for n in lengths]
    return prompts, max_tokens


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen3_dir"])
def test_greedy_parity_with_preemption_and_chunked_prefill(request, model_fixture, compiled):
    model_dir = request.getfixturevalue(model_fixture)
    engine = LLMEngine(EngineConfig(enforce_eager=not compiled, model=str(model_dir), dtype="float32", block_size=16,
                                    num_gpu_blocks_override=64, max_num_seqs=64, max_num_batched_tokens=256))
    prompts, max_tokens = random_workload(engine.vocab_size)
    assert max(len(p) for p in prompts) > engine.config.max_num_batched_tokens  # chunked prefill happens
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    results = engine.generate(prompts, params, on_step=assert_no_slack)
    assert engine.stats()["num_preemptions"] >= 1
    assert_engine_idle(engine)

    hf = load_hf(model_dir)
    for prompt, m, result in zip(prompts, max_tokens, results):
        out = result.outputs[0]
        assert len(out.token_ids) == m and out.finish_reason == "length"
        assert out.token_ids == hf_greedy(hf, prompt, m), f"prompt of {len(prompt)} tokens diverged"


def test_logprobs_match_hf_log_softmax(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(enforce_eager=True, model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=16 << 20))
    prompts, _ = random_workload(engine.vocab_size, num_prompts=4, seed=1)
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True))
    assert_engine_idle(engine)
    hf = load_hf(tiny_llama_dir)
    for prompt, result in zip(prompts, results):
        out = result.outputs[0]
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + out.token_ids])).logits[0].float()
        ref = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
        for pos, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            assert lp.token_id == token and lp.rank == 1
            assert abs(lp.logprob - ref[pos, token].item()) < 1e-4
            top_lp, top_ids = ref[pos].topk(5)
            assert list(lp.top_ids) == top_ids.tolist()
            assert max(abs(a - b) for a, b in zip(lp.top_logprobs, top_lp.tolist())) < 1e-4
        assert abs(out.cumulative_logprob - sum(lp.logprob for lp in out.logprobs)) < 1e-3


def test_seeded_request_is_batch_invariant(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(enforce_eager=True, model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=32 << 20))
    prompt = list(range(10, 40))
    seeded = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    alone = engine.generate([prompt], seeded)[0].outputs[0].token_ids
    rng = random.Random(5)
    others = [[rng.randrange(1, engine.vocab_size) for _ in range(rng.randint(1, 60))] for _ in range(16)]
    other_params = [SamplingParams(temperature=rng.choice([0.0, 0.7, 1.0]), top_k=rng.choice([None, 5]),
                                   seed=rng.choice([None, 7]), max_tokens=rng.randint(1, 30), ignore_eos=True)
                    for _ in others]
    batch = engine.generate(others[:8] + [prompt] + others[8:], other_params[:8] + [seeded] + other_params[8:])
    assert batch[8].outputs[0].token_ids == alone
    assert engine.generate([prompt], seeded)[0].outputs[0].token_ids == alone
    assert_engine_idle(engine)


def test_abort_frees_blocks_at_next_step(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(enforce_eager=True, model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=16 << 20))
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    engine.add_request("keep", list(range(1, 50)), params)
    engine.add_request("drop", list(range(1, 90)), params)
    for _ in range(3):
        engine.step()
    held = engine.stats()["num_free_blocks"]
    engine.abort_request("drop")
    deltas = engine.step()
    assert engine.stats()["num_free_blocks"] > held
    assert any(d.request_id == "drop" and d.finish_reason is not None for d in deltas)
    assert not engine.has_request("drop")
    engine.abort_request("keep")
    engine.step()
    assert_engine_idle(engine)


def test_bad_requests_are_refused_cleanly(tiny_llama_dir):
    from shared.protocol import ProtocolError

    engine = LLMEngine(EngineConfig(enforce_eager=True, model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=16 << 20,
                                    max_model_len=128))
    bad = [
        ([], SamplingParams()),
        ([1, 2], SamplingParams(temperature=5.0)),
        ([1, 2], SamplingParams(n=0)),
        ([engine.vocab_size + 5], SamplingParams()),
        (list(range(1, 200)), SamplingParams(max_tokens=4)),
        ([1, 2], SamplingParams(logprobs=50)),
    ]
    for prompt, params in bad:
        with pytest.raises(ProtocolError):
            engine.add_request("x", prompt, params)
    assert_engine_idle(engine)


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_default_model_greedy_parity(default_model_dir, compiled):
    engine = LLMEngine(EngineConfig(enforce_eager=not compiled, model=str(default_model_dir), dtype="float32",
                                    kv_cache_memory=64 << 20))
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
             "The three primary colors are"]
    prompts = [engine.tokenizer.encode(t) for t in texts]
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    assert_engine_idle(engine)
    hf = load_hf(default_model_dir)
    for prompt, result in zip(prompts, results):
        assert result.outputs[0].token_ids == hf_greedy(hf, prompt, 32)
