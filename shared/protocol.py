"""Every message that crosses the bus, and the names of the streams it crosses.

Messages are frozen dataclasses encoded as MessagePack maps ``{"t": type tag, field: value}``.
Decoding never trusts the sender: sizes are bounded by the unpacker, every field's type is
checked against its annotation, and anything wrong raises one :class:`ProtocolError`.
Only the standard library and msgpack are imported here (the wall in DESIGN.md).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, ClassVar

import msgpack

MAX_MESSAGE_BYTES = 32 << 20
MAX_PROMPT_TOKENS = 1 << 20
MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
MAX_N = 64


class ProtocolError(ValueError):
    """A message (or a parameter inside one) that must be refused; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None, code: int = 400):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code  # the HTTP status it maps to: 400 bad input, 503 overloaded


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
        body = _to_plain(self)
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
    """engine -> detok: the new tokens of one sequence (choice ``index``) of a request."""

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
    # only on a request's first delta (seq == 0): where to reply and how to detokenize
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
    cls = MESSAGE_TYPES.get(body.get("t"))  # type: ignore[arg-type]
    if cls is None:
        raise ProtocolError(f"unknown message type {body.get('t')!r}")
    return _from_plain(cls, {k: v for k, v in body.items() if k != "t"}, cls.__name__)


# Per class, the codec is compiled once from the annotations: encoding walks a list of
# (field, default, nested encoder) and leaves out fields that hold their default; decoding runs
# one checker closure per field, each with its error path fixed at compile time.
_ENCODERS: dict[type, Any] = {}
_DECODERS: dict[tuple[type, str], Any] = {}
_NO_DEFAULT = object()


def _to_plain(obj: Any) -> dict:
    cls = type(obj)
    encoder = _ENCODERS.get(cls)
    if encoder is None:
        encoder = _ENCODERS[cls] = _compile_encoder(cls)
    return encoder(obj)


def _compile_encoder(cls: type):
    hints = _hints(cls)
    plan = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else _NO_DEFAULT
        plan.append((f.name, default, type(default), _nested_encoder(hints[f.name])))

    def encode(obj: Any) -> dict:
        out = {}
        for name, default, default_type, nested in plan:
            value = getattr(obj, name)
            if value is default or (value == default and type(value) is default_type):
                continue  # the receiver fills it in
            out[name] = value if nested is None or value is None else nested(value)
        return out

    return encode


def _nested_encoder(tp: Any):
    """None when msgpack can pack the value as it is; else a function making it plain."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        nested = [_nested_encoder(t) for t in typing.get_args(tp) if t is not type(None)]
        return next((n for n in nested if n is not None), None)
    if dataclasses.is_dataclass(tp):
        return _to_plain
    if typing.get_origin(tp) is tuple and dataclasses.is_dataclass(typing.get_args(tp)[0]):
        return lambda items: [_to_plain(x) for x in items]
    return None


def _hints(cls: type) -> dict[str, Any]:
    return {k: v for k, v in typing.get_type_hints(cls).items() if typing.get_origin(v) is not ClassVar}


def _from_plain(cls: type, body: Any, where: str) -> Any:
    decoder = _DECODERS.get((cls, where))
    if decoder is None:
        decoder = _DECODERS[(cls, where)] = _compile_decoder(cls, where)
    return decoder(body)


def _compile_decoder(cls: type, where: str):
    hints = _hints(cls)
    checkers = {name: _checker(tp, f"{where}.{name}") for name, tp in hints.items()}

    def decode_body(body: Any) -> Any:
        if type(body) is not dict:
            raise ProtocolError(f"{where}: expected a map")
        try:
            kwargs = {name: checkers[name](value) for name, value in body.items()}
        except KeyError:
            unknown = set(body) - set(checkers)
            raise ProtocolError(f"{where}: unknown fields {sorted(map(str, unknown))}") from None
        try:
            return cls(**kwargs)
        except TypeError as exc:  # a required field is missing
            raise ProtocolError(f"{where}: {exc}") from None

    return decode_body


def _checker(tp: Any, where: str):
    """A function value -> checked value (or ProtocolError) for annotation ``tp``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = [_checker(t, where) for t in typing.get_args(tp) if t is not type(None)]
        nullable = type(None) in typing.get_args(tp)
        if len(options) == 1:
            only = options[0]
            return (lambda v: None if v is None else only(v)) if nullable else only

        def check_union(value):
            if value is None and nullable:
                return None
            errors = []
            for option in options:
                try:
                    return option(value)
                except ProtocolError as exc:
                    errors.append(exc.message)
            raise ProtocolError(errors[0] if len(errors) == 1 else f"{where}: no type matches {value!r:.60}")

        return check_union
    if origin is tuple:
        item_tp = typing.get_args(tp)[0]
        if item_tp in (int, str):  # the hot cases: token ids, stop strings

            def check_flat(value):
                if type(value) not in (tuple, list):
                    raise ProtocolError(f"{where}: expected an array")
                for x in value:
                    if type(x) is not item_tp:
                        raise ProtocolError(f"{where}: expected {'integers' if item_tp is int else 'strings'}")
                return tuple(value)

            return check_flat
        item = _checker(item_tp, f"{where}[]")

        def check_tuple(value):
            if type(value) not in (tuple, list):
                raise ProtocolError(f"{where}: expected an array")
            return tuple(item(x) for x in value)

        return check_tuple
    if origin is dict:
        key_tp, value_tp = typing.get_args(tp)
        key, val = _checker(key_tp, f"{where} key"), _checker(value_tp, f"{where} value")

        def check_dict(value):
            if type(value) is not dict:
                raise ProtocolError(f"{where}: expected a map")
            return {key(k): val(v) for k, v in value.items()}

        return check_dict
    if dataclasses.is_dataclass(tp):
        return lambda value: _from_plain(tp, value, where)
    if tp is float:

        def check_float(value):
            if type(value) is float:
                return value
            if type(value) is int:
                return float(value)
            raise ProtocolError(f"{where}: expected a number")

        return check_float
    if tp in (int, str, bool, bytes):
        message = f"{where}: expected an integer" if tp is int else f"{where}: expected {tp.__name__}"

        def check_exact(value):
            if type(value) is tp:
                return value
            raise ProtocolError(message)

        return check_exact
    raise TypeError(f"{where}: unsupported annotation {tp}")
