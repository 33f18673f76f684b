"""Sampler against references: HF's logits processors, hand-computed masks, seeded draws."""

from types import SimpleNamespace

import torch
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from engine_svc.request import Request, make_generator
from engine_svc.sampler import Sampler, _min_p, _top_k_top_p
from engine_svc.scheduler_output import SampleRow
from shared.protocol import SamplingParams

VOCAB = 64


def make_requests(params_list, outputs=None):
    reqs = []
    for i, params in enumerate(params_list):
        r = Request(f"r{i}", [1, 2, 3, 3], params, generator=make_generator(params.seed, 0))
        for t in (outputs or {}).get(i, []):
            r.token_ids.append(t)
        reqs.append(r)
    return reqs


def rows_for(requests):
    """The sample rows a scheduler would plan for these sequences, one logits row each."""
    return [SampleRow(r.key, i, r.params, r.num_prompt_tokens,
                      history=tuple(r.token_ids) if r.params.uses_history else (),
                      ban_stop=r.num_output_tokens < r.params.min_tokens, seed=r.seed,
                      num_output_tokens=r.num_output_tokens, generator=r.generator)
            for i, r in enumerate(requests)]


def sample(logits, requests, sampler=None):
    """Tokens and logprobs in the requests' order (the sampler answers by sequence key)."""
    out = (sampler or Sampler())(logits, rows_for(requests))
    keys = [r.key for r in requests]
    return SimpleNamespace(token_ids=[out.token_ids[k] for k in keys], logprobs=[out.logprobs.get(k) for k in keys])


def finite_set(row):
    return set(torch.nonzero(torch.isfinite(row)).flatten().tolist())


def test_greedy_is_argmax_and_logprobs_are_raw():
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    reqs = make_requests([SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.5)] * 3)
    out = sample(logits, reqs)
    ref = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([[1, 2, 3, 3]] * 3), logits.clone())
    assert out.token_ids == ref.argmax(-1).tolist()
    raw_lp = torch.log_softmax(logits, -1)
    for i, lp in enumerate(out.logprobs):
        assert abs(lp.logprob - raw_lp[i, out.token_ids[i]].item()) < 1e-6  # before the penalty
        assert list(lp.top_ids) == raw_lp[i].topk(3).indices.tolist()


def test_top_k_top_p_min_p_match_hf_warpers():
    torch.manual_seed(1)
    logits = torch.randn(4, VOCAB) * 3
    cases = [dict(top_k=5), dict(top_p=0.7), dict(top_k=10, top_p=0.5), dict(min_p=0.1)]
    reqs = make_requests([SamplingParams(temperature=1.0, **c) for c in cases])
    ours = _top_k_top_p(_min_p(logits, reqs), reqs)
    refs = [TopKLogitsWarper(5)(None, logits[0:1].clone()),
            TopPLogitsWarper(0.7)(None, logits[1:2].clone()),
            TopPLogitsWarper(0.5)(None, TopKLogitsWarper(10)(None, logits[2:3].clone())),
            MinPLogitsWarper(0.1)(None, logits[3:4].clone())]
    for i, ref in enumerate(refs):
        assert finite_set(ours[i]) == finite_set(ref[0]), cases[i]


def test_frequency_presence_bias_and_min_tokens():
    logits = torch.zeros(2, VOCAB)
    params = SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25,
                            logit_bias={9: 3.0}, min_tokens=5, stop_token_ids=(9,))
    reqs = make_requests([params, SamplingParams(temperature=0.0, logit_bias={9: 3.0})], outputs={0: [7, 7, 8]})
    processed = Sampler(eos_token_ids=[0])._process(logits, rows_for(reqs))
    assert processed[0, 7].item() == -0.5 * 2 - 0.25
    assert processed[0, 8].item() == -0.5 - 0.25
    assert processed[0, 9].item() == float("-inf") and processed[0, 0].item() == float("-inf")  # min_tokens
    assert processed[1, 9].item() == 3.0 and processed[1, 0].item() == 0.0


def test_seeded_rows_ignore_the_batch():
    torch.manual_seed(2)
    logits = torch.randn(5, VOCAB)
    seeded = SamplingParams(temperature=0.8, seed=42)
    alone = sample(logits[2:3], make_requests([seeded])).token_ids[0]
    batch = make_requests([SamplingParams(temperature=1.0)] * 2 + [seeded] + [SamplingParams(seed=3)] * 2)
    assert sample(logits, batch).token_ids[2] == alone


def test_sampling_distribution_matches_softmax():
    """One seeded sequence's draws over its positions, and unseeded draws, follow softmax(logits)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    expected = logits.softmax(-1)[0] * 4000
    for params in (SamplingParams(temperature=1.0, seed=0), SamplingParams(temperature=1.0)):
        req = make_requests([params])[0]
        counts = torch.zeros(4)
        for _ in range(4000):
            token = sample(logits, [req]).token_ids[0]
            counts[token] += 1
            req.token_ids.append(token)  # the next draw is the sequence's next position
        chi2 = ((counts - expected) ** 2 / expected).sum().item()
        assert chi2 < 16.3  # chi-square, 3 degrees of freedom, p = 0.001


def test_a_mixed_batch_greedy_rows_take_the_argmax_and_seeded_rows_draw_as_alone():
    torch.manual_seed(4)
    logits = torch.randn(4, VOCAB) * 2
    seeded = SamplingParams(temperature=0.7, seed=11)
    alone = sample(logits[1:2], make_requests([seeded])).token_ids[0]
    batch = make_requests([SamplingParams(temperature=0.0), seeded, SamplingParams(temperature=0.0), seeded])
    out = sample(logits, batch).token_ids
    assert [out[0], out[2]] == [logits[0].argmax().item(), logits[2].argmax().item()]
    assert out[1] == alone
    only_sampled = sample(logits[1:2].repeat(2, 1), make_requests([seeded, seeded])).token_ids
    assert only_sampled == [alone, alone]  # no greedy row: no argmax taken, the draws as before


def test_bfloat16_logits_plain_greedy_as_they_are_and_everything_else_in_float32():
    """A bfloat16 model's logits: plain greedy rows take their argmax without a float32 copy (same
    answers, ties included); a row with logprobs, a penalty or a temperature makes the whole batch
    widen first, so it samples and reports exactly as from float32 logits."""
    torch.manual_seed(7)
    logits = (torch.randn(6, VOCAB) * 3).bfloat16()
    logits[0, 5] = logits[0, 9] = logits[0].max()  # a tie: the first wins
    plain = make_requests([SamplingParams(temperature=0.0)] * 6)
    assert sample(logits, plain).token_ids == logits.float().argmax(-1).tolist()
    mixed = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=2),
             SamplingParams(temperature=0.0, repetition_penalty=1.3), SamplingParams(temperature=0.8, seed=3),
             SamplingParams(temperature=0.0, logit_bias={1: 5.0}), SamplingParams(temperature=0.0)]
    got, want = sample(logits, make_requests(mixed)), sample(logits.float(), make_requests(mixed))
    assert got.token_ids == want.token_ids
    assert got.logprobs[1] == want.logprobs[1] and got.logprobs[1] is not None
