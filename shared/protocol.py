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
from enum import IntEnum
from typing import ClassVar

import msgpack

from shared.codec import ProtocolError, from_plain, to_plain

MAX_MESSAGE_BYTES = 32 << 20
MAX_PROMPT_TOKENS = 1 << 20
MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
MAX_N = 64


class FinishReason(IntEnum):
    STOP = 1  # EOS, a stop token or a stop string
    LENGTH = 2  # max_tokens or max_model_len
    ABORT = 3  # client went away or an Abort arrived
    ERROR = 4

    @property
    def openai(self) -> str:
        return {1: "stop", 2: "length", 3: "abort", 4: "error"}[self.value]


# --------------------------------------------------------------------------- sampling


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """What to sample and when to stop; validated at the gateway and again in the engine."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool = False

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        """Raise ProtocolError naming the first bad parameter; return self when all is well."""
        _check(1 <= self.n <= MAX_N, f"n must be between 1 and {MAX_N}, got {self.n}", "n")
        _check(_finite(self.temperature) and 0.0 <= self.temperature <= 2.0,
               f"temperature must be in [0, 2], got {self.temperature}", "temperature")
        _check(_finite(self.top_p) and 0.0 < self.top_p <= 1.0,
               f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        _check(self.top_k is None or self.top_k >= 1 or self.top_k == -1,
               f"top_k must be -1 (disabled) or at least 1, got {self.top_k}", "top_k")
        _check(_finite(self.min_p) and 0.0 <= self.min_p <= 1.0,
               f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        _check(self.seed is None or -(1 << 63) <= self.seed < (1 << 63), "seed out of range", "seed")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_finite(value) and -2.0 <= value <= 2.0, f"{name} must be in [-2, 2], got {value}", name)
        _check(_finite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
               f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}", "repetition_penalty")
        _check(self.max_tokens is None or self.max_tokens >= 1,
               f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        _check(self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}", "min_tokens")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
               "min_tokens must not exceed max_tokens", "min_tokens")
        _check(len(self.stop) <= MAX_STOP_STRINGS and all(self.stop),
               f"stop takes at most {MAX_STOP_STRINGS} non-empty strings", "stop")
        _check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
               f"logprobs must be between 0 and {MAX_LOGPROBS}", "logprobs")
        ids = list(self.stop_token_ids) + list((self.logit_bias or {}).keys())
        if vocab_size is not None:
            _check(all(0 <= t < vocab_size for t in ids), "token id out of the vocabulary", "stop_token_ids")
        for bias in (self.logit_bias or {}).values():
            _check(_finite(bias) and -100.0 <= bias <= 100.0, "logit_bias values must be in [-100, 100]",
                   "logit_bias")
        _check(_finite(self.length_penalty), "length_penalty must be finite", "length_penalty")
        _check(not self.use_beam_search or self.n >= 1, "beam search needs n >= 1", "n")
        return self


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise ProtocolError(message, param)


# --------------------------------------------------------------------------- pieces


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatMessage:
    role: str
    content: str
    name: str | None = None


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
    arrival_time: float = 0.0
    deadline: float | None = None
    trace: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineRequest(Message):
    """tokenizer -> engine (and prefill -> decode engine): a tokenized request."""

    TAG: ClassVar[int] = 2
    request_id: str
    reply_to: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    detok: DetokParams = field(default_factory=DetokParams)
    cache_salt: str | None = None
    arrival_time: float = 0.0
    deadline: float | None = None
    trace: dict[str, str] = field(default_factory=dict)
    # tokens the client already received from an engine that died: re-prefill and go on
    delivered_token_ids: tuple[int, ...] = ()
    # P/D: where the prefill engine left the KV blocks, and the token it sampled
    kv_handle: str | None = None
    first_token_id: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Abort(Message):
    """gateway/detok -> every engine: stop these requests and free their blocks."""

    TAG: ClassVar[int] = 3
    request_ids: tuple[str, ...]
    reason: str = "abort"


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenDelta(Message):
    """engine -> detok: the new tokens of one sequence (choice ``index``) of a request. On
    admission the engine announces the request with a token-less delta of seq -1."""

    TAG: ClassVar[int] = 4
    request_id: str
    seq: int
    index: int = 0
    new_token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprobs, ...] | None = None
    cumulative_logprob: float | None = None
    finish_reason: int | None = None
    stop_reason: int | None = None  # the stop token id that ended it, if one did
    engine_id: str = ""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_choices: int = 1
    # only on the announcement and each choice's first delta (seq 0): where to reply, how to detokenize
    reply_to: str | None = None
    detok: DetokParams | None = None
    error: ErrorInfo | None = None


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


MESSAGE_TYPES: dict[int, type[Message]] = {
    cls.TAG: cls for cls in (GenerateRequest, EngineRequest, Abort, TokenDelta, RequestOutput, Heartbeat)
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
    def decode_in(self) -> str:
        return f"{self.prefix}:decode:in"

    @property
    def engine_ctl(self) -> str:
        return f"{self.prefix}:engine:ctl"

    def detok_in(self, shard: int) -> str:
        return f"{self.prefix}:detok:in:{shard}"

    def gateway_out(self, gateway_id: str) -> str:
        return f"{self.prefix}:gateway:{gateway_id}:out"

    def kv(self, request_id: str) -> str:
        return f"{self.prefix}:kv:{request_id}"

    @property
    def heartbeat(self) -> str:
        return f"{self.prefix}:heartbeat"

    @property
    def dlq(self) -> str:
        return f"{self.prefix}:dlq"


GROUP_TOKENIZER = "tokenizer"
GROUP_ENGINE = "engine"
GROUP_DECODE = "decode"


def detok_shard(request_id: str, num_shards: int) -> int:
    """Stable across processes (never Python's salted hash()): FNV-1a over the id's bytes."""
    h = 0xCBF29CE484222325
    for b in request_id.encode():
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h % num_shards


# --------------------------------------------------------------------------- codec


def encode(msg: Message) -> bytes:
    return msg.to_wire()


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
