"""The gateway's request flow over an in-memory bus: aggregation, streaming, errors, aborts.

No Redis here: ``ScriptedContext`` replaces the two bus ends of GatewayContext (submit, abort)
and answers each GenerateRequest with scripted RequestOutputs through the real Collector.
The same flows run against the real stack in tests/e2e.
"""

from __future__ import annotations

import dataclasses
import asyncio
import json
import time

import pytest

from gateway.app import build_app
from gateway.config import GatewayLimits
from shared.config import GatewayConfig
from shared.heartbeat import Punctuality
from shared.protocol import (ErrorInfo, FinishReason, GenerateRequest, Heartbeat, RequestOutput,
                             TextLogprobs, Usage)
from tests.unit.doubles import BusFreeContext
from tests.unit.doubles import SilentReader as _SilentReader  # noqa: F401 (test_gateway_direct.py imports it here)


class ScriptedContext(BusFreeContext):
    """GatewayContext whose bus is a function GenerateRequest -> list[RequestOutput]."""

    def __init__(self, config, limits, script):
        super().__init__(config, limits)
        self.script = script

    async def submit(self, requests):
        await super().submit(requests)
        loop = asyncio.get_running_loop()
        for request in requests:
            for out in self.script(request):
                loop.call_soon(self.collector.deliver, out)


def words(request: GenerateRequest, texts=("Hello", " world"), *, duplicate=False, logprobs=False):
    """Per choice: one output per text, the last one finished; a prompt note first."""
    outs = [RequestOutput(request_id=request.request_id, prompt_token_ids=(1, 2, 3),
                          prompt_text=request.prompt if request.prompt is not None else "<ids>")]
    for index in range(request.sampling.n):
        for seq, text in enumerate(texts):
            last = seq == len(texts) - 1
            lps = (TextLogprobs(token=text, token_id=10 + seq, logprob=-0.5),) if logprobs else None
            # like the detokenizer: the request's usage (all choices) rides on its very last output
            usage = Usage(prompt_tokens=3, completion_tokens=len(texts) * request.sampling.n) \
                if last and index == request.sampling.n - 1 else None
            out = RequestOutput(request_id=request.request_id, seq=seq, index=index, text_delta=f"{text}{index}",
                                token_ids=(10 + seq,), logprobs=lps, num_choices=request.sampling.n,
                                finish_reason=FinishReason.STOP if last else None, usage=usage)
            outs += [out, out] if duplicate else [out]
    return outs


@pytest.fixture
def make_client(serve_gateway):
    def make(script, **settings):
        """``settings``: GatewayLimits fields go to the limits, the rest to the GatewayConfig."""
        limit_names = {f.name for f in dataclasses.fields(GatewayLimits)}
        config = GatewayConfig(served_model_name="tiny", **{k: v for k, v in settings.items() if k not in limit_names})
        ctx = ScriptedContext(config, GatewayLimits(**{k: v for k, v in settings.items() if k in limit_names}), script)
        return serve_gateway(config, ctx), ctx

    return make


def sse_events(resp) -> list:
    events = []
    for line in resp.text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_completions_aggregate_prompts_and_choices(make_client):
    client, ctx = make_client(lambda r: words(r, duplicate=True))
    resp = client.post("/v1/completions", json={"model": "tiny", "prompt": ["a", "b"], "n": 2, "max_tokens": 5})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == ["Hello0 world0", "Hello1 world1"] * 2
    assert {c["finish_reason"] for c in body["choices"]} == {"stop"}
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 8, "total_tokens": 14,
                             "prompt_tokens_details": None}
    assert [r.prompt for r in ctx.submitted] == ["a", "b"]
    assert all(r.reply_to == ctx.reply_to and r.sampling.n == 2 for r in ctx.submitted)
    assert len({r.request_id for r in ctx.submitted}) == 2
    assert ctx.aborted == [] and ctx.collector.num_pending == 0


def test_token_prompts_echo_and_logprobs(make_client):
    client, ctx = make_client(lambda r: words(r, logprobs=True))
    resp = client.post("/v1/completions", json={"prompt": [[5, 6]], "echo": True, "logprobs": 0})
    choice = resp.json()["choices"][0]
    assert ctx.submitted[0].prompt_token_ids == (5, 6) and ctx.submitted[0].echo
    assert choice["text"] == "<ids>Hello0 world0"
    assert choice["logprobs"] == {"tokens": ["Hello", " world"], "token_logprobs": [-0.5, -0.5],
                                  "top_logprobs": [{"Hello": -0.5}, {" world": -0.5}], "text_offset": [5, 10]}


def test_chat_stream_with_usage(make_client):
    client, ctx = make_client(words)
    resp = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "stream": True, "n": 2,
        "stream_options": {"include_usage": True}})
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 4
    chunks = events[:-2]
    assert all(c["object"] == "chat.completion.chunk" and len(c["choices"]) == 1 for c in chunks)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content") or "" for c in mine) == f"Hello{index} world{index}"
        assert [c["finish_reason"] for c in mine][-1] == "stop"
    assert ctx.submitted[0].messages[0].content == "hi"


def test_an_error_before_the_stream_starts_is_an_http_status(make_client):
    def refuse(r):
        return [RequestOutput(request_id=r.request_id, finish_reason=FinishReason.ERROR,
                              error=ErrorInfo(message="prompt too long", param="prompt", code=400))]

    client, ctx = make_client(refuse)
    for stream in (False, True):
        resp = client.post("/v1/completions", json={"prompt": "x", "stream": stream})
        assert resp.status_code == 400
        assert resp.json()["error"] == {"message": "prompt too long", "type": "BadRequestError",
                                        "param": "prompt", "code": 400}
    assert ctx.collector.num_pending == 0


def test_an_error_mid_stream_is_one_sse_event_then_close(make_client):
    def fail_late(r):
        return words(r)[:2] + [RequestOutput(request_id=r.request_id, seq=1, finish_reason=FinishReason.ERROR,
                                             error=ErrorInfo(message="engine died", type="InternalServerError",
                                                             code=500))]

    client, ctx = make_client(fail_late)
    events = sse_events(client.post("/v1/completions", json={"prompt": "x", "stream": True}))
    assert events[0]["choices"][0]["text"] == "Hello0"
    assert events[-1] == {"error": {"message": "engine died", "type": "InternalServerError", "param": None,
                                    "code": 500}}
    assert "[DONE]" not in events
    assert ctx.aborted == [(ctx.submitted[0].request_id,)]


def test_silence_times_out_with_503_and_an_abort(make_client):
    client, ctx = make_client(lambda r: [], idle_timeout_s=0.2)
    resp = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert resp.status_code == 503 and resp.json()["error"]["code"] == 503
    assert ctx.aborted == [(ctx.submitted[0].request_id,)] and ctx.collector.num_pending == 0


def test_what_one_read_holds_for_a_stream_goes_out_in_one_body_write():
    config = GatewayConfig(served_model_name="tiny")
    ctx = ScriptedContext(config, GatewayLimits(), lambda r: words(r, (" a", " b", " c", " d")))
    app = build_app(config, context=ctx)
    request = [{"type": "http.request", "body": json.dumps({"prompt": "x", "stream": True}).encode()}]
    sent = []

    async def receive():
        if request:
            return request.pop()
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    async def run():
        await ctx.open()  # the script's outputs are all delivered before the stream's task runs
        await app({"type": "http", "method": "POST", "path": "/v1/completions", "root_path": "", "query_string": b"",
                   "headers": [(b"content-type", b"application/json")]}, receive, send)
        await ctx.close()

    asyncio.run(run())
    bodies = [m["body"] for m in sent if m["type"] == "http.response.body"]
    assert len(bodies) == 2 and bodies[1] == b"data: [DONE]\n\n"
    events = [json.loads(line[6:]) for line in bodies[0].decode().split("\n\n") if line]
    assert [e["choices"][0]["text"] for e in events] == [" a0", " b0", " c0", " d0"]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_outputs_for_unknown_requests_are_dropped(make_client):
    client, ctx = make_client(words)
    ctx.collector.deliver(RequestOutput(request_id="nobody", text_delta="x"))
    assert ctx.collector.num_dropped == 1
    assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 200


def test_metrics_count_finished_requests(make_client):
    client, _ = make_client(words)
    client.post("/v1/completions", json={"prompt": "x", "n": 2})
    text = client.get("/metrics").text
    # one success per choice; tokens are the engines' figures, not a gateway's (shared/telemetry.py)
    assert 'pagedserve:request_success_total{finished_reason="stop",model_name="tiny"} 2.0' in text
    assert 'pagedserve:time_to_first_token_seconds_count{model_name="tiny"} 1.0' in text
    assert "generation_tokens" not in text


def test_health_without_a_heartbeat_reading_is_503_and_metrics_are_the_gateways_own(make_client):
    """No poll of the heartbeat hash has answered (this context has no Redis): not ready, said
    without internal detail; /metrics shows the gateway's own figures, not the engines'."""
    client, ctx = make_client(words)
    resp = client.get("/health")
    error = resp.json()["error"]
    assert resp.status_code == 503 and error["type"] == "ServiceUnavailableError"
    assert error["message"] == "not ready: the request bus does not answer"
    assert "num_requests_running" not in client.get("/metrics").text  # the engine's own figure


class _Reading:
    """The health poll's last reading of the heartbeat hash (what fail_if_no_engine judges)."""

    def __init__(self, raw):
        self.raw = raw


def _hash(*, hash_age_s: float, engine_age_s: float | None) -> dict:
    raw = {b"_epoch": str(time.time() - hash_age_s).encode()}
    if engine_age_s is not None:
        raw[b"engine-0"] = Heartbeat(service="engine", service_id="engine-0", time=time.time() - engine_age_s,
                                     stats={}).to_wire()
    return raw


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _beats(clock: _Clock, *, on_time_s: float | None, overdue_s: float = 0.0) -> Punctuality:
    """A gateway's own beats: landing every second for ``on_time_s`` (None: the last one failed),
    the last one ``overdue_s`` ago."""
    punctuality = Punctuality(1.0, clock=clock)
    if on_time_s is None:
        punctuality.failed()
        return punctuality
    clock.now -= on_time_s + overdue_s
    for _ in range(int(on_time_s) + 1):
        punctuality.landed()
        clock.now += 1.0
    clock.now += overdue_s - 1.0
    return punctuality


def test_no_engine_verdict_waits_for_evidence_old_enough_to_mean_something():
    """The gateway fails its requests in flight for want of an engine only when the heartbeat
    hash is older than the age limit (not just flushed or re-created by an empty restart) and its
    own beats have landed on time for that long (not in a stall, nor just after one), and no
    engine beat is fresh."""
    clock = _Clock()
    cases = [  # (reading, own beats, failed?)
        (None, dict(on_time_s=60), 0),  # Redis does not answer: nothing to judge
        (_hash(hash_age_s=2, engine_age_s=None), dict(on_time_s=60), 0),  # just flushed
        (_hash(hash_age_s=60, engine_age_s=30), dict(on_time_s=3), 0),  # a stall just ended: beats look stale
        (_hash(hash_age_s=60, engine_age_s=30), dict(on_time_s=None), 0),  # our own beats fail right now
        # the host was paused: on time for a minute, then nothing for 12 s -- and this check runs
        # before the beat that would notice it
        (_hash(hash_age_s=60, engine_age_s=12), dict(on_time_s=60, overdue_s=12), 0),
        (_hash(hash_age_s=60, engine_age_s=1), dict(on_time_s=60), 0),  # an engine is alive
        (_hash(hash_age_s=60, engine_age_s=30), dict(on_time_s=60), 1),  # the engines are gone
    ]

    async def scenario():
        ctx = ScriptedContext(GatewayConfig(served_model_name="tiny"), GatewayLimits(heartbeat_max_age_s=10.0),
                              words)
        await ctx.open()
        got = []
        ctx.collector.register("r1", type("Inbox", (), {"put": got.append, "resume": got.append})())
        try:
            results = []
            for raw, beats, _ in cases:
                ctx.health, ctx.punctuality = _Reading(raw), _beats(clock, **beats)
                results.append(await ctx.fail_if_no_engine())
            return results, got
        finally:
            ctx.health = None
            await ctx.close()

    results, got = asyncio.run(scenario())
    assert results == [failed for _, _, failed in cases]
    assert len(got) == 1 and got[0].error.code == 503 and "no engine is alive" in got[0].error.message


def test_too_many_requests_in_flight_is_429(make_client):
    client, ctx = make_client(words, max_pending_requests=0)
    resp = client.post("/v1/completions", json={"prompt": "x"})
    assert resp.status_code == 429 and resp.json()["error"]["code"] == 429
    assert ctx.submitted == []


def test_a_503_from_the_engine_carries_retry_after_streamed_or_not(make_client):
    """A refusal that comes back over the bus (the engine's queue is full) reaches the client
    with Retry-After, like the gateway's own 429/503, whether or not it asked for a stream."""
    def full(request):
        error = ErrorInfo(message="the engine's queue is full", type="ServiceUnavailableError", code=503)
        return [RequestOutput(request_id=request.request_id, finish_reason=FinishReason.ERROR, error=error)]

    client, _ = make_client(full)
    for stream in (False, True):
        resp = client.post("/v1/completions", json={"prompt": "x", "stream": stream})
        assert resp.status_code == 503, resp.text
        assert resp.headers["retry-after"] == "1" and resp.headers["content-type"] == "application/json"
        assert resp.json()["error"]["message"] == "the engine's queue is full"
