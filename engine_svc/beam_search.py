"""Beam search for one prompt: which beams live on, which hypotheses are finished.

The selection rule follows HF transformers' (vectorised) beam search for a single prompt, so
that the same weights give the same beams and scores: the top K = max(2, 1 + #eos) * num_beams
continuations of all live beams are taken; those that end (EOS or max length) among the first
num_beams become finished hypotheses scored sum(logprob) / generated_len ** length_penalty; the
best num_beams unfinished ones live on. Blocks are not this class's business: the scheduler
forks and frees the beams' sequences according to what :meth:`BeamSearch.step` returns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_NEG = -1.0e9


@dataclass(frozen=True, slots=True)
class Hypothesis:
    token_ids: list[int]  # generated tokens only
    score: float  # length-penalised, as HF's sequences_scores
    cumulative_logprob: float
    ends_with_eos: bool


class BeamSearch:
    """Owns one request's beam state: live beams' scores and tokens, and the best finished ones."""

    def __init__(self, num_beams: int, prompt_len: int, max_new_tokens: int, eos_token_ids=(),
                 length_penalty: float = 1.0, early_stopping: bool | str = False):
        self.num_beams = num_beams
        self.eos_token_ids = frozenset(eos_token_ids)
        self.num_candidates = max(2, 1 + len(self.eos_token_ids)) * num_beams
        self.prompt_len = prompt_len
        self.max_length = prompt_len + max_new_tokens
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.cur_len = prompt_len
        self.running_scores = torch.zeros(1)
        self.running_tokens: list[list[int]] = [[]]
        self.finished_scores = torch.full((num_beams,), _NEG)
        self.finished_raw = [0.0] * num_beams
        self.finished_tokens: list[list[int]] = [[] for _ in range(num_beams)]
        self.finished_flags = torch.zeros(num_beams, dtype=torch.bool)
        self.improvable = True
        self.done = False

    def step(self, logprobs: torch.Tensor) -> list[tuple[int, int]]:
        """``logprobs[i]`` is live beam i's log_softmax row. Returns the next live beams as
        (parent beam index, appended token), best first; sets ``done`` when the search ends."""
        vocab = logprobs.shape[1]
        accumulated = (logprobs.float().cpu() + self.running_scores[:, None]).reshape(-1)
        top_scores, top_index = accumulated.topk(min(self.num_candidates, accumulated.numel()))
        parents = (top_index // vocab).tolist()
        tokens = (top_index % vocab).tolist()
        ends = torch.tensor([t in self.eos_token_ids or self.cur_len + 1 >= self.max_length for t in tokens])
        self._update_finished(top_scores, parents, tokens, ends)

        running = top_scores + ends.float() * _NEG
        order = running.topk(min(self.num_beams, running.numel())).indices.tolist()
        order = [j for j in order if not ends[j]]  # HF keeps such beams at -1e9; they can never win
        self.running_scores = running[order] if order else torch.full((1,), _NEG)
        self.running_tokens = [self.running_tokens[parents[j]] + [tokens[j]] for j in order]
        self.cur_len += 1
        self._update_heuristic()
        all_full = bool(self.finished_flags.all()) and self.early_stopping is True
        self.done = not (self.improvable and not all_full and not bool(ends.all()) and order)
        return [(parents[j], tokens[j]) for j in order]

    def best(self, n: int) -> list[Hypothesis]:
        return [Hypothesis(self.finished_tokens[i], float(self.finished_scores[i]), self.finished_raw[i],
                           bool(self.finished_tokens[i]) and self.finished_tokens[i][-1] in self.eos_token_ids)
                for i in range(min(n, self.num_beams)) if bool(self.finished_flags[i])]

    def _update_finished(self, top_scores, parents, tokens, ends) -> None:
        is_top = torch.arange(len(tokens)) < self.num_beams
        just_finished = ends & is_top
        scores = top_scores / float((self.cur_len + 1 - self.prompt_len) ** self.length_penalty)
        if bool(self.finished_flags.all()) and self.early_stopping is True:
            scores = scores + _NEG
        if not self.improvable:
            scores = scores + _NEG
        scores = scores + (~just_finished).float() * _NEG
        merged = torch.cat((self.finished_scores, scores))
        keep = merged.topk(self.num_beams).indices.tolist()
        candidates_tokens = [self.running_tokens[p] + [t] for p, t in zip(parents, tokens)]
        all_tokens = self.finished_tokens + candidates_tokens
        all_raw = self.finished_raw + top_scores.tolist()
        all_flags = torch.cat((self.finished_flags, just_finished))
        self.finished_scores = merged[keep]
        self.finished_tokens = [all_tokens[i] for i in keep]
        self.finished_raw = [all_raw[i] for i in keep]
        self.finished_flags = all_flags[keep]

    def _update_heuristic(self) -> None:
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_length - self.prompt_len
        else:
            best_len = self.cur_len - self.prompt_len
        best_possible = self.running_scores[:1] / float(best_len ** self.length_penalty)
        worst = torch.where(self.finished_flags, self.finished_scores.min(), torch.tensor(_NEG))
        self.improvable = self.improvable and bool((best_possible > worst).any())


@dataclass(eq=False, slots=True)
class BeamGroup:
    """The live beam sequences of one beam-search request and the rows they reported this step.
    The group advances only when every live beam has reported (beams move in lockstep)."""

    search: BeamSearch
    beams: list
    rows: dict

    def is_ready(self) -> bool:
        return all(beam in self.rows for beam in self.beams)
