"""The HTTP side of one Submission: a JSON body or an SSE stream, and the client's departure.

This is a plain ASGI callable rather than Starlette's StreamingResponse because the gateway must
own three things StreamingResponse hides: a disconnect watcher that runs from the first moment
(also while a non-streaming request waits), the choice between an HTTP error status (nothing
sent yet) and an SSE error event (the stream began), and a ``finally`` that always closes the
submission -- which aborts it on the engine unless every choice finished.

Streaming sends one ASGI message per wake-up, not per event: everything one reply-stream read
held for this request (each a ``data:`` event) goes out in one body write. Under uvicorn, plain
text deltas that find the stream's task waiting skip the task and are written by the collector
(the fast path, direct_write.py, attached once the headers went out).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gateway.direct_write import DirectWriter
from gateway.errors import APIError
from gateway.renderer import ResponseRenderer, sse
from gateway.submission import Applied, Submission

JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]
DONE = b"data: [DONE]\n\n"


class Responder:
    """Writes one Submission to the client and always closes it (``on_done(submission, status)``)."""

    def __init__(self, submission: Submission, renderer: ResponseRenderer, *, stream: bool,
                 include_usage: bool = False, on_done: Callable[[Submission, int], None] | None = None):
        self.submission = submission
        self.renderer = renderer
        self.stream = stream
        self.include_usage = include_usage
        self.on_done = on_done
        self.status = 200

    async def __call__(self, scope, receive, send) -> None:
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        watcher.add_done_callback(self._on_disconnect)
        try:
            if self.stream:
                await self._send_stream(scope, send)
            else:
                await self._send_body(send)
        finally:
            watcher.remove_done_callback(self._on_disconnect)
            watcher.cancel()
            self.submission.close()
            if self.on_done is not None:
                self.on_done(self.submission, 499 if self.submission.is_cancelled else self.status)

    def _on_disconnect(self, task: asyncio.Future) -> None:
        if not task.cancelled():
            self.submission.cancel()

    async def _send_body(self, send) -> None:
        try:
            choices = await self.submission.collect()
        except APIError as exc:
            await self._send_error(send, exc)
            return
        if self.submission.is_cancelled:
            return
        body = self.renderer.response(choices, self.submission.usage()).model_dump_json().encode()
        await send({"type": "http.response.start", "status": 200, "headers": JSON_HEADERS})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _send_stream(self, scope, send) -> None:
        submission = self.submission
        try:
            applied = await submission.receive()
        except APIError as exc:  # nothing sent yet: a real HTTP status is still possible
            await self._send_error(send, exc)
            return
        if submission.is_cancelled:
            return
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        submission.direct_writer = DirectWriter.attach(scope, self.renderer)
        try:
            while applied:
                events = self._events(applied)
                if events:
                    await send({"type": "http.response.body", "body": events, "more_body": True})
                applied = await submission.receive()
        except APIError as exc:  # the stream began: one error event, then close
            self.status = exc.status
            await send({"type": "http.response.body", "body": exc.sse_event(), "more_body": False})
            return
        await send({"type": "http.response.body", "body": b"" if submission.is_cancelled else self._tail(),
                    "more_body": False})

    def _events(self, applied: Applied) -> bytes:
        """The SSE events of one wake-up's outputs, in order, as one body."""
        renderer = self.renderer
        events = []
        for choice, out in applied:
            event = renderer.text_event(choice, out)
            if event is not None:
                events.append(event)
            else:
                events.extend(sse(chunk) for chunk in renderer.chunks(choice, out))
        return b"".join(events)

    def _tail(self) -> bytes:
        usage = sse(self.renderer.usage_chunk(self.submission.usage())) if self.include_usage else b""
        return usage + DONE

    async def _send_error(self, send, exc: APIError) -> None:
        self.status = exc.status
        if self.submission.is_cancelled:
            return
        response = exc.response()  # its headers carry Retry-After on a 429/503
        await send({"type": "http.response.start", "status": exc.status, "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": response.body, "more_body": False})


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
