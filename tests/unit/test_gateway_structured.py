"""Structured outputs and tool calling at the gateway: request bodies -> constraints and tool
policies, 400s that name the client's field, and replies (whole and streamed) read by the official
openai client -- over the in-memory bus of test_gateway_flow, no Redis, no model."""

from __future__ import annotations

import json
import random

import openai
import pydantic
import pytest
from starlette.testclient import TestClient

from gateway.openai_protocol.request_bodies import ChatCompletionRequest, CompletionRequest, ServerOptions
from gateway.tool_calls import required_tool_schema
from gateway.tool_parsers import NamedToolParser, RequiredToolParser, read_all, tool_calls_from_required
from shared.protocol import (ChatMessage, ErrorInfo, FinishReason, GenerateRequest, ProtocolError, RequestOutput,
                             ToolCallMessage, Usage)
from tests.fixtures.schemas import SCHEMAS
from tests.unit.test_gateway_flow import make_client, sse_events  # noqa: F401 (make_client: a fixture)

# strict: the openai client's parse() and stream() helpers parse only strict tools' arguments
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": SCHEMAS["tool_arguments"], "strict": True}}
PING = {"type": "function", "function": {"name": "ping", "strict": True}}
TOOLS = [WEATHER, PING]
USER = [{"role": "user", "content": "hi"}]
AUTO = ServerOptions(tool_call_parser="hermes")


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate_json(json.dumps({"messages": USER, **fields}))


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate_json(json.dumps({"prompt": "hi", **fields}))


# --------------------------------------------------------------------------- requests -> constraints


def test_response_format_and_structured_outputs_become_one_constraint():
    schema = SCHEMAS["person"]
    named = chat(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}})
    assert json.loads(named.sampling_params().structured_outputs.json) == schema
    assert list(json.loads(named.sampling_params().structured_outputs.json)) == list(schema)  # order kept
    assert chat(response_format={"type": "json_object"}).sampling_params().structured_outputs.json_object
    assert chat(response_format={"type": "text"}).sampling_params().structured_outputs is None
    for fields, kind, value in [({"json": schema}, "json", json.dumps(schema)),
                                ({"json": '{"type": "integer"}'}, "json", '{"type": "integer"}'),
                                ({"regex": "[a-z]+"}, "regex", "[a-z]+"),
                                ({"choice": ["yes", "no"]}, "choice", ("yes", "no")),
                                ({"grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"'),
                                ({"json_object": True}, "json_object", True)]:
        for request in (completion(structured_outputs=fields), chat(structured_outputs=fields)):
            constraint = request.sampling_params().structured_outputs
            assert (constraint.kind, getattr(constraint, kind)) == (kind, value)
            assert not constraint.disable_any_whitespace
    server = ServerOptions(disable_any_whitespace=True)
    assert completion(response_format={"type": "json_object"}).sampling_params(server).structured_outputs \
        .disable_any_whitespace
    assert chat(structured_outputs={"regex": "a", "disable_any_whitespace": True}).sampling_params() \
        .structured_outputs.disable_any_whitespace


@pytest.mark.parametrize("fields, param", [
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": "3"}}, "structured_outputs.json"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": " "}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": ""}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
])
def test_bad_constraints_name_the_field_the_client_used(fields, param):
    for request in (completion, chat):
        with pytest.raises(ProtocolError) as info:
            request(**fields).sampling_params()
        assert info.value.param == param


def test_unknown_response_format_is_a_400_naming_it(make_client):
    client, _ = make_client(lambda r: [])
    resp = client.post("/v1/chat/completions", json={"messages": USER, "response_format": {"type": "structural_tag"}})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "response_format.type"


# --------------------------------------------------------------------------- tool choice


def test_tool_policy_follows_vllm():
    assert chat().tool_policy().mode == "none"
    assert chat(tools=TOOLS, tool_choice="none").tool_policy().mode == "none"
    assert chat(tools=TOOLS).tool_policy(AUTO).mode == "auto"  # the default with tools
    required = chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False).tool_policy()
    assert json.loads(required.constraint.json) == required_tool_schema(TOOLS, parallel_tool_calls=False)
    named = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}).tool_policy()
    assert (named.mode, named.name, json.loads(named.constraint.json)) == ("named", "get_weather",
                                                                             SCHEMAS["tool_arguments"])
    server = ServerOptions(disable_any_whitespace=True)
    assert chat(tools=TOOLS, tool_choice="required").tool_policy(server).constraint.disable_any_whitespace
    request = chat(tools=TOOLS, tool_choice="required")
    assert request.sampling_params(tools=request.tool_policy()).structured_outputs == request.tool_policy().constraint
    assert json.loads(request.tools_json()) == TOOLS
    assert chat().tools_json() is None


@pytest.mark.parametrize("fields, options, param", [
    ({"tools": TOOLS}, ServerOptions(), "tool_choice"),  # "auto" without --enable-auto-tool-choice
    ({"tools": TOOLS, "tool_choice": "auto"}, ServerOptions(), "tool_choice"),
    ({"tool_choice": "required"}, AUTO, "tool_choice"),
    ({"tools": [], "tool_choice": "none"}, AUTO, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, AUTO, "tool_choice"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, AUTO, "tools"),
])
def test_bad_tool_choices_are_refused(fields, options, param):
    with pytest.raises(ProtocolError) as info:
        chat(**fields).tool_policy(options)
    assert info.value.param == param


def test_a_forced_call_and_a_response_format_do_not_mix():
    request = chat(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    with pytest.raises(ProtocolError) as info:
        request.sampling_params(tools=request.tool_policy())
    assert info.value.param == "tool_choice"
    auto = chat(tools=TOOLS, response_format={"type": "json_object"})  # auto: the format constrains the text
    assert auto.sampling_params(AUTO, auto.tool_policy(AUTO)).structured_outputs.json_object


def test_tool_messages_reach_the_wire():
    request = chat(messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"location": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    assert request.chat_messages()[1:] == (
        ChatMessage(role="assistant", tool_calls=(ToolCallMessage(id="call_1", name="get_weather",
                                                                  arguments='{"location": "Oslo"}'),)),
        ChatMessage(role="tool", content="sunny", tool_call_id="call_1"))


# --------------------------------------------------------------------------- reading forced calls


def test_forced_call_parsers_agree_with_the_whole_text_however_it_is_split():
    text = ''.join(SPLIT_CALLS).replace('{"location"', '{ "location"\n').replace(", {", " ,\n  {")
    whole = read_all(RequiredToolParser(), text)
    assert whole.content is None and [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [
        ("get_weather", {"location": "Oslo"}), ("ping", {})]
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 20)))
        parser = RequiredToolParser()
        deltas = [parser.feed(text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)])] + [parser.finish()]
        assert parser.is_complete and not "".join(d.content for d in deltas)
        pieces = [c for d in deltas for c in d.tool_calls]
        assert [p.name for p in pieces if p.id] == ["get_weather", "ping"]
        for index, call in enumerate(whole.tool_calls):
            assert "".join(p.arguments for p in pieces if p.index == index) == call.arguments
    assert read_all(RequiredToolParser(), 'no [calls]').content == "no [calls]"
    with pytest.raises(ValueError):
        tool_calls_from_required('[{"name": "ping", "arguments": {}}')  # cut short
    named = NamedToolParser("f")
    deltas = [named.feed(t) for t in (" ", ' {"a"', ": 1}", " \n")] + [named.finish()]
    pieces = [c for d in deltas for c in d.tool_calls]
    assert pieces[0].name == "f" and pieces[0].id and "".join(p.arguments for p in pieces) == '{"a": 1}'


# --------------------------------------------------------------------------- replies over the in-memory bus


def texts(*pieces: str):
    """A script: every choice of a request generates `pieces` (one output each), then stops."""
    def script(request: GenerateRequest):
        n = request.sampling.n
        outs = []
        for index in range(n):
            for seq, piece in enumerate(pieces):
                last = seq == len(pieces) - 1
                outs.append(RequestOutput(
                    request_id=request.request_id, seq=seq, index=index, text_delta=piece, token_ids=(7,),
                    num_choices=n, finish_reason=FinishReason.STOP if last else None,
                    usage=Usage(prompt_tokens=3, completion_tokens=len(pieces) * n) if last and index == n - 1 else None))
        return outs
    return script


def openai_client(http: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


class Person(pydantic.BaseModel):
    name: str
    age: int


def test_openai_parse_gets_a_parsed_object(make_client):
    http, ctx = make_client(texts('{"name": ', '"Ada", "age": 36}'))
    completion = openai_client(http).chat.completions.parse(model="tiny", messages=USER, response_format=Person)
    assert completion.choices[0].message.parsed == Person(name="Ada", age=36)
    schema = json.loads(ctx.submitted[0].sampling.structured_outputs.json)
    assert schema["properties"].keys() == {"name", "age"} and schema["additionalProperties"] is False


SPLIT_CALLS = ['[{"name": "get_', 'weather", "argu', 'ments": {"location": "Os', 'lo"}}, {"name": "ping", ',
               '"arguments": {}}]']


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_returns_calls_the_client_parses(make_client, stream):
    http, ctx = make_client(texts(*SPLIT_CALLS))
    client = openai_client(http)
    kwargs = dict(model="tiny", messages=USER, tools=TOOLS, tool_choice="required")
    if stream:
        with client.chat.completions.stream(**kwargs) as events:
            completion = events.get_final_completion()
    else:
        completion = client.chat.completions.parse(**kwargs)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"location": "Oslo"}), ("ping", {})]
    assert [c.function.parsed_arguments for c in calls] == [{"location": "Oslo"}, {}]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("chatcmpl-tool-") for c in calls)
    assert json.loads(ctx.submitted[0].tools) == TOOLS


def test_streamed_tool_call_deltas_have_openai_shape(make_client):
    http, _ = make_client(texts(*SPLIT_CALLS))
    resp = http.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS, "tool_choice": "required",
                                                   "stream": True})
    deltas = [e["choices"][0]["delta"] for e in sse_events(resp)[:-1]]
    calls = [c for d in deltas for c in d.get("tool_calls") or ()]
    first = [c for c in calls if "id" in c]
    assert [c["function"]["name"] for c in first] == ["get_weather", "ping"]
    assert all(c["type"] == "function" and c["index"] == i for i, c in enumerate(first))
    assert all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in calls if "id" not in c)
    assert "".join(c["function"]["arguments"] for c in calls if c["index"] == 0) == '{"location": "Oslo"}'
    assert all("tool_calls" not in d for d in deltas if d.get("content") is not None and not d.get("tool_calls"))
    assert sse_events(resp)[-2]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_returns_one_call_and_stop(make_client, stream):
    http, ctx = make_client(texts('{"location"', ': "Oslo", "unit": ', '"celsius"}'))
    client = openai_client(http)
    tool_choice = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(model="tiny", messages=USER, tools=TOOLS, tool_choice=tool_choice, n=2)
    if stream:
        with client.chat.completions.stream(**kwargs) as events:
            completion = events.get_final_completion()
    else:
        completion = client.chat.completions.create(**kwargs)
    assert len(completion.choices) == 2
    for choice in completion.choices:  # each choice reads its own call
        assert choice.finish_reason == "stop" and not choice.message.content
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"location": "Oslo", "unit": "celsius"}
    assert completion.choices[0].message.tool_calls[0].id != completion.choices[1].message.tool_calls[0].id
    assert json.loads(ctx.submitted[0].sampling.structured_outputs.json) == SCHEMAS["tool_arguments"]


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_parses_hermes_blocks(make_client, stream):
    http, ctx = make_client(texts("Let me check.", " <tool_", 'call>{"name": "ping", "arguments": {}}</tool_call>'))
    client = openai_client(http)
    kwargs = dict(model="tiny", messages=USER, tools=TOOLS)
    with pytest.raises(openai.BadRequestError):  # the server was not started with --enable-auto-tool-choice
        client.chat.completions.create(**kwargs)
    http, ctx = make_client(ctx.script, enable_auto_tool_choice=True, tool_call_parser="hermes")
    client = openai_client(http)
    if stream:
        with client.chat.completions.stream(**kwargs) as events:
            completion = events.get_final_completion()
    else:
        completion = client.chat.completions.create(**kwargs)
    choice = completion.choices[0]
    assert choice.message.content == "Let me check." and choice.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [("ping", "{}")]
    assert ctx.submitted[0].sampling.structured_outputs is None


def test_plain_replies_carry_no_tool_calls_key(make_client):
    http, _ = make_client(texts("Hello", " there"))
    body = http.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS, "tool_choice": "none"}).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello there"}
    events = sse_events(http.post("/v1/chat/completions", json={"messages": USER, "stream": True}))
    assert all("tool_calls" not in e["choices"][0]["delta"] for e in events[:-1])


def test_a_tokenizer_error_names_the_clients_field(make_client):
    def refuse(request: GenerateRequest):
        return [RequestOutput(request_id=request.request_id, finish_reason=FinishReason.ERROR, error=ErrorInfo(
            message="structured_outputs.json: Unsupported type \"foo\"", param="structured_outputs.json"))]

    http, _ = make_client(refuse)
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}
    for stream in (False, True):
        resp = http.post("/v1/chat/completions", json={"messages": USER, "response_format": fmt, "stream": stream})
        assert resp.status_code == 400
        assert resp.json()["error"]["param"] == "response_format.json_schema.schema"
        assert resp.json()["error"]["message"] == 'response_format.json_schema.schema: Unsupported type "foo"'
    resp = http.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS, "tool_choice": "required"})
    assert resp.json()["error"]["param"] == "tools"
    resp = http.post("/v1/completions", json={"prompt": "x", "structured_outputs": {"json": {"type": "foo"}}})
    assert resp.json()["error"]["param"] == "structured_outputs.json"
