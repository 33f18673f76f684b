"""Structured outputs: the one constraint a request's generated text must obey.

The gateway turns ``response_format`` / ``structured_outputs`` / tool choice into a
:class:`StructuredOutputs`, validates it, and ships it on the wire as a plain map
(:meth:`StructuredOutputs.to_wire`). The engine compiles it into a grammar (``engine_svc/structured``)
and caches the result under :meth:`StructuredOutputs.key`. Standard library only, plus the
:class:`ProtocolError` every refused parameter raises (the wall in DESIGN.md).
"""

from __future__ import annotations

import hashlib
import json as jsonlib
from dataclasses import dataclass
from typing import Any

from shared.codec import ProtocolError

MAX_CONSTRAINT_CHARS = 1 << 16  # a schema, regex or grammar; all the choices together
MAX_CHOICES = 1024
PARAM_PREFIX = "structured_outputs"
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True, kw_only=True)
class StructuredOutputs:
    """Exactly one constraint (a JSON schema, any JSON object, a regex, a choice of strings or an
    EBNF grammar) plus how strictly JSON whitespace is held; immutable, so its key never changes.

    ``json`` is the schema as JSON text (not a dict) so the wire form, the cache key and the
    compiler all see the same bytes, and property order (which sets the generation order) is kept.
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False  # JSON only: no free whitespace between tokens

    @property
    def kind(self) -> str:
        """Which constraint is set: one of KINDS, or "" when none is (validate() refuses that)."""
        return next((k for k in KINDS if getattr(self, k) not in (None, False)), "")

    def validate(self) -> StructuredOutputs:
        """Raise ProtocolError naming the bad parameter; return self when all is well."""
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        _check(len(set_kinds) == 1,
               f"exactly one of {', '.join(KINDS)} must be set, got {set_kinds or 'none'}", PARAM_PREFIX)
        _check(type(self.disable_any_whitespace) is bool, "must be a boolean", _param("disable_any_whitespace"))
        _check(type(self.json_object) is bool, "must be a boolean", _param("json_object"))
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                _check(type(value) is str and value.strip() != "", "must be a non-empty string", _param(name))
                _check(len(value) <= MAX_CONSTRAINT_CHARS,
                       f"is longer than {MAX_CONSTRAINT_CHARS} characters", _param(name))
        if self.json is not None:
            _check_schema_text(self.json)
        if self.choice is not None:
            _check_choice(self.choice)
        return self

    def to_wire(self) -> dict[str, Any]:
        """A plain map for MessagePack holding only what is set."""
        out: dict[str, Any] = {}
        for name in KINDS:
            value = getattr(self, name)
            if value not in (None, False):
                out[name] = list(value) if name == "choice" else value
        if self.disable_any_whitespace:
            out["disable_any_whitespace"] = True
        return out

    @classmethod
    def from_wire(cls, body: Any) -> StructuredOutputs:
        """The inverse of to_wire; checks keys, types and sizes, then validate()."""
        _check(type(body) is dict, "expected a map", PARAM_PREFIX)
        unknown = set(body) - set(KINDS) - {"disable_any_whitespace"}
        _check(not unknown, f"unknown fields {sorted(map(str, unknown))}", PARAM_PREFIX)
        choice = body.get("choice")
        if choice is not None:
            _check(type(choice) in (list, tuple) and len(choice) <= MAX_CHOICES,
                   f"must be an array of at most {MAX_CHOICES} strings", _param("choice"))
            choice = tuple(choice)
        for name in ("json", "regex", "grammar"):
            value = body.get(name)
            _check(value is None or type(value) is str, "must be a string", _param(name))
        return cls(json=body.get("json"), json_object=body.get("json_object", False), regex=body.get("regex"),
                   choice=choice, grammar=body.get("grammar"),
                   disable_any_whitespace=body.get("disable_any_whitespace", False)).validate()

    def key(self) -> str:
        """sha256 hex of the constraint: equal constraints (to the byte) share compiled grammars."""
        wire = self.to_wire()
        if self.kind not in ("json", "json_object"):
            wire.pop("disable_any_whitespace", None)  # it changes nothing there
        text = jsonlib.dumps(wire, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _param(name: str) -> str:
    return f"{PARAM_PREFIX}.{name}"


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise ProtocolError(f"{param}: {message}", param)


def _check_schema_text(text: str) -> None:
    try:
        schema = jsonlib.loads(text)
    except ValueError as exc:
        raise ProtocolError(f"{_param('json')}: not valid JSON: {exc}", _param("json")) from None
    _check(isinstance(schema, (dict, bool)), "a JSON schema must be an object or a boolean", _param("json"))


def _check_choice(choice: Any) -> None:
    param = _param("choice")
    _check(type(choice) is tuple and 1 <= len(choice) <= MAX_CHOICES,
           f"must hold between 1 and {MAX_CHOICES} strings", param)
    _check(all(type(c) is str and c for c in choice), "must hold non-empty strings", param)
    _check(sum(map(len, choice)) <= MAX_CONSTRAINT_CHARS,
           f"holds more than {MAX_CONSTRAINT_CHARS} characters in all", param)
