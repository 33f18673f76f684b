"""Structured outputs and tool calling through the whole stack on the default model (SmolLM2-135M-
Instruct), driven by the official openai client: every constrained output parses and validates,
forced tool calls come back as calls the client parses, bad constraints are 400s naming the
client's field, and a pool too small for the batch (preemption) or a cached prefix changes none
of it. The idle invariant is checked after every test."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pydantic
import pytest

from tests.e2e.conftest import openai_client
from tests.e2e.stack import Stack
from tests.fixtures.schemas import SCHEMAS

pytestmark = pytest.mark.slow

MODEL = "smollm2"
BLOCK_SIZE = 16
# 16 sequences of ~90 tokens (a ~60-token prompt, ~30 generated) need ~96 blocks; 40 make the engine
# preempt under the bulk run
ENGINE_ARGS = ["--enforce-eager", "--num-gpu-blocks-override", "40", "--max-num-seqs", "16",
               "--max-num-batched-tokens", "512", "--block-size", str(BLOCK_SIZE)]
GATEWAY_ARGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
SYSTEM = ("You are a helpful assistant that answers with JSON only. Fill every field with a plausible value; "
          "keep strings short.")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": SCHEMAS["tool_arguments"], "strict": True}}
ROUTE = {"type": "function", "function": {"name": "plan_route", "description": "A path between grid points",
                                          "parameters": SCHEMAS["defs_ref"], "strict": True}}
TOOLS = [WEATHER, ROUTE]
ARGUMENT_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def default_stack(redis_url, default_model_dir, tmp_path_factory):
    stack = Stack(redis_url, default_model_dir, tmp_path_factory.mktemp("structured-logs"), served_model_name=MODEL,
                  max_model_len=2048, engine_args=ENGINE_ARGS, gateway_args=GATEWAY_ARGS)
    stack.start(timeout_s=300)
    yield stack
    stack.stop()


@pytest.fixture
def client(default_stack) -> openai.OpenAI:
    yield openai_client(default_stack, timeout=300)
    default_stack.assert_idle()


def ask(name: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Give one example of a '{name.replace('_', ' ')}' object."}]


def schema_request(client: openai.OpenAI, k: int) -> tuple[str, str, str | None]:
    """Request k of the bulk run: (schema name, output text, finish_reason); schemas, streaming,
    temperature and the way the schema is given all vary with k."""
    name = sorted(SCHEMAS)[k % len(SCHEMAS)]
    schema = SCHEMAS[name]
    if k % 3 == 2:
        fields = {"extra_body": {"structured_outputs": {"json": schema}}}
    else:
        fields = {"response_format": {"type": "json_schema",
                                      "json_schema": {"name": name, "schema": schema, "strict": True}}}
    temperature = (k // len(SCHEMAS)) % 2  # 0, then 1, then 0, ...: every schema meets both
    kwargs = dict(model=MODEL, messages=ask(name), max_tokens=200, temperature=temperature, seed=k, **fields)
    if k % 2:
        stream = client.chat.completions.create(stream=True, **kwargs)
        pieces, finish = [], None
        for chunk in stream:
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        return name, "".join(pieces), finish
    choice = client.chat.completions.create(**kwargs).choices[0]
    return name, choice.message.content, choice.finish_reason


def test_a_hundred_schema_requests_all_validate_under_preemption(default_stack, client):
    preempted_before = default_stack.engine_stats()["num_preemptions"]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda k: schema_request(client, k), range(100)))
    assert len({name for name, _, _ in results}) >= 12
    for name, text, finish in results:
        assert finish == "stop", (name, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    # the pool holds fewer sequences than the batch: outputs stay valid across recompute
    assert default_stack.engine_stats()["num_preemptions"] > preempted_before


def test_a_cached_prefix_gives_the_same_valid_output(client):
    kwargs = dict(model=MODEL, messages=ask("nested object") + [{"role": "user", "content": "Once more."}],
                  max_tokens=200, temperature=0, response_format={
                      "type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMAS["nested_object"]}})
    first, second = (client.chat.completions.create(**kwargs) for _ in range(2))
    assert first.choices[0].message.content == second.choices[0].message.content
    jsonschema.validate(json.loads(second.choices[0].message.content), SCHEMAS["nested_object"])
    num_prompt = second.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens == (num_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_regex_choice_and_grammar_outputs_match(client):
    date = r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d)"
    grammar = 'root ::= "(" num " " op " " num ")"\nnum ::= [1-9] [0-9]?\nop ::= "+" | "-" | "*"'
    choices = ["red", "green", "blue"]
    for temperature in (0, 1):
        common = dict(model=MODEL, max_tokens=20, temperature=temperature, seed=3)
        text = client.completions.create(prompt="The date of the moon landing:", n=2,
                                         extra_body={"structured_outputs": {"regex": date}}, **common)
        assert all(re.fullmatch(date, c.text) for c in text.choices), [c.text for c in text.choices]
        pick = client.chat.completions.create(messages=[{"role": "user", "content": "Name a color."}],
                                              extra_body={"structured_outputs": {"choice": choices}}, **common)
        assert pick.choices[0].message.content in choices
        stream = client.chat.completions.create(messages=[{"role": "user", "content": "Write a sum."}], stream=True,
                                                extra_body={"structured_outputs": {"grammar": grammar}}, **common)
        expression = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert re.fullmatch(r"\([1-9][0-9]? [-+*] [1-9][0-9]?\)", expression), expression
    json_object = client.completions.create(prompt="A JSON object about a cat:", max_tokens=100, temperature=0,
                                            model=MODEL, extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(json_object.choices[0].text), dict), json_object.choices[0].text


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population: int = pydantic.Field(ge=0, le=50_000_000)


def test_openai_parse_returns_a_parsed_object(client):
    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe Paris as JSON."}], response_format=City,
        max_tokens=100, temperature=0)
    assert isinstance(completion.choices[0].message.parsed, City), completion.choices[0].message.content


def check_calls(calls, names=None) -> None:
    assert calls and len({c.id for c in calls}) == len(calls)
    for call in calls:
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), ARGUMENT_SCHEMAS[call.function.name])
        assert call.function.parsed_arguments == json.loads(call.function.arguments)


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_calls_parse_and_a_tool_reply_continues(client, stream):
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]

    def call(tool_choice, temperature=0.0, history=messages, top_p=1.0):
        kwargs = dict(model=MODEL, messages=history, tools=TOOLS, tool_choice=tool_choice, max_tokens=200,
                      temperature=temperature, top_p=top_p, seed=1)
        if stream:
            with client.chat.completions.stream(**kwargs) as events:
                return events.get_final_completion().choices[0]
        return client.chat.completions.parse(**kwargs).choices[0]

    required = call("required")
    assert required.finish_reason == "tool_calls" and not required.message.content
    check_calls(required.message.tool_calls)
    # sampled, as a client would: the grammar allows unbounded JSON whitespace, and the raw
    # distribution's tail let one seeded sample wander into it until max_tokens (top_p cuts the tail)
    sampled = call("required", temperature=1.0, top_p=0.9)
    assert sampled.finish_reason == "tool_calls"
    check_calls(sampled.message.tool_calls)
    named = call({"type": "function", "function": {"name": "get_weather"}})
    assert named.finish_reason == "stop" and not named.message.content
    check_calls(named.message.tool_calls, names={"get_weather"})
    assert len(named.message.tool_calls) == 1
    # the tool's answer goes back with the call that asked for it, and the conversation goes on
    tool_call = named.message.tool_calls[0]
    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": tool_call.id, "type": "function",
            "function": {"name": tool_call.function.name, "arguments": tool_call.function.arguments}}]},
        {"role": "tool", "tool_call_id": tool_call.id, "content": "Sunny, 21 degrees celsius."}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                            max_tokens=40, temperature=0)
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")
    assert answer.choices[0].message.tool_calls is None


@pytest.mark.parametrize("request_fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema"),
    ({"extra_body": {"structured_outputs": {"json": {"$ref": "#/$defs/missing"}}}}, "structured_outputs.json"),
    ({"extra_body": {"structured_outputs": {"regex": "(ab"}}}, "structured_outputs.regex"),
    ({"extra_body": {"structured_outputs": {"grammar": "root ::= undefined_rule"}}}, "structured_outputs.grammar"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}}, "structured_outputs"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_constraints_are_400_naming_the_field(client, request_fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       **request_fields)
    assert info.value.status_code == 400 and info.value.body["param"] == param, info.value.body
