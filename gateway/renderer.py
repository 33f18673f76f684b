"""Choices -> OpenAI response bodies and stream chunks, for completions and for chat.

A renderer knows the shapes only; it never touches inboxes, Redis or HTTP. While streaming, each
applied RequestOutput becomes ``text_event()`` (a plain text delta, the hot path) or ``chunks()``;
otherwise ``response()`` runs once at the end.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from json.encoder import encode_basestring  # json.dumps(str, ensure_ascii=False), minus its dispatch

from pydantic import BaseModel

from gateway.choice import ChoiceState
from gateway.openai_protocol.response_bodies import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    FunctionCall,
    PromptTokensDetails,
    ToolCallOut,
    TopLogprob,
    UsageInfo,
)
from gateway.tool_calls import StreamDelta
from gateway.tool_choice import NO_TOOLS, ToolPolicy
from shared.protocol import RequestOutput, TextLogprobs


def make_usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> UsageInfo:
    details = PromptTokensDetails(cached_tokens=num_cached_tokens) if num_cached_tokens else None
    return UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                     total_tokens=num_prompt_tokens + num_completion_tokens, prompt_tokens_details=details)


def completion_logprobs(lps: Sequence[TextLogprobs], start: int) -> tuple[CompletionLogprobs, int]:
    """The legacy parallel-list shape; ``text_offset`` counts from ``start``. Returns the end offset."""
    out = CompletionLogprobs()
    for lp in lps:
        out.tokens.append(lp.token)
        out.token_logprobs.append(lp.logprob)
        top = dict(zip(lp.top_tokens, lp.top_logprobs))
        top.setdefault(lp.token, lp.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(start)
        start += len(lp.token)
    return out, start


def chat_logprobs(lps: Sequence[TextLogprobs]) -> ChatLogprobs:
    return ChatLogprobs(content=[
        ChatTokenLogprob(
            token=lp.token, logprob=lp.logprob, bytes=list(lp.bytes) or list(lp.token.encode()),
            top_logprobs=[TopLogprob(token=t, logprob=v, bytes=list(t.encode()))
                          for t, v in zip(lp.top_tokens, lp.top_logprobs)],
        )
        for lp in lps
    ])


_INDEX, _TEXT = 987654321, "\u2063text\u2063"  # placeholders no real chunk holds


class ResponseRenderer:
    """The shapes of one API (completions or chat) for one HTTP request."""

    def __init__(self, response_id: str, model: str, *, want_logprobs: bool):
        self.response_id = response_id
        self.model = model
        self.want_logprobs = want_logprobs
        self.created = int(time.time())
        self._text_template: tuple[bytes, bytes, bytes] | None = None
        self.has_plain_text_deltas = True  # False: every text delta is read (tool calls), never sent as is

    def text_event(self, choice: ChoiceState, out: RequestOutput) -> bytes | None:
        """The SSE event of a plain text delta -- the hot path while streaming -- filled into the
        bytes of a chunk the pydantic model rendered once; None when the chunk needs the model
        (a choice's first chunk, logprobs, the finish)."""
        if self.want_logprobs or not self.has_plain_text_deltas or not choice.is_started or not out.text_delta \
                or out.finish_reason is not None:
            return None
        if self._text_template is None:
            rendered = sse(self._plain_text_chunk(_INDEX, _TEXT))
            head, rest = rendered.split(str(_INDEX).encode())
            middle, tail = rest.split(json.dumps(_TEXT, ensure_ascii=False).encode())
            self._text_template = (head, middle, tail)
        head, middle, tail = self._text_template
        return b"".join((head, b"%d" % choice.index, middle, encode_basestring(out.text_delta).encode(), tail))

    def _plain_text_chunk(self, index: int, text: str) -> BaseModel:
        raise NotImplementedError

    def response(self, choices: Sequence[ChoiceState], usage: UsageInfo) -> BaseModel:
        raise NotImplementedError

    def chunks(self, choice: ChoiceState, out: RequestOutput) -> list[BaseModel]:
        raise NotImplementedError

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        raise NotImplementedError


def sse(body: BaseModel) -> bytes:
    return b"data: " + body.model_dump_json().encode() + b"\n\n"


class TextCompletionRenderer(ResponseRenderer):
    """``text_completion`` objects; echoed prompt text leads the first chunk of each choice."""

    def response(self, choices: Sequence[ChoiceState], usage: UsageInfo) -> CompletionResponse:
        return CompletionResponse(id=self.response_id, created=self.created, model=self.model, usage=usage,
                                  choices=[self._full_choice(c) for c in choices])

    def _full_choice(self, choice: ChoiceState) -> CompletionChoice:
        logprobs = None
        if self.want_logprobs:
            logprobs, _ = completion_logprobs(choice.logprobs, len(choice.echo_text))
        return CompletionChoice(index=choice.index, text=choice.text, logprobs=logprobs,
                                finish_reason=choice.finish_reason_str, stop_reason=choice.stop_reason)

    def chunks(self, choice: ChoiceState, out: RequestOutput) -> list[CompletionChunk]:
        text = out.text_delta
        if not choice.is_started:
            choice.is_started = True
            choice.logprob_offset = len(choice.echo_text)
            text = choice.echo_text + text
        logprobs = None
        if self.want_logprobs and out.logprobs:
            logprobs, choice.logprob_offset = completion_logprobs(out.logprobs, choice.logprob_offset)
        if not text and logprobs is None and out.finish_reason is None:
            return []
        body = CompletionChoice(index=choice.index, text=text, logprobs=logprobs,
                                finish_reason=choice.finish_reason_str if out.finish_reason is not None else None,
                                stop_reason=out.stop_reason)
        return [CompletionChunk(id=self.response_id, created=self.created, model=self.model, choices=[body])]

    def _plain_text_chunk(self, index: int, text: str) -> CompletionChunk:
        return CompletionChunk(id=self.response_id, created=self.created, model=self.model,
                               choices=[CompletionChoice(index=index, text=text)])

    def usage_chunk(self, usage: UsageInfo) -> CompletionChunk:
        return CompletionChunk(id=self.response_id, created=self.created, model=self.model, choices=[], usage=usage)


class ChatCompletionRenderer(ResponseRenderer):
    """``chat.completion`` objects; each streamed choice opens with a role-only delta. Under a tool
    policy that reads calls, each choice's text goes through its own parser: content and
    ``tool_calls`` (whole, or as OpenAI's call deltas while streaming)."""

    def __init__(self, response_id: str, model: str, *, want_logprobs: bool, tools: ToolPolicy = NO_TOOLS):
        super().__init__(response_id, model, want_logprobs=want_logprobs)
        self.tools = tools
        self.has_plain_text_deltas = not tools.reads_calls

    def response(self, choices: Sequence[ChoiceState], usage: UsageInfo) -> ChatCompletionResponse:
        return ChatCompletionResponse(id=self.response_id, created=self.created, model=self.model, usage=usage,
                                      choices=[self._full_choice(c) for c in choices])

    def _full_choice(self, choice: ChoiceState) -> ChatChoice:
        logprobs = chat_logprobs(choice.logprobs) if self.want_logprobs else None
        if not self.tools.reads_calls:
            message, finish = ChatMessageOut(content=choice.text), choice.finish_reason_str
        else:
            parsed = self.tools.read(choice.text)
            calls = [ToolCallOut(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                     for c in parsed.tool_calls]
            message = ChatMessageOut(content=parsed.content, tool_calls=calls or None)
            finish = self.tools.finish_reason(choice.finish_reason_str, len(calls))
        return ChatChoice(index=choice.index, message=message, logprobs=logprobs, finish_reason=finish,
                          stop_reason=choice.stop_reason)

    def chunks(self, choice: ChoiceState, out: RequestOutput) -> list[ChatCompletionChunk]:
        chunks = []
        if not choice.is_started:
            choice.is_started = True
            chunks.append(self._chunk(ChatChunkChoice(index=choice.index,
                                                      delta=DeltaMessage(role="assistant", content=""))))
        logprobs = chat_logprobs(out.logprobs) if self.want_logprobs and out.logprobs else None
        delta, finish = self._delta(choice, out)
        if delta.content or delta.tool_calls or logprobs is not None or finish is not None:
            chunks.append(self._chunk(ChatChunkChoice(index=choice.index, delta=delta, logprobs=logprobs,
                                                      finish_reason=finish, stop_reason=out.stop_reason)))
        return chunks

    def _delta(self, choice: ChoiceState, out: RequestOutput) -> tuple[DeltaMessage, str | None]:
        """One output's delta message and finish_reason: its text as is, or what the choice's parser releases."""
        finished = out.finish_reason is not None
        if not self.tools.reads_calls:
            delta = DeltaMessage(content=out.text_delta) if out.text_delta else DeltaMessage()
            return delta, choice.finish_reason_str if finished else None
        if choice.tool_parser is None:
            choice.tool_parser = self.tools.parser()
        parser = choice.tool_parser
        pieces = [parser.feed(out.text_delta) if out.text_delta else StreamDelta()]
        if finished:
            pieces.append(parser.finish())
        content = "".join(p.content for p in pieces)
        calls = [c.to_openai() for p in pieces for c in p.tool_calls]
        finish = self.tools.finish_reason(choice.finish_reason_str, parser.num_calls) if finished else None
        return DeltaMessage(content=content or None, tool_calls=calls or None), finish

    def _plain_text_chunk(self, index: int, text: str) -> ChatCompletionChunk:
        return self._chunk(ChatChunkChoice(index=index, delta=DeltaMessage(content=text)))

    def _chunk(self, choice: ChatChunkChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.response_id, created=self.created, model=self.model, choices=[choice])

    def usage_chunk(self, usage: UsageInfo) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.response_id, created=self.created, model=self.model, choices=[],
                                   usage=usage)
