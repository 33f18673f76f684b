"""The plain data that crosses the step: what the Scheduler plans, what the Sampler answers.

No live objects travel here: chunks carry copies of the token ids and block tables, sample rows
carry each sequence's parameters and (only when a penalty needs it) a copy of its history. The
sampler's answer comes back keyed by sequence (request id, choice index), as vLLM's
``SchedulerOutput`` / ``ModelRunnerOutput`` do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shared.protocol import SamplingParams, TokenLogprobs

SeqKey = tuple[str, int]  # (request id, choice index): one sequence


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """One sequence's share of a step: compute `token_ids` at positions
    [num_computed_tokens, num_computed_tokens + len(token_ids)).

    `block_table` is a snapshot of the physical blocks holding positions 0 .. end-1 (already
    allocated, already copy-on-written). Logits are wanted for the last token only when `sample`
    is set (the last chunk of a prompt, or a decode step).
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_table: tuple[int, ...]
    sample: bool


@dataclass(frozen=True, slots=True)
class SampleRow:
    """One sequence to sample this step, from logits row ``logits_row`` (n > 1 children forked
    off one prompt share their parent's row).

    ``history`` (prompt then outputs) is filled only when a penalty reads it; ``ban_stop`` is set
    while ``min_tokens`` is not reached; ``beam_candidates`` > 0 asks for that many best
    (token, logprob) pairs instead of a sample (beam search chooses itself). ``seed`` is the
    sequence's seed (Request.seed) and ``num_output_tokens`` its position: a CPU draw keys its
    noise on the two (engine_svc/race.py). ``generator`` is a seeded sequence's RNG on an
    accelerator, or None; ``matcher`` its grammar state (structured
    outputs), or None. The sampler only reads them: it draws from the generator and asks the
    matcher which tokens are allowed; the scheduler advances the matcher.
    """

    key: SeqKey
    logits_row: int
    params: SamplingParams
    num_prompt_tokens: int
    history: tuple[int, ...] = ()
    ban_stop: bool = False
    beam_candidates: int = 0
    seed: int | None = None
    num_output_tokens: int = 0
    generator: Any = None  # torch.Generator: the scheduler never calls it, the sampler draws from it
    matcher: Any = None  # structured.Matcher


@dataclass(slots=True)
class SchedulerOutput:
    """A step's plan: the block copies (src, dst) to do before the forward, the chunks to run,
    and the sequences to sample."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    sampling: list[SampleRow] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(slots=True)
class SamplerOutput:
    """The sampler's answer, keyed by sequence: a token (and its logprobs when asked) for every
    sampled row, or the best candidates of a beam row."""

    token_ids: dict[SeqKey, int] = field(default_factory=dict)
    logprobs: dict[SeqKey, TokenLogprobs] = field(default_factory=dict)
    beam_candidates: dict[SeqKey, list[tuple[int, float]]] = field(default_factory=dict)
