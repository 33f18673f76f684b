"""The codec of bus messages: frozen dataclasses <-> plain maps that MessagePack can carry.

Per class, it is compiled once from the annotations: encoding walks a list of (field, default,
nested encoder) and leaves out fields that hold their default; decoding runs one checker
closure per field, each with its error path fixed at compile time, and raises one
:class:`ProtocolError` for anything the annotations do not allow. Standard library only.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, ClassVar


class ProtocolError(ValueError):
    """A message (or a parameter inside one) that must be refused; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None, code: int = 400):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code  # the HTTP status it maps to: 400 bad input, 503 overloaded


_ENCODERS: dict[type, Any] = {}
_DECODERS: dict[tuple[type, str], Any] = {}
_NO_DEFAULT = object()


def to_plain(obj: Any) -> dict:
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
        return to_plain
    if typing.get_origin(tp) is tuple and dataclasses.is_dataclass(typing.get_args(tp)[0]):
        return lambda items: [to_plain(x) for x in items]
    return None


def _hints(cls: type) -> dict[str, Any]:
    return {k: v for k, v in typing.get_type_hints(cls).items() if typing.get_origin(v) is not ClassVar}


def from_plain(cls: type, body: Any, where: str) -> Any:
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
        return lambda value: from_plain(tp, value, where)
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
