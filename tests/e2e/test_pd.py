"""Prefill/decode disaggregation end to end: the stack with a prefill engine (engine-p0) and a
decode engine (engine-d0) as real processes on a real redis-server, KV handed over through Redis.

Greedy text equals the unified in-process engine's (float32: its tokens do not depend on how
requests are batched), prefix-cache hits included; the decode engine's counters show every
hand-off loaded (exact counts); spoiled entries (the prefill engine's test hook) are recomputed to
the same text and counted by reason; n > 1 stays on the prefill engine; a client that leaves
between the hand-off and the decode engine's load leaves nothing behind. Every test ends with the
idle invariant on both engines, no entry pending in ps:decode:in and no ps:kv:* key left.
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from shared.protocol import SamplingParams
from tests.e2e.conftest import TINY_ENGINE_ARGS, TINY_MAX_MODEL_LEN, openai_client
from tests.e2e.engines import assert_idle_without, start_engine
from tests.e2e.stack import Stack

ENGINE_ARGS = [*TINY_ENGINE_ARGS, "--dtype", "float32"]
WORDS = "the quick brown fox jumps over a lazy dog while seven red birds sing songs about rivers and hills".split()
SHARED = " ".join(WORDS * 3)  # a long common beginning: prefix-cache hits on the prefill engine
PROMPTS = [" ".join(WORDS[i:i + 3 + i % 5]) for i in range(8)] + [f"{SHARED} number {i}" for i in range(8)]
MAX_TOKENS = 8


def start_pd_stack(redis_url, model_dir, log_dir, prefill_args=()) -> Stack:
    return Stack(redis_url, model_dir, log_dir, pd=True, max_model_len=TINY_MAX_MODEL_LEN, engine_args=ENGINE_ARGS,
                 prefill_args=list(prefill_args)).start()


@pytest.fixture(scope="module")
def pd_stack(redis_url, tiny_llama_dir, tmp_path_factory):
    stack = start_pd_stack(redis_url, tiny_llama_dir, tmp_path_factory.mktemp("pd-logs"))
    yield stack
    stack.stop()


@pytest.fixture
def stack(pd_stack):
    yield pd_stack
    pd_stack.assert_idle()


@pytest.fixture(scope="module")
def reference_engine(tiny_llama_dir):
    from engine_svc import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(enforce_eager=True, model=str(tiny_llama_dir), max_model_len=TINY_MAX_MODEL_LEN,
                                  kv_cache_memory=64 << 20, dtype="float32"))


def reference(engine, prompts, **params) -> list[str]:
    results = engine.generate(prompts, SamplingParams(temperature=0.0, **params))
    return [r.outputs[0].text for r in results]


def beat(stack: Stack, engine_id: str, since: float) -> dict[str, float]:
    """The engine's stats from a heartbeat written after ``since``."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        b = stack.heartbeats().get(engine_id)
        if b is not None and b.time > since:
            return b.stats
        time.sleep(0.2)
    raise AssertionError(f"no fresh heartbeat from {engine_id}")


def complete_all(stack: Stack, prompts: list[str], **kw) -> list:
    client = openai_client(stack)
    body = {"ignore_eos": True, **kw.pop("extra_body", {})}
    with ThreadPoolExecutor(8) as pool:  # concurrent: prefills and decodes overlap
        return list(pool.map(lambda p: client.completions.create(model="tiny", prompt=p, max_tokens=MAX_TOKENS,
                                                                 temperature=0, extra_body=body, **kw), prompts))


def test_greedy_text_through_prefill_and_decode_equals_the_unified_engine(stack, reference_engine):
    expected = reference(reference_engine, PROMPTS, max_tokens=MAX_TOKENS, ignore_eos=True)
    before = beat(stack, "engine-d0", time.time())
    first = complete_all(stack, PROMPTS)
    assert [r.choices[0].text for r in first] == expected
    assert all(r.usage.completion_tokens == MAX_TOKENS for r in first)
    again = complete_all(stack, PROMPTS)  # now every full block of every prompt is cached at the prefill engine
    assert [r.choices[0].text for r in again] == expected
    assert all(r.usage.prompt_tokens_details and r.usage.prompt_tokens_details.cached_tokens > 0 for r in again[8:])
    stream = openai_client(stack).completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=MAX_TOKENS,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == expected[3]
    stack.assert_idle()
    after = beat(stack, "engine-d0", time.time())
    # every request was handed off once and its KV loaded once: 2 x 16 + 1, no fallback
    assert after["kv_num_loaded"] - before.get("kv_num_loaded", 0) == 33
    assert after.get("kv_num_fallbacks", 0) == before.get("kv_num_fallbacks", 0)
    prefill = beat(stack, "engine-p0", time.time())
    assert prefill["kv_num_saved"] >= after["kv_num_loaded"] and prefill["kv_bytes_saved"] > 0
    metrics = httpx.get(f"http://127.0.0.1:{stack.decode_metrics_port}/metrics", timeout=10).text
    loaded = next(line for line in metrics.splitlines()
                  if line.startswith("pagedserve:kv_transfer_requests_total") and 'direction="loaded"' in line)
    assert float(loaded.rsplit(" ", 1)[1]) == after["kv_num_loaded"]


def test_n_greater_than_one_stays_on_the_prefill_engine(stack, reference_engine):
    expected = reference(reference_engine, PROMPTS[:1], max_tokens=MAX_TOKENS, ignore_eos=True)[0]
    before = beat(stack, "engine-d0", time.time())
    resp = openai_client(stack).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                                   temperature=0, n=2, extra_body={"ignore_eos": True})
    assert [c.text for c in resp.choices] == [expected, expected]
    stack.assert_idle()
    assert beat(stack, "engine-d0", time.time()).get("kv_num_loaded", 0) == before.get("kv_num_loaded", 0)


def test_a_client_leaving_between_prefill_and_decode_leaves_nothing(stack):
    """The decode engine is frozen, so the request waits in ps:decode:in with its KV saved; its client
    leaves after the first token. The prefill engine deletes the entry; the thawed decode engine
    finds it gone, recomputes, meets the abort and frees everything."""
    decode = stack.service("engine-d0")
    decode.proc.send_signal(signal.SIGSTOP)
    try:
        with httpx.stream("POST", stack.base_url + "/v1/completions", timeout=30,
                          json={"model": "tiny", "prompt": PROMPTS[9], "max_tokens": 200, "stream": True,
                                "ignore_eos": True}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    break  # the first token, from the prefill engine
        deadline = time.monotonic() + 10
        with stack.redis() as client:
            while time.monotonic() < deadline and list(client.scan_iter(match=f"{stack.prefix}:kv:*")):
                time.sleep(0.1)
            assert not list(client.scan_iter(match=f"{stack.prefix}:kv:*"))  # deleted by the prefill engine
            assert client.xlen(stack.names.decode_in) >= 1  # the hand-off, waiting for the decode engine
    finally:
        decode.proc.send_signal(signal.SIGCONT)
    stack.assert_idle(timeout_s=20)


def test_spoiled_kv_entries_are_recomputed_to_the_same_text(redis_url, tiny_llama_dir, tmp_path, reference_engine):
    """The prefill engine's test hook spoils its entries in turn: deleted, a flipped byte, a header
    for another block size. The decode engine refuses each, counts it by reason, and recomputes."""
    stack = start_pd_stack(redis_url, tiny_llama_dir, tmp_path, ["--kv-transfer-fault", "delete,flip,foreign"])
    try:
        prompts = PROMPTS[:3]
        expected = reference(reference_engine, prompts, max_tokens=MAX_TOKENS, ignore_eos=True)
        client = openai_client(stack)
        texts = [client.completions.create(model="tiny", prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
        assert texts == expected
        stack.assert_idle()
        stats = beat(stack, "engine-d0", time.time())
        reasons = (stats["kv_fallbacks_missing"], stats["kv_fallbacks_corrupt"], stats["kv_fallbacks_mismatch"])
        assert reasons == (1, 1, 1)
        assert stats["kv_num_fallbacks"] == 3 and stats.get("kv_num_loaded", 0) == 0
    finally:
        stack.stop()



def test_streams_of_a_killed_decode_engine_complete_on_another_with_the_same_text(redis_url, tiny_llama_dir,
                                                                                  tmp_path):
    """Two decode engines; the one generating four streams is frozen mid-stream and SIGKILLed. Its
    requests fail over (the detok shard's Resume, README: Failover): the prefill engine re-prefills
    each with its delivered tokens and hands it to the other decode engine; every stream completes
    with the text of a fault-free run."""
    import asyncio

    import openai

    stack = start_pd_stack(redis_url, tiny_llama_dir, tmp_path)
    try:
        other = start_engine(stack, "engine-d1", "engine-d1", "--role", "decode", *ENGINE_ARGS)
        victim = stack.service("engine-d0")

        async def one(client, prompt: str, progress: list[int] | None = None) -> str:
            stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=200, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True})
            parts = []
            async for chunk in stream:
                if chunk.choices:
                    parts.append(chunk.choices[0].text)
                    if progress is not None:
                        progress[0] += 1
            return "".join(parts)

        async def scenario():
            async with openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="x", max_retries=0,
                                          timeout=300) as client:
                prompts = [f"Story {i}:" for i in range(4)]
                baseline = await asyncio.gather(*(one(client, p) for p in prompts))
                other.signal(signal.SIGSTOP)  # only the victim takes the next hand-offs
                try:
                    await asyncio.sleep(1.5)  # the blocking read it may have left in Redis expires
                    progress = [[0] for _ in prompts]
                    tasks = [asyncio.ensure_future(one(client, p, progress[i])) for i, p in enumerate(prompts)]
                    deadline = time.monotonic() + 60
                    while not all(p[0] >= 5 for p in progress):
                        assert time.monotonic() < deadline and not any(t.done() for t in tasks), stack.logs()
                        await asyncio.sleep(0.02)
                    victim.signal(signal.SIGSTOP)
                    cut = [p[0] for p in progress]
                finally:
                    other.signal(signal.SIGCONT)
                victim.signal(signal.SIGKILL)
                return baseline, await asyncio.gather(*tasks, return_exceptions=True), cut

        baseline, results, cut = asyncio.run(scenario())
        assert not [r for r in results if isinstance(r, BaseException)], (results, stack.logs())
        assert results == baseline
        assert all(5 <= c < 100 for c in cut), cut  # cut early: the rest came from engine-d1
        assert_idle_without(stack, "engine-d0", timeout_s=20)
        d1 = stack.heartbeats()["engine-d1"].stats
        assert d1["num_free_blocks"] == d1["num_total_blocks"] and d1["num_requests"] == 0
        assert d1["kv_num_loaded"] >= 4  # the resumed requests came to it through the hand-off
    finally:
        stack.stop()


@pytest.mark.slow
def test_default_model_greedy_text_through_prefill_and_decode(redis_url, default_model_dir, tmp_path):
    """16 prompts on the default model (float32, eager on both sides) through the P/D stack, twice
    (the second round hits the prefill engine's prefix cache): the unified engine's text."""
    from engine_svc import EngineConfig, LLMEngine

    args = ["--enforce-eager", "--dtype", "float32", "--kv-cache-memory", "256M", "--max-num-seqs", "16"]
    unified = LLMEngine(EngineConfig(enforce_eager=True, model=str(default_model_dir), dtype="float32",
                                     max_model_len=2048, kv_cache_memory=256 << 20))
    expected = reference(unified, PROMPTS, max_tokens=MAX_TOKENS, ignore_eos=True)
    del unified
    stack = Stack(redis_url, default_model_dir, tmp_path, pd=True, served_model_name="smollm2", max_model_len=2048,
                  engine_args=args).start(timeout_s=400)
    try:
        client = openai_client(stack, timeout=300)
        for _ in range(2):
            with ThreadPoolExecutor(8) as pool:
                texts = list(pool.map(lambda p: client.completions.create(
                    model="smollm2", prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                    extra_body={"ignore_eos": True}).choices[0].text, PROMPTS))
            assert texts == expected
        stack.assert_idle()
        decode = beat(stack, "engine-d0", time.time())
        assert decode["kv_num_loaded"] == 32 and decode["kv_num_fallbacks"] == 0
        assert beat(stack, "engine-p0", time.time())["prefix_cache_hits"] > 0
    finally:
        stack.stop()


def test_a_decode_engine_killed_before_its_load_leaves_its_requests_to_another(redis_url, tiny_llama_dir, tmp_path,
                                                                               reference_engine):
    """engine-d1 (test hook "stall": 5 s before each load) takes the hand-offs while engine-d0 is
    frozen, and is SIGKILLed while it sleeps before its first load: it holds a request whose KV entry
    it never read. Every stream completes on engine-d0 with the fault-free text (failover from the
    detok shard, or the hand-off still unread), within a bounded delay; the un-loaded entry does not
    leak (the failover's re-prefill saves it again, and engine-d0's load consumes it)."""
    import asyncio

    import openai

    prompts = [f"Story {i}:" for i in range(4)]
    max_tokens = 24
    expected = reference(reference_engine, prompts, max_tokens=max_tokens, ignore_eos=True)
    stack = start_pd_stack(redis_url, tiny_llama_dir, tmp_path)
    try:
        victim = start_engine(stack, "engine-d1", "engine-d1", "--role", "decode", "--kv-transfer-fault", "stall",
                              *ENGINE_ARGS)
        other = stack.service("engine-d0")

        async def one(client, prompt: str) -> str:
            stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
            return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

        async def scenario():
            async with openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="x", max_retries=0,
                                          timeout=300) as client:
                other.signal(signal.SIGSTOP)  # only the victim takes the hand-offs
                try:
                    await asyncio.sleep(1.5)  # the blocking read it may have left in Redis expires
                    tasks = [asyncio.ensure_future(one(client, p)) for p in prompts]
                    deadline = time.monotonic() + 60
                    while "test hook: stalling" not in victim.log_path.read_text(errors="replace"):
                        assert time.monotonic() < deadline and not any(t.done() for t in tasks), stack.logs()
                        await asyncio.sleep(0.02)
                    victim.signal(signal.SIGKILL)  # in its stall: it admitted a hand-off, and loaded nothing
                    killed_at = time.monotonic()
                    with stack.redis() as r:
                        entries = list(r.scan_iter(match=f"{stack.prefix}:kv:*"))
                finally:
                    other.signal(signal.SIGCONT)
                results = await asyncio.gather(*tasks, return_exceptions=True)
                return results, entries, time.monotonic() - killed_at

        results, entries, delay = asyncio.run(scenario())
        assert not [r for r in results if isinstance(r, BaseException)], (results, stack.logs())
        assert results == expected
        assert entries  # the victim died holding at least one KV entry it had not loaded
        assert delay < 60, delay  # the heartbeat goes stale in 10 s; a re-prefill and 24 tokens take far less
        victim.proc.wait(timeout=10)
        assert_idle_without(stack, "engine-d1", timeout_s=30)  # no ps:kv:* key left: the entry did not leak
        beats = stack.heartbeats()
        d0 = beats["engine-d0"].stats
        assert d0["kv_num_loaded"] >= 1 and d0["num_requests"] == 0
        # the victim's admitted request came back through a failover: resubmitted, prefilled again
        assert beats["engine-p0"].stats["num_messages"] >= len(prompts) + 1
    finally:
        stack.stop()
