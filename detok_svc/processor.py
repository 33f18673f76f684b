"""Per-request detokenization state: TokenDelta in, RequestOutput (and Abort on a stop string) out.

Pure logic over a tokenizer; ``service.py`` feeds it stream entries. An entry carries the
deltas of many requests (up to 16 of one engine step's), so each entry counts the unfinished requests it
holds deltas of, and the service acks it only when that count is zero (``take_ackable``): a
restarted shard replays what is pending and rebuilds the same outputs with the same ``seq``
(the gateway drops what it already has). A request that finished before the crash but shared
an entry with one that had not is replayed partly; it never finishes and ``expire`` drops it.
Deltas are idempotent on (request_id, index, seq).

Failover: when a request's engine dies, the shard hands the request back to its gateway
(``Resume``: the output tokens it took, and the seq to go on from) instead of failing it, and
keeps its text state; the gateway resubmits it, and the new engine's Admission takes it up again.
Until then the dead engine's late deltas are dropped (the new engine regenerates them); after it
too, since the new engine numbers a choice's deltas from the next multiple of ``SEQ_EPOCH`` and
the shard takes no lower seq any more: an engine judged dead that was only frozen cannot mix in.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from detok_svc.incremental import TokenStrings, detokenizer_factory
from detok_svc.stop import StopChecker
from shared.protocol import (Abort, Admission, DetokParams, ErrorInfo, FinishReason, Message, RequestOutput, Resume,
                             StreamNames, TextLogprobs, TokenDelta, TokenLogprobs, Usage)

MAX_FINISHED_IDS = 100_000
RESUME_TIMEOUT_S = 30.0  # a resumed request no engine admits by then is given up (503)
SEQ_EPOCH = 1 << 24  # a resumed request's deltas are numbered from the next multiple (fencing, below)


class ChoiceText:
    """One sequence (choice ``index``) of a request: its detokenizer, stop checker and what was sent."""

    def __init__(self, params: DetokParams, new_detokenizer):
        self.detok = new_detokenizer(params.skip_special_tokens)
        self.stop = StopChecker(params.stop, params.include_stop_str_in_output)
        self.text = ""  # decoded output text, after any stop-string cut
        self.num_sent = 0  # characters of text already sent
        self.last_seq = -1
        self.num_tokens = 0
        self.token_ids: list[int] = []  # every output token taken: what a resumed request re-prefills
        self.finish_reason: int | None = None
        self.stopped_here = False  # ended by a stop string: the engine may still be generating it
        self.held_ids: list[int] = []
        self.held_logprobs: list[TextLogprobs] = []


@dataclass(slots=True)
class RequestText:
    """What a shard knows of one admitted request: where its text goes, and each choice's text."""

    reply_to: str
    params: DetokParams
    num_choices: int
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    choices: dict[int, ChoiceText] = field(default_factory=dict)
    entry_ids: list[str] = field(default_factory=list)
    last_seen: float = field(default_factory=time.monotonic)
    engine_id: str = ""  # the engine its deltas come from
    num_finished: int = 0  # choices with a finish_reason
    resumed_at: float | None = None  # handed back to the gateway (its engine died), not yet re-admitted

    @property
    def is_resumable(self) -> bool:
        """One choice goes on from its tokens; several only while none has any (a plain restart):
        their sequences went different ways, which one engine request cannot carry."""
        return self.num_choices == 1 or all(c.last_seq < 0 for c in self.choices.values())

    @property
    def is_finished(self) -> bool:
        return self.num_finished == self.num_choices


class DetokProcessor:
    """Owns the state of every request in flight on one shard, dropped as soon as it finishes."""

    def __init__(self, tokenizer, names: StreamNames):
        self.new_detokenizer = detokenizer_factory(tokenizer)
        self.strings = TokenStrings(tokenizer)
        self.names = names
        self.requests: dict[str, RequestText] = {}
        self.finished: OrderedDict[str, None] = OrderedDict()  # recently finished ids: late deltas are dropped
        self.holders: dict[str, int] = {}  # entry id -> unfinished requests with deltas in it
        self._touched: dict[str, None] = {}  # entries seen or released since the last take_ackable()

    def process(self, entry_id: str, msg: TokenDelta | Admission) -> list[tuple[str, Message]]:
        """The messages to send for one delta (or admission)."""
        self._touched[entry_id] = None
        request = self._request_for(msg)
        if request is None:
            if isinstance(msg, Admission) and msg.request_id in self.finished:  # a resume raced its end
                return [(self.names.engine_ctl, Abort(request_ids=(msg.request_id,), reason="finished"))]
            return []
        if not request.entry_ids or request.entry_ids[-1] != entry_id:
            request.entry_ids.append(entry_id)
            self.holders[entry_id] = self.holders.get(entry_id, 0) + 1
        request.last_seen = time.monotonic()
        if isinstance(msg, Admission):  # the request (and its engine) is known; no text yet
            request.engine_id, request.resumed_at = msg.engine_id, None  # (again, after a resume)
            return []
        if request.resumed_at is not None:
            return []  # the dead engine's late delta: the new engine makes it again
        delta = msg
        out = self._apply(request, delta)
        if not request.is_finished:
            return out
        self._drop(delta.request_id)
        if any(c.stopped_here for c in request.choices.values()):
            out.append((self.names.engine_ctl, Abort(request_ids=(delta.request_id,), reason="stop")))
        return out

    def take_ackable(self) -> list[str]:
        """Entries touched since the last call that no unfinished request holds any more. Call it
        after a whole read: an entry's later deltas may still start holding it."""
        ackable = [e for e in self._touched if e not in self.holders]
        self._touched.clear()
        return ackable

    def fail(self, entry_id: str, request_id: str, exc: Exception) -> list[tuple[str, Message]]:
        """Drop a request whose delta could not be processed: its gateway gets a 500, the engine an
        Abort (which frees its blocks), and its entries are released."""
        self._touched[entry_id] = None
        request = self._drop(request_id)
        out: list[tuple[str, Message]] = [(self.names.engine_ctl, Abort(request_ids=(request_id,), reason="error"))]
        if request is not None:
            error = ErrorInfo(message=f"detokenizer error: {type(exc).__name__}", type="InternalServerError",
                              code=500)
            out.append((request.reply_to, RequestOutput(request_id=request_id, finish_reason=FinishReason.ERROR,
                                                        error=error, num_choices=request.num_choices)))
        return out

    def expire(self, max_idle_s: float) -> list[tuple[str, Message]]:
        """Give up on requests that got no delta for ``max_idle_s``: each gateway gets a 503, and
        the entries are released."""
        now = time.monotonic()
        unresumed = [r for r, q in self.requests.items() if q.resumed_at is not None
                     and now - q.resumed_at > RESUME_TIMEOUT_S]  # its client left, or no engine took it
        return (self._give_up(unresumed, "the request could not be resumed on another engine")
                + self._give_up([r for r, q in self.requests.items() if now - q.last_seen > max_idle_s],
                                "the engine stopped answering for this request"))

    def fail_engines(self, dead: set[str], can_resume: bool = False) -> list[tuple[str, Message]]:
        """The requests of ``dead`` engines (their heartbeat went stale or was removed). While
        another engine may be alive (``can_resume``), each resumable one goes back to its gateway
        to be resubmitted (failover); the others fail with a 503 now rather than after the idle
        timeout."""
        orphans = [r for r, q in self.requests.items() if q.engine_id in dead]
        if not can_resume:
            return self._give_up(orphans, "the engine serving this request stopped")
        out = self._give_up([r for r in orphans if not self.requests[r].is_resumable],
                            "the engine serving this request stopped (a request with n > 1 cannot be resumed)")
        now = time.monotonic()
        for request_id in orphans:
            request = self.requests.get(request_id)
            if request is None:
                continue
            dead_engine, request.engine_id, request.resumed_at = request.engine_id, "", now
            if request.num_choices > 1:  # nothing out yet: a plain restart
                out.append((request.reply_to, Resume(request_id=request_id, engine_id=dead_engine)))
                continue
            choice = request.choices.get(0) or request.choices.setdefault(0, ChoiceText(request.params,
                                                                                        self.new_detokenizer))
            next_seq = (max(choice.last_seq, 0) // SEQ_EPOCH + 1) * SEQ_EPOCH
            choice.last_seq = next_seq - 1  # the dead engine's deltas, however late, are below it
            out.append((request.reply_to, Resume(request_id=request_id, token_ids=tuple(choice.token_ids),
                                                 next_seq=next_seq, engine_id=dead_engine)))
        return out

    def _give_up(self, request_ids: list[str], message: str) -> list[tuple[str, Message]]:
        out: list[tuple[str, Message]] = []
        for request_id in request_ids:
            request = self._drop(request_id)
            error = ErrorInfo(message=message, type="ServiceUnavailableError", code=503)
            out.append((request.reply_to, RequestOutput(request_id=request_id, finish_reason=FinishReason.ERROR,
                                                        error=error, num_choices=request.num_choices)))
        return out

    def _drop(self, request_id: str) -> RequestText | None:
        """Forget a request (finished or given up on) and release its hold on its entries."""
        request = self.requests.pop(request_id, None)
        self._remember_finished(request_id)
        for entry_id in request.entry_ids if request is not None else ():
            self._touched[entry_id] = None
            left = self.holders[entry_id] - 1
            if left:
                self.holders[entry_id] = left
            else:
                del self.holders[entry_id]
        return request

    def _request_for(self, msg: TokenDelta | Admission) -> RequestText | None:
        request = self.requests.get(msg.request_id)
        if request is None and isinstance(msg, Admission) and msg.request_id not in self.finished:
            request = RequestText(msg.reply_to, msg.detok, max(1, msg.num_choices), engine_id=msg.engine_id)
            self.requests[msg.request_id] = request
        return request  # None: a late delta of a finished request (or one never admitted)

    def _remember_finished(self, request_id: str) -> None:
        self.finished[request_id] = None
        if len(self.finished) > MAX_FINISHED_IDS:
            self.finished.popitem(last=False)

    def _apply(self, request: RequestText, delta: TokenDelta) -> list[tuple[str, Message]]:
        choice = request.choices.get(delta.index)
        if choice is None:
            if not 0 <= delta.index < request.num_choices:
                return []
            choice = request.choices[delta.index] = ChoiceText(request.params, self.new_detokenizer)
        if delta.seq <= choice.last_seq or choice.finish_reason is not None:
            return []  # a duplicate, or tokens of a choice a stop string already ended
        choice.last_seq = delta.seq
        request.num_prompt_tokens = max(request.num_prompt_tokens, delta.num_prompt_tokens)
        request.num_cached_tokens = max(request.num_cached_tokens, delta.num_cached_tokens)
        if delta.error is not None:  # the engine gave up on the whole request
            for index in range(request.num_choices):
                request.choices.setdefault(index, ChoiceText(request.params, self.new_detokenizer))
                request.choices[index].finish_reason = FinishReason.ERROR
            request.num_finished = request.num_choices
            return [(request.reply_to, RequestOutput(request_id=delta.request_id, seq=delta.seq, index=delta.index,
                                                     finish_reason=FinishReason.ERROR, error=delta.error,
                                                     num_choices=request.num_choices))]
        return self._advance(request, choice, delta)

    def _advance(self, request: RequestText, choice: ChoiceText, delta: TokenDelta) -> list[tuple[str, Message]]:
        choice.num_tokens += len(delta.new_token_ids)
        choice.token_ids += delta.new_token_ids
        choice.held_ids += delta.new_token_ids
        if request.params.logprobs and delta.logprobs:
            choice.held_logprobs += [self._text_logprobs(lp) for lp in delta.logprobs]
        new_text = choice.detok.push(delta.new_token_ids)
        if delta.finish_reason is not None:
            new_text += choice.detok.finish()
        choice.text += new_text
        stop_reason: str | int | None = delta.stop_reason
        finish_reason = delta.finish_reason
        match = None  # as in vLLM, a stop string counts only in text decoded after min_tokens tokens
        if choice.num_tokens > request.params.min_tokens:
            match = choice.stop.check(choice.text, len(new_text))
        if match is not None:
            choice.text = choice.text[:match.end]
            stop_reason, finish_reason = match.stop, FinishReason.STOP
            choice.stopped_here = delta.finish_reason is None
        end = len(choice.text) if finish_reason is not None else choice.stop.releasable(choice.text, choice.num_sent)
        text_delta = choice.text[choice.num_sent:end]
        if not text_delta and finish_reason is None:
            return []  # held back: its tokens leave with the next text
        choice.num_sent = max(choice.num_sent, end)
        if finish_reason is not None:
            choice.finish_reason = finish_reason
            request.num_finished += 1
        output = RequestOutput(
            request_id=delta.request_id, seq=delta.seq, index=delta.index, text_delta=text_delta,
            token_ids=tuple(choice.held_ids), logprobs=tuple(choice.held_logprobs) if request.params.logprobs else None,
            finish_reason=finish_reason, stop_reason=stop_reason if finish_reason is not None else None,
            num_choices=request.num_choices, usage=self._usage(request) if request.is_finished else None)
        choice.held_ids, choice.held_logprobs = [], []
        return [(request.reply_to, output)]

    def _usage(self, request: RequestText) -> Usage:
        return Usage(prompt_tokens=request.num_prompt_tokens,
                     completion_tokens=sum(c.num_tokens for c in request.choices.values()),
                     cached_tokens=request.num_cached_tokens)

    def _text_logprobs(self, lp: TokenLogprobs) -> TextLogprobs:
        return TextLogprobs(token=self.strings.text(lp.token_id), token_id=lp.token_id, logprob=lp.logprob,
                            bytes=self.strings.bytes(lp.token_id),
                            top_tokens=tuple(self.strings.text(t) for t in lp.top_ids),
                            top_logprobs=lp.top_logprobs)
