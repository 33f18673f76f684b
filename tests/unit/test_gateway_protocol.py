"""The HTTP schema, its conversion to SamplingParams, and the error envelope -- no Redis, no model."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError
from starlette.testclient import TestClient

from gateway.app import build_app
from shared.config import GatewayConfig
from gateway.config import GatewayLimits
from gateway.errors import APIError
from gateway.openai_protocol.request_bodies import ChatCompletionRequest, CompletionRequest
from gateway.renderer import chat_logprobs, completion_logprobs
from shared.protocol import ChatMessage, ProtocolError, SamplingParams, TextLogprobs


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate_json(json.dumps({"prompt": "hi", **fields}))


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate_json(
        json.dumps({"messages": [{"role": "user", "content": "hi"}], **fields}))


# --------------------------------------------------------------------------- requests


@pytest.mark.parametrize("prompt, expected", [
    ("hello", ["hello"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [(1, 2, 3)]),
    ([[1, 2], [3]], [(1, 2), (3,)]),
])
def test_completion_prompt_forms(prompt, expected):
    assert completion(prompt=prompt).prompts() == expected


@pytest.mark.parametrize("prompt", ["", [], [[]], ["a", ""]])
def test_empty_prompts_are_refused(prompt):
    with pytest.raises(ProtocolError) as info:
        completion(prompt=prompt).prompts()
    assert info.value.param == "prompt"


def test_completion_defaults_match_openai():
    params = completion().sampling_params()
    assert params == SamplingParams(max_tokens=16)


def test_completion_fields_reach_sampling_params():
    params = completion(n=3, temperature=0.5, top_p=0.9, top_k=-1, min_p=0.1, seed=7, stop="\n",
                        stop_token_ids=[2], presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                        logit_bias={"42": -100, "7": 5.5}, ignore_eos=True, min_tokens=2, max_tokens=9,
                        skip_special_tokens=False, include_stop_str_in_output=True, logprobs=3).sampling_params()
    assert params == SamplingParams(
        n=3, temperature=0.5, top_p=0.9, top_k=None, min_p=0.1, seed=7, stop=("\n",), stop_token_ids=(2,),
        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2, logit_bias={42: -100.0, 7: 5.5},
        ignore_eos=True, min_tokens=2, max_tokens=9, skip_special_tokens=False, include_stop_str_in_output=True,
        logprobs=3)


def test_chat_fields_reach_sampling_params():
    params = chat(max_tokens=5, max_completion_tokens=7, logprobs=True, top_logprobs=4, stop=["a", "b"],
                  top_k=0).sampling_params()
    assert (params.max_tokens, params.logprobs, params.stop, params.top_k) == (7, 4, ("a", "b"), None)
    assert chat().sampling_params().max_tokens is None  # chat: up to the context length
    assert chat(logprobs=True).sampling_params().logprobs == 0
    assert chat().sampling_params().logprobs is None


def test_chat_content_parts_are_joined():
    req = ChatCompletionRequest.model_validate_json(json.dumps({"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}))
    assert req.chat_messages() == (ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="ab"))


@pytest.mark.parametrize("build, param", [
    (lambda: completion(n=0), "n"),
    (lambda: completion(max_tokens=-1), "max_tokens"),
    (lambda: completion(temperature=5), "temperature"),
    (lambda: completion(top_p=0), "top_p"),
    (lambda: completion(logprobs=21), "logprobs"),
    (lambda: completion(logit_bias={"x": 1}), "logit_bias"),
    (lambda: completion(suffix="x"), "suffix"),
    (lambda: completion(stream_options={"include_usage": True}), "stream_options"),
    (lambda: completion(min_tokens=20, max_tokens=10), "min_tokens"),
    (lambda: chat(top_logprobs=2), "top_logprobs"),
    (lambda: chat(logprobs=True, top_logprobs=21), "top_logprobs"),
])
def test_bad_values_name_their_parameter(build, param):
    with pytest.raises(ProtocolError) as info:
        build().sampling_params()
    assert info.value.param == param


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": "10"}, "max_tokens"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({}, "prompt"),
])
def test_wrong_types_are_400_with_param(body, param):
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate_json(json.dumps(body))
    err = APIError.from_validation(info.value)
    assert (err.status, err.param) == (400, param)


def test_malformed_json_is_400():
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate_json(b'{"prompt": "x"')
    err = APIError.from_validation(info.value)
    assert err.status == 400 and "malformed JSON" in err.message and err.param is None


# --------------------------------------------------------------------------- logprob shapes


LPS = [TextLogprobs(token="Hel", token_id=1, logprob=-0.5, top_tokens=("Hel", "He"), top_logprobs=(-0.5, -1.5)),
       TextLogprobs(token="lo", token_id=2, logprob=-0.25, bytes=(108, 111))]


def test_completion_logprobs_shape():
    out, end = completion_logprobs(LPS, start=4)
    assert out.model_dump() == {"tokens": ["Hel", "lo"], "token_logprobs": [-0.5, -0.25],
                                "top_logprobs": [{"Hel": -0.5, "He": -1.5}, {"lo": -0.25}],
                                "text_offset": [4, 7]}
    assert end == 9


def test_chat_logprobs_shape():
    out = chat_logprobs(LPS).model_dump()
    assert out["content"][0] == {"token": "Hel", "logprob": -0.5, "bytes": [72, 101, 108],
                                 "top_logprobs": [{"token": "Hel", "logprob": -0.5, "bytes": [72, 101, 108]},
                                                  {"token": "He", "logprob": -1.5, "bytes": [72, 101]}]}
    assert out["content"][1]["bytes"] == [108, 111] and out["content"][1]["top_logprobs"] == []


# --------------------------------------------------------------------------- over HTTP (no lifespan: no Redis)


@pytest.fixture
def client():
    config = GatewayConfig(model="/models/tiny", served_model_name="tiny", max_model_len=32)
    return TestClient(build_app(config, GatewayLimits(max_body_bytes=4096)), raise_server_exceptions=False)


def assert_envelope(resp, status: int, param: str | None = "any"):
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"]
    if param != "any":
        assert error["param"] == param
    return error


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", b'{"model": "tiny", "prompt": "x"', 400, None),
    ("/v1/completions", b'[1, 2]', 400, "any"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": "many"}', 400, "max_tokens"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "n": 0}', 400, "n"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": -1}', 400, "max_tokens"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "temperature": 5}', 400, "temperature"),
    ("/v1/completions", b'{"model": "nope", "prompt": "x"}', 404, "model"),
    ("/v1/completions", json.dumps({"model": "tiny", "prompt": list(range(40))}).encode(), 400, "prompt"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}', 400, "any"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": []}', 400, "messages"),
    ("/v1/chat/completions", b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}', 404, "model"),
    # integers past 64 bits cannot cross the bus: a 400 naming the field, not a failed publish
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "max_tokens": %d}' % (1 << 70), 400, "max_tokens"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "top_k": %d}' % (1 << 64), 400, "top_k"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "seed": -%d}' % (1 << 70), 400, "seed"),
    ("/v1/completions", b'{"model": "tiny", "prompt": [1, %d]}' % (1 << 70), 400, "prompt"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "stop_token_ids": [%d]}' % (1 << 70), 400, "stop_token_ids.0"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "logit_bias": {"%d": 1}}' % (1 << 70), 400, "logit_bias"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": %d}'
     % (1 << 70), 400, "max_completion_tokens"),
])
def test_bad_requests_get_status_and_envelope(client, path, body, status, param):
    resp = client.post(path, content=body, headers={"content-type": "application/json"})
    error = assert_envelope(resp, status, param)
    assert error["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]


def test_body_over_the_limit_is_413(client):
    resp = client.post("/v1/completions", content=json.dumps({"prompt": "x" * 5000}))
    assert_envelope(resp, 413)


def test_unknown_route_and_method_use_the_envelope(client):
    assert_envelope(client.get("/v1/nothing"), 404)
    assert_envelope(client.get("/v1/completions"), 405)


def test_models_and_version(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    assert models["data"][0]["max_model_len"] == 32
    assert isinstance(client.get("/version").json()["version"], str)


def test_api_key_guards_the_api_but_not_probes():
    app = build_app(GatewayConfig(served_model_name="tiny", api_key="sekrit"))
    client = TestClient(app, raise_server_exceptions=False)
    assert_envelope(client.get("/v1/models"), 401)
    assert_envelope(client.get("/v1/models", headers={"authorization": "Bearer wrong"}), 401)
    assert client.get("/v1/models", headers={"authorization": "Bearer sekrit"}).status_code == 200
    assert client.get("/version").status_code == 200


def test_command_line_builds_config_and_limits():
    from shared.flags import parse_gateway

    config = parse_gateway(["--redis-url", "redis://h:1/0", "--prefix", "p", "--port", "9", "--model", "/m",
                            "--served-model-name", "m", "--api-key", "k", "--max-model-len", "64",
                            "--request-timeout", "5", "--reuse-port"])
    assert (config.bus.redis_url, config.bus.prefix, config.port, config.model) == ("redis://h:1/0", "p", 9, "/m")
    assert (config.served_model_name, config.api_key, config.max_model_len) == ("m", "k", 64)
    assert config.limits == GatewayLimits(idle_timeout_s=5.0) and config.log_level == "info" and config.reuse_port
    assert parse_gateway([]).limits == GatewayLimits() and not parse_gateway([]).reuse_port


def test_served_model_name_and_aliases():
    from gateway.config import accepts_model, served_model_name

    named = GatewayConfig(model="/cache/models/SmolLM2/", served_model_name="smol")
    assert served_model_name(named) == "smol"
    assert all(accepts_model(named, m) for m in ("smol", "/cache/models/SmolLM2/", None))
    assert not accepts_model(named, "gpt-4")
    assert served_model_name(GatewayConfig(model="/cache/models/SmolLM2/")) == "SmolLM2"


# --------------------------------------------------------------------------- the streaming fast path
@pytest.mark.parametrize("renderer_cls", ["TextCompletionRenderer", "ChatCompletionRenderer"])
def test_text_events_equal_the_pydantic_chunks(renderer_cls):
    import random

    import gateway.renderer as renderers
    from gateway.choice import ChoiceState
    from shared.protocol import RequestOutput

    rng = random.Random(0)
    alphabet = ["a", " ", '"', "\\", "\n", "\t", "\x00", "\x1f", "é", "🙂", "\u2028", "</", "\u2063"]
    renderer = getattr(renderers, renderer_cls)('cmpl-"quoted"', "model/é", want_logprobs=False)
    reference = getattr(renderers, renderer_cls)(renderer.response_id, renderer.model, want_logprobs=False)
    reference.created = renderer.created
    for index in (0, 3, 12):
        choice, ref_choice = ChoiceState(index=index), ChoiceState(index=index)
        first = RequestOutput(request_id="r", text_delta="hi")
        assert renderer.text_event(choice, first) is None  # a choice's first chunk goes through the model
        renderer.chunks(choice, first), reference.chunks(ref_choice, first)
        for _ in range(50):
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8)))
            out = RequestOutput(request_id="r", text_delta=text)
            event = renderer.text_event(choice, out)
            (chunk,) = [c for c in reference.chunks(ref_choice, out) if c.choices]
            assert event.startswith(b"data: ") and event.endswith(b"\n\n")
            assert json.loads(event[6:]) == json.loads(chunk.model_dump_json())
        assert renderer.text_event(choice, RequestOutput(request_id="r", text_delta="x", finish_reason=1)) is None
    with_logprobs = getattr(renderers, renderer_cls)("id", "m", want_logprobs=True)
    started = ChoiceState(index=0)
    started.is_started = True
    assert with_logprobs.text_event(started, RequestOutput(request_id="r", text_delta="x")) is None
