"""The engine's side of structured outputs: compile each constraint once, start a matcher per sequence."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from shared.structured import StructuredOutputs


class GrammarManager:
    """Owns the engine's GrammarCache, built on the first constrained request from the model's
    tokenizer (xgrammar is imported only then), and hands out one Matcher per constrained
    sequence once its grammar is compiled. Compiles run on the cache's worker thread: ``start``
    answers None until then, so a step never waits for one."""

    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int, stop_token_ids: Sequence[int],
                 max_entries: int = 256):
        self.load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.max_entries = max_entries
        self._cache = None

    @property
    def cache(self):
        if self._cache is None:
            from engine_svc.structured.cache import GrammarCache

            self._cache = GrammarCache.from_tokenizer(self.load_tokenizer(), self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids or None,
                                                      max_entries=self.max_entries)
        return self._cache

    def submit(self, constraint: StructuredOutputs) -> None:
        """Start compiling (a no-op when cached or compiling)."""
        self.cache.submit(constraint)

    def start(self, constraint: StructuredOutputs):
        """A Matcher at the start of the constraint, or None while it compiles; raises the
        ProtocolError of a constraint that does not compile."""
        key = constraint.key()
        try:
            return self.cache.matcher(key)
        except KeyError:  # evicted before its request was admitted: compile again
            self.cache.submit(constraint)
            return None

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()
