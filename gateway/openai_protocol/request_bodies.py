"""OpenAI's request bodies as pydantic models, and what each turns into on the bus (prompts,
chat messages, SamplingParams).

Pydantic checks only shapes and types here; ranges (temperature in [0, 2], n >= 1, ...) are
checked by ``shared.protocol.SamplingParams.validate`` so that the gateway and the engine refuse
exactly the same things with the same messages. Unknown fields are ignored, as vLLM does.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from shared.protocol import ChatMessage, ProtocolError, SamplingParams

TokenIds = list[int]


class _RequestBody(BaseModel):
    """Strict types, unknown fields ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_RequestBody):
    include_usage: bool = False


class _SamplingFields(_RequestBody):
    """The sampling fields shared by completions and chat (OpenAI's plus vLLM's extras)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None
    use_beam_search: bool = False  # vLLM's extra: n beams, returned when the search ends
    length_penalty: float = 1.0
    early_stopping: bool = False

    def _sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The SamplingParams this request asks for, validated (raises ProtocolError)."""
        if self.stream_options is not None and not self.stream:
            raise ProtocolError("stream_options can only be set when stream is true", "stream_options")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        params = SamplingParams(
            n=self.n,
            temperature=_default(self.temperature, 1.0),
            top_p=_default(self.top_p, 1.0),
            top_k=None if self.top_k in (None, 0, -1) else self.top_k,
            min_p=_default(self.min_p, 0.0),
            seed=self.seed,
            presence_penalty=_default(self.presence_penalty, 0.0),
            frequency_penalty=_default(self.frequency_penalty, 0.0),
            repetition_penalty=_default(self.repetition_penalty, 1.0),
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            logit_bias=_logit_bias(self.logit_bias),
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            use_beam_search=self.use_beam_search,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
        )
        return params.validate()

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage


def _default(value: float | None, default: float) -> float:
    return default if value is None else value


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    try:
        return {int(token): float(value) for token, value in bias.items()}
    except ValueError:
        raise ProtocolError("logit_bias keys must be token ids", "logit_bias") from None


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. ``prompt``: a string, strings, token ids, or lists of token ids."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | tuple[int, ...]]:
        """One entry per prompt; each becomes one GenerateRequest."""
        prompt = self.prompt
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            items = [tuple(prompt)]
        else:
            items = [p if isinstance(p, str) else tuple(p) for p in prompt]
        if not items or any(len(p) == 0 for p in items):
            raise ProtocolError("prompt must not be empty", "prompt")
        return items

    def sampling_params(self) -> SamplingParams:
        if self.suffix is not None:
            raise ProtocolError("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise ProtocolError("best_of is not supported", "best_of")
        return self._sampling(self.max_tokens, self.logprobs)


class ContentPart(_RequestBody):
    type: str
    text: str | None = None


class ChatMessageIn(_RequestBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def to_message(self) -> ChatMessage:
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise ProtocolError("only text content parts are supported", "messages")
            content = "".join(part.text or "" for part in content)
        return ChatMessage(role=self.role, content=content or "", name=self.name)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessageIn]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def chat_messages(self) -> tuple[ChatMessage, ...]:
        if not self.messages:
            raise ProtocolError("messages must not be empty", "messages")
        return tuple(m.to_message() for m in self.messages)

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ProtocolError("top_logprobs needs logprobs to be true", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        if logprobs is not None and logprobs > 20:
            raise ProtocolError("top_logprobs must be between 0 and 20", "top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling(max_tokens, logprobs)


class TokenizeRequest(_RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_RequestBody):
    model: str | None = None
    tokens: list[int]
