"""Every message that crosses the bus, and the names of the streams it crosses.

Messages are frozen dataclasses encoded as MessagePack maps ``{"t": type tag, field: value}``.
Decoding never trusts the sender: sizes are bounded by the unpacker, every field's type is
checked against its annotation (``shared/codec.py``), and anything wrong raises one
:class:`ProtocolError`. Only the standard library, msgpack and the codec are imported here
(the wall in DESIGN.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import msgpack

from shared.codec import ProtocolError, from_plain, to_plain
from shared.sampling_params import (MAX_LOGPROBS, MAX_N, MAX_STOP_STRINGS, FinishReason,  # noqa: F401 (the wire's types)
                                    SamplingParams)

MAX_MESSAGE_BYTES = 32 << 20
MAX_PROMPT_TOKENS = 1 << 20


# --------------------------------------------------------------------------- pieces


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallMessage:
    """A tool call an assistant made earlier in the conversation, as the client sends it back."""

    id: str
    name: str
    arguments: str  # JSON text, as OpenAI carries it


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatMessage:
    role: str
    content: str = ""
    name: str | None = None
    tool_call_id: str | None = None  # role "tool": the call this message answers
    tool_calls: tuple[ToolCallMessage, ...] = ()  # role "assistant"


@dataclass(frozen=True, slots=True, kw_only=True)
class DetokParams:
    """What the detokenizer needs to turn a request's tokens into text."""

    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: bool = False
    min_tokens: int = 0  # stop strings count only once a sequence has more tokens than this


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenLogprobs:
    """The sampled token's logprob and the top-N alternatives at one position (raw logits)."""

    token_id: int
    logprob: float
    rank: int
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class TextLogprobs:
    """TokenLogprobs rendered for the client: token strings instead of ids."""

    token: str
    token_id: int
    logprob: float
    bytes: tuple[int, ...] = ()
    top_tokens: tuple[str, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorInfo:
    """An OpenAI error object plus the HTTP status the gateway should answer with."""

    message: str
    type: str = "BadRequestError"
    param: str | None = None
    code: int = 400


# --------------------------------------------------------------------------- messages


class Message:
    """Base of every bus message: a type tag plus MessagePack encoding with strict decoding."""

    __slots__ = ()
    TAG: ClassVar[int] = 0

    def to_wire(self) -> bytes:
        body = to_plain(self)
        body["t"] = self.TAG
        return msgpack.packb(body, use_bin_type=True)

    @classmethod
    def from_wire(cls, data: bytes) -> Message:
        msg = decode(data)
        if not isinstance(msg, cls):
            raise ProtocolError(f"expected {cls.__name__}, got {type(msg).__name__}")
        return msg


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerateRequest(Message):
    """gateway -> tokenizer: one prompt (text, token ids, or chat messages) to generate from."""

    TAG: ClassVar[int] = 1
    request_id: str
    reply_to: str
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None
    add_generation_prompt: bool = True
    sampling: SamplingParams = field(default_factory=SamplingParams)
    echo: bool = False
    cache_salt: str | None = None
    tools: str | None = None  # the OpenAI tools, as JSON text: the chat template renders them
    arrival_time: float = 0.0
    trace: dict[str, str] = field(default_factory=dict)  # W3C trace context (traceparent) of the gateway's span
    deadline: float = 0.0  # unix time after which nobody computes it (check_deadline); 0: none (old senders)
    # a resubmission after the request's engine died (failover): the output tokens already delivered
    # (n = 1; empty when nothing was) and the seq the request's outputs go on from
    resumed_token_ids: tuple[int, ...] = ()
    resumed_seq: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineRequest(Message):
    """tokenizer -> engine: a tokenized request."""

    TAG: ClassVar[int] = 2
    request_id: str
    reply_to: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    detok: DetokParams = field(default_factory=DetokParams)
    cache_salt: str | None = None
    arrival_time: float = 0.0
    trace: dict[str, str] = field(default_factory=dict)  # W3C trace context of the tokenizer's span
    deadline: float = 0.0  # the GenerateRequest's, copied through
    # failover: outputs already delivered, which the engine re-prefills after the prompt and goes on from
    resumed_token_ids: tuple[int, ...] = ()
    resumed_seq: int = 0  # the seq its first TokenDelta carries (the dead engine's deltas came before)
    # P/D: a prefill engine's hand-off to ps:decode:in (resumed_token_ids then hold the first token):
    # the handle of the KV it saved for the first num_kv_tokens tokens (None: saving failed, recompute)
    kv_handle: str | None = None
    num_kv_tokens: int = 0
    prefill_engine_id: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Abort(Message):
    """gateway/detok -> every engine: stop these requests and free their blocks."""

    TAG: ClassVar[int] = 3
    request_ids: tuple[str, ...]
    reason: str = "abort"


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenDelta(Message):
    """engine -> detok: the new tokens of one sequence (choice ``index``) of a request; every
    choice ends with exactly one delta carrying its finish_reason."""

    TAG: ClassVar[int] = 4
    request_id: str
    seq: int
    index: int = 0
    new_token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprobs, ...] | None = None
    cumulative_logprob: float | None = None
    finish_reason: int | None = None
    stop_reason: int | None = None  # the stop token id that ended it, if one did
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_choices: int = 1
    error: ErrorInfo | None = None  # the engine gave up on the whole request


@dataclass(frozen=True, slots=True, kw_only=True)
class Admission(Message):
    """engine -> detok: a request is admitted, by which engine, and where its text goes. Sent
    before its first token, so that a detok shard fails the request at once if that engine dies."""

    TAG: ClassVar[int] = 7
    request_id: str
    num_choices: int = 1
    engine_id: str = ""
    reply_to: str = ""
    detok: DetokParams = field(default_factory=DetokParams)
    trace: dict[str, str] = field(default_factory=dict)  # W3C trace context of the engine's span


@dataclass(frozen=True, slots=True, kw_only=True)
class Resume(Message):
    """detok -> gateway: the engine generating this request died; resubmit it with the output
    tokens the detokenizer already took (``token_ids``), to go on at ``next_seq`` (failover)."""

    TAG: ClassVar[int] = 8
    request_id: str
    token_ids: tuple[int, ...] = ()
    next_seq: int = 0
    engine_id: str = ""  # the engine that died


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestOutput(Message):
    """anything -> gateway: text for one choice of a request, or the error that ended it."""

    TAG: ClassVar[int] = 5
    request_id: str
    seq: int = 0
    index: int = 0
    text_delta: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TextLogprobs, ...] | None = None
    finish_reason: int | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None
    num_choices: int = 1
    error: ErrorInfo | None = None
    # sent once by the tokenizer for echo / usage before any text arrives
    prompt_text: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat(Message):
    """every service -> ps:heartbeat hash: who is alive and how loaded it is."""

    TAG: ClassVar[int] = 6
    service: str
    service_id: str
    time: float
    stats: dict[str, float] = field(default_factory=dict)
    host: str = ""
    pid: int = 0
    start_time: float = 0.0  # when the service started (time.time()): its uptime


MESSAGE_TYPES: dict[int, type[Message]] = {
    cls.TAG: cls for cls in (GenerateRequest, EngineRequest, Abort, TokenDelta, RequestOutput, Heartbeat,
                          Admission, Resume)
}


# --------------------------------------------------------------------------- streams


@dataclass(frozen=True, slots=True)
class StreamNames:
    """Every Redis key pagedserve uses, under one namespace prefix."""

    prefix: str = "ps"

    @property
    def tokenizer_in(self) -> str:
        return f"{self.prefix}:tokenizer:in"

    @property
    def engine_in(self) -> str:
        return f"{self.prefix}:engine:in"

    @property
    def engine_ctl(self) -> str:
        return f"{self.prefix}:engine:ctl"

    @property
    def decode_in(self) -> str:
        return f"{self.prefix}:decode:in"

    def kv(self, request_id: str) -> str:
        return f"{self.prefix}:kv:{request_id}"

    def detok_in(self, shard: int) -> str:
        return f"{self.prefix}:detok:in:{shard}"

    def gateway_out(self, gateway_id: str) -> str:
        return f"{self.prefix}:gateway:{gateway_id}:out"

    @property
    def heartbeat(self) -> str:
        return f"{self.prefix}:heartbeat"

    @property
    def dlq(self) -> str:
        return f"{self.prefix}:dlq"


GROUP_TOKENIZER = "tokenizer"
GROUP_ENGINE = "engine"
GROUP_DECODE = "decode"


def check_deadline(deadline: float) -> float:
    """A request's deadline as every hop re-validates it: a finite unix time, 0 for none."""
    if not math.isfinite(deadline) or deadline < 0:
        raise ProtocolError("deadline must be a finite unix time (0: none)", "deadline")
    return deadline


def is_expired(deadline: float, now: float) -> bool:
    """Whether a request with this deadline must no longer be computed at ``now`` (unix time)."""
    return 0 < deadline <= now


def detok_shard(request_id: str, num_shards: int) -> int:
    """Stable across processes (never Python's salted hash()): FNV-1a over the id's bytes."""
    h = 0xCBF29CE484222325
    for b in request_id.encode():
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h % num_shards


# --------------------------------------------------------------------------- codec


def decode(data: bytes) -> Message:
    """Bytes -> a validated message; any problem raises ProtocolError."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError("message is not bytes")
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        body = msgpack.unpackb(
            data, raw=False, strict_map_key=False, use_list=False,
            max_str_len=MAX_MESSAGE_BYTES, max_bin_len=MAX_MESSAGE_BYTES,
            max_array_len=MAX_PROMPT_TOKENS, max_map_len=1 << 16, max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable message: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError("message is not a map")
    tag = body.pop("t", None)
    cls = MESSAGE_TYPES.get(tag) if type(tag) is int else None  # not True (== 1), nor a map (unhashable)
    if cls is None:
        raise ProtocolError(f"unknown message type {tag!r}")
    return from_plain(cls, body, cls.__name__)
