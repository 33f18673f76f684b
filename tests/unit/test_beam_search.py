"""Beam search against HF transformers' generate(num_beams=...): same beams, same scores."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from engine_svc import EngineConfig, LLMEngine
from engine_svc.beam_search import BeamSearch
from shared.protocol import SamplingParams
from tests.invariants import assert_engine_idle

SETTINGS = [(3, 1.0, False), (4, 0.5, True), (2, 2.0, "never"), (4, -1.0, False)]


def hf_beams(model, prompt, k, max_new, length_penalty, early_stopping, eos):
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             num_beams=k, num_return_sequences=k, max_new_tokens=max_new,
                             length_penalty=length_penalty, early_stopping=early_stopping, do_sample=False,
                             output_scores=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=eos)
    return [(seq[len(prompt):].tolist(), score.item()) for seq, score in zip(out.sequences, out.sequences_scores)]


def assert_same_beams(hf, ours):
    assert len(ours) == len(hf)
    for (hf_tokens, hf_score), (tokens, score) in zip(hf, ours):
        # HF pads finished beams with a fill token after their end
        assert hf_tokens[:len(tokens)] == tokens, (hf_tokens, tokens)
        assert len(set(hf_tokens[len(tokens):])) <= 1
        assert abs(hf_score - score) < 1e-4 + 2e-6 * abs(hf_score)  # float32 sums of ~20 logprobs


def test_selection_rule_matches_hf_with_eos_on_a_small_vocab():
    """The pure algorithm, fed by HF forwards, on a vocabulary small enough that EOS wins often."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=3, bos_token_id=1,
                         pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    num_eos_endings = 0
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(4, 40, (int(torch.randint(1, 10, (1,), generator=g)),), generator=g).tolist()
        for k, lp, es in SETTINGS:
            search = BeamSearch(k, len(prompt), 12, [3], lp, es)
            beams = [list(prompt)]
            while not search.done:
                with torch.inference_mode():
                    rows = torch.stack([torch.log_softmax(model(torch.tensor([b])).logits[0, -1], -1) for b in beams])
                values, ids = rows.topk(search.num_candidates, dim=-1)
                candidates = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
                beams = [beams[p] + [t] for p, t in search.step(candidates)]
            ours = [(h.token_ids, h.score) for h in search.best(k)]
            num_eos_endings += sum(h.ends_with_eos for h in search.best(k))
            assert_same_beams(hf_beams(model, prompt, k, 12, lp, es, 3), ours)
    assert num_eos_endings > 0  # the EOS paths were exercised


def test_engine_beam_search_matches_hf(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(enforce_eager=True, model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=32 << 20))
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    eos = list(engine.runner.eos_token_ids)
    prompts = [list(range(5, 25)), [7], list(range(100, 137))]
    for k, lp, es in SETTINGS:
        params = SamplingParams(n=k, use_beam_search=True, length_penalty=lp, early_stopping=es is True,
                                max_tokens=10, temperature=0.0)
        if es == "never":
            continue  # SamplingParams.early_stopping is a bool
        results = engine.generate(prompts, params)
        assert_engine_idle(engine)
        for prompt, result in zip(prompts, results):
            ours = [(o.token_ids, o.cumulative_logprob / (len(o.token_ids) ** lp)) for o in result.outputs]
            assert_same_beams(hf_beams(hf, prompt, k, 10, lp, es, eos), ours)


def test_beams_share_blocks(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(enforce_eager=True, model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=32 << 20,
                                    block_size=16))
    engine.add_request("b", list(range(1, 161)), SamplingParams(n=4, use_beam_search=True, max_tokens=6))
    for _ in range(3):
        engine.step()
    beams = engine.scheduler.requests["b"]
    assert len(beams) == 4
    # the prompt's 10 full blocks are held once, shared by all 4 beams
    shared = set(beams[0].block_table[:10])
    assert all(set(b.block_table[:10]) == shared for b in beams)
    assert all(engine.block_manager.blocks[i].ref_count == 4 for i in shared)
    while engine.has_work():
        engine.step()
    assert_engine_idle(engine)
