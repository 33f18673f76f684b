"""Test doubles the unit tests share: the gateway's context without Redis, and a tokenizer that
counts its calls. The app around them is served by the ``serve_gateway`` fixture (conftest.py)."""

from __future__ import annotations

import asyncio

from gateway.collector import Collector
from gateway.context import GatewayContext
from shared.protocol import GenerateRequest


class SilentReader:
    """A Collector's bus reader that never returns an entry: outputs reach the Collector only
    through ``deliver``, which the test (or its context) calls."""

    async def read(self, count=0, block_ms=None):
        await asyncio.sleep(3600)
        return []

    async def close(self):
        pass


class BusFreeContext(GatewayContext):
    """The real GatewayContext with its two Redis ends replaced: what it submits is listed in
    ``submitted``, what it aborts in ``aborted``, and its Collector reads from no bus."""

    def __init__(self, config, limits):
        super().__init__(config, limits)
        self.submitted: list[GenerateRequest] = []
        self.aborted: list[tuple[str, ...]] = []

    async def open(self):
        self.collector = Collector(SilentReader())
        self.collector.start()

    async def close(self):
        await self.collector.stop()

    async def submit(self, requests):
        self.submitted.extend(requests)

    def abort(self, request_ids, reason):
        self.aborted.append(tuple(request_ids))


class CountingTokenizer:
    """A HF tokenizer that counts what it is asked to encode (batch calls and ``encode``)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.num_calls = 0

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __len__(self):
        return len(self.tokenizer)

    def __call__(self, *args, **kwargs):
        self.num_calls += 1
        return self.tokenizer(*args, **kwargs)

    def encode(self, *args, **kwargs):
        self.num_calls += 1
        return self.tokenizer.encode(*args, **kwargs)
