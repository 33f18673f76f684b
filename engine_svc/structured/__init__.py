"""Structured outputs in the engine: grammars built from constraints (`grammar`), compiled and cached
per tokenizer (`cache`), and followed token by token per sequence (`matcher`)."""

from engine_svc.structured.cache import GrammarCache, make_tokenizer_info
from engine_svc.structured.grammar import build_grammar, choice_ebnf, validate_constraint
from engine_svc.structured.matcher import Matcher, allocate_bitmask, apply_bitmask

__all__ = ["GrammarCache", "Matcher", "allocate_bitmask", "apply_bitmask", "build_grammar", "choice_ebnf",
           "make_tokenizer_info", "validate_constraint"]
