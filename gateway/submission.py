"""One HTTP request in flight on the bus: its GenerateRequests, its inbox, and its choices."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Protocol

from gateway.choice import ChoiceState, PromptState
from gateway.direct_write import DirectWriter
from gateway.errors import APIError
from gateway.openai_protocol.response_bodies import UsageInfo
from gateway.renderer import make_usage
from shared.protocol import ErrorInfo, FinishReason, GenerateRequest, RequestOutput, Resume

log = logging.getLogger(__name__)
MAX_GAPS = 4096

Applied = list[tuple[ChoiceState, RequestOutput]]


class _Bus(Protocol):
    collector: object

    async def submit(self, requests: Sequence[GenerateRequest]) -> None: ...

    def abort(self, request_ids: Sequence[str], reason: str) -> None: ...


class Submission:
    """Owns the choices of one HTTP request while its prompts travel the bus.

    Each prompt is one GenerateRequest whose ``n`` choices come back with ``index`` 0..n-1;
    prompt ``p``'s choice ``i`` is the response's choice ``p * n + i`` (as vLLM numbers them).
    The collector ``put``s every output of the request's ids into one inbox and wakes the
    request's task at most once per reply-stream read, so ``receive()`` hands over everything
    that arrived in that read at once. The one exception is the fast path (``direct_writer``,
    direct_write.py): while ``receive()`` waits on an empty inbox every earlier event is on the
    wire, so a plain text delta is applied and written at once instead. ``close()`` always runs
    (the responder's ``finally``): it unregisters the ids and, unless every choice finished,
    aborts them so the engine frees their blocks.

    The requests' deadline (unix time, set by the endpoint) is the one timeout: at it the client
    gets a 503 (one SSE error event once streaming), and ``close()`` aborts the requests, which no
    service computes past that time anyway.

    Failover: when the engine generating a prompt dies, its detok shard sends a ``Resume`` with
    the output tokens it already took; ``resume()`` resubmits that prompt's GenerateRequest with
    them (``resumed_token_ids``, ``resumed_seq``), and its outputs go on where they stopped.
    """

    def __init__(self, bus: _Bus, requests: Sequence[GenerateRequest], *,
                 echo_texts: Sequence[str | None] | None = None, param_names: Mapping[str, str] | None = None):
        self.bus = bus
        self.param_names = param_names or {}  # a service's parameter name -> the client's (errors)
        self.requests = list(requests)
        self.deadline = min(r.deadline for r in self.requests)  # 0: none
        self.n = self.requests[0].sampling.n
        self.positions = {r.request_id: p for p, r in enumerate(self.requests)}
        self.prompts = [PromptState() for _ in self.requests]
        self.choices = [ChoiceState(index=i) for i in range(len(self.requests) * self.n)]
        self._num_unfinished = len(self.choices)
        self.is_cancelled = False
        self.is_timed_out = False
        self.first_output_time: float | None = None
        self.output_gaps: list[float] = []  # seconds between successive outputs (inter-token latency)
        self.start_time = time.monotonic()
        self._last_output_time = self.start_time
        self._inbox: list[RequestOutput] = []
        self._waiter: asyncio.Future | None = None  # set while receive() waits on an empty inbox
        self._watchdog: asyncio.TimerHandle | None = None
        self._echo = [r.echo for r in self.requests]
        self.direct_writer: DirectWriter | None = None  # set by the responder once the stream began
        self.num_resumes = 0
        self._resubmissions: set[asyncio.Task] = set()
        self.num_direct = 0  # outputs the fast path wrote
        for p, text in enumerate(echo_texts or ()):
            if text is not None and self._echo[p]:
                self._set_echo(p, text)

    @property
    def request_ids(self) -> list[str]:
        return [r.request_id for r in self.requests]

    @property
    def is_finished(self) -> bool:
        return self._num_unfinished == 0

    async def start(self) -> None:
        for request_id in self.request_ids:
            self.bus.collector.register(request_id, self)
        try:
            await self.bus.submit(self.requests)
        except BaseException:
            for request_id in self.request_ids:
                self.bus.collector.unregister(request_id)
            raise

    def put(self, out: RequestOutput) -> None:
        """The collector's hand-off; the waiting task runs once the collector's read is routed."""
        waiter = self._waiter
        if waiter is not None and not waiter.done() and self.direct_writer is not None and self._write_now(out):
            return
        self._inbox.append(out)
        self._wake()

    def _write_now(self, out: RequestOutput) -> bool:
        """The fast path, for a plain text delta of a started choice; False: it takes the inbox."""
        if out.error is not None or out.usage is not None or out.prompt_text is not None \
                or out.prompt_token_ids is not None or not 0 <= out.index < self.n:
            return False
        position = self.positions.get(out.request_id)
        if position is None:
            return False
        choice = self.choices[position * self.n + out.index]
        event = self.direct_writer.event(choice, out)
        if event is None:
            return False
        if self._add(choice, out):
            self.direct_writer.write(event)
            self.num_direct += 1
        return True

    def resume(self, msg: Resume) -> None:
        """The prompt's engine died: send the prompt again, going on from the tokens delivered."""
        position = self.positions.get(msg.request_id)
        if position is None or self.is_cancelled or self.is_finished:
            return
        request = dataclasses.replace(self.requests[position], resumed_token_ids=msg.token_ids,
                                      resumed_seq=msg.next_seq)
        self.num_resumes += 1
        log.info("resuming %s after engine %s died (%d tokens delivered)", msg.request_id, msg.engine_id,
                 len(msg.token_ids))
        task = asyncio.get_running_loop().create_task(self._resubmit(request))
        self._resubmissions.add(task)
        task.add_done_callback(self._resubmissions.discard)

    async def _resubmit(self, request: GenerateRequest) -> None:
        try:
            await self.bus.submit([request])
        except APIError as exc:  # the bus is gone: the client gets the error the first submit would have
            self.put(RequestOutput(request_id=request.request_id, finish_reason=FinishReason.ERROR,
                                   error=ErrorInfo(message=exc.message, type="ServiceUnavailableError",
                                                   code=exc.status)))

    def cancel(self) -> None:
        """The client went away: wake ``receive()``, which then returns nothing."""
        self.is_cancelled = True
        self._wake()

    def close(self, reason: str = "client disconnected") -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        for request_id in self.request_ids:
            self.bus.collector.unregister(request_id)
        for task in list(self._resubmissions):  # a resume the client no longer waits for
            task.cancel()
        if not self.is_finished:
            self.bus.abort(self.request_ids, reason)

    async def receive(self) -> Applied:
        """Every (choice, output) applied since the last call, waiting while there is none; an
        empty list once every choice finished or the client left (``is_cancelled``).

        Raises APIError for an error reported by any service (after handing over the outputs
        that came before it) or at the deadline.
        """
        while not self.is_cancelled and not self.is_finished:
            if self.is_timed_out:
                raise APIError(503, f"the request did not finish by its deadline "
                                    f"({self.deadline - self.requests[0].arrival_time:g}s after it arrived)")
            if not self._inbox:
                await self._wait()
                continue
            outs, self._inbox = self._inbox, []
            applied: Applied = []
            for k, out in enumerate(outs):
                if out.error is not None:
                    if applied:  # the client gets what came first, then the error
                        self._inbox[:0] = outs[k:]
                        return applied
                    raise APIError.from_info(out.error).renamed(self.param_names)
                choice = self._apply(out)
                if choice is not None:
                    applied.append((choice, out))
            if applied:
                return applied
        return []

    async def collect(self) -> list[ChoiceState]:
        while await self.receive():
            pass
        return self.choices

    async def _wait(self) -> None:
        """One timer per submission, for its deadline (armed at the first wait)."""
        loop = asyncio.get_running_loop()
        if self._watchdog is None and self.deadline:
            self._watchdog = loop.call_later(max(self.deadline - time.time(), 0.0), self._expire)
        self._waiter = loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _expire(self) -> None:
        self.is_timed_out = True
        self._wake()

    def _apply(self, out: RequestOutput) -> ChoiceState | None:
        position = self.positions.get(out.request_id)
        if position is None:
            return None
        if out.prompt_token_ids is not None or out.usage is not None:
            self.prompts[position].add(out)
        if out.prompt_text is not None and self._echo[position]:
            self._set_echo(position, out.prompt_text)
        if _is_prompt_only(out) or not 0 <= out.index < self.n:
            return None
        choice = self.choices[position * self.n + out.index]
        return choice if self._add(choice, out) else None

    def _add(self, choice: ChoiceState, out: RequestOutput) -> bool:
        """Apply ``out`` to its choice and note the time; False for a duplicate or a late one."""
        if not choice.add(out):
            return False
        if choice.is_finished:
            self._num_unfinished -= 1
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
                choice.echo_text = text

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
