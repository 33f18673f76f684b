"""Logits -> tokens: logit_bias/min_tokens -> penalties -> temperature -> min_p -> top-k/top-p -> sample."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from engine_svc.race import race_rows, row_keys
from engine_svc.scheduler_output import SampleRow, SamplerOutput
from shared.protocol import TokenLogprobs


class Sampler:
    """A function of (logits, the sample rows of a plan) -> tokens, keyed by sequence.

    Logprobs come from the raw logits, before any processing. A seeded sequence's noise comes from
    its seed and output position alone on CPU (engine_svc/race.py), from its own generator on an
    accelerator, so its tokens do not depend on the batch around it. Sorting
    happens only for rows that ask for top-p.
    """

    def __init__(self, eos_token_ids: Sequence[int] = (), use_flashinfer: bool | None = None):
        self.eos_token_ids = list(eos_token_ids)
        if use_flashinfer is None:
            from engine_svc import flashinfer_sampler

            use_flashinfer = flashinfer_sampler.is_available()
        self.use_flashinfer = use_flashinfer

    def __call__(self, logits: torch.Tensor, requests: list[SampleRow]) -> SamplerOutput:
        if not requests:
            return SamplerOutput()
        rows = [r.logits_row for r in requests]
        if rows[-1] != len(rows) - 1:  # some rows feed several sequences (n > 1 forks)
            logits = logits[torch.tensor(rows, device=logits.device)]
        if logits.dtype != torch.float32 and not _plain_greedy(requests):
            logits = logits.float()  # a bfloat16 model's logits: plain greedy rows take their argmax as they are
        raw = logits
        logits = self._process(logits, requests)
        token_ids = self._sample(logits, requests)
        keys = [r.key for r in requests]
        logprobs = self._logprobs(raw, token_ids, requests)
        return SamplerOutput(dict(zip(keys, token_ids.tolist())),
                             {k: lp for k, lp in zip(keys, logprobs) if lp is not None},
                             self._beam_candidates(logits, requests))

    @staticmethod
    def _beam_candidates(raw: torch.Tensor, requests: list[SampleRow]) -> dict:
        """Beam search chooses tokens itself, from the best log_softmax entries of each beam's
        processed logits (as HF's beam search): the search's top K over all beams lies within
        each beam's own top K."""
        beams = [i for i, r in enumerate(requests) if r.beam_candidates]
        if not beams:
            return {}
        k = max(requests[i].beam_candidates for i in beams)
        rows = torch.log_softmax(raw[torch.tensor(beams, device=raw.device)].float(), dim=-1)
        values, ids = rows.topk(min(k, rows.shape[1]), dim=-1)
        return {requests[i].key: [(t, v) for t, v in zip(ids_row, values_row) if v > -math.inf]  # not masked out
                [:requests[i].beam_candidates] for i, ids_row, values_row in zip(beams, ids.tolist(), values.tolist())}

    # ------------------------------------------------------------------ processors
    def _process(self, logits: torch.Tensor, requests: list[SampleRow]) -> torch.Tensor:
        constrained = [i for i, r in enumerate(requests) if r.matcher is not None]
        biased = [i for i, r in enumerate(requests) if r.params.logit_bias]
        blocked = [i for i, r in enumerate(requests) if r.ban_stop]
        penalized = [i for i, r in enumerate(requests) if r.params.uses_history]
        if not (constrained or biased or blocked or penalized):
            return logits
        logits = logits.clone()
        if constrained:  # the grammar first: penalties and sampling see only what it allows
            _apply_grammars(logits, requests, constrained)
        for i in biased:
            bias = requests[i].params.logit_bias
            ids = torch.tensor(list(bias.keys()), device=logits.device)
            logits[i, ids] += torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
        for i in blocked:
            params = requests[i].params
            ids = list(params.stop_token_ids) + ([] if params.ignore_eos else self.eos_token_ids)
            if not ids:
                continue
            ids = torch.tensor(ids, device=logits.device)
            if requests[i].matcher is not None:
                others = torch.isfinite(logits[i])
                others[ids] = False
                if not bool(others.any()):
                    continue  # the grammar allows only a stop now: it wins over min_tokens
            logits[i, ids] = float("-inf")
        if penalized:
            self._apply_penalties(logits, [requests[i] for i in penalized], penalized)
        return logits

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, requests: list[SampleRow], rows: list[int]) -> None:
        device, vocab = logits.device, logits.shape[1]
        sub = logits[rows]
        counts = torch.zeros_like(sub)
        seen = torch.zeros(sub.shape, dtype=torch.bool, device=device)
        for j, request in enumerate(requests):
            outputs = request.history[request.num_prompt_tokens:]
            if outputs:
                ids = torch.tensor(outputs, device=device)
                counts[j].index_add_(0, ids, torch.ones(len(outputs), dtype=sub.dtype, device=device))
            seen[j, torch.tensor(request.history, device=device).clamp_(0, vocab - 1)] = True
        rep = torch.tensor([r.params.repetition_penalty for r in requests], device=device).unsqueeze(1)
        freq = torch.tensor([r.params.frequency_penalty for r in requests], device=device).unsqueeze(1)
        pres = torch.tensor([r.params.presence_penalty for r in requests], device=device).unsqueeze(1)
        # repetition penalty over prompt and output (as HF and vLLM); the others over outputs only
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - freq * counts - pres * (counts > 0).to(sub.dtype)
        logits[rows] = sub

    # ------------------------------------------------------------------ sampling
    def _sample(self, logits: torch.Tensor, requests: list[SampleRow]) -> torch.Tensor:
        greedy = [r.params.is_greedy for r in requests]
        if all(greedy):
            return _argmax(logits)
        if self.use_flashinfer and logits.is_cuda and all(r.generator is None for r in requests):
            return self._sample_flashinfer(logits, requests)
        raw = logits
        temps = [1.0 if g else r.params.temperature for g, r in zip(greedy, requests)]
        if any(t != 1.0 for t in temps):  # 1.0 is the OpenAI default: no copy of the logits for it
            logits = logits / torch.tensor(temps, dtype=logits.dtype, device=logits.device).unsqueeze(1)
        logits = _min_p(logits, requests)
        logits = _top_k_top_p(logits, requests)
        if logits.is_cpu:  # the race over counter-based noise, in C++
            sampled = race_rows(logits, *row_keys([r.seed for r in requests], [r.num_output_tokens for r in requests]))
        else:
            probs = logits.softmax(dim=-1)
            noise = torch.empty_like(probs).exponential_()
            for i, request in enumerate(requests):
                if request.generator is not None:
                    noise[i].exponential_(generator=request.generator)
            sampled = (probs / noise).argmax(dim=-1)  # the exponential race: one draw from probs
        if not any(greedy):
            return sampled
        return torch.where(torch.tensor(greedy, device=logits.device), _argmax(raw), sampled)

    @staticmethod
    def _sample_flashinfer(logits: torch.Tensor, requests: list[SampleRow]) -> torch.Tensor:
        """FlashInfer's sorting-free kernels draw the whole batch from one generator, so only
        batches without per-request seeds come here (seeded ones keep the torch path)."""
        from engine_svc.flashinfer_sampler import flashinfer_sample

        def column(values, dtype):
            return torch.tensor(values, dtype=dtype, device=logits.device)

        return flashinfer_sample(
            logits, column([0.0 if r.params.is_greedy else r.params.temperature for r in requests], torch.float32),
            column([r.params.top_k or 0 for r in requests], torch.int32),
            column([r.params.top_p for r in requests], torch.float32),
            column([r.params.min_p for r in requests], torch.float32))

    # ------------------------------------------------------------------ logprobs
    @staticmethod
    def _logprobs(raw: torch.Tensor, token_ids: torch.Tensor,
                  requests: list[SampleRow]) -> list[TokenLogprobs | None]:
        wanted = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        out: list[TokenLogprobs | None] = [None] * len(requests)
        if not wanted:
            return out
        index = torch.tensor(wanted, device=raw.device)
        logprobs = torch.log_softmax(raw[index].float(), dim=-1)
        chosen = token_ids[index]
        chosen_lp = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)
        ranks = (logprobs > chosen_lp.unsqueeze(1)).sum(dim=1) + 1
        max_n = max(requests[i].params.logprobs for i in wanted)
        top_lp, top_ids = logprobs.topk(max_n, dim=-1) if max_n else (None, None)
        chosen_l, chosen_lp_l, ranks_l = chosen.tolist(), chosen_lp.tolist(), ranks.tolist()
        top_ids_l = top_ids.tolist() if top_ids is not None else None
        top_lp_l = top_lp.tolist() if top_lp is not None else None
        for j, i in enumerate(wanted):
            n = requests[i].params.logprobs
            out[i] = TokenLogprobs(
                token_id=chosen_l[j], logprob=chosen_lp_l[j], rank=ranks_l[j],
                top_ids=tuple(top_ids_l[j][:n]) if n else (),
                top_logprobs=tuple(top_lp_l[j][:n]) if n else ())
        return out


def _plain_greedy(requests: list[SampleRow]) -> bool:
    """Every row greedy with nothing to process, no logprobs and no beam: the token is the argmax of
    the raw logits, which a bfloat16 row answers as its float32 copy would (the conversion is exact)."""
    return all(r.params.is_greedy and r.matcher is None and not r.params.logit_bias and not r.ban_stop
               and not r.params.uses_history and r.params.logprobs is None and not r.beam_candidates
               for r in requests)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1); CPU float32 or bfloat16 rows through the C++ op (cpu_sampling.cpp, same
    answers, ~5x faster for a batch of 256 here)."""
    if (logits.is_cpu and logits.dtype in (torch.float32, torch.bfloat16) and logits.dim() == 2
            and logits.shape[1] > 0):
        from engine_svc.attention.cpu_ops import argmax_op

        op = argmax_op()
        if op is not None:
            return op(logits)
    return logits.argmax(dim=-1)


def _apply_grammars(logits: torch.Tensor, requests: list[SampleRow], rows: list[int]) -> None:
    from engine_svc.structured.matcher import allocate_bitmask, apply_bitmask

    bitmask = allocate_bitmask(logits.shape[0], logits.shape[1])
    masked = [i for i in rows if requests[i].matcher.fill_bitmask(bitmask, i)]  # False: all allowed
    apply_bitmask(logits, bitmask, masked)


def _min_p(logits: torch.Tensor, requests: list[SampleRow]) -> torch.Tensor:
    rows = [i for i, r in enumerate(requests) if r.params.min_p > 0.0 and not r.params.is_greedy]
    if not rows:
        return logits
    min_p = torch.zeros(len(requests), dtype=logits.dtype, device=logits.device)
    min_p[rows] = torch.tensor([requests[i].params.min_p for i in rows], dtype=logits.dtype, device=logits.device)
    probs = logits.softmax(dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _top_k_top_p(logits: torch.Tensor, requests: list[SampleRow]) -> torch.Tensor:
    vocab = logits.shape[1]
    top_k = [min(r.params.top_k, vocab) if r.params.top_k and r.params.top_k > 0 else vocab for r in requests]
    top_p = [r.params.top_p for r in requests]
    limited = [i for i, k in enumerate(top_k) if k < vocab]
    if limited:
        index = torch.tensor(limited, device=logits.device)
        ks = torch.tensor([top_k[i] for i in limited], device=logits.device)
        sub = logits[index]
        kth = sub.topk(int(ks.max())).values.gather(1, (ks - 1).unsqueeze(1))
        logits = logits.clone()
        logits[index] = sub.masked_fill(sub < kth, float("-inf"))
    rows = [i for i, p in enumerate(top_p) if p < 1.0]
    if rows:
        index = torch.tensor(rows, device=logits.device)
        sub = logits[index]
        sorted_logits, order = sub.sort(dim=-1, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        p = torch.tensor([top_p[i] for i in rows], dtype=logits.dtype, device=logits.device).unsqueeze(1)
        drop = cum <= 1.0 - p
        drop[:, -1] = False  # always keep the most likely token
        sub = sub.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
        logits = logits.clone()
        logits[index] = sub
    return logits
