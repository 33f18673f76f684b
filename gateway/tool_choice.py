"""What a chat request's ``tools`` and ``tool_choice`` ask of generation and of the reply.

:func:`tool_policy` decides it once per request, before anything reaches the bus, as vLLM's
``check_tool_usage`` does: "none" leaves the text alone; "auto" (the default when tools are given)
needs ``--enable-auto-tool-choice`` and reads ``<tool_call>`` blocks out of free text; "required"
and a named function put a JSON schema on generation (``tool_calls.structured_outputs_for_tool_choice``)
and read the constrained text back as calls. Each choice of the reply gets its own parser.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.tool_calls import ParsedToolCalls, parse_tool_calls, structured_outputs_for_tool_choice
from gateway.tool_parsers import HermesToolParser, NamedToolParser, RequiredToolParser, read_all
from shared.codec import ProtocolError
from shared.structured import StructuredOutputs

TOOL_CALL_PARSERS = ("hermes",)
MODES = ("none", "auto", "required", "named")

ToolParser = HermesToolParser | RequiredToolParser | NamedToolParser


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolPolicy:
    """How one chat request uses its tools: ``mode`` is one of MODES (``name``: the function a
    named choice forces), ``constraint`` what a forced call puts on generation."""

    mode: str = "none"
    name: str | None = None
    constraint: StructuredOutputs | None = None

    @property
    def reads_calls(self) -> bool:
        return self.mode != "none"

    def parser(self) -> ToolParser:
        """A fresh streaming parser for one choice (mode "none" has none to give)."""
        if self.mode == "auto":
            return HermesToolParser()
        if self.mode == "required":
            return RequiredToolParser()
        if self.mode == "named":
            return NamedToolParser(self.name)
        raise ValueError("tool_choice none reads no calls")

    def read(self, text: str) -> ParsedToolCalls:
        """A finished choice's content and calls."""
        if self.mode == "none":
            return ParsedToolCalls(content=text)
        if self.mode == "auto":
            return parse_tool_calls(text)
        return read_all(self.parser(), text)

    def finish_reason(self, reason: str | None, num_calls: int) -> str | None:
        """OpenAI's finish_reason: "tool_calls" when an auto or required choice stopped on its own
        after making calls; a named choice stops with "stop", as OpenAI's forced calls do."""
        if reason == "stop" and num_calls and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason


NO_TOOLS = ToolPolicy()


def tool_policy(tools: Sequence[Mapping[str, Any]] | None, tool_choice: str | Mapping | None,
                parallel_tool_calls: bool = True, *, tool_call_parser: str | None = None,
                disable_any_whitespace: bool = False) -> ToolPolicy:
    """The policy of a request; ProtocolError (a 400) for a choice the tools or the server cannot meet.
    ``tool_call_parser`` is set only when the server enables auto tool choice."""
    if tools is not None and len(tools) == 0:
        raise ProtocolError("`tools` must not be an empty array; give at least one tool or leave it out", "tools")
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return NO_TOOLS
    if not tools:
        raise ProtocolError("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if tool_choice == "auto":
        if tool_call_parser not in TOOL_CALL_PARSERS:
            raise ProtocolError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                                'set on the server; pass tool_choice "required", "none" or a named function',
                                "tool_choice")
        return ToolPolicy(mode="auto")
    constraint = structured_outputs_for_tool_choice(tool_choice, tools, parallel_tool_calls)
    constraint = dataclasses.replace(constraint, disable_any_whitespace=disable_any_whitespace)
    if tool_choice == "required":
        return ToolPolicy(mode="required", constraint=constraint)
    return ToolPolicy(mode="named", name=tool_choice["function"]["name"], constraint=constraint)
