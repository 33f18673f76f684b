"""OpenAI tool calling: the schema that forces a call, and the Hermes parser that finds calls in text.

``tool_choice`` "required" or a named function constrains generation with a JSON schema
(:func:`structured_outputs_for_tool_choice`), and the constrained text is then read back, whole or
as it streams, by a :class:`RequiredToolParser` / :class:`NamedToolParser` (:func:`read_all` runs
one over a finished text, so a response and a stream carry the same calls).
``tool_choice`` "auto" leaves the model free; its ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
blocks are found by :func:`parse_tool_calls` (a finished text) or a :class:`HermesToolParser` fed text
deltas. All use one JSON scanner (``gateway/json_scanner.py``) so they cut the same ``arguments``
text. Pure: standard library and ``shared`` only.
"""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.json_scanner import JsonScanner
from shared.codec import ProtocolError
from shared.structured import StructuredOutputs

START, END = "<tool_call>", "</tool_call>"
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCall:
    """One complete call: `arguments` is JSON text, as OpenAI sends it."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallDelta:
    """A piece of call `index` in a stream: the first carries id and name, later ones argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        function: dict[str, str] = {"arguments": self.arguments}
        if self.id is not None:
            out.update(id=self.id, type="function")
            function = {"name": self.name or "", "arguments": self.arguments}
        out["function"] = function
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class ParsedToolCalls:
    """A finished text split into what the client reads as content and the calls it should make."""

    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamDelta:
    """What one fed text delta releases: content text and tool-call pieces (either may be empty)."""

    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()


# --------------------------------------------------------------------------- forcing a call


def structured_outputs_for_tool_choice(tool_choice: str | Mapping | None, tools: Sequence[Mapping] | None,
                                       parallel_tool_calls: bool = True) -> StructuredOutputs | None:
    """The constraint that `tool_choice` puts on generation: None for "auto" / "none" / no tools."""
    if not tools or tool_choice in (None, "auto", "none"):
        return None
    if tool_choice == "required":
        schema = required_tool_schema(tools, parallel_tool_calls)
    elif isinstance(tool_choice, Mapping) and isinstance(tool_choice.get("function"), Mapping):
        schema = named_tool_schema(tools, tool_choice["function"].get("name"))
    else:
        raise ProtocolError(f"unsupported tool_choice {tool_choice!r:.80}", "tool_choice")
    return StructuredOutputs(json=json.dumps(schema, ensure_ascii=False)).validate()


def required_tool_schema(tools: Sequence[Mapping], parallel_tool_calls: bool = True) -> dict[str, Any]:
    """A JSON array of one or more (one only without `parallel_tool_calls`) ``{"name": ..., "arguments":
    {...}}`` objects, each naming one of `tools` with arguments that match its parameters. Each tool's
    ``$defs`` move to the root, where its ``#/$defs/...`` references now point; a name defined
    differently by two tools is refused."""
    options, defs = [], {}
    for name, parameters in _functions(tools).items():
        for section in ("$defs", "definitions"):
            for def_name, def_schema in parameters.pop(section, {}).items():
                if defs.setdefault(section, {}).setdefault(def_name, def_schema) != def_schema:
                    raise ProtocolError(f"tools define {section}/{def_name} in two different ways", "tools")
        options.append({"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                         "arguments": parameters},
                        "required": ["name", "arguments"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return {**schema, **defs}


def named_tool_schema(tools: Sequence[Mapping], name: str | None) -> dict[str, Any]:
    """The parameters schema of the tool called `name`: the whole output is its arguments."""
    functions = _functions(tools)
    if name not in functions:
        raise ProtocolError(f"tool_choice names {name!r:.80}, which is not in tools", "tool_choice")
    return functions[name]


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


def _functions(tools: Sequence[Mapping]) -> dict[str, dict[str, Any]]:
    """name -> a private copy of its parameters schema, for every function tool."""
    out = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ProtocolError("each tool needs a function with a name", "tools")
        if function["name"] in out:
            raise ProtocolError(f"two tools are called {function['name']!r:.80}", "tools")
        parameters = function.get("parameters") or EMPTY_PARAMETERS
        if not isinstance(parameters, Mapping):
            raise ProtocolError(f"the parameters of {function['name']!r:.80} are not a JSON schema object", "tools")
        out[function["name"]] = copy.deepcopy(dict(parameters))
    return out


# --------------------------------------------------------------------------- finding calls (Hermes)


def parse_tool_calls(text: str, new_id: Callable[[], str] = new_tool_call_id) -> ParsedToolCalls:
    """Calls and content of a finished text. A block is a call only if it holds one JSON object with
    a string "name", then its end tag (or the end of the text); any other block is content from
    its start tag up to where it broke. Whitespace before a block, and at the end once there are
    calls, is dropped."""
    pieces, calls, pos = [], [], 0
    while (start := text.find(START, pos)) >= 0:
        pieces.append(text[pos:start].rstrip())
        scanner = JsonScanner()
        end = start + len(START) + scanner.feed(text[start + len(START):])
        after = text[end:].lstrip()
        name = scanner.member("name") if scanner.done else None
        if isinstance(name, str) and (after.startswith(END) or END.startswith(after)):
            calls.append(ToolCall(id=new_id(), name=name, arguments=scanner.arguments() or "{}"))
            pos = len(text) - len(after) + len(END) if after.startswith(END) else len(text)
        else:
            pieces.append(text[start:end])
            pos = end
    pieces.append(text[pos:])
    content = "".join(pieces)
    content = content.rstrip() if calls else content
    return ParsedToolCalls(content=content or None, tool_calls=tuple(calls))


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
