"""Structured outputs in the engine: grammars (built from constraints by ``shared/grammar.py``)
compiled and cached per tokenizer (`cache`), and followed token by token per sequence (`matcher`).

The names below load on first use (PEP 562), so importing a sibling module that needs none of them
does not import xgrammar, and with it torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "GrammarCache": "cache", "make_tokenizer_info": "cache",
    "Matcher": "matcher", "allocate_bitmask": "matcher", "apply_bitmask": "matcher",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
