"""StructuredOutputs -> xgrammar Grammar, without a tokenizer.

Building the grammar parses the schema / regex / EBNF and is where bad input fails (tens to
hundreds of microseconds for ordinary schemas), so the tokenizer service calls
:func:`validate_constraint` to answer 400 before a request reaches an engine; the engine compiles
the same Grammar against its tokenizer (``engine_svc/structured/cache.py``). Here, not in the
gateway: xgrammar imports torch, which the gateway's process does without.
"""

from __future__ import annotations

import json
import re

import xgrammar as xgr

from shared.codec import ProtocolError
from shared.structured import PARAM_PREFIX, StructuredOutputs

# xgrammar prefixes its messages with "[12:00:00] /project/cpp/file.cc:123: "; clients need none of it
_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def build_grammar(constraint: StructuredOutputs) -> xgr.Grammar:
    """The xgrammar Grammar of a validated constraint; raises ProtocolError naming the parameter."""
    kind = constraint.kind
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(constraint.json, **_whitespace(constraint))
        if kind == "json_object":
            if constraint.disable_any_whitespace:  # the builtin JSON grammar always allows whitespace
                return xgr.Grammar.from_json_schema('{"type": "object"}', **_whitespace(constraint))
            return xgr.Grammar.builtin_json_grammar()
        if kind == "regex":
            return xgr.Grammar.from_regex(constraint.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(constraint.choice))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(constraint.grammar)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ProtocolError(f"{PARAM_PREFIX}.{kind}: {clean_message(exc)}", f"{PARAM_PREFIX}.{kind}") from None
    raise ProtocolError(f"{PARAM_PREFIX}: no constraint is set", PARAM_PREFIX)


def _whitespace(constraint: StructuredOutputs) -> dict:
    """vLLM's default lets the model put whitespace where JSON allows it; without it (its
    disable_any_whitespace), JSON is compact: "," and ":" with no space, as vLLM passes xgrammar."""
    if constraint.disable_any_whitespace:
        return {"any_whitespace": False, "separators": (",", ":")}
    return {"any_whitespace": True}


def validate_constraint(constraint: StructuredOutputs) -> None:
    """validate() plus a parse by xgrammar: what the gateway runs to answer 400 early."""
    build_grammar(constraint.validate())


def choice_ebnf(choices: tuple[str, ...]) -> str:
    """An EBNF alternation matching exactly one of `choices`. JSON string syntax is a subset of
    what xgrammar's EBNF literals accept (\\" \\\\ \\n \\uXXXX), so json.dumps escapes each one."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def clean_message(exc: BaseException) -> str:
    """xgrammar's error text without its timestamp, source location and check expression."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return _LOCATION.sub("", lines[0] if lines else type(exc).__name__)[:500]
