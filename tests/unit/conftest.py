from __future__ import annotations

import contextlib

import pytest
from starlette.testclient import TestClient

from gateway.app import build_app


@pytest.fixture
def serve_gateway():
    """``serve_gateway(config, ctx)``: a TestClient on the gateway app over ``ctx`` with its
    lifespan entered (the context opened); every client is closed at the test's end."""
    with contextlib.ExitStack() as clients:
        yield lambda config, ctx: clients.enter_context(
            TestClient(build_app(config, context=ctx), raise_server_exceptions=False))
