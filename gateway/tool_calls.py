"""OpenAI tool calling: the calls' types, the schema that forces a call, and finding calls in a
finished text.

``tool_choice`` "required" or a named function constrains generation with a JSON schema
(:func:`structured_outputs_for_tool_choice`); the constrained text is read back by the streaming
parsers of ``gateway/tool_parsers.py`` (whole texts too, so a response and a stream carry the same
calls). ``tool_choice`` "auto" leaves the model free; its
``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks are found by
:func:`parse_tool_calls` (a finished text) or ``tool_parsers.HermesToolParser`` fed text deltas.
All use one JSON scanner (``gateway/json_scanner.py``) so they cut the same ``arguments`` text.
Pure: standard library and ``shared`` only.
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
