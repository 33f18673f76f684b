"""GenerateRequest -> EngineRequest: tokenize, check against the model's limits, or refuse with a 400.

Pure logic over a HF fast tokenizer; the service loop around it is in service.py. A batch of
text prompts is encoded in one call (the Rust tokenizer spreads it over threads).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shared.protocol import (DetokParams, EngineRequest, ErrorInfo, FinishReason, GenerateRequest, Message,
                             ProtocolError, RequestOutput, StreamNames, check_deadline, is_expired)
from tokenizer_svc.chat import ChatRenderer

# its gateway has answered the client at the deadline (and aborted it): no work for it here
EXPIRED = ErrorInfo(message="the request's deadline passed before it was tokenized (request_timeout)",
                    type="ServiceUnavailableError", code=503)


@dataclass(slots=True)
class _Work:
    request: GenerateRequest
    text: str | None = None
    ids: list[int] | None = None
    error: ErrorInfo | None = None
    span: Any = None  # the request's "tokenize" span, with tracing on


class PromptEncoder:
    """Owns the tokenizer and the length limit; turns each request into its outgoing messages.
    With ``tracing`` (shared.tracing.Tracing), a traced request gets a "tokenize" span (a
    "chat_template" child for chat) whose context its EngineRequest carries on."""

    def __init__(self, tokenizer, max_model_len: int, names: StreamNames, tracing=None):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        # bounded work: a text longer than this cannot fit max_model_len tokens, and is refused
        # without being tokenized (a 15 MB prompt would hold this replica for seconds)
        self.max_prompt_chars = max_model_len * longest_token_chars(tokenizer)
        self.chat = ChatRenderer(tokenizer, self.max_prompt_chars)
        self.vocab_size = len(tokenizer)
        self.names = names
        self.tracing = tracing

    def encode_batch(self, requests: Sequence[GenerateRequest]) -> list[tuple[str, Message]]:
        """Every (stream, message) to send, in order: per request the echo (if asked) then the
        EngineRequest to the engines, or one error RequestOutput to its gateway."""
        work = [_Work(r) for r in requests]
        if self.tracing is not None:
            for w in work:
                if w.request.trace:
                    w.span = self.tracing.start("tokenize", w.request.trace,
                                                attributes={"pagedserve.request_id": w.request.request_id})
        texts = []
        for w in work:
            self._prepare(w)
            if w.error is None and w.ids is None:
                texts.append(w)
        if texts:
            encoded = self.tokenizer([w.text for w in texts], add_special_tokens=True)["input_ids"]
            for w, ids in zip(texts, encoded):
                w.ids = list(ids)
        out: list[tuple[str, Message]] = []
        for w in work:
            if w.error is None:
                self._check(w)
            out += self._emit(w)
            if w.span is not None:
                w.span.set_attribute("gen_ai.usage.prompt_tokens", len(w.ids or ()))
                if w.error is not None:
                    w.span.set_attribute("pagedserve.error", w.error.message)
                w.span.end()
        return out

    def _prepare(self, w: _Work) -> None:
        r = w.request
        try:
            if is_expired(check_deadline(r.deadline), time.time()):
                w.error = EXPIRED
                return
            given = sum(x is not None for x in (r.prompt, r.prompt_token_ids, r.messages))
            if given != 1:
                raise ProtocolError("give exactly one of prompt, prompt_token_ids or messages", "prompt")
            r.sampling.validate(self.vocab_size)
            if r.sampling.structured_outputs is not None:
                validate_constraint(r.sampling.structured_outputs)
            if r.messages is not None:
                started = time.monotonic()
                w.text, w.ids = self.chat.encode(r.messages, r.add_generation_prompt, _tools(r.tools))
                if w.span is not None:
                    self.tracing.span_between("chat_template", w.span, started, time.monotonic())
            elif r.prompt_token_ids is not None:
                w.ids = list(r.prompt_token_ids)
                if not all(0 <= t < self.vocab_size for t in w.ids):
                    raise ProtocolError(f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
            else:
                self._check_chars(r.prompt, "prompt")
                w.text = r.prompt
        except ProtocolError as exc:
            w.error = ErrorInfo(message=exc.message, param=exc.param, code=getattr(exc, "code", 400))

    def _check_chars(self, text: str, param: str) -> None:
        if len(text) > self.max_prompt_chars:
            raise ProtocolError(f"This model's maximum context length is {self.max_model_len} tokens; a prompt of "
                                f"{len(text)} characters cannot fit it (at most {self.max_prompt_chars}).", param)

    def _check(self, w: _Work) -> None:
        num_prompt = len(w.ids)
        max_tokens = w.request.sampling.max_tokens
        if num_prompt == 0:
            w.error = ErrorInfo(message="the prompt is empty", param="prompt")
        elif num_prompt + (max_tokens or 1) > self.max_model_len:
            asked = num_prompt + (max_tokens or 1)
            w.error = ErrorInfo(
                message=(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                         f"requested {asked} tokens ({num_prompt} in the prompt, {max_tokens or 1} for the "
                         f"completion). Please reduce the length of the prompt or the completion."),
                param="max_tokens" if num_prompt < self.max_model_len else "prompt")

    def _emit(self, w: _Work) -> list[tuple[str, Message]]:
        r = w.request
        if w.error is not None:
            return [(r.reply_to, RequestOutput(request_id=r.request_id, finish_reason=FinishReason.ERROR,
                                               num_choices=r.sampling.n, error=w.error))]
        out: list[tuple[str, Message]] = []
        if r.echo:
            text = w.text if w.text is not None else self.tokenizer.decode(w.ids)
            out.append((r.reply_to, RequestOutput(request_id=r.request_id, num_choices=r.sampling.n,
                                                  prompt_text=text, prompt_token_ids=tuple(w.ids))))
        s = r.sampling
        detok = DetokParams(stop=s.stop, include_stop_str_in_output=s.include_stop_str_in_output,
                            skip_special_tokens=s.skip_special_tokens, logprobs=s.logprobs is not None,
                            min_tokens=s.min_tokens)
        out.append((self.names.engine_in, EngineRequest(
            request_id=r.request_id, reply_to=r.reply_to, prompt_token_ids=tuple(w.ids), sampling=s,
            detok=detok, cache_salt=r.cache_salt, arrival_time=r.arrival_time, deadline=r.deadline,
            resumed_token_ids=r.resumed_token_ids, resumed_seq=r.resumed_seq,  # failover: the engine goes on
            trace=self.tracing.carrier(w.span) if w.span is not None else {})))
        return out


def longest_token_chars(tokenizer) -> int:
    """The most characters of text one token can stand for (byte-level BPE and SentencePiece spell
    a token with at least one vocabulary character per character of text); the gateway applies
    the same rule before publishing (gateway/context.py)."""
    return max(1, max(map(len, tokenizer.get_vocab()), default=1))


def _tools(text: str | None) -> list | None:
    if text is None:
        return None
    try:
        tools = json.loads(text)
    except ValueError:
        raise ProtocolError("tools must be JSON", "tools") from None
    if not isinstance(tools, list):
        raise ProtocolError("tools must be an array", "tools")
    return tools


def validate_constraint(constraint) -> None:
    """xgrammar's parse of a structured-output constraint (imported only when one is used: it
    imports torch); a server installed without xgrammar refuses the request with a clear 501."""
    try:
        from shared.grammar import validate_constraint as parse
    except ImportError:
        raise ProtocolError("structured outputs need the xgrammar package on this server "
                            "(pip install --no-deps xgrammar==0.2.9)", "structured_outputs", code=501) from None
    parse(constraint)
