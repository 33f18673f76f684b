"""A character-level JSON syntax check that knows where the members of its top-level object lie.

The Hermes tool-call parser (gateway/tool_calls.py) feeds it the text of one ``<tool_call>`` block
as it streams in: it learns a call's name the moment that string closes, streams the
``arguments`` text while it grows, and notices broken JSON at the first bad character. Pure.
"""

from __future__ import annotations

import json
import re
from typing import Any

ARGUMENT_KEYS = ("arguments", "parameters")  # Hermes models write the first; some the second

_VALUE, _ARRAY_FIRST, _KEY_FIRST, _KEY, _COLON, _AFTER, _STRING, _ESCAPE, _UNICODE, _TOKEN = range(10)
_TOKEN_CHARS = frozenset("0123456789+-.eEtrufalsn")
_TOKEN_RE = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?|true|false|null")


class JsonScanner:
    """Checks, character by character, that its text begins one JSON object, and records where each
    member of that object starts and ends; it stops at the character that ends the object (`done`)
    or breaks the syntax (`error`), without consuming more."""

    __slots__ = ("text", "pos", "state", "stack", "done", "error", "members", "_key", "_mark", "_hex_left", "_in_key")

    def __init__(self):
        self.text = ""
        self.pos = 0
        self.state = _VALUE
        self.stack: list[str] = []
        self.done = self.error = False
        self.members: dict[str, list[int | None]] = {}  # key -> [start, end or None]
        self._key: str | None = None
        self._mark = 0  # where the current string or token began
        self._hex_left = 0
        self._in_key = False

    def feed(self, chunk: str) -> int:
        """Scan `chunk`; the number of its characters that belong to the object (all unless it stopped)."""
        begin = len(self.text)
        self.text += chunk
        while self.pos < len(self.text) and not (self.done or self.error):
            if self._step(self.text[self.pos]):
                self.pos += 1
        if self.done or self.error:
            self.text = self.text[:self.pos]
        return self.pos - begin

    def member(self, key: str) -> Any:
        """The decoded value of a finished top-level member, else None."""
        span = self.members.get(key)
        return None if span is None or span[1] is None else json.loads(self.text[span[0]:span[1]])

    def arguments(self, partial: bool = False) -> str | None:
        """The arguments' JSON text (a string value is decoded); with `partial`, as far as scanned."""
        key = next((k for k in ARGUMENT_KEYS if k in self.members), None)
        if key is None:
            return None
        start, end = self.members[key]
        if self.text[start] == '"':
            return None if end is None else json.loads(self.text[start:end])
        if end is None and not partial:
            return None
        return self.text[start:self.pos if end is None else end]

    def _step(self, c: str) -> bool:  # noqa: C901 (one branch per state reads best as a table)
        """Advance over `c`; False when `c` must be scanned again in the new state (after a token)."""
        state = self.state
        if state == _STRING:
            if c == "\\":
                self.state = _ESCAPE
            elif c == '"':
                self._end_string()
            elif c < " ":
                self.error = True
        elif state == _ESCAPE:
            if c == "u":
                self.state, self._hex_left = _UNICODE, 4
            elif c in '"\\/bfnrt':
                self.state = _STRING
            else:
                self.error = True
        elif state == _UNICODE:
            if c not in "0123456789abcdefABCDEF":
                self.error = True
            self._hex_left -= 1
            if self._hex_left == 0:
                self.state = _STRING
        elif state == _TOKEN:
            if c in _TOKEN_CHARS:
                return True
            if not _TOKEN_RE.fullmatch(self.text, self._mark, self.pos):
                self.error = True
                return True
            self._end_value(self.pos)
            return False
        elif c in " \t\n\r":
            pass
        elif state in (_VALUE, _ARRAY_FIRST):
            if state == _ARRAY_FIRST and c == "]":
                self.stack.pop()
                self._end_value(self.pos + 1)
            elif not self.stack and c != "{":
                self.error = True  # a call is an object
            elif c in "{[\"" or c in "-0123456789tfn":
                self._start_value(c)
            else:
                self.error = True
        elif state in (_KEY_FIRST, _KEY) and c == '"':
            self.state, self._mark, self._in_key = _STRING, self.pos, True
        elif state == _KEY_FIRST and c == "}":
            self.stack.pop()
            self._end_value(self.pos + 1)
        elif state == _COLON and c == ":":
            self.state = _VALUE
        elif state == _AFTER and c == ",":
            self.state = _KEY if self.stack[-1] == "{" else _VALUE
        elif state == _AFTER and c == {"{": "}", "[": "]"}[self.stack[-1]]:
            self.stack.pop()
            self._end_value(self.pos + 1)
        else:
            self.error = True
        return True

    def _start_value(self, c: str) -> None:
        if len(self.stack) == 1 and self._key is not None:
            self.members[self._key] = [self.pos, None]
        self._mark = self.pos
        if c in "{[":
            self.stack.append(c)
            self.state = _KEY_FIRST if c == "{" else _ARRAY_FIRST
        else:
            self.state, self._in_key = (_STRING, False) if c == '"' else (_TOKEN, False)

    def _end_string(self) -> None:
        if not self._in_key:
            self._end_value(self.pos + 1)
            return
        self._in_key = False
        self.state = _COLON
        if len(self.stack) == 1:
            self._key = json.loads(self.text[self._mark:self.pos + 1])

    def _end_value(self, end: int) -> None:
        if len(self.stack) == 1 and self._key in self.members and self.members[self._key][1] is None:
            self.members[self._key][1] = end
        if not self.stack:
            self.done = True
        else:
            self.state = _AFTER
