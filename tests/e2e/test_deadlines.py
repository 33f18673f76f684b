"""Deadlines end to end: work whose client was answered at its deadline is computed by nobody.

The engine (or the tokenizer) is frozen with SIGSTOP while requests with a 2 s request_timeout
arrive; every client gets its 503 at the deadline from the gateway; then the frozen service
resumes and finds the requests on its stream. The engine's own counters (its /metrics) show that
it computed none of them -- no prompt or generation token counted, each one refused at admission
and counted as expired -- and the stack is idle afterwards.
"""

from __future__ import annotations

import asyncio
import signal
import time

import openai
import pytest

from tests.e2e.conftest import TINY_ENGINE_ARGS, TINY_MAX_MODEL_LEN, openai_client
from tests.e2e.stack import Stack

NUM_REQUESTS = 8
TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def deadline_stack(redis_url, tiny_llama_dir, tmp_path_factory):
    stack = Stack(redis_url, tiny_llama_dir, tmp_path_factory.mktemp("deadline-logs"), num_tokenizers=1,
                  max_model_len=TINY_MAX_MODEL_LEN, engine_args=TINY_ENGINE_ARGS)
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture
def stack(deadline_stack):
    yield deadline_stack
    deadline_stack.assert_idle(timeout_s=15)


async def _expire_all(stack: Stack, frozen) -> list[tuple[BaseException | None, float]]:
    """NUM_REQUESTS requests (half streamed) while ``frozen`` is stopped; each one's error and when it came."""
    async with openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
        await client.models.list()  # a warm connection

        async def one(i: int):
            started = time.monotonic()
            try:
                if i % 2:
                    stream = await client.completions.create(
                        model="tiny", prompt=f"Late {i}:", max_tokens=8, stream=True,
                        extra_body={"request_timeout": TIMEOUT_S, "ignore_eos": True})
                    async for _ in stream:
                        pass
                else:
                    await client.chat.completions.create(
                        model="tiny", messages=[{"role": "user", "content": f"Late {i}"}], max_tokens=8,
                        extra_body={"request_timeout": TIMEOUT_S})
            except openai.APIError as exc:
                return exc, time.monotonic() - started
            return None, time.monotonic() - started

        for service in frozen:
            service.signal(signal.SIGSTOP)
        try:
            return await asyncio.gather(*[one(i) for i in range(NUM_REQUESTS)])
        finally:
            await asyncio.sleep(1.0)  # past every deadline with a margin, then the service goes on
            for service in frozen:
                service.signal(signal.SIGCONT)


def _assert_answered_at_the_deadline(results) -> None:
    for error, seconds in results:
        assert error is not None and "deadline" in str(error), error
        assert TIMEOUT_S - 0.05 <= seconds < TIMEOUT_S + 8.0  # slack for a loaded machine


def _wait_for(predicate, stack: Stack, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out: {stack.engine_counters()}\n{stack.logs()}"
        time.sleep(0.2)


def test_an_engine_frozen_through_the_deadlines_computes_none_of_those_requests(stack):
    client = openai_client(stack, timeout=60)
    assert client.completions.create(model="tiny", prompt="warm", max_tokens=2).usage.completion_tokens == 2
    before = stack.engine_counters()

    results = asyncio.run(_expire_all(stack, [stack.service("engine")]))
    _assert_answered_at_the_deadline(results)

    # the resumed engine finds the requests on ps:engine:in and refuses each at admission (it
    # reads its requests before its ctl stream in a turn, so the gateway's aborts come second)
    _wait_for(lambda: stack.engine_counters()["num_requests_expired_total:admission"]
              == before["num_requests_expired_total:admission"] + NUM_REQUESTS, stack)
    after = stack.engine_counters()
    for name in ("prompt_tokens_total", "generation_tokens_total", "num_requests_expired_total:waiting",
                 "num_requests_expired_total:running"):
        assert after[name] == before[name], name  # nothing of theirs computed
    # and the engine serves as before
    assert client.completions.create(model="tiny", prompt="again", max_tokens=3).usage.completion_tokens == 3


def test_a_tokenizer_frozen_through_the_deadlines_forwards_none_of_those_requests(stack):
    before = stack.engine_counters()
    results = asyncio.run(_expire_all(stack, [stack.service("tokenizer-0")]))
    _assert_answered_at_the_deadline(results)
    _wait_for(lambda: not any(stack.pending().values()), stack)  # the tokenizer has read and answered them all
    time.sleep(1.5)  # what it would have forwarded has reached the engine by now
    after = stack.engine_counters()
    for name in ("prompt_tokens_total", "generation_tokens_total", "num_requests_expired_total:admission",
                 "num_requests_expired_total:waiting", "num_requests_expired_total:running"):
        assert after[name] == before[name], name  # none reached the engine


def test_a_stream_still_generating_at_its_deadline_ends_there_and_its_engine_stops(stack):
    """The client gets its text so far, then one error event; the engine stops computing it at the
    deadline (by its own check or by the gateway's abort, whichever comes first) and frees its blocks."""
    # The tiny model streams its 1,000 tokens in 1.0-1.6 s here (greedy or sampled): a deadline
    # of 0.4 s ends the stream well inside them, and its first token well after.
    deadline_s = 0.4
    before = stack.engine_counters()
    client = openai_client(stack, timeout=60)
    started = time.monotonic()
    stream = client.completions.create(model="tiny", prompt="Count:", max_tokens=1000, stream=True,
                                       extra_body={"request_timeout": deadline_s, "ignore_eos": True})
    chunks = []
    with pytest.raises(openai.APIError) as info:
        for chunk in stream:
            chunks.append(chunk)
    seconds = time.monotonic() - started
    assert "deadline" in str(info.value) and chunks and deadline_s - 0.05 <= seconds < deadline_s + 8.0
    _wait_for(lambda: stack.engine_stats().get("num_requests", 1) == 0, stack)
    after = stack.engine_counters()
    assert after["generation_tokens_total"] - before["generation_tokens_total"] < 1000  # stopped early
    stopped_by = {phase: after[f"num_requests_expired_total:{phase}"] - before[f"num_requests_expired_total:{phase}"]
                  for phase in ("admission", "waiting", "running")}
    assert stopped_by in ({"admission": 0, "waiting": 0, "running": 1}, {"admission": 0, "waiting": 0, "running": 0})


def test_a_bad_request_timeout_is_a_400_naming_it(stack):
    client = openai_client(stack)
    for value in (0, -1, 10_000, "soon"):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"request_timeout": value})
        assert info.value.body["param"] == "request_timeout"
