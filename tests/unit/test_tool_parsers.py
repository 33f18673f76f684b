"""Tool calling: the Hermes parser (whole texts and streams split anywhere), the JSON scanner under it,
and the schemas that force a call, checked with jsonschema and driven through the real xgrammar."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import random
import re

import pytest

from gateway.json_scanner import JsonScanner
from gateway.tool_calls import (
    ParsedToolCalls, StreamDelta, ToolCall, ToolCallDelta, new_tool_call_id, named_tool_schema, parse_tool_calls,
    required_tool_schema, structured_outputs_for_tool_choice,
)
from gateway.tool_parsers import HermesToolParser, tool_call_from_named, tool_calls_from_required
from shared.codec import ProtocolError
from tests.fixtures.schemas import SCHEMAS

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": SCHEMAS["tool_arguments"]}}
ROUTE = {"type": "function", "function": {"name": "plan_route", "parameters": SCHEMAS["defs_ref"]}}
PING = {"type": "function", "function": {"name": "ping"}}  # no parameters at all
TOOLS = [WEATHER, ROUTE, PING]


def ids():
    counter = itertools.count()
    return lambda: f"chatcmpl-tool-{next(counter):032x}"


def stream(text: str, pieces: list[str] | None = None) -> tuple[str, list[ToolCallDelta]]:
    """Feed `pieces` (default: one character at a time) and return all content and call deltas."""
    parser = HermesToolParser(ids())
    deltas = [parser.feed(p) for p in (pieces if pieces is not None else list(text))] + [parser.finish()]
    assert "".join(pieces if pieces is not None else text) == text
    return "".join(d.content for d in deltas), [c for d in deltas for c in d.tool_calls]


def assemble(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """Join stream deltas into calls, checking that each call's first delta carries its id and name."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        if delta.index not in calls:
            assert delta.id is not None and delta.name and delta.index == len(calls)
            calls[delta.index] = {"id": delta.id, "name": delta.name, "arguments": ""}
        else:
            assert delta.id is None and delta.name is None
        calls[delta.index]["arguments"] += delta.arguments
    return [ToolCall(**calls[i]) for i in sorted(calls)]


def random_split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


# --------------------------------------------------------------------------- whole texts

CALL_A = '{"name": "get_weather", "arguments": {"location": "Paris, \\"FR\\"", "unit": "celsius", "days": 3}}'
CALL_B = '{"arguments": {"start": {"x": 1, "y": 2}, "path": [{"x": 3, "y": 4}]}, "name": "plan_route"}'

WELL_FORMED = {
    "plain": ("Just text, no calls.\n", "Just text, no calls.\n", []),
    "one": (f"<tool_call>\n{CALL_A}\n</tool_call>", None,
            [("get_weather", '{"location": "Paris, \\"FR\\"", "unit": "celsius", "days": 3}')]),
    "two_with_content": (f"Let me check.\n\n<tool_call>{CALL_A}</tool_call>\n<tool_call>\n{CALL_B}\n</tool_call>\n",
                         "Let me check.",
                         [("get_weather", '{"location": "Paris, \\"FR\\"", "unit": "celsius", "days": 3}'),
                          ("plan_route", '{"start": {"x": 1, "y": 2}, "path": [{"x": 3, "y": 4}]}')]),
    "content_after": (f"<tool_call>{CALL_A}</tool_call>\nDone, and <tools> are fine.\n",
                      "\nDone, and <tools> are fine.", [("get_weather", json.loads(CALL_A)["arguments"])]),
    "no_arguments": ('<tool_call>{"name": "ping"}</tool_call>', None, [("ping", "{}")]),
    "parameters_key": ('<tool_call>{"name": "ping", "parameters": {"n": -1.5e-3, "ok": [true, false, null]}}'
                       "</tool_call>", None, [("ping", '{"n": -1.5e-3, "ok": [true, false, null]}')]),
    "string_arguments": ('<tool_call>{"name": "ping", "arguments": "{\\"n\\": 1}"}</tool_call>', None,
                         [("ping", '{"n": 1}')]),
    "unicode": ('<tool_call>{"name": "ping", "arguments": {"s": "é中\\u00e9 </tool_call>"}}</tool_call>', None,
                [("ping", '{"s": "é中\\u00e9 </tool_call>"}')]),
    "no_end_tag": (f"<tool_call>{CALL_A}", None, [("get_weather", json.loads(CALL_A)["arguments"])]),
    "cut_end_tag": (f"<tool_call>{CALL_A}\n</tool_", None, [("get_weather", json.loads(CALL_A)["arguments"])]),
    "early_malformed": ("Hi <tool_call>not json</tool_call> bye", "Hi<tool_call>not json</tool_call> bye", []),
    "no_name": ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    "name_not_string": ('<tool_call>{"name": 3, "arguments": {}}</tool_call>',
                        '<tool_call>{"name": 3, "arguments": {}}</tool_call>', []),
    "malformed_then_good": (f'<tool_call>{{"name" 1}}</tool_call>\n<tool_call>{CALL_A}</tool_call>',
                            '<tool_call>{"name" 1}</tool_call>', [("get_weather", json.loads(CALL_A)["arguments"])]),
    "partial_start_at_end": ("The tag is <tool_c", "The tag is <tool_c", []),
}


@pytest.mark.parametrize("name", sorted(WELL_FORMED))
def test_parse_tool_calls(name):
    text, content, calls = WELL_FORMED[name]
    parsed = parse_tool_calls(text, ids())
    assert parsed.content == content
    assert [c.name for c in parsed.tool_calls] == [n for n, _ in calls]
    for call, (_, arguments) in zip(parsed.tool_calls, calls):
        if isinstance(arguments, str):
            assert call.arguments == arguments
        else:
            assert json.loads(call.arguments) == arguments
    assert [c.id for c in parsed.tool_calls] == [f"chatcmpl-tool-{i:032x}" for i in range(len(calls))]


@pytest.mark.parametrize("name", sorted(WELL_FORMED))
def test_streaming_agrees_with_the_whole_text_however_it_is_split(name):
    text = WELL_FORMED[name][0]
    expected = parse_tool_calls(text, ids())
    splits = [list(text), [text]] + [random_split(text, random.Random(seed)) for seed in range(20)]
    for pieces in splits:
        content, deltas = stream(text, pieces)
        assert (content or None) == expected.content
        assert assemble(deltas) == list(expected.tool_calls)


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "f", "arguments": {"a": 1,}}</tool_call>',  # trailing comma
    '<tool_call>{"name": "f", "arguments": {"a": tru}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"a": 01}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"a": "x\ny"}}</tool_call>',  # raw newline in a string
    '<tool_call>{"name": "f", "arguments": {}} trailing words</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"a": [1}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"a": 1}',  # cut off by max_tokens
])
def test_malformed_json_is_left_as_content(text):
    assert parse_tool_calls(text) == ParsedToolCalls(content=text, tool_calls=())


def test_a_stream_cannot_take_back_a_sent_name():
    """The documented difference: once a name went out the call stays, with the arguments sent."""
    text = '<tool_call>{"name": "f", "arguments": {"a": 1,}}</tool_call>'
    content, deltas = stream(text)
    assert assemble(deltas)[0].arguments == '{"a": 1,' and content == "}</tool_call>"


def test_stream_sends_name_first_then_arguments_as_they_grow():
    parser = HermesToolParser(ids())
    assert parser.feed("Sure. <tool") == StreamDelta(content="Sure.")  # " <tool" held: it may be a tag
    assert parser.feed('_call>{"name": "get_wea') == StreamDelta()
    first = parser.feed('ther", "arguments": {"location": "Pa')
    assert first.tool_calls == (ToolCallDelta(index=0, id="chatcmpl-tool-" + "0" * 32, name="get_weather",
                                              arguments='{"location": "Pa'),)
    assert parser.feed('ris"').tool_calls == (ToolCallDelta(index=0, arguments='ris"'),)
    assert parser.feed(', "unit": "celsius"}').tool_calls == (ToolCallDelta(index=0, arguments=', "unit": "celsius"}'),)
    assert parser.feed("}\n</tool_").tool_calls == ()  # the outer brace is not an argument
    assert parser.feed("call>\n<tool_call>") == StreamDelta()
    second = parser.feed('{"name": "ping"}</tool_call>')
    assert [(d.index, d.name, d.arguments) for d in second.tool_calls] == [(1, "ping", "{}")]
    assert parser.finish() == StreamDelta() and parser.num_calls == 2


def test_tool_call_ids_and_openai_shapes():
    a, b = new_tool_call_id(), new_tool_call_id()
    assert a != b and re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", a)
    call = ToolCall(id="x", name="f", arguments="{}")
    assert call.to_openai() == {"id": "x", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert ToolCallDelta(index=1, id="x", name="f").to_openai() == {
        "index": 1, "id": "x", "type": "function", "function": {"name": "f", "arguments": ""}}
    assert ToolCallDelta(index=1, arguments='{"a"').to_openai() == {"index": 1, "function": {"arguments": '{"a"'}}


@pytest.mark.parametrize("text, done, error", [
    ('{"a": [1, -2.5E+3, {"b": null}], "c": "\\u00e9\\n"} rest', True, False),
    ('{"a": 1', False, False),
    ('{"a" 1}', False, True),
    ('{"a": 1 "b": 2}', False, True),
    ('[1]', False, True),  # a call must be an object
    ('{"a": "\\x"}', False, True),
    ('{"a": "\\u12g4"}', False, True),
    ('{"a": [1,]}', False, True),
    ('{"a": -}', False, True),
    ('{,}', False, True),
])
def test_json_scanner(text, done, error):
    scanner = JsonScanner()
    consumed = sum(scanner.feed(c) for c in text)
    assert (scanner.done, scanner.error) == (done, error)
    if done:
        assert text[consumed:] == " rest" and json.loads(scanner.text) == json.loads(text[:consumed])
        assert scanner.member("a") == [1, -2500.0, {"b": None}] and scanner.member("c") == "é\n"


# --------------------------------------------------------------------------- forcing a call


def test_required_schema_accepts_calls_and_refuses_the_rest():
    schema = required_tool_schema(TOOLS)
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [{"name": "get_weather", "arguments": {"location": "Oslo", "unit": "celsius"}},
            {"name": "plan_route", "arguments": {"start": {"x": 1, "y": 2}, "path": []}},
            {"name": "ping", "arguments": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "nope", "arguments": {}}], [{"name": "get_weather", "arguments": {"unit": "kelvin"}}],
                [{"name": "plan_route", "arguments": {"start": {"x": 10, "y": 0}, "path": []}}],  # through $ref
                [{"name": "ping"}], [{"name": "ping", "arguments": {}, "extra": 1}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert "point" in schema["$defs"] and '"$defs":' not in json.dumps(schema["items"])  # where #/$defs points
    single = required_tool_schema(TOOLS, parallel_tool_calls=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good[:2], single)
    jsonschema.validate(good[:1], single)


def test_required_schema_leaves_tools_alone_and_refuses_conflicting_defs():
    before = copy.deepcopy(TOOLS)
    required_tool_schema(TOOLS)
    assert TOOLS == before
    other = copy.deepcopy(ROUTE)
    other["function"]["name"] = "other_route"
    other["function"]["parameters"]["$defs"]["point"]["properties"]["x"]["maximum"] = 99
    with pytest.raises(ProtocolError) as info:
        required_tool_schema([ROUTE, other])
    assert info.value.param == "tools"
    same = copy.deepcopy(ROUTE)
    same["function"]["name"] = "same_route"
    required_tool_schema([ROUTE, same])  # equal definitions may be shared


def test_named_schema_and_tool_choice():
    assert named_tool_schema(TOOLS, "get_weather") == SCHEMAS["tool_arguments"]
    assert named_tool_schema(TOOLS, "ping") == {"type": "object", "properties": {}}
    with pytest.raises(ProtocolError) as info:
        named_tool_schema(TOOLS, "missing")
    assert info.value.param == "tool_choice"
    for choice in ("auto", "none", None):
        assert structured_outputs_for_tool_choice(choice, TOOLS) is None
    assert structured_outputs_for_tool_choice("required", []) is None
    required = structured_outputs_for_tool_choice("required", TOOLS, parallel_tool_calls=False)
    assert json.loads(required.json) == required_tool_schema(TOOLS, parallel_tool_calls=False)
    named = structured_outputs_for_tool_choice({"type": "function", "function": {"name": "get_weather"}}, TOOLS)
    assert json.loads(named.json) == SCHEMAS["tool_arguments"]
    with pytest.raises(ProtocolError):
        structured_outputs_for_tool_choice("sometimes", TOOLS)
    with pytest.raises(ProtocolError):
        structured_outputs_for_tool_choice("required", [{"type": "function"}])
    with pytest.raises(ProtocolError):
        structured_outputs_for_tool_choice("required", [PING, PING])


def test_reading_back_constrained_output():
    text = ('[{"name": "get_weather", "arguments": {"location": "Oslo", "unit": "celsius"}}, '
            '{"name": "ping", "arguments": {}}]')
    calls = tool_calls_from_required(text, ids())
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"location": "Oslo", "unit": "celsius"}), ("ping", {})]
    assert tool_call_from_named("ping", ' {"n": 1} ', ids()).arguments == '{"n": 1}'
    with pytest.raises(ValueError):
        tool_calls_from_required('{"name": "ping"}')


# --------------------------------------------------------------------------- the real grammar


@pytest.fixture(scope="module")
def cache():
    pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    from engine_svc.structured import GrammarCache
    from shared.models import ModelNotFoundError, default_model_dir

    try:
        tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    except ModelNotFoundError as exc:
        pytest.skip(f"default model absent: {exc}")
    cache = GrammarCache.from_tokenizer(tokenizer, 49152)
    yield cache, tokenizer
    cache.close()


def generate(cache, tokenizer, constraint, seed: int) -> str:
    import torch

    from engine_svc.structured import allocate_bitmask

    constraint = dataclasses.replace(constraint, disable_any_whitespace=True)  # so a random walk ends
    cache.submit(constraint).result(timeout=30)
    matcher = cache.matcher(constraint.key())
    bitmask, rng, token_ids = allocate_bitmask(1, 49152), random.Random(seed), []
    shifts = torch.arange(32, dtype=torch.int32)
    while not matcher.is_terminated():
        assert len(token_ids) < 600
        matcher.fill_bitmask(bitmask, 0)
        allowed = ((bitmask[0].unsqueeze(-1) >> shifts) & 1).flatten()[:49152].nonzero().flatten().tolist()
        closing = [t for t in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("]")) if t in allowed]
        token_ids.append(closing[0] if closing and rng.random() < 0.3 else rng.choice(allowed))
        assert matcher.accept(token_ids[-1])
    return tokenizer.decode(token_ids[:-1])


def test_generation_under_required_choice_gives_valid_calls(cache):
    cache, tokenizer = cache
    constraint = structured_outputs_for_tool_choice("required", TOOLS)
    parameters = {t["function"]["name"]: t["function"].get("parameters", {}) for t in TOOLS}
    names = set()
    for seed in range(12):
        text = generate(cache, tokenizer, constraint, seed)
        jsonschema.validate(json.loads(text, strict=False), required_tool_schema(TOOLS))
        for call in tool_calls_from_required(text):
            jsonschema.validate(json.loads(call.arguments, strict=False), parameters[call.name])
            names.add(call.name)
    assert len(names) >= 2


def test_generation_under_a_named_function_gives_its_arguments(cache):
    cache, tokenizer = cache
    choice = {"type": "function", "function": {"name": "plan_route"}}
    constraint = structured_outputs_for_tool_choice(choice, TOOLS)
    for seed in range(5):
        call = tool_call_from_named("plan_route", generate(cache, tokenizer, constraint, seed))
        jsonschema.validate(json.loads(call.arguments), SCHEMAS["defs_ref"])
