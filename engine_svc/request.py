"""One sequence the engine is generating: its tokens, progress, blocks and stopping state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from shared.protocol import FinishReason, SamplingParams, TokenLogprobs


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3
    WAITING_FOR_GRAMMAR = 4  # queued, its structured-output grammar still compiling
    WAITING_FOR_KV = 5  # P/D decode side: queued until its blocks are free and its KV is loaded into them


@dataclass(eq=False, slots=True)
class Request:
    """Owns its token ids, ``num_computed_tokens``, status, ``block_table`` and block hashes.

    One Request is one sequence: a request with n > 1 becomes n Requests sharing a
    ``request_id`` and told apart by ``index`` (the OpenAI choice index). ``token_ids`` is the
    prompt followed by the outputs; positions below ``num_computed_tokens`` have K/V in the
    blocks of ``block_table``.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    index: int = 0
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    deadline: float = 0.0  # unix time: past it the scheduler drops the request (0: none)
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    status: RequestStatus = RequestStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0  # leading blocks of block_table already offered to the prefix cache
    generator: torch.Generator | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    cumulative_logprob: float = 0.0
    num_children_pending: int = 0  # n - 1 siblings still to fork when the prompt is done
    beam: Any = None  # the BeamGroup this sequence is a beam of (use_beam_search)
    matcher: Any = None  # the grammar state of a structured-output sequence (structured.Matcher)
    num_deltas_sent: int = 0
    # P/D: a prefill engine's sequence stops at its next token and is handed off (``hand_off``); a
    # decode engine's arrives with the handle of the KV of its first ``num_kv_tokens`` tokens
    hand_off: bool = False
    kv_handle: str | None = None
    num_kv_tokens: int = 0
    pending_token_ids: list[int] = field(default_factory=list)  # sampled, not yet reported
    pending_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # when each phase began (the scheduler's clock), for metrics and traces (iteration_stats.py)
    scheduled_time: float | None = None  # first scheduled
    first_token_time: float | None = None
    last_token_time: float | None = None
    preemption_times: list[float] = field(default_factory=list)
    prefill_chunks: list[tuple[float, float, int]] = field(default_factory=list)  # (start, end, tokens)
    decode_steps: list[tuple[float, float]] = field(default_factory=list)  # only when the scheduler records them

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    def spawn(self, index: int, token_ids: list[int], **changes) -> Request:
        """A sibling sequence of the same request (an n > 1 child, a beam) that starts from
        ``token_ids``: it shares the prompt, parameters and phase times so far, and gets its own
        copy of the grammar state."""
        return Request(self.request_id, self.prompt_token_ids, self.params, index=index, cache_salt=self.cache_salt,
                       arrival_time=self.arrival_time, token_ids=token_ids, num_cached_tokens=self.num_cached_tokens,
                       beam=self.beam, matcher=self.matcher.fork() if self.matcher is not None else None,
                       scheduled_time=self.scheduled_time, first_token_time=self.first_token_time,
                       last_token_time=self.last_token_time, preemption_times=list(self.preemption_times),
                       prefill_chunks=list(self.prefill_chunks), deadline=self.deadline, **changes)

    @property
    def key(self) -> tuple[str, int]:
        return (self.request_id, self.index)

    @property
    def seed(self) -> int | None:
        """The seed this sequence draws with: its request's plus its index (n > 1), so that child
        ``index`` draws as a lone request seeded ``seed + index`` would."""
        return None if self.params.seed is None else (self.params.seed + self.index) & 0xFFFF_FFFF_FFFF_FFFF

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_tokens - 1

    def append_token(self, token_id: int, logprobs: TokenLogprobs | None) -> None:
        self.token_ids.append(token_id)
        self.pending_token_ids.append(token_id)
        if logprobs is not None:
            self.pending_logprobs.append(logprobs)
            self.cumulative_logprob += logprobs.logprob

    def finish(self, reason: FinishReason, stop_reason: int | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason


def make_generator(seed: int | None, index: int, device: str | torch.device = "cpu") -> torch.Generator | None:
    """A seeded sequence's torch.Generator on an accelerator (child ``index`` of a seeded request
    draws as a lone request seeded ``seed + index`` would). None on CPU, where the sampler keys
    its noise on the sequence's seed and output position instead (engine_svc/race.py)."""
    if seed is None or torch.device(device).type == "cpu":
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed((seed + index) & 0xFFFF_FFFF_FFFF_FFFF)
    return generator
