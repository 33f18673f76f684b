"""What the scheduler saw happen since it was last asked: plain numbers and finished-sequence records.

The scheduler fills an ``IterationStats`` as events happen (a prefill completes, tokens are
sampled, a sequence is preempted or finishes) and hands it out with ``take_stats()``; the engine
service turns it into Prometheus figures (``engine_svc/metrics.py``) and trace spans
(``shared/tracing.py``). Nothing here imports Prometheus, OpenTelemetry, Redis or torch, so the
scheduler stays plain. Every time is ``time.monotonic()`` of the engine process (the scheduler's
clock), so each interval is measured with one process's clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.sampling_params import FinishReason


@dataclass(frozen=True, slots=True)
class FinishedSequence:
    """One finished sequence (choice ``index``) of a request, with when each phase began.

    ``scheduled_time`` is None for a sequence that never ran (aborted while waiting), and
    ``first_token_time`` None for one that never produced a token."""

    request_id: str
    index: int
    finish_reason: int
    arrival_time: float  # queued at the engine
    scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float
    num_prompt_tokens: int
    num_cached_tokens: int
    num_generation_tokens: int
    max_tokens: int
    preemption_times: tuple[float, ...] = ()
    prefill_chunks: tuple[tuple[float, float, int], ...] = ()  # (start, end, tokens) of each prompt chunk
    decode_steps: tuple[tuple[float, float], ...] = ()  # (start, end) of each decode step, when recorded


@dataclass(slots=True)
class IterationStats:
    """Counts since the last ``take_stats()``; every event is counted once, where it happens.

    - ``num_prompt_tokens``: the prompt of each request whose prefill completed (its first token
      was sampled), once per request (an n > 1 request's children share its prompt).
    - ``num_generation_tokens``: every token sampled for a sequence still running when sampled.
    - ``step_tokens``: tokens computed by each step (one entry per step that ran the model).
    - ``decode_step_seconds``: the duration (scheduled to sampled) of each step that only decoded
      (every chunk one token of a sequence past its first token): what serving adds per token is
      the clients' time per output token minus these.
    - ``num_preemptions``: sequences preempted (by recompute).
    - ``admitted``: (n, max_tokens) of each request added.
    - ``finished``: each sequence that finished, whatever the reason.
    - ``num_expired``: requests dropped past their deadline, by phase ("admission": refused;
      "waiting": nothing computed; "running": dropped after some was), once per request.
    """

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    step_tokens: list[int] = field(default_factory=list)
    decode_step_seconds: list[float] = field(default_factory=list)
    admitted: list[tuple[int, int]] = field(default_factory=list)
    finished: list[FinishedSequence] = field(default_factory=list)
    num_expired: dict[str, int] = field(default_factory=dict)


# The scheduler's notes, made where the events happen (on Request fields the stats read later).
def is_decode(request, num_tokens: int) -> bool:
    """A chunk of ``num_tokens`` for ``request`` is a decode step (one token past its first), not a
    prompt chunk or a recompute."""
    return num_tokens == 1 and request.first_token_time is not None


def note_chunk(request, num_tokens: int, step_start: float, now: float, record_decode_steps: bool) -> None:
    """A chunk of ``request`` ran from ``step_start`` to ``now``: a prompt chunk (or a recompute)
    is kept; a decode step only when every step is recorded (--collect-detailed-traces)."""
    if not is_decode(request, num_tokens):
        request.prefill_chunks.append((step_start, now, num_tokens))
    elif record_decode_steps:
        request.decode_steps.append((step_start, now))


def note_token(stats: IterationStats, request, now: float) -> None:
    """A token was sampled for ``request``: the first one completes the prefill, and counts the
    prompt once per request (children and beams are forked with index > 0 or a first token)."""
    stats.num_generation_tokens += 1
    if request.first_token_time is None:
        request.first_token_time = now
        if request.index == 0:
            stats.num_prompt_tokens += request.num_prompt_tokens
    request.last_token_time = now


def finished_record(request, now: float, max_tokens: int) -> FinishedSequence:
    """The record of a sequence that finished at ``now`` (its reason ABORT when it has none)."""
    return FinishedSequence(
        request.request_id, request.index, int(request.finish_reason or FinishReason.ABORT), request.arrival_time,
        request.scheduled_time, request.first_token_time, request.last_token_time, now, request.num_prompt_tokens,
        request.num_cached_tokens, request.num_output_tokens, max_tokens, tuple(request.preemption_times),
        tuple(request.prefill_chunks), tuple(request.decode_steps))
