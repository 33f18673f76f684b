"""The plain data a Scheduler hands to the ModelRunner each step (no tensors here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """One sequence's share of a step: compute `token_ids` at positions
    [num_computed_tokens, num_computed_tokens + len(token_ids)).

    `block_table` lists the physical blocks holding positions 0 .. end-1 (already allocated,
    already copy-on-written). Logits are wanted for the last token only when `sample` is set
    (the last chunk of a prompt, or a decode step).
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    sample: bool


@dataclass(slots=True)
class SchedulerOutput:
    """A step's plan: the chunks to run, and the block copies (src, dst) to do before the forward.

    The runner reads ``chunks`` and ``block_copies`` only. The rest is for the sampler and the
    scheduler's update: ``requests[i]`` owns ``chunks[i]``; sequence ``sample_requests[j]``
    samples from logits row ``sample_rows[j]`` (several sequences share a row when n > 1 forks
    them off one prompt).
    """

    chunks: list[ScheduledChunk] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    requests: list[Any] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    sample_requests: list[Any] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
