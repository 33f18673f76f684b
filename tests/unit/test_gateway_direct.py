"""The per-token fast path (gateway/direct_write.py) under a real uvicorn server.

Outputs arrive one at a time, as from the bus, so that the stream's task waits on an empty inbox
when most of them land: those go straight to the transport. The client must see exactly what the
ASGI path sends (compared with Starlette's TestClient, which has no raw send and so never takes
the fast path), and a stream still flowing at its deadline must end there with one error event. The fast path must not turn itself off without a test failing: the installed uvicorn must
be one it supports, and under it most plain deltas must take it.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time

import pytest
import uvicorn
from starlette.testclient import TestClient

from gateway.app import build_app
from gateway.config import GatewayLimits
from gateway.collector import Collector
from gateway.direct_write import SUPPORTED_UVICORN, capture_raw_send, is_supported, uvicorn_version
from shared.config import GatewayConfig
from shared.redis_server import free_port
from tests.unit.test_gateway_flow import ScriptedContext, _SilentReader, sse_events, words

TEXTS = tuple(f" w{i}" for i in range(30))


class RecordingCollector(Collector):
    """Keeps every inbox (Submission) ever registered, to read its counters after the request."""

    def __init__(self, reader):
        super().__init__(reader)
        self.registered = []

    def register(self, request_id, inbox):
        super().register(request_id, inbox)
        self.registered.append(inbox)

    @property
    def num_direct(self) -> int:
        return sum(inbox.num_direct for inbox in set(self.registered))


class PacedContext(ScriptedContext):
    """Routes each scripted output ``gap_s`` after the previous one."""

    gap_s = 0.01

    async def open(self):
        self.collector = RecordingCollector(_SilentReader())
        self.collector.start()

    async def submit(self, requests):
        self.submitted.extend(requests)
        loop = asyncio.get_running_loop()
        outs = [out for request in requests for out in self.script(request)]
        for k, out in enumerate(outs):
            loop.call_later(self.gap_s * (k + 1), self.collector.deliver, out)


class Server:
    """uvicorn (httptools) in a thread, serving the gateway app as `python -m gateway` does."""

    def __init__(self, ctx: ScriptedContext, config: GatewayConfig):
        self.port = free_port()
        app = capture_raw_send(build_app(config, context=ctx))
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, http="httptools",
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def stream(self, body: dict) -> list:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        text = resp.read().decode()
        conn.close()
        return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def _script(request):
    return words(request, TEXTS)


def _comparable(events: list) -> list:
    return [e if e == "[DONE]" else {k: v for k, v in json.loads(e).items() if k not in ("id", "created")}
            for e in events]


@pytest.mark.parametrize("n", [1, 2])
def test_fast_path_sends_what_the_asgi_path_sends(n):
    config = GatewayConfig(served_model_name="tiny")
    body = {"model": "tiny", "prompt": "hi", "stream": True, "n": n, "max_tokens": 64,
            "stream_options": {"include_usage": True}}
    ctx = PacedContext(config, GatewayLimits(), _script)
    with Server(ctx, config) as server:
        fast = server.stream(body)
    assert ctx.collector.num_direct >= n * len(TEXTS) // 2  # most plain deltas took the fast path

    slow_ctx = ScriptedContext(config, GatewayLimits(), _script)  # every output in one read: one body write
    with TestClient(build_app(config, context=slow_ctx)) as client:
        slow = [e if e == "[DONE]" else json.dumps(e) for e in sse_events(client.post("/v1/completions", json=body))]
    assert _comparable(fast) == _comparable(slow)
    texts = {i: "".join(json.loads(e)["choices"][0]["text"] for e in fast[:-1]
                        if json.loads(e)["choices"] and json.loads(e)["choices"][0]["index"] == i) for i in range(n)}
    assert texts == {i: "".join(f"{t}{i}" for t in TEXTS) for i in range(n)}
    assert not ctx.collector.inboxes and not ctx.aborted  # finished: nothing left, nothing aborted


def test_a_stream_still_flowing_at_its_deadline_ends_with_one_error_event_and_an_abort():
    """The deadline is the one timeout (gateway/submission.py): chunks flowing, on the fast path
    too, do not move it."""
    config = GatewayConfig(served_model_name="tiny")
    ctx = PacedContext(config, GatewayLimits(idle_timeout_s=30.0), _script)
    ctx.gap_s = 0.05  # 30 outputs over 1.5 s; the client's deadline comes after 0.6 s
    with Server(ctx, config) as server:
        events = server.stream({"model": "tiny", "prompt": "hi", "stream": True, "max_tokens": 64,
                                "request_timeout": 0.6})
    assert ctx.collector.num_direct > 0
    *chunks, last = [json.loads(e) for e in events]
    assert last["error"]["code"] == 503 and "deadline" in last["error"]["message"]
    assert 0 < len(chunks) < len(TEXTS) and all("error" not in c for c in chunks)
    assert "".join(f"{t}0" for t in TEXTS).startswith("".join(c["choices"][0]["text"] for c in chunks))
    assert ctx.aborted == [(ctx.submitted[0].request_id,)]


def test_the_installed_uvicorn_is_one_the_fast_path_supports():
    """Upgrading uvicorn past SUPPORTED_UVICORN turns the fast path off (every chunk then takes
    the ASGI path, correct but slower): check direct_write.py against the new version's
    RequestResponseCycle, then extend the range."""
    assert is_supported(uvicorn_version()), f"uvicorn {uvicorn_version()} is outside {SUPPORTED_UVICORN}"
    assert not is_supported(SUPPORTED_UVICORN[1]) and not is_supported(None)
