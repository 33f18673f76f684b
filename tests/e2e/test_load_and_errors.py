"""Load across tokenizer replicas, clients that leave, and bad requests -- against the whole stack."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

# --------------------------------------------------------------------------- load


def tokenizer_counts(stack) -> dict[str, float]:
    return {k: b.stats.get("num_requests", 0.0) for k, b in stack.heartbeats().items() if b.service == "tokenizer"}


def wait_for_fresh_heartbeats(stack, since: float, services=("tokenizer",), timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        beats = [b for b in stack.heartbeats().values() if b.service in services]
        if beats and all(b.time > since for b in beats):
            return
        time.sleep(0.1)


def test_60_concurrent_requests_spread_over_3_tokenizers(stack):
    before = tokenizer_counts(stack)
    assert len(before) == 3

    async def one(client, i):
        if i % 2:
            resp = await client.completions.create(model="tiny", prompt=f"Request {i}:", max_tokens=8,
                                                   temperature=0.7, seed=i, extra_body={"ignore_eos": True})
            return resp.usage.completion_tokens
        resp = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"#{i}"}],
                                                    max_tokens=8, extra_body={"ignore_eos": True})
        return resp.usage.completion_tokens

    async def burst():
        async with openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="x", max_retries=0,
                                      timeout=180) as client:
            return await asyncio.gather(*(one(client, i) for i in range(60)))

    assert asyncio.run(burst()) == [8] * 60
    wait_for_fresh_heartbeats(stack, time.time())
    after = tokenizer_counts(stack)
    handled = {k: after[k] - before.get(k, 0.0) for k in after}
    assert sum(handled.values()) == 60
    assert all(n > 0 for n in handled.values()), handled


# --------------------------------------------------------------------------- clients that leave


def engine_request_free_within(stack, seconds: float) -> float:
    """Seconds until an engine heartbeat beaten after this call reports no request and every block
    free (fails after ``seconds``; the engine beats every second, so an older beat proves nothing)."""
    start, since = time.monotonic(), time.time()
    while time.monotonic() - start < seconds:
        beat = stack.heartbeats()["engine-0"]
        s = beat.stats
        if beat.time > since and s["num_requests"] == 0 and s["num_free_blocks"] == s["num_total_blocks"]:
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"engine still busy {seconds}s after the client left: {stack.engine_stats()}")


def test_client_leaving_mid_stream_frees_its_blocks_within_2s(stack):
    # The client leaves after 5 chunks, long before the last of the 1,000 tokens (at least 1 s of
    # decoding here); the engine's own token counter shows that it stopped early.
    before = stack.engine_counters()["generation_tokens_total"]
    body = {"model": "tiny", "prompt": "A very long story:", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", stack.base_url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            num_chunks = 0
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    assert json.loads(line[6:])["choices"][0]["finish_reason"] is None
                    num_chunks += 1
                    if num_chunks == 5:
                        break
    # leaving the with-blocks closed the connection mid-stream
    engine_request_free_within(stack, 2.0)
    assert stack.engine_counters()["generation_tokens_total"] - before < 1000


def test_client_leaving_a_unary_request_aborts_it(stack):
    # the tiny model takes 1.0-1.6 s for its 1,000 tokens here: a client that leaves after 0.3 s
    # leaves while they are computed
    body = {"model": "tiny", "prompt": "Another long story:", "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(stack.base_url + "/v1/completions", json=body, timeout=0.3)
    engine_request_free_within(stack, 2.0)


# --------------------------------------------------------------------------- bad requests


def post_raw(stack, path: str, content: bytes) -> httpx.Response:
    return httpx.post(stack.base_url + path, content=content, headers={"content-type": "application/json"},
                      timeout=30)


def assert_envelope(resp: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status and error["message"]
    if param != "any":
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize("body, status, param", [
    (b'{"model": "tiny", "prompt": "x"', 400, None),  # malformed JSON
    (b'{"model": "tiny", "prompt": "x", "max_tokens": "ten"}', 400, "max_tokens"),  # wrong type
    (b'{"model": "tiny", "prompt": {"text": "x"}}', 400, "prompt"),  # wrong type
    (b'{"model": "tiny", "prompt": "x", "n": 0}', 400, "n"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": -1}', 400, "max_tokens"),
    (b'{"model": "tiny", "prompt": "x", "temperature": 5}', 400, "temperature"),
    (b'{"model": "gpt-17", "prompt": "x"}', 404, "model"),
])
def test_bad_requests_get_status_and_envelope(stack, body, status, param):
    assert_envelope(post_raw(stack, "/v1/completions", body), status, param)


def test_prompts_longer_than_max_model_len_are_400(stack, client):
    long_text = "hello " * 1500  # well over max_model_len tokens
    for path, body in (("/v1/completions", {"model": "tiny", "prompt": long_text}),
                       ("/v1/completions", {"model": "tiny", "prompt": list(range(5, 1500))}),
                       ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": long_text}]}),
                       ("/v1/completions", {"model": "tiny", "prompt": long_text, "stream": True})):
        error = assert_envelope(httpx.post(stack.base_url + path, json=body, timeout=30), 400)
        assert "maximum context length" in error["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", max_tokens=5000)
    assert info.value.status_code == 400


def test_the_openai_client_sees_the_right_exceptions(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", n=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], temperature=5)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
