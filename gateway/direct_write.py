"""The per-token fast path, and the one place the gateway knows a server's internals: a plain
text chunk written straight to uvicorn's transport.

While a stream runs, nearly every RequestOutput is one plain text delta. On the ASGI path each
costs a task wake-up, the coroutine frames of the server and Starlette's middleware and
uvicorn's ``send``: measured with 64 streams, ~32 us of gateway CPU per token against ~20 us here
(and the README's serving run: 42 against ~30). When a stream's task waits on an empty inbox
(so every earlier event of the stream is already on the wire), ``Submission.put`` instead
renders the chunk and writes it from the collector's task, framed as uvicorn frames a streamed
body (HTTP/1.1 chunked).

Everything else takes the ASGI path: a choice's first chunk, logprobs, the finish and usage,
errors, a client that is not reading (uvicorn paused writing) or is gone, any server other than
uvicorn's httptools protocol, and any uvicorn outside SUPPORTED_UVICORN -- the versions whose
``RequestResponseCycle`` (``transport``, ``flow.write_paused``, ``disconnected``,
``response_complete``, ``chunked_encoding``) this module was written and tested against
(0.54.0). tests/unit/test_gateway_direct.py fails when the installed uvicorn leaves that range
or the fast path stops being taken, and checks that its bytes equal the ASGI path's.
"""

from __future__ import annotations

import importlib.metadata
import logging

from gateway.choice import ChoiceState
from gateway.renderer import ResponseRenderer
from shared.protocol import RequestOutput

log = logging.getLogger(__name__)

RAW_SEND = "pagedserve.raw_send"  # scope key: the server's own send, before any middleware wraps it
SUPPORTED_UVICORN = ((0, 30), (0, 56))  # [from, to): the pyproject floor up to the last version checked (0.55)
_HTTPTOOLS = "uvicorn.protocols.http.httptools_impl"


def uvicorn_version() -> tuple[int, int] | None:
    try:
        major, minor = importlib.metadata.version("uvicorn").split(".")[:2]
        return int(major), int(minor)
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None


def is_supported(version: tuple[int, int] | None) -> bool:
    return version is not None and SUPPORTED_UVICORN[0] <= version < SUPPORTED_UVICORN[1]


def capture_raw_send(app):
    """The ASGI app, with the server's ``send`` kept in every HTTP scope under RAW_SEND; outside
    the supported uvicorn versions, the app itself (the fast path is then off, and says so)."""
    version = uvicorn_version()
    if not is_supported(version):
        log.warning("uvicorn %s is outside %s: the per-token fast path is off", version, SUPPORTED_UVICORN)
        return app

    async def captured(scope, receive, send):
        if scope["type"] == "http":
            scope[RAW_SEND] = send
        await app(scope, receive, send)

    return captured


class DirectWriter:
    """Owns one streamed response's fast path: whether a chunk may take it now, and the write."""

    def __init__(self, cycle, renderer: ResponseRenderer):
        self.cycle = cycle  # uvicorn's RequestResponseCycle: transport, flow control, state
        self.renderer = renderer

    @classmethod
    def attach(cls, scope, renderer: ResponseRenderer) -> DirectWriter | None:
        """For a response whose headers went out chunked through uvicorn's httptools protocol;
        None anywhere else (the ASGI path then carries every chunk)."""
        cycle = getattr(scope.get(RAW_SEND), "__self__", None)
        if cycle is None or type(cycle).__module__ != _HTTPTOOLS:
            return None
        if not all(hasattr(cycle, a) for a in ("transport", "flow", "disconnected", "response_complete")):
            return None
        return cls(cycle, renderer) if getattr(cycle, "chunked_encoding", False) else None

    def event(self, choice: ChoiceState, out: RequestOutput) -> bytes | None:
        """The SSE event of a plain text delta the client can take now; None: the ASGI path."""
        cycle = self.cycle
        if cycle.disconnected or cycle.response_complete or cycle.flow.write_paused:
            return None
        return self.renderer.text_event(choice, out)

    def write(self, event: bytes) -> None:
        self.cycle.transport.write(b"%x\r\n%s\r\n" % (len(event), event))
