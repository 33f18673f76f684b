"""OpenAI's response bodies and stream chunks as pydantic models (what ``renderer.py`` fills)."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer


class _ResponseBody(BaseModel):
    """Only the fields declared: a typo in the renderer fails at once."""

    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_ResponseBody):
    cached_tokens: int = 0


class UsageInfo(_ResponseBody):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(_ResponseBody):
    """The legacy completions shape: parallel lists, one entry per generated token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_ResponseBody):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(_ResponseBody):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(_ResponseBody):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_ResponseBody):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(_ResponseBody):
    name: str
    arguments: str  # JSON text


class ToolCallOut(_ResponseBody):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class _WithToolCalls(_ResponseBody):
    """A message whose ``tool_calls`` key is left out when it has none (as OpenAI leaves it)."""

    @model_serializer(mode="wrap")
    def _without_empty_calls(self, handler) -> dict[str, Any]:
        out = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class ChatMessageOut(_WithToolCalls):
    role: Literal["assistant"] = "assistant"
    content: str | None = None  # None when the message is only tool calls
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(_ResponseBody):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_ResponseBody):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaMessage(_WithToolCalls):
    role: Literal["assistant"] | None = None
    content: str | None = None
    # OpenAI's shape: a call's first piece {index, id, type, function: {name, arguments}}, later
    # pieces {index, function: {arguments}} (gateway.tool_calls.ToolCallDelta.to_openai)
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(_ResponseBody):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_ResponseBody):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionChunk(_ResponseBody):
    """A streamed completion chunk has the same shape as the full response."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
