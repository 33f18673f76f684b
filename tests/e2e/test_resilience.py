"""Processes killed under load: a tokenizer replica's pending requests are reclaimed and every request
completes; a dead engine's requests fail fast and leave nothing behind."""

from __future__ import annotations

import asyncio
import signal
import time

import openai
import pytest

from shared.protocol import GROUP_TOKENIZER
from tests.e2e.conftest import TINY_ENGINE_ARGS, TINY_MAX_MODEL_LEN
from tests.e2e.stack import Stack


@pytest.fixture
def stack(redis_url, tiny_llama_dir, tmp_path):
    stack = Stack(redis_url, tiny_llama_dir, tmp_path / "logs", num_tokenizers=3,
                  max_model_len=TINY_MAX_MODEL_LEN, engine_args=TINY_ENGINE_ARGS)
    stack.start()
    yield stack
    try:
        stack.assert_idle(timeout_s=15)
    finally:
        stack.stop()


def test_sigkilled_tokenizer_under_load_loses_no_request(stack):
    victim = stack.service("tokenizer-0")

    def stranded() -> int:
        with stack.redis() as client:
            consumers = client.xinfo_consumers(stack.names.tokenizer_in, GROUP_TOKENIZER)
        return sum(c["pending"] for c in consumers if c["name"] == b"tokenizer-0")

    async def scenario():
        async with openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="x", max_retries=0,
                                      timeout=180) as client:
            await client.models.list()  # a warm connection, so the burst lands at once
            replicas = [stack.service(f"tokenizer-{i}") for i in range(3)]
            for replica in replicas:  # nobody reads while the burst arrives...
                replica.signal(signal.SIGSTOP)
            tasks = [asyncio.ensure_future(client.completions.create(
                model="tiny", prompt=f"Load {i}:", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}))
                for i in range(40)]
            await asyncio.sleep(1.0)
            with stack.redis() as redis_client:  # ...then the victim takes a batch it will never process
                redis_client.xreadgroup(GROUP_TOKENIZER, "tokenizer-0", {stack.names.tokenizer_in: ">"}, count=8)
            num_stranded = stranded()
            victim.signal(signal.SIGKILL)
            for replica in replicas[1:]:
                replica.signal(signal.SIGCONT)
            return num_stranded, await asyncio.gather(*tasks, return_exceptions=True)

    num_stranded, results = asyncio.run(scenario())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert len(results) == 40 and all(r.usage.completion_tokens == 6 for r in results)
    assert num_stranded > 0  # the survivors really did reclaim the dead replica's entries
    assert stranded() == 0


def test_a_dead_engine_fails_its_requests_fast_and_leaves_no_state(redis_url, tiny_llama_dir, tmp_path):
    """SIGKILL the only engine mid-stream: the streaming client gets an error event and a queued
    request a 503, within the heartbeat age (10 s) and a check (2 s), not after the 600 s idle
    timeout; the detokenizer and the gateway hold nothing afterwards."""
    stack = Stack(redis_url, tiny_llama_dir, tmp_path / "logs", max_model_len=TINY_MAX_MODEL_LEN,
                  engine_args=TINY_ENGINE_ARGS)
    stack.start()
    try:
        engine = stack.service("engine")

        async def scenario():
            async with openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="x", max_retries=0,
                                          timeout=120) as client:
                stream = await client.completions.create(model="tiny", prompt="Count:", max_tokens=900,
                                                         stream=True, extra_body={"ignore_eos": True})
                first = await anext(aiter(stream))
                engine.signal(signal.SIGSTOP)  # frozen mid-stream: no more tokens, no more heartbeats
                started = asyncio.get_running_loop().time()
                queued = asyncio.ensure_future(client.completions.create(model="tiny", prompt="Later", max_tokens=4))
                await asyncio.sleep(0.5)
                engine.signal(signal.SIGKILL)
                with pytest.raises(openai.APIError) as streamed:
                    async for _ in stream:
                        pass
                with pytest.raises(openai.APIStatusError) as waiting:
                    await queued
                return first, streamed.value, waiting.value, asyncio.get_running_loop().time() - started

        first, streamed, waiting, seconds = asyncio.run(scenario())
        assert first.choices[0].text is not None
        assert "stopped" in str(streamed) or "no engine" in str(streamed)
        assert waiting.status_code == 503 and "no engine is alive" in waiting.message
        assert seconds < 30
        deadline = time.monotonic() + 10
        while True:
            beats = stack.heartbeats()
            held = {k: b.stats.get("num_requests", 0) + b.stats.get("num_routes", 0) for k, b in beats.items()
                    if b.service in ("detok", "gateway")}
            pending = stack.pending()[f"{stack.names.detok_in(0)}/detok"]
            if (not any(held.values()) and pending == 0) or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        assert not any(held.values()) and pending == 0, (held, pending)
    finally:
        stack.stop()
