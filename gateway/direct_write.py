"""The per-token fast path: a plain text chunk written straight to uvicorn's transport.

While a stream runs, nearly every RequestOutput is one plain text delta. On the ASGI path each
costs a queue hand-off, a task wake-up, two async generators, Starlette's two send wrappers and
uvicorn's ``send``: at 64 streams about a quarter of the gateway's CPU per token, paid 64 times in
a row after every engine step. When a stream's task is parked on its empty queue (so every
earlier event of the stream is already on the wire), the collector instead renders the chunk and
writes it itself, framed as uvicorn frames a streamed body (HTTP/1.1 chunked).

Everything else takes the ASGI path: a choice's first chunk, logprobs, the finish and usage,
errors, a client that is not reading (uvicorn paused writing) or is gone, and any server other
than uvicorn's httptools protocol (the only one whose transport this module knows how to use).
"""

from __future__ import annotations

from gateway.choice import Choice
from gateway.renderer import Renderer
from shared.protocol import RequestOutput

RAW_SEND = "pagedserve.raw_send"  # scope key: the server's own send, before any middleware wraps it
_HTTPTOOLS = "uvicorn.protocols.http.httptools_impl"


def capture_raw_send(app):
    """The ASGI app, with the server's ``send`` kept in every HTTP scope under RAW_SEND."""

    async def captured(scope, receive, send):
        if scope["type"] == "http":
            scope[RAW_SEND] = send
        await app(scope, receive, send)

    return captured


class DirectWriter:
    """Owns one streamed response's fast path: whether a chunk may take it, and the write."""

    def __init__(self, cycle, renderer: Renderer):
        self.cycle = cycle  # uvicorn's RequestResponseCycle: transport, flow control, state
        self.renderer = renderer

    @classmethod
    def attach(cls, scope, renderer: Renderer) -> DirectWriter | None:
        """For a response whose headers went out chunked through uvicorn's httptools protocol;
        None anywhere else (the ASGI path then carries every chunk)."""
        cycle = getattr(scope.get(RAW_SEND), "__self__", None)
        if cycle is None or type(cycle).__module__ != _HTTPTOOLS:
            return None
        if not all(hasattr(cycle, a) for a in ("transport", "flow", "disconnected", "response_complete")):
            return None
        return cls(cycle, renderer) if getattr(cycle, "chunked_encoding", False) else None

    def accepts(self, choice: Choice, out: RequestOutput) -> bool:
        cycle = self.cycle
        if cycle.disconnected or cycle.response_complete or cycle.flow.write_paused:
            return False
        return self.renderer.is_plain_text(choice, out)

    def write(self, choice: Choice, out: RequestOutput) -> None:
        event = self.renderer.text_event(choice, out)
        self.cycle.transport.write(b"%x\r\n%s\r\n" % (len(event), event))
