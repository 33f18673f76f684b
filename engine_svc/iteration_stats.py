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
    - ``num_preemptions``: sequences preempted (by recompute).
    - ``admitted``: (n, max_tokens) of each request added.
    - ``finished``: each sequence that finished, whatever the reason.
    """

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    step_tokens: list[int] = field(default_factory=list)
    admitted: list[tuple[int, int]] = field(default_factory=list)
    finished: list[FinishedSequence] = field(default_factory=list)
