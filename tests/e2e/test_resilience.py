"""Processes killed under load: a tokenizer replica's pending requests are reclaimed and every request
completes; a dead engine's requests go on on another engine (failover), or fail fast when none is
left, and leave nothing behind."""

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
            held = {k: b.stats.get("num_requests", 0) + b.stats.get("num_inboxes", 0) for k, b in beats.items()
                    if b.service in ("detok", "gateway")}
            pending = stack.pending()[f"{stack.names.detok_in(0)}/detok"]
            if (not any(held.values()) and pending == 0) or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        assert not any(held.values()) and pending == 0, (held, pending)
    finally:
        stack.stop()


def test_requests_a_dead_engine_admitted_go_on_on_another_engine(redis_url, tiny_llama_dir, tmp_path):
    """Two engines; the one that admitted three requests (one streaming, two still waiting for a
    slot) is SIGKILLed. The detokenizer knows them from the engine's admission announcements and
    hands them back to the gateway, which resubmits them: the stream goes on from the tokens it
    had, the waiting ones start over, all on the other engine, within the heartbeat age and a
    check (not the idle timeout); the other engine serves new requests too. (float32: a re-prefill
    computes what the decode steps did, so the greedy text is the fault-free one.)"""
    one_at_a_time = ["--enforce-eager", "--dtype", "float32", "--kv-cache-memory", "64M", "--max-num-seqs", "1",
                     "--max-num-batched-tokens", "1024"]
    stack = Stack(redis_url, tiny_llama_dir, tmp_path / "logs", max_model_len=TINY_MAX_MODEL_LEN,
                  engine_args=one_at_a_time)
    stack.start()
    try:
        victim = stack.service("engine")
        survivor = stack.start_service("engine-b", "engine_svc", "--service-id", "engine-1", *one_at_a_time)
        deadline = time.monotonic() + 120
        while "engine-1" not in stack.heartbeats():
            assert time.monotonic() < deadline, stack.logs()
            time.sleep(0.25)

        def detok_holds() -> float:
            beat = stack.heartbeats().get("detok-0")
            return beat.stats.get("num_requests", 0) if beat is not None else 0

        async def scenario():
            async with openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="x", max_retries=0,
                                          timeout=120) as client:
                survivor.signal(signal.SIGSTOP)  # a few seconds: only the victim admits what comes now
                await asyncio.sleep(1.5)  # the blocking read it may have left in Redis (≤ 0.5 s) expires
                try:
                    stream = await client.completions.create(model="tiny", prompt="Count:", max_tokens=900,
                                                             temperature=0, stream=True,
                                                             extra_body={"ignore_eos": True})
                    first = await anext(aiter(stream))
                    waiting = [asyncio.ensure_future(client.completions.create(
                        model="tiny", prompt=f"Wait {i}", max_tokens=4, extra_body={"ignore_eos": True}))
                        for i in range(2)]
                    deadline = time.monotonic() + 5
                    while detok_holds() < 3:  # announced: admitted by the victim, no token yet
                        assert time.monotonic() < deadline, stack.logs()
                        await asyncio.sleep(0.05)
                finally:
                    survivor.signal(signal.SIGCONT)
                victim.signal(signal.SIGKILL)
                started = time.monotonic()
                streamed = first.choices[0].text + "".join([c.choices[0].text async for c in stream])
                results = await asyncio.gather(*waiting, return_exceptions=True)
                seconds = time.monotonic() - started
                later = await client.completions.create(model="tiny", prompt="After", max_tokens=4,
                                                        extra_body={"ignore_eos": True})
                whole = await client.completions.create(model="tiny", prompt="Count:", max_tokens=900,
                                                        temperature=0, extra_body={"ignore_eos": True})
                return streamed, results, seconds, later, whole

        streamed, results, seconds, later, whole = asyncio.run(scenario())
        assert not any(isinstance(r, BaseException) for r in results), results
        assert all(r.usage.completion_tokens == 4 for r in results)
        assert streamed == whole.choices[0].text  # no token lost or repeated across the failover (greedy)
        assert seconds < 60
        assert later.usage.completion_tokens == 4  # the surviving engine serves
        deadline = time.monotonic() + 15
        while True:
            beats = stack.heartbeats()
            alive = beats["engine-1"].stats
            problems = [k for k, b in beats.items() if b.service in ("detok", "gateway")
                        and b.stats.get("num_requests", 0) + b.stats.get("num_inboxes", 0)]
            if alive["num_free_blocks"] != alive["num_total_blocks"] or alive["num_requests"]:
                problems.append(f"engine-1: {alive}")
            problems += [k for k, v in stack.pending().items() if v]
            if not problems or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        assert not problems, problems
    finally:
        stack.stop()
