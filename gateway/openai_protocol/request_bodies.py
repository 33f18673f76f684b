"""OpenAI's request bodies as pydantic models, and what each turns into on the bus (prompts,
chat messages, SamplingParams).

Pydantic checks only shapes and types here; ranges (temperature in [0, 2], n >= 1, ...) are
checked by ``shared.protocol.SamplingParams.validate`` so that the gateway and the engine refuse
exactly the same things with the same messages. Unknown fields are ignored, as vLLM does.

A constraint (``response_format``, vLLM's ``structured_outputs``, or a forced tool call) gets the
cheap checks here (one constraint, a schema that is JSON, a tool that exists); whether xgrammar can
parse it is the tokenizer's check, whose error names ``structured_outputs.<kind>`` and is renamed to
the field this client used (``param_names``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.errors import rename_param
from gateway.tool_choice import NO_TOOLS, ToolPolicy, tool_policy
from shared.protocol import ChatMessage, ProtocolError, SamplingParams, ToolCallMessage
from shared.structured import StructuredOutputs

# Every integer a client sends must fit the bus's 64-bit integers (MessagePack): a larger one is a
# 400 naming its field here, not a failed publish later.
Int64 = Annotated[int, Field(ge=-(1 << 63), le=(1 << 63) - 1)]
TokenIds = list[Int64]


class _RequestBody(BaseModel):
    """Strict types, unknown fields ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerOptions:
    """The server's flags that a request body is read under (from GatewayConfig)."""

    disable_any_whitespace: bool = False  # --structured-outputs-config.disable_any_whitespace
    tool_call_parser: str | None = None  # set only with --enable-auto-tool-choice: "auto" parses with it


class StreamOptions(_RequestBody):
    include_usage: bool = False


class JsonSchemaFormat(_RequestBody):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(_RequestBody):
    """OpenAI's ``response_format``; vLLM's structural tags are not supported."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(_RequestBody):
    """vLLM's ``structured_outputs`` extra: exactly one of json (a schema), regex, choice, grammar, json_object."""

    json_schema: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def constraint(self) -> StructuredOutputs:
        schema = self.json_schema
        text = schema if isinstance(schema, str) or schema is None else json.dumps(schema, ensure_ascii=False)
        return StructuredOutputs(json=text, json_object=bool(self.json_object), regex=self.regex,
                                 choice=None if self.choice is None else tuple(self.choice), grammar=self.grammar,
                                 disable_any_whitespace=self.disable_any_whitespace)


class _SamplingFields(_RequestBody):
    """The sampling fields shared by completions and chat (OpenAI's plus vLLM's extras)."""

    model: str | None = None
    n: Int64 = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None
    use_beam_search: bool = False  # vLLM's extra: n beams, returned when the search ends
    length_penalty: float = 1.0
    early_stopping: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    request_timeout: float | None = None  # pagedserve's extra: seconds this request may take (its deadline)

    @property
    def has_constraint(self) -> bool:
        fmt = self.response_format
        return self.structured_outputs is not None or (fmt is not None and fmt.type != "text")

    def param_names(self) -> dict[str, str]:
        """``structured_outputs.*`` parameter -> the field this request set (an error names the latter)."""
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return {}
        if fmt.type == "json_object":
            return {"structured_outputs.json_object": "response_format", "structured_outputs": "response_format"}
        return {"structured_outputs.json": "response_format.json_schema.schema", "structured_outputs": "response_format"}

    def constraint(self, options: ServerOptions) -> StructuredOutputs | None:
        """The constraint of ``response_format`` or ``structured_outputs`` (not both), checked."""
        fmt, body = self.response_format, self.structured_outputs
        if fmt is not None and fmt.type != "text" and body is not None:
            raise ProtocolError("give response_format or structured_outputs, not both", "structured_outputs")
        if body is not None:
            constraint = body.constraint()
        elif fmt is None or fmt.type == "text":
            return None
        elif fmt.type == "json_object":
            constraint = StructuredOutputs(json_object=True)
        elif fmt.json_schema is None:
            raise ProtocolError("response_format.json_schema is required when its type is json_schema",
                                "response_format.json_schema")
        else:
            schema = {} if fmt.json_schema.json_schema is None else fmt.json_schema.json_schema
            constraint = StructuredOutputs(json=json.dumps(schema, ensure_ascii=False))
        if options.disable_any_whitespace:
            constraint = dataclasses.replace(constraint, disable_any_whitespace=True)
        try:
            return constraint.validate()
        except ProtocolError as exc:
            param, message = rename_param(exc.param, exc.message, self.param_names())
            raise ProtocolError(message, param) from None

    def _sampling(self, max_tokens: int | None, logprobs: int | None,
                  constraint: StructuredOutputs | None = None) -> SamplingParams:
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
            structured_outputs=constraint,
        )
        return params.validate()

    def timeout_s(self, limit_s: float) -> float:
        """Seconds until this request's deadline: the client's ``request_timeout``, at most the
        server's ``--request-timeout`` (``limit_s``, also the default), so that an engine that
        remembers aborts that long covers every deadline."""
        timeout = self.request_timeout
        if timeout is None:
            return limit_s
        if not (math.isfinite(timeout) and 0 < timeout <= limit_s):
            raise ProtocolError(f"request_timeout must be a number of seconds in (0, {limit_s:g}]", "request_timeout")
        return timeout

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage


def _default(value: float | None, default: float) -> float:
    return default if value is None else value


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    try:
        out = {int(token): float(value) for token, value in bias.items()}
    except ValueError:
        raise ProtocolError("logit_bias keys must be token ids", "logit_bias") from None
    if not all(-(1 << 63) <= token < (1 << 63) for token in out):
        raise ProtocolError("logit_bias keys must be token ids", "logit_bias")
    return out


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. ``prompt``: a string, strings, token ids, or lists of token ids."""

    # the first member that fits wins, token ids before lists of strings: a million ids are not
    # also validated (and refused one by one) as strings (~5x the parse time)
    prompt: Annotated[str | TokenIds | list[str] | list[TokenIds], Field(union_mode="left_to_right")]
    max_tokens: Int64 | None = 16
    echo: bool = False
    logprobs: Int64 | None = None
    suffix: str | None = None
    best_of: Int64 | None = None

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

    def sampling_params(self, options: ServerOptions = ServerOptions()) -> SamplingParams:
        if self.suffix is not None:
            raise ProtocolError("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise ProtocolError("best_of is not supported", "best_of")
        return self._sampling(self.max_tokens, self.logprobs, self.constraint(options))


class ContentPart(_RequestBody):
    type: str
    text: str | None = None


class FunctionCallIn(_RequestBody):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(_RequestBody):
    """A call an earlier assistant turn made, sent back with the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(_RequestBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # role "assistant"
    tool_call_id: str | None = None  # role "tool": the call this message answers

    def to_message(self) -> ChatMessage:
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise ProtocolError("only text content parts are supported", "messages")
            content = "".join(part.text or "" for part in content)
        calls = tuple(ToolCallMessage(id=c.id, name=c.function.name, arguments=c.function.arguments)
                      for c in self.tool_calls or ())
        return ChatMessage(role=self.role, content=content or "", name=self.name, tool_call_id=self.tool_call_id,
                           tool_calls=calls)


class FunctionDefinition(_RequestBody):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the parameters are enforced whenever a call is forced


class Tool(_RequestBody):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_RequestBody):
    name: str


class NamedToolChoice(_RequestBody):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessageIn]
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def chat_messages(self) -> tuple[ChatMessage, ...]:
        if not self.messages:
            raise ProtocolError("messages must not be empty", "messages")
        return tuple(m.to_message() for m in self.messages)

    def tool_list(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template takes them (transformers' ``tools=``)."""
        return None if self.tools is None else [t.model_dump(by_alias=True, exclude_none=True) for t in self.tools]

    def tools_json(self) -> str | None:
        """What GenerateRequest.tools carries: every tool, whatever tool_choice says (as vLLM renders them)."""
        return None if not self.tools else json.dumps(self.tool_list(), ensure_ascii=False)

    def tool_policy(self, options: ServerOptions = ServerOptions()) -> ToolPolicy:
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            choice = choice.model_dump()
        return tool_policy(self.tool_list(), choice, self.parallel_tool_calls, tool_call_parser=options.tool_call_parser,
                           disable_any_whitespace=options.disable_any_whitespace)

    def param_names(self) -> dict[str, str]:
        if self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice):
            return {"structured_outputs.json": "tools", "structured_outputs": "tool_choice"}
        return super().param_names()

    def sampling_params(self, options: ServerOptions = ServerOptions(), tools: ToolPolicy = NO_TOOLS) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ProtocolError("top_logprobs needs logprobs to be true", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        if logprobs is not None and logprobs > 20:
            raise ProtocolError("top_logprobs must be between 0 and 20", "top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if tools.constraint is not None and self.has_constraint:
            raise ProtocolError("a forced tool call (tool_choice required or a named function) already constrains "
                                "the output; leave out response_format and structured_outputs", "tool_choice")
        return self._sampling(max_tokens, logprobs, tools.constraint or self.constraint(options))


class TokenizeRequest(_RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_RequestBody):
    model: str | None = None
    tokens: list[Int64]
