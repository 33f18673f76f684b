"""Beam search for one prompt: which beams live on, which hypotheses are finished.

The selection rule follows HF transformers' (vectorised) beam search for a single prompt, so
that the same weights give the same beams and scores: the top K = max(2, 1 + #eos) * num_beams
continuations of all live beams are taken; those that end (EOS or max length) among the first
num_beams become finished hypotheses scored sum(logprob) / generated_len ** length_penalty; the
best num_beams unfinished ones live on. Blocks are not this class's business: the scheduler
forks and frees the beams' sequences according to what :meth:`BeamSearch.step` returns.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

_NEG = -1.0e9


def _f32(x: float) -> float:
    """Round to float32: one float64 operation on float32 inputs, rounded, is the float32 result,
    so the scores here equal HF's float32 tensors bit for bit."""
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass(frozen=True, slots=True)
class Hypothesis:
    token_ids: list[int]  # generated tokens only
    score: float  # length-penalised, as HF's sequences_scores
    cumulative_logprob: float
    ends_with_eos: bool


class BeamSearch:
    """Owns one request's beam state: live beams' scores and tokens, and the best finished ones.
    Plain Python over the candidates the sampler hands over: no tensors."""

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
        self.running_scores = [0.0]
        self.running_tokens: list[list[int]] = [[]]
        self.finished_scores = [_NEG] * num_beams
        self.finished_raw = [0.0] * num_beams
        self.finished_tokens: list[list[int]] = [[] for _ in range(num_beams)]
        self.finished_flags = [False] * num_beams
        self.improvable = True
        self.done = False

    def step(self, candidates: list[list[tuple[int, float]]]) -> list[tuple[int, int]]:
        """``candidates[i]`` holds live beam i's best (token, logprob) pairs (at least
        ``num_candidates`` of them, or its whole vocabulary). Returns the next live beams as
        (parent beam index, appended token), best first; sets ``done`` when the search ends."""
        scored = [(_f32(self.running_scores[i] + logprob), i, token)
                  for i, row in enumerate(candidates) for token, logprob in row]
        scored.sort(key=lambda c: -c[0])  # stable: ties keep (beam, rank) order, as a flat top-k
        top = scored[:self.num_candidates]
        top_scores = [c[0] for c in top]
        parents = [c[1] for c in top]
        tokens = [c[2] for c in top]
        ends = [t in self.eos_token_ids or self.cur_len + 1 >= self.max_length for t in tokens]
        self._update_finished(top_scores, parents, tokens, ends)

        order = sorted(range(len(top)), key=lambda j: -(top_scores[j] + (_NEG if ends[j] else 0.0)))
        order = [j for j in order[:self.num_beams] if not ends[j]]  # HF keeps such beams at -1e9; they never win
        self.running_scores = [top_scores[j] for j in order] if order else [_NEG]
        self.running_tokens = [self.running_tokens[parents[j]] + [tokens[j]] for j in order]
        self.cur_len += 1
        self._update_heuristic()
        all_full = all(self.finished_flags) and self.early_stopping is True
        self.done = not (self.improvable and not all_full and not all(ends) and order)
        return [(parents[j], tokens[j]) for j in order]

    def best(self, n: int) -> list[Hypothesis]:
        return [Hypothesis(self.finished_tokens[i], self.finished_scores[i], self.finished_raw[i],
                           bool(self.finished_tokens[i]) and self.finished_tokens[i][-1] in self.eos_token_ids)
                for i in range(min(n, self.num_beams)) if self.finished_flags[i]]

    def _update_finished(self, top_scores, parents, tokens, ends) -> None:
        divisor = _f32(float((self.cur_len + 1 - self.prompt_len) ** self.length_penalty))
        closings = (all(self.finished_flags) and self.early_stopping is True) + (not self.improvable)
        scores = []
        for j, raw in enumerate(top_scores):
            score = _f32(raw / divisor)
            for _ in range(closings + (not (ends[j] and j < self.num_beams))):
                score = _f32(score + _NEG)
            scores.append(score)
        merged = self.finished_scores + scores
        keep = sorted(range(len(merged)), key=lambda i: -merged[i])[:self.num_beams]
        all_tokens = self.finished_tokens + [self.running_tokens[p] + [t] for p, t in zip(parents, tokens)]
        all_raw = self.finished_raw + list(top_scores)
        all_flags = self.finished_flags + [ends[j] and j < self.num_beams for j in range(len(tokens))]
        self.finished_scores = [merged[i] for i in keep]
        self.finished_tokens = [all_tokens[i] for i in keep]
        self.finished_raw = [all_raw[i] for i in keep]
        self.finished_flags = [all_flags[i] for i in keep]

    def _update_heuristic(self) -> None:
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_length - self.prompt_len
        else:
            best_len = self.cur_len - self.prompt_len
        best_possible = _f32(self.running_scores[0] / _f32(float(best_len ** self.length_penalty)))
        worst = min(self.finished_scores)
        self.improvable = self.improvable and any(best_possible > (worst if flag else _NEG)
                                                  for flag in self.finished_flags)


@dataclass(eq=False, slots=True)
class BeamGroup:
    """The live beam sequences of one beam-search request and the rows they reported this step.
    The group advances only when every live beam has reported (beams move in lockstep)."""

    search: BeamSearch
    beams: list
    rows: dict

    def is_ready(self) -> bool:
        return all(beam in self.rows for beam in self.beams)
