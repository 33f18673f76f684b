"""The whole stack (real processes) on a redis-server of the test's own, which is paused (SIGSTOP)
for 15 s, killed and restarted empty, or flushed, under streaming traffic.

Every client gets either its whole output or exactly one error event, within its deadline; no
service process dies; new requests succeed 10 s after Redis is back, without restarting
anything; afterwards nothing is pending, no request state is left, every KV block is free, and
the consumer-group streams hold no consumed entry (they are deleted with their ack)."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from tests.e2e.conftest import TINY_ENGINE_ARGS, TINY_MAX_MODEL_LEN
from tests.e2e.stack import Stack
from tests.fixtures.redis import restart_empty

NUM_STREAMS = 6
MAX_TOKENS = 900  # long enough to be mid-stream when the fault comes
CLIENT_DEADLINE_S = 120.0


@pytest.fixture
def stack(own_redis, tiny_llama_dir, tmp_path):
    stack = Stack(own_redis.url, tiny_llama_dir, tmp_path / "logs", max_model_len=TINY_MAX_MODEL_LEN,
                  engine_args=TINY_ENGINE_ARGS, gateway_args=["--request-timeout", "90"])
    stack.start()
    yield stack
    stack.stop()


@dataclass
class Outcome:
    status: int = 0
    events: list[dict] = field(default_factory=list)
    done: bool = False  # the [DONE] event came
    seconds: float = 0.0

    @property
    def errors(self) -> list[dict]:
        return [e for e in self.events if "error" in e]

    def problem(self) -> str | None:
        """None when the client got its whole output or exactly one error event (the last)."""
        if self.status != 200:
            return f"HTTP {self.status}"
        if self.errors:
            if len(self.errors) != 1 or "error" not in self.events[-1]:
                return f"{len(self.errors)} error events, last event {self.events[-1]}"
            return None
        usage = [e["usage"] for e in self.events if e.get("usage")]
        if not self.done or not usage or usage[-1]["completion_tokens"] != MAX_TOKENS:
            return f"incomplete without an error: done={self.done}, usage={usage[-1:]}"
        return None


async def _stream(client: httpx.AsyncClient, i: int, started: asyncio.Event) -> Outcome:
    body = {"model": "tiny", "prompt": f"Count {i}:", "max_tokens": MAX_TOKENS, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    outcome, t0 = Outcome(), time.monotonic()
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        outcome.status = resp.status_code
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                outcome.done = True
                continue
            outcome.events.append(json.loads(line[6:]))
            started.set()
    outcome.seconds = time.monotonic() - t0
    return outcome


async def _traffic(stack: Stack, under_way: threading.Event) -> list[Outcome]:
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=CLIENT_DEADLINE_S) as client:
        started = [asyncio.Event() for _ in range(NUM_STREAMS)]
        tasks = [asyncio.ensure_future(_stream(client, i, started[i])) for i in range(NUM_STREAMS)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        under_way.set()
        return await asyncio.wait_for(asyncio.gather(*tasks), CLIENT_DEADLINE_S)


def _under_traffic(stack: Stack, fault) -> tuple[list[Outcome], float]:
    """NUM_STREAMS streams, each under way when ``fault()`` runs; their outcomes and the monotonic
    time the fault ended (Redis back). The fault runs on this (the main) thread: a redis-server
    dies with the thread that started it (PR_SET_PDEATHSIG), so it must outlive the test."""
    under_way, result = threading.Event(), {}

    def clients() -> None:
        try:
            result["outcomes"] = asyncio.run(_traffic(stack, under_way))
        except BaseException as exc:  # noqa: BLE001 - reported below
            result["error"] = exc
            under_way.set()

    thread = threading.Thread(target=clients, daemon=True)
    thread.start()
    assert under_way.wait(90) and "error" not in result, result
    fault()
    back = time.monotonic()
    thread.join(CLIENT_DEADLINE_S + 30)
    assert "outcomes" in result, (result, stack.logs())
    return result["outcomes"], back


def _new_requests_succeed(stack: Stack, back: float) -> None:
    time.sleep(max(0.0, back + 10 - time.monotonic()))
    with httpx.Client(base_url=stack.base_url, timeout=60) as client:
        for i in range(3):
            resp = client.post("/v1/completions", json={"model": "tiny", "prompt": f"After {i}", "max_tokens": 8,
                                                        "ignore_eos": True})
            assert resp.status_code == 200, (resp.status_code, resp.text, stack.logs())
            assert resp.json()["usage"]["completion_tokens"] == 8


def _check(stack: Stack, outcomes: list[Outcome], back: float) -> None:
    print(f"{sum(not o.errors for o in outcomes)} streams whole, errors: {[o.errors[0]['error']['message'] for o in outcomes if o.errors]}")
    problems = [(i, p) for i, o in enumerate(outcomes) if (p := o.problem()) is not None]
    assert not problems, (problems, stack.logs())
    dead = [s.name for s in stack.services if not s.is_alive]
    assert not dead, (dead, stack.logs())
    _new_requests_succeed(stack, back)
    stack.assert_idle(timeout_s=30)
    names = stack.names
    with stack.redis() as client:  # consumed entries are deleted with their ack
        lengths = {s: client.xlen(s) for s in (names.tokenizer_in, names.engine_in, names.detok_in(0))}
    assert lengths == dict.fromkeys(lengths, 0), lengths
    assert not [s.name for s in stack.services if not s.is_alive], stack.logs()


@pytest.mark.slow
def test_redis_paused_for_15s_under_streaming_traffic(stack, own_redis):
    def pause():
        own_redis.process.send_signal(signal.SIGSTOP)
        try:
            time.sleep(15)
        finally:
            own_redis.process.send_signal(signal.SIGCONT)

    outcomes, back = _under_traffic(stack, pause)
    _check(stack, outcomes, back)


@pytest.mark.slow
def test_redis_killed_and_restarted_empty_under_streaming_traffic(stack, own_redis):
    def kill_and_restart():
        own_redis.stop()
        time.sleep(3)
        restart_empty(own_redis)

    outcomes, back = _under_traffic(stack, kill_and_restart)
    _check(stack, outcomes, back)
    messages = [o.errors[0]["error"]["message"] for o in outcomes if o.errors]
    assert all(m.startswith("the request bus lost its state") for m in messages), messages


@pytest.mark.slow
def test_flushall_under_streaming_traffic(stack, own_redis):
    def flush():
        with stack.redis() as client:
            client.flushall()

    outcomes, back = _under_traffic(stack, flush)
    _check(stack, outcomes, back)
    # Neither the detok shard nor the gateway takes the flush for the engine's death (both judge a
    # heartbeat hash younger than the age limit as no evidence); the engine ends what it held with
    # its own 503.
    allowed = ("the request bus lost its state",)
    messages = [o.errors[0]["error"]["message"] for o in outcomes if o.errors]
    assert all(m.startswith(allowed) for m in messages), messages
