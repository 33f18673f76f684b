"""The gateway's front door without Redis: readiness from heartbeats, limits checked before any
work (nothing submitted), the malformed requests of issue 14 and their OpenAI envelopes.

The context's bus is a list (``submitted``); the same cases run against the real stack in
tests/e2e/test_admission.py.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from starlette.requests import Request

from gateway.app import _check_message_sizes, _read_body
from gateway.errors import APIError
from gateway.health import HealthPoller, readiness
from shared.config import ENGINE_ROLES
from shared.config import GatewayConfig, GatewayLimits
from shared.protocol import MAX_MESSAGE_BYTES, GenerateRequest, Heartbeat, SamplingParams
from tests.unit.doubles import BusFreeContext, CountingTokenizer


def beat(service: str, service_id: str, age_s: float = 0.0, **stats) -> tuple[bytes, bytes]:
    wire = Heartbeat(service=service, service_id=service_id, time=time.time() - age_s, stats=stats,
                     host="secret-host", pid=4242).to_wire()
    return service_id.encode(), wire


def stack_beats(*, num_detok_shards: int = 1, **ages) -> dict[bytes, bytes]:
    """A live tokenizer, engine and detok per shard (``ages``: seconds since a service id's beat)."""
    ids = [("tokenizer", "tokenizer-0"), ("engine", "engine-0")] + \
          [("detok", f"detok-{k}") for k in range(num_detok_shards)]
    return dict(beat(kind, sid, ages.get(sid.replace("-", "_"), 0.0), shard=float(sid[-1]) if kind == "detok" else 0.0)
                for kind, sid in ids)


class ListContext(BusFreeContext):
    """The real context with its Redis ends replaced: submissions are listed, the heartbeat hash is
    whatever the test sets (``health.raw``); nothing here can reach Redis."""

    def __init__(self, config, limits):
        super().__init__(config, limits)
        self.health = HealthPoller(None, "unused", interval_s=1.0, timeout_s=1.0)


@pytest.fixture
def make_gateway(serve_gateway):
    def make(api_key=None, max_model_len=64, max_prompt_chars=640, **limits):
        config = GatewayConfig(served_model_name="tiny", api_key=api_key, max_model_len=max_model_len)
        ctx = ListContext(config, GatewayLimits(**limits))
        ctx.max_prompt_chars = max_prompt_chars  # what loading the tokenizer sets (max_model_len x longest token)
        return serve_gateway(config, ctx), ctx

    return make


def assert_envelope(resp, status: int, type_: str, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["code"] == status and error["type"] == type_ and error["param"] == param, error
    return error


# ----------------------------------------------------------------------------- readiness


def test_readiness_needs_a_tokenizer_an_engine_and_every_detok_shard():
    assert readiness(stack_beats(), num_detok_shards=1, max_age_s=10).is_ready
    two = stack_beats(num_detok_shards=2)
    assert readiness(two, num_detok_shards=2, max_age_s=10).is_ready
    del two[b"detok-1"]
    assert readiness(two, num_detok_shards=2, max_age_s=10).missing == ("detok shard 1",)
    stale = stack_beats(tokenizer_0=11.0, engine_0=3.0)
    assert readiness(stale, num_detok_shards=1, max_age_s=10).missing == ("tokenizer",)
    no_engine = {k: v for k, v in stack_beats().items() if k != b"engine-0"}
    assert readiness(no_engine, num_detok_shards=1, max_age_s=10).missing == ("engine",)
    assert readiness({}, num_detok_shards=1, max_age_s=10).missing == ("tokenizer", "engine", "detok")
    down = readiness(None, num_detok_shards=1, max_age_s=10)
    assert not down.is_ready and down.problem == "not ready: the request bus does not answer"


def test_readiness_under_pd_needs_an_engine_that_takes_requests_and_one_that_decodes_them():
    """Engines beat their role (stat "role": the index in ENGINE_ROLES): a decode engine alone
    takes no request, prefill engines alone hand them to nobody."""
    def with_engines(*roles: str) -> dict[bytes, bytes]:
        raw = {k: v for k, v in stack_beats().items() if k != b"engine-0"}
        raw.update(beat("engine", f"engine-{i}", role=float(ENGINE_ROLES.index(r))) for i, r in enumerate(roles))
        return raw

    def missing(*roles: str) -> tuple[str, ...]:
        return readiness(with_engines(*roles), num_detok_shards=1, max_age_s=10).missing

    assert missing("prefill", "decode") == () and missing("both") == () and missing("both", "decode") == ()
    assert missing("decode") == ("prefill engine",)
    assert missing("prefill", "prefill") == ("decode engine",)
    assert readiness(with_engines("decode"), num_detok_shards=1, max_age_s=10).problem == \
        "not ready: no live prefill engine"


def test_health_answers_from_the_last_reading_with_detail_only_for_the_key(make_gateway):
    client, ctx = make_gateway(api_key="k")
    ctx.health.raw = None  # never read (or Redis stopped)
    error = assert_envelope(client.get("/health"), 503, "ServiceUnavailableError")
    assert client.get("/health").headers["retry-after"] == "1"
    assert error["message"] == "not ready: the request bus does not answer"
    ctx.health.raw = {k: v for k, v in stack_beats().items() if k != b"detok-0"}
    assert assert_envelope(client.get("/health"), 503, "ServiceUnavailableError")["message"] == \
        "not ready: no live detok"
    ctx.health.raw = stack_beats()
    ctx.health.raw.update([beat("gateway", "gateway-g0")])
    resp = client.get("/health")
    assert resp.status_code == 200 and resp.json() == {"status": "ok"}  # no ids, no host, no address
    resp = client.get("/health", headers={"Authorization": "Bearer k"})
    assert resp.json() == {"status": "ok", "services": ["detok-0", "engine-0", "gateway-g0", "tokenizer-0"]}
    assert "secret-host" not in resp.text
    ctx.health.raw = stack_beats(engine_0=30.0)  # the reading ages: judged when asked
    assert_envelope(client.get("/health"), 503, "ServiceUnavailableError")


def test_health_poll_that_cannot_reach_redis_reads_as_down():
    class Stalled:
        async def hgetall(self, key):
            await asyncio.sleep(3600)

    poller = HealthPoller(Stalled(), "k", interval_s=0.05, timeout_s=0.05)
    poller.raw = stack_beats()
    started = time.monotonic()
    asyncio.run(poller.poll_once())
    assert poller.raw is None and time.monotonic() - started < 1.0


# ----------------------------------------------------------------------------- limits before work


def test_token_prompt_longer_than_the_model_is_refused_before_publishing(make_gateway):
    client, ctx = make_gateway(max_model_len=64)
    error = assert_envelope(client.post("/v1/completions", json={"prompt": list(range(64)), "max_tokens": 1}),
                            400, "BadRequestError", "prompt")
    assert "maximum context length is 64 tokens" in error["message"]
    assert ctx.submitted == []


def test_token_prompt_beyond_the_bus_is_refused_without_a_max_model_len(make_gateway):
    client, ctx = make_gateway(max_model_len=None, max_prompt_chars=None)
    resp = client.post("/v1/completions", json={"prompt": [1] * ((1 << 20) + 1)})
    assert "at most 1048576 token ids" in assert_envelope(resp, 400, "BadRequestError", "prompt")["message"]
    assert ctx.submitted == []


def test_text_that_cannot_fit_the_model_is_refused_untokenized(make_gateway):
    client, ctx = make_gateway(max_model_len=64, max_prompt_chars=640, idle_timeout_s=0.2)  # nothing answers
    resp = client.post("/v1/completions", json={"prompt": "x" * 641})
    assert "641 characters" in assert_envelope(resp, 400, "BadRequestError", "prompt")["message"]
    resp = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "y" * 400}] * 2})
    assert_envelope(resp, 400, "BadRequestError", "messages")
    assert client.post("/v1/completions", json={"prompt": "x" * 640}).status_code == 503  # published, unanswered
    assert [r.prompt for r in ctx.submitted] == ["x" * 640]


def test_a_message_too_large_for_the_bus_is_413():
    big = GenerateRequest(request_id="r", reply_to="g", prompt="x" * (MAX_MESSAGE_BYTES + 1),
                          sampling=SamplingParams())
    with pytest.raises(APIError) as info:
        _check_message_sizes([big])
    assert info.value.status == 413
    _check_message_sizes([GenerateRequest(request_id="r", reply_to="g", prompt="x", sampling=SamplingParams())])


def test_body_over_the_limit_is_413(make_gateway):
    client, ctx = make_gateway(max_body_bytes=1000)
    assert_envelope(client.post("/v1/completions", json={"prompt": "x" * 2000}), 413, "RequestTooLargeError")
    assert_envelope(client.post("/tokenize", json={"prompt": "x" * 2000}), 413, "RequestTooLargeError")
    assert ctx.submitted == []


def test_too_many_requests_in_flight_is_429_with_retry_after(make_gateway):
    client, ctx = make_gateway(max_pending_requests=0)
    resp = client.post("/v1/completions", json={"prompt": "x"})
    assert_envelope(resp, 429, "RateLimitError")
    assert resp.headers["retry-after"] == "1" and ctx.submitted == []


# ----------------------------------------------------------------------------- malformed requests


def test_two_authorization_headers_are_a_400(make_gateway):
    client, ctx = make_gateway(api_key="k")
    twice = [("Authorization", "Bearer k"), ("Authorization", "Bearer other")]
    assert_envelope(client.post("/v1/completions", json={"prompt": "x"}, headers=twice), 400, "BadRequestError",
                    "authorization")
    assert_envelope(client.post("/v1/completions", json={"prompt": "x"}, headers=twice[::-1]), 400,
                    "BadRequestError", "authorization")
    assert ctx.submitted == []
    assert_envelope(client.post("/v1/completions", json={"prompt": "x"}), 401, "AuthenticationError")


def test_wrong_method_is_a_typed_405_with_allow(make_gateway):
    client, _ = make_gateway()
    resp = client.get("/v1/completions")
    assert_envelope(resp, 405, "MethodNotAllowedError")
    assert resp.headers["allow"] == "POST"


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_a_body_that_is_not_json_by_its_type_is_415(make_gateway, content_type):
    client, ctx = make_gateway(idle_timeout_s=0.2)
    resp = client.post("/v1/completions", content=b'{"prompt": "x"}', headers={"content-type": content_type})
    assert_envelope(resp, 415, "UnsupportedMediaTypeError", "content-type")
    assert ctx.submitted == []
    ok = client.post("/v1/completions", content=b'{"prompt": "x"}',
                     headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 503 and len(ctx.submitted) == 1  # accepted, published, unanswered


def test_a_half_sent_body_times_out_with_408():
    async def run():
        sent = False

        async def receive():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": b'{"prompt": ', "more_body": True}
            await asyncio.sleep(3600)  # the client stalls

        request = Request({"type": "http", "method": "POST", "path": "/v1/completions",
                           "headers": [(b"content-length", b"100")]}, receive)
        started = time.monotonic()
        with pytest.raises(APIError) as info:
            await _read_body(request, limit=1000, timeout_s=0.2)
        return info.value, time.monotonic() - started

    error, elapsed = asyncio.run(run())
    assert error.status == 408 and error.type == "RequestTimeoutError"
    assert error.response_headers()["connection"] == "close"
    assert 0.2 <= elapsed < 2.0


# ----------------------------------------------------------------------------- the tokenizer's bounded work


def test_the_tokenizer_refuses_text_that_cannot_fit_without_tokenizing_it(default_model_dir):
    from transformers import AutoTokenizer

    from shared.protocol import ChatMessage, RequestOutput, StreamNames
    from tokenizer_svc.prompts import PromptEncoder, longest_token_chars

    tokenizer = CountingTokenizer(AutoTokenizer.from_pretrained(default_model_dir))
    encoder = PromptEncoder(tokenizer, 128, StreamNames("x"))
    assert encoder.max_prompt_chars == 128 * longest_token_chars(tokenizer) and longest_token_chars(tokenizer) > 1
    huge = "x" * (15 << 20)
    started = time.monotonic()
    out = encoder.encode_batch([
        GenerateRequest(request_id="text", reply_to="g", prompt=huge, sampling=SamplingParams()),
        GenerateRequest(request_id="chat", reply_to="g", messages=(ChatMessage(role="user", content=huge),),
                        sampling=SamplingParams()),
        GenerateRequest(request_id="small", reply_to="g", prompt="hello", sampling=SamplingParams(max_tokens=4))])
    assert time.monotonic() - started < 2.0
    errors = {m.request_id: m.error for _, m in out if isinstance(m, RequestOutput)}
    assert errors["text"].param == "prompt" and errors["chat"].param == "messages"
    assert [m.request_id for s, m in out if s == "x:engine:in"] == ["small"]
    assert tokenizer.num_calls == 1  # the small prompt's batch: neither huge text was tokenized


def test_an_out_of_vocabulary_logit_bias_names_logit_bias(default_model_dir):
    from transformers import AutoTokenizer

    from shared.protocol import StreamNames
    from tokenizer_svc.prompts import PromptEncoder

    encoder = PromptEncoder(AutoTokenizer.from_pretrained(default_model_dir), 128, StreamNames("x"))
    bias = {len(encoder.tokenizer) + 5: 1.0}
    [(_, out)] = encoder.encode_batch([GenerateRequest(request_id="r", reply_to="g", prompt="hi",
                                                       sampling=SamplingParams(logit_bias=bias))])
    assert out.error is not None and out.error.param == "logit_bias" and out.error.code == 400


def test_sampling_params_name_the_field_whose_token_id_is_out_of_the_vocabulary():
    """The one check the tokenizer and the engine both run (SamplingParams.validate)."""
    from shared.codec import ProtocolError

    with pytest.raises(ProtocolError) as bias:
        SamplingParams(logit_bias={7: 1.0, 99: 1.0}).validate(vocab_size=50)
    with pytest.raises(ProtocolError) as stop:
        SamplingParams(stop_token_ids=(99,), logit_bias={7: 1.0}).validate(vocab_size=50)
    assert (bias.value.param, stop.value.param) == ("logit_bias", "stop_token_ids")
    SamplingParams(stop_token_ids=(49,), logit_bias={0: 1.0}).validate(vocab_size=50)
