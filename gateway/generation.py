"""One HTTP request in flight on the bus: its GenerateRequests, one queue, and its choices."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from gateway.choice import Choice, PromptInfo
from gateway.direct_write import DirectWriter
from gateway.errors import APIError
from gateway.openai_protocol import UsageInfo
from gateway.renderer import make_usage
from shared.protocol import GenerateRequest, RequestOutput

_CANCELLED = object()
_TIMED_OUT = object()
MAX_GAPS = 4096


class _Bus(Protocol):
    collector: object

    async def submit(self, requests: Sequence[GenerateRequest]) -> None: ...

    def abort(self, request_ids: Sequence[str], reason: str) -> None: ...


class Generation:
    """Owns the choices of one HTTP request while its prompts travel the bus.

    Each prompt is one GenerateRequest whose ``n`` choices come back with ``index`` 0..n-1;
    prompt ``p``'s choice ``i`` is the response's choice ``p * n + i`` (as vLLM numbers them).
    Every request id routes to the same queue. ``close()`` always runs (the responder's
    ``finally``): it unregisters the ids and, unless every choice finished, aborts them so the
    engine frees their blocks.
    """

    def __init__(self, bus: _Bus, requests: Sequence[GenerateRequest], *, idle_timeout_s: float,
                 echo_texts: Sequence[str | None] | None = None):
        self.bus = bus
        self.requests = list(requests)
        self.idle_timeout_s = idle_timeout_s
        self.n = self.requests[0].sampling.n
        self.positions = {r.request_id: p for p, r in enumerate(self.requests)}
        self.prompts = [PromptInfo() for _ in self.requests]
        self.choices = [Choice(index=i) for i in range(len(self.requests) * self.n)]
        self.queue: asyncio.Queue = asyncio.Queue()
        self.is_cancelled = False
        self.first_output_time: float | None = None
        self.output_gaps: list[float] = []  # seconds between successive outputs (inter-token latency)
        self.start_time = time.monotonic()
        self._last_output_time = self.start_time
        self._waiting_since = self.start_time  # the idle timeout counts from the last call of _next
        self._watchdog: asyncio.TimerHandle | None = None
        self._echo = [r.echo for r in self.requests]
        self.is_parked = False  # events() waits on an empty queue: everything before is delivered
        self.direct_writer: DirectWriter | None = None  # set by the responder once the stream began
        for p, text in enumerate(echo_texts or ()):
            if text is not None and self._echo[p]:
                self._set_echo(p, text)

    @property
    def request_ids(self) -> list[str]:
        return [r.request_id for r in self.requests]

    @property
    def is_finished(self) -> bool:
        return all(c.is_finished for c in self.choices)

    async def start(self) -> None:
        for request_id in self.request_ids:
            self.bus.collector.register(request_id, self.queue, self.deliver_now)
        try:
            await self.bus.submit(self.requests)
        except BaseException:
            for request_id in self.request_ids:
                self.bus.collector.unregister(request_id)
            raise

    def cancel(self) -> None:
        """The client went away: wake ``events()``, which then ends quietly."""
        self.is_cancelled = True
        self.queue.put_nowait(_CANCELLED)

    def close(self, reason: str = "client disconnected") -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        for request_id in self.request_ids:
            self.bus.collector.unregister(request_id)
        if not self.is_finished:
            self.bus.abort(self.request_ids, reason)

    async def events(self) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        """Yield (choice, output) for every new output until all choices finish.

        Raises APIError for an error reported by any service or when nothing arrives for
        ``idle_timeout_s``; returns early (``is_cancelled``) when the client left.
        """
        while not self.is_finished and not self.is_cancelled:
            item = await self._next()
            if item is _CANCELLED:
                return
            if item.error is not None:
                raise APIError.from_info(item.error)
            choice = self._apply(item)
            if choice is not None:
                yield choice, item

    async def collect(self) -> list[Choice]:
        async for _ in self.events():
            pass
        return self.choices

    async def _next(self) -> object:
        """The next item of the queue. One timer per generation watches for silence, re-armed
        only when it fires: a per-item timeout would cost a timer for every token."""
        self._waiting_since = time.monotonic()
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().call_later(self.idle_timeout_s, self._watch)
        self.is_parked = True
        try:
            item = await self.queue.get()
        finally:
            self.is_parked = False
        if item is _TIMED_OUT:
            raise APIError(503, f"no reply from the serving stack within {self.idle_timeout_s:g}s")
        return item

    def _watch(self) -> None:
        quiet_s = time.monotonic() - self._waiting_since
        if quiet_s >= self.idle_timeout_s and self.queue.empty():
            self.queue.put_nowait(_TIMED_OUT)
        else:
            self._watchdog = asyncio.get_running_loop().call_later(max(self.idle_timeout_s - quiet_s, 0.01),
                                                                   self._watch)

    def deliver_now(self, out: RequestOutput) -> bool:
        """The collector's fast path: apply a plain text delta and write it to the client at once,
        in order because nothing is queued and ``events()`` is parked. False: queue it instead."""
        writer = self.direct_writer
        if writer is None or not self.is_parked or not self.queue.empty() or out.error is not None \
                or out.usage is not None or out.prompt_text is not None or out.prompt_token_ids is not None:
            return False
        position = self.positions.get(out.request_id)
        if position is None or not 0 <= out.index < self.n:
            return False
        choice = self.choices[position * self.n + out.index]
        if not writer.accepts(choice, out):
            return False
        if self._add(choice, out):  # what _apply does for an output with no prompt note and no usage
            writer.write(choice, out)
            self._waiting_since = self._last_output_time  # the idle watchdog counts from here
        return True

    def _apply(self, out: RequestOutput) -> Choice | None:
        position = self.positions.get(out.request_id)
        if position is None:
            return None
        prompt = self.prompts[position]
        prompt.add(out)
        if out.prompt_text is not None and self._echo[position]:
            self._set_echo(position, out.prompt_text)
        if _is_prompt_only(out) or not 0 <= out.index < self.n:
            return None
        choice = self.choices[position * self.n + out.index]
        return choice if self._add(choice, out) else None

    def _add(self, choice: Choice, out: RequestOutput) -> bool:
        """Apply ``out`` to its choice and note the time; False for a duplicate or a late one."""
        if not choice.add(out):
            return False
        now = time.monotonic()
        if self.first_output_time is None:
            self.first_output_time = now
        elif len(self.output_gaps) < MAX_GAPS:
            self.output_gaps.append(now - self._last_output_time)
        self._last_output_time = now
        return True

    def _set_echo(self, position: int, text: str) -> None:
        for choice in self.choices[position * self.n:(position + 1) * self.n]:
            if not choice.is_started:
                choice.set_echo(text)

    def usage(self) -> UsageInfo:
        """Prompt tokens once per prompt (not per choice), as vLLM counts them; outputs of all choices."""
        num_output = 0
        for position, prompt in enumerate(self.prompts):
            counted = sum(c.num_output_tokens for c in self.choices[position * self.n:(position + 1) * self.n])
            num_output += counted if prompt.num_output_tokens is None else max(counted, prompt.num_output_tokens)
        return make_usage(sum(p.num_tokens for p in self.prompts), num_output,
                          sum(p.num_cached_tokens for p in self.prompts))


def _is_prompt_only(out: RequestOutput) -> bool:
    """The tokenizer's note (prompt text / ids for echo and usage), not part of any choice."""
    has_prompt = out.prompt_text is not None or out.prompt_token_ids is not None
    has_choice = bool(out.text_delta or out.token_ids or out.logprobs) or out.finish_reason is not None
    return has_prompt and not has_choice
