"""Streaming tool-call parsers: text deltas in, content and OpenAI tool-call deltas out.

:class:`HermesToolParser` finds ``<tool_call>`` blocks in free text (tool_choice "auto");
:class:`RequiredToolParser` and :class:`NamedToolParser` read the text a forced call's schema
produced (tool_choice "required" / a named function); :func:`read_all` runs any of them over a
finished text. Pure: standard library and ``gateway.tool_calls`` / ``gateway.json_scanner`` only.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from gateway.json_scanner import JsonScanner
from gateway.tool_calls import (END, START, ParsedToolCalls, StreamDelta, ToolCall, ToolCallDelta,
                                new_tool_call_id)


class _CallStream:
    """What every streaming parser shares: the id source, the number of calls begun, and how a
    call's block releases its id and name (once the name string closes), then its arguments."""

    def __init__(self, new_id: Callable[[], str]):
        self._new_id = new_id
        self.num_calls = 0

    def _send_progress(self, block: _Block, out: _Collector) -> None:
        scanner = block.scanner
        if block.index is None:
            name = scanner.member("name")
            if not isinstance(name, str):
                return
            block.index, self.num_calls = self.num_calls, self.num_calls + 1
            out.call(ToolCallDelta(index=block.index, id=self._new_id(), name=name))
        arguments = scanner.arguments(partial=True)
        if arguments is None and scanner.done:
            arguments = "{}"
        if arguments and len(arguments) > block.num_sent:
            out.call(ToolCallDelta(index=block.index, arguments=arguments[block.num_sent:]))
            block.num_sent = len(arguments)


class HermesToolParser(_CallStream):
    """Owns the streaming state of one choice: the outside text it holds back (trailing whitespace,
    a possible partial ``<tool_call>``) and the block being read; it releases content and call
    pieces as soon as they are certain, and each call's id and name before its arguments.

    Agrees with parse_tool_calls on well-formed blocks and on blocks that break before their name
    is read (they become content). A block that breaks after its name was sent cannot be taken
    back: that call ends with the arguments sent so far and the rest of the block is content,
    where parse_tool_calls would make the whole block content.
    """

    def __init__(self, new_id: Callable[[], str] = new_tool_call_id):
        super().__init__(new_id)
        self._held = ""
        self._block: _Block | None = None

    def feed(self, text: str) -> StreamDelta:
        out = _Collector()
        while text:
            text = self._feed_block(text, out) if self._block else self._feed_outside(text, out)
        return out.delta()

    def finish(self) -> StreamDelta:
        """Release what is held once generation ends; an unclosed block whose name was sent stays a call."""
        out = _Collector()
        block, self._block = self._block, None
        text = START + block.scanner.text if block is not None and block.index is None else ""
        text += self._held
        self._held = ""
        out.content(text.rstrip() if self.num_calls else text)
        return out.delta()

    def _feed_outside(self, text: str, out: _Collector) -> str:
        text = self._held + text
        start = text.find(START)
        if start >= 0:
            out.content(text[:start].rstrip())
            self._held, self._block = "", _Block()
            return text[start + len(START):]
        keep = next((n for n in range(min(len(START) - 1, len(text)), 0, -1) if START.startswith(text[-n:])), 0)
        head = text[:len(text) - keep]
        out.content(head.rstrip())
        self._held = head[len(head.rstrip()):] + text[len(head):]
        return ""

    def _feed_block(self, text: str, out: _Collector) -> str:
        block = self._block
        scanner = block.scanner
        if not scanner.done:
            consumed = scanner.feed(text)
            rest = text[consumed:]
            if scanner.error or (scanner.done and not isinstance(scanner.member("name"), str)):
                return self._break_block(out, rest)
            self._send_progress(block, out)
            return rest
        block.tail += text
        after = block.tail.lstrip()
        if after.startswith(END):
            self._block = None
            return after[len(END):]
        if END.startswith(after):
            return ""  # the end tag may still be coming
        self._block = None
        return block.tail

    def _break_block(self, out: _Collector, rest: str) -> str:
        block, self._block = self._block, None
        if block.index is None:
            out.content(START + block.scanner.text)
        return rest



# --------------------------------------------------------------------------- reading forced calls

_OPEN, _ITEM, _AFTER, _CLOSED, _CONTENT = range(5)  # where a RequiredToolParser stands in its array


class RequiredToolParser(_CallStream):
    """Owns the streaming state of one choice generated under required_tool_schema: where it stands
    in the array (before ``[``, before an item, after one, after ``]``) and the item being read. Each
    item's id and name go out once its name closes, its arguments as they grow. Text the array's
    grammar does not allow (only a client's own constraint-free text could hold it) is content,
    from the first such character on."""

    def __init__(self, new_id: Callable[[], str] = new_tool_call_id):
        super().__init__(new_id)
        self._state = _OPEN
        self._block: _Block | None = None

    @property
    def is_complete(self) -> bool:
        return self._state == _CLOSED

    def feed(self, text: str) -> StreamDelta:
        out = _Collector()
        while text:
            text = self._feed_item(text, out) if self._block else self._feed_between(text, out)
        return out.delta()

    def finish(self) -> StreamDelta:
        """Nothing is held back between items; a call cut short ends with the arguments sent so far."""
        self._block = None
        return StreamDelta()

    def _feed_between(self, text: str, out: _Collector) -> str:
        rest = text.lstrip()
        if not rest:
            return ""
        c, state = rest[0], self._state
        if state == _OPEN and c == "[":
            self._state = _ITEM
        elif state == _ITEM and c == "{":
            self._block = _Block()
            return rest  # the item's scanner reads its own "{"
        elif state == _AFTER and c in ",]":
            self._state = _ITEM if c == "," else _CLOSED
        else:
            self._state = _CONTENT
            out.content(text if state == _CONTENT else rest)
            return ""
        return rest[1:]

    def _feed_item(self, text: str, out: _Collector) -> str:
        block = self._block
        consumed = block.scanner.feed(text)
        if block.scanner.error or (block.scanner.done and not isinstance(block.scanner.member("name"), str)):
            self._block, self._state = None, _CONTENT
            out.content(("" if block.index is not None else block.scanner.text) + text[consumed:])
            return ""
        self._send_progress(block, out)
        if block.scanner.done:
            self._block, self._state = None, _AFTER
        return text[consumed:]


class NamedToolParser:
    """Owns the streaming state of one choice generated under named_tool_schema: the whole text is
    the arguments of one call to `name`. The call's id and name go out with the first feed, the
    text as it comes, less whitespace before it and (held back until more text follows) after it."""

    def __init__(self, name: str, new_id: Callable[[], str] = new_tool_call_id):
        self.name = name
        self._new_id = new_id
        self._held = ""
        self._num_sent = 0
        self.num_calls = 0

    def feed(self, text: str) -> StreamDelta:
        out = _Collector()
        if self.num_calls == 0:
            self.num_calls = 1
            out.call(ToolCallDelta(index=0, id=self._new_id(), name=self.name))
        text = self._held + text
        if not self._num_sent:
            text = text.lstrip()
        body = text.rstrip()
        self._held = text[len(body):]
        if body:
            out.call(ToolCallDelta(index=0, arguments=body))
            self._num_sent += len(body)
        return out.delta()

    def finish(self) -> StreamDelta:
        self._held = ""
        return StreamDelta()


def read_all(parser: RequiredToolParser | NamedToolParser | HermesToolParser, text: str) -> ParsedToolCalls:
    """A finished text through a fresh streaming parser: the content and the calls its deltas add up to."""
    deltas = (parser.feed(text), parser.finish())
    calls: dict[int, dict[str, str]] = {}
    for piece in (c for d in deltas for c in d.tool_calls):
        call = calls.setdefault(piece.index, {"id": piece.id or "", "name": piece.name or "", "arguments": ""})
        call["arguments"] += piece.arguments
    content = "".join(d.content for d in deltas)
    return ParsedToolCalls(content=content or None,
                           tool_calls=tuple(ToolCall(**calls[i]) for i in sorted(calls)))


class _Block:
    """The block being read: its scanner, the call index once its name was sent, the argument
    characters sent, and the text after its object while waiting for the end tag."""

    __slots__ = ("scanner", "index", "num_sent", "tail")

    def __init__(self):
        self.scanner = JsonScanner()
        self.index: int | None = None
        self.num_sent = 0
        self.tail = ""


class _Collector:
    """Gathers one feed's output, merging consecutive pieces of the same call."""

    def __init__(self):
        self.texts: list[str] = []
        self.calls: list[ToolCallDelta] = []

    def content(self, text: str) -> None:
        if text:
            self.texts.append(text)

    def call(self, delta: ToolCallDelta) -> None:
        last = self.calls[-1] if self.calls else None
        if last is not None and last.index == delta.index and delta.id is None:
            self.calls[-1] = ToolCallDelta(index=last.index, id=last.id, name=last.name,
                                           arguments=last.arguments + delta.arguments)
        else:
            self.calls.append(delta)

    def delta(self) -> StreamDelta:
        return StreamDelta(content="".join(self.texts), tool_calls=tuple(self.calls))


def tool_calls_from_required(text: str, new_id: Callable[[], str] = new_tool_call_id) -> tuple[ToolCall, ...]:
    """The calls in text generated under required_tool_schema, arguments as generated; ValueError if
    it is not a whole JSON array of ``{"name": ..., "arguments": ...}`` objects."""
    parser = RequiredToolParser(new_id)
    parsed = read_all(parser, text)
    if parsed.content is not None or not parser.is_complete:
        raise ValueError("expected a JSON array of {name, arguments} objects")
    return parsed.tool_calls


def tool_call_from_named(name: str, text: str, new_id: Callable[[], str] = new_tool_call_id) -> ToolCall:
    """The call of text generated under named_tool_schema (its arguments, as generated)."""
    json.loads(text)  # a ValueError here means the constraint was not applied
    return read_all(NamedToolParser(name, new_id), text).tool_calls[0]
