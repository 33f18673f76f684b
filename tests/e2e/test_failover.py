"""Engine failover: two engines, the one generating several streams is SIGKILLed mid-stream; every
stream goes on on the survivor (prompt plus the tokens already delivered, re-prefilled) and
completes without an error, with the text of the same requests run without the fault."""

from __future__ import annotations

import asyncio
import signal
import time

import openai
import pytest

from tests.e2e.conftest import TINY_MAX_MODEL_LEN
from tests.e2e.engines import forget_heartbeat, start_engine
from tests.e2e.stack import Stack

# float32: a re-prefill computes exactly what the decode steps did (bfloat16 may round differently)
TINY_ARGS = ["--enforce-eager", "--dtype", "float32", "--kv-cache-memory", "64M", "--max-num-seqs", "16",
             "--max-num-batched-tokens", "1024"]
REQUESTS = [dict(prompt=f"Story {i}:", temperature=0.0) for i in range(4)] + [
    dict(prompt="Seeded:", temperature=1.0, top_p=0.95, seed=1234),  # seeded sampling goes on from the same state
    dict(prompt="Penalized:", temperature=0.8, seed=99, frequency_penalty=0.5),
]


async def stream_text(client, model: str, max_tokens: int, progress: list[int] | None = None,
                      **kwargs) -> tuple[str, int]:
    """The streamed text of one completion and its completion_tokens (from the usage chunk);
    ``progress[0]`` counts the text chunks received so far."""
    stream = await client.completions.create(model=model, max_tokens=max_tokens, stream=True,
                                             stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True}, **kwargs)
    parts, usage = [], None
    async for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].text)
            if progress is not None:
                progress[0] += 1
        if chunk.usage is not None:
            usage = chunk.usage
    return "".join(parts), usage.completion_tokens


def kill_mid_stream_and_compare(stack: Stack, engine_args: list[str], requests: list[dict], max_tokens: int,
                                model: str) -> None:
    """Run ``requests`` once on the healthy pair of engines, then again with only the second engine
    admitting them, which is frozen and SIGKILLed once every stream is under way: every stream
    completes on the survivor with the first run's text, and nothing is left afterwards."""
    victim = start_engine(stack, "engine-b", "engine-1", *engine_args, timeout_s=300)
    survivor = stack.service("engine")

    async def scenario():
        async with openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="x", max_retries=0,
                                      timeout=300) as client:
            baseline = await asyncio.gather(*(stream_text(client, model, max_tokens, **r) for r in requests))
            survivor.signal(signal.SIGSTOP)  # a few seconds: only the victim admits what comes now
            try:
                await asyncio.sleep(1.5)  # the blocking read the survivor may have left in Redis expires
                progress = [[0] for _ in requests]
                tasks = [asyncio.ensure_future(stream_text(client, model, max_tokens, progress[i], **r))
                         for i, r in enumerate(requests)]
                deadline = time.monotonic() + 60
                while not all(p[0] >= 5 for p in progress):  # every stream under way (so: admitted by the victim)
                    assert time.monotonic() < deadline and not any(t.done() for t in tasks), stack.logs()
                    await asyncio.sleep(0.02)
                victim.signal(signal.SIGSTOP)  # frozen mid-stream (no token, no heartbeat), then killed
                cut = [p[0] for p in progress]
            finally:
                survivor.signal(signal.SIGCONT)
            killed_at = time.monotonic()
            victim.signal(signal.SIGKILL)
            results = await asyncio.gather(*tasks, return_exceptions=True)
            return baseline, results, cut, time.monotonic() - killed_at

    baseline, results, cut, seconds = asyncio.run(scenario())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, (errors, stack.logs())
    assert all(tokens == max_tokens for _, tokens in baseline + results)
    for request, (want, _), (got, _) in zip(requests, baseline, results):
        assert got == want, request
    assert seconds < 90  # the heartbeat age (10 s) and a check (2 s), then the rest of the tokens
    assert all(5 <= c < max_tokens // 2 for c in cut), cut  # every stream was cut early: the rest is the survivor's
    forget_heartbeat(stack, "engine-1")
    stack.assert_idle(timeout_s=20)


def test_streams_of_a_sigkilled_engine_complete_on_the_survivor_with_the_same_text(redis_url, tiny_llama_dir,
                                                                                   tmp_path):
    stack = Stack(redis_url, tiny_llama_dir, tmp_path / "logs", max_model_len=TINY_MAX_MODEL_LEN,
                  engine_args=TINY_ARGS)
    stack.start()
    try:
        kill_mid_stream_and_compare(stack, TINY_ARGS, REQUESTS, max_tokens=300, model="tiny")
    finally:
        stack.stop()


@pytest.mark.slow
def test_default_model_streams_survive_their_engine(redis_url, default_model_dir, tmp_path):
    args = ["--dtype", "float32", "--kv-cache-memory", "256M", "--max-num-seqs", "8"]
    stack = Stack(redis_url, default_model_dir, tmp_path / "logs", served_model_name="smollm2",
                  max_model_len=2048, engine_args=args)
    stack.start(timeout_s=300)
    try:
        requests = [dict(prompt="The history of Paris", temperature=0.0),
                    dict(prompt="def fibonacci(n):", temperature=0.0),
                    dict(prompt="Once upon a time", temperature=0.9, seed=7)]
        kill_mid_stream_and_compare(stack, args, requests, max_tokens=96, model="smollm2")
    finally:
        stack.stop()


def test_a_client_that_leaves_while_its_engine_is_dead_leaves_nothing_behind(redis_url, tiny_llama_dir, tmp_path):
    """Two streams on the victim; it is SIGKILLed and one client leaves before the failover: the
    other stream completes on the survivor, and the one whose client left (its Resume finds no
    one waiting) is given up by the detok shard after the resume timeout; nothing is left."""
    from detok_svc.processor import RESUME_TIMEOUT_S

    stack = Stack(redis_url, tiny_llama_dir, tmp_path / "logs", max_model_len=TINY_MAX_MODEL_LEN,
                  engine_args=TINY_ARGS)
    stack.start()
    try:
        victim = start_engine(stack, "engine-b", "engine-1", *TINY_ARGS)
        survivor = stack.service("engine")

        async def scenario():
            async with openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="x", max_retries=0,
                                          timeout=120) as client:
                survivor.signal(signal.SIGSTOP)
                try:
                    await asyncio.sleep(1.5)
                    streams = [await client.completions.create(model="tiny", prompt=f"Leave {i}:", max_tokens=300,
                                                               temperature=0, stream=True,
                                                               extra_body={"ignore_eos": True}) for i in range(2)]
                    firsts = [await anext(aiter(s)) for s in streams]
                    victim.signal(signal.SIGSTOP)
                finally:
                    survivor.signal(signal.SIGCONT)
                victim.signal(signal.SIGKILL)
                await streams[0].close()  # this client leaves before its request is resumed
                rest = "".join([c.choices[0].text async for c in streams[1] if c.choices])
                return firsts[1].choices[0].text + rest

        text = asyncio.run(scenario())
        assert text
        forget_heartbeat(stack, "engine-1")
        stack.assert_idle(timeout_s=RESUME_TIMEOUT_S + 25)  # the shard's expiry runs every 10 s
    finally:
        stack.stop()
