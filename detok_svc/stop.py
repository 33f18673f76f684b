"""Stop strings: find the first one in freshly decoded text and say where the output ends.

While streaming, the last ``max(len(stop)) - 1`` characters are held back (a stop string may
be starting there, and text sent to the client cannot be taken back). When the stop string is
kept in the output (``include_stop_str_in_output``) nothing needs holding back. No Redis here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StopMatch:
    end: int  # the output text is text[:end]
    stop: str


class StopChecker:
    """Owns one sequence's stop strings; never looks at text it has already cleared."""

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False):
        self.stop = tuple(s for s in stop if s)
        self.include = include_stop_str_in_output
        self.max_len = max((len(s) for s in self.stop), default=0)
        self.holdback = 0 if (self.include or not self.stop) else self.max_len - 1

    def check(self, text: str, num_new_chars: int) -> StopMatch | None:
        """The earliest stop string that ends inside the last ``num_new_chars`` of ``text``."""
        if not self.stop or num_new_chars <= 0:
            return None
        start = max(0, len(text) - num_new_chars - self.max_len + 1)
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            i = text.find(s, start)
            if i >= 0 and (best is None or (i, -len(s)) < (best[0], -best[1])):
                best = (i, len(s), s)
        if best is None:
            return None
        i, n, s = best
        return StopMatch(end=i + n if self.include else i, stop=s)

    def releasable(self, text: str, num_sent: int) -> int:
        """How many characters of ``text`` may be sent now (``num_sent`` already were)."""
        return max(num_sent, len(text) - self.holdback)
