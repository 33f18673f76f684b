"""What the gateway has received so far for one choice, and for one prompt, of an HTTP request."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.protocol import FinishReason, RequestOutput, TextLogprobs


@dataclass(slots=True)
class ChoiceState:
    """Owns the text, the number of tokens and the logprobs received so far for one choice index.

    Delivery on the bus is at-least-once, so a RequestOutput whose ``seq`` was already applied
    is ignored (``add`` returns False). The renderer alone writes ``is_started``,
    ``logprob_offset`` (where the streamed completions ``text_offset`` stands) and ``tool_parser``
    (a streamed chat choice's own tool-call parser, when the request reads calls).
    """

    index: int
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[TextLogprobs] = field(default_factory=list)
    finish_reason: int | None = None
    stop_reason: str | int | None = None
    echo_text: str = ""
    num_output_tokens: int = 0
    seen: set[int] = field(default_factory=set)
    # streaming bookkeeping: whether the echo / the assistant role went out, where logprobs stand
    is_started: bool = False
    logprob_offset: int = 0
    tool_parser: object | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self.echo_text + "".join(self.text_parts)

    @property
    def finish_reason_str(self) -> str | None:
        return None if self.finish_reason is None else FinishReason(self.finish_reason).openai

    def add(self, out: RequestOutput) -> bool:
        """Apply one output; False when it is a duplicate or arrives after the finish."""
        if out.seq in self.seen or self.is_finished:
            return False
        self.seen.add(out.seq)
        if out.text_delta:
            self.text_parts.append(out.text_delta)
        self.num_output_tokens += len(out.token_ids)
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason
        return True


@dataclass(slots=True)
class PromptState:
    """What the services reported about one prompt (one GenerateRequest, all its choices).

    The tokenizer's echo note carries the prompt's ids; the detokenizer puts the request's usage
    (prompt tokens, completion tokens of all its choices) on its last output.
    """

    num_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int | None = None

    def add(self, out: RequestOutput) -> None:
        if out.prompt_token_ids is not None:
            self.num_tokens = len(out.prompt_token_ids)
        if out.usage is not None:
            self.num_tokens = max(self.num_tokens, out.usage.prompt_tokens)
            self.num_cached_tokens = max(self.num_cached_tokens, out.usage.cached_tokens)
            self.num_output_tokens = out.usage.completion_tokens
