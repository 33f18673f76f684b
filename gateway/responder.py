"""The HTTP side of one Generation: a JSON body or an SSE stream, and the client's departure.

This is a plain ASGI callable rather than Starlette's StreamingResponse because the gateway must
own three things StreamingResponse hides: a disconnect watcher that runs from the first moment
(also while a non-streaming request waits), the choice between an HTTP error status (nothing
sent yet) and an SSE error event (the stream began), and a ``finally`` that always closes the
generation -- which aborts it on the engine unless every choice finished.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable


from gateway.direct_write import DirectWriter
from gateway.errors import APIError
from gateway.generation import Generation
from gateway.renderer import Renderer, sse

JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]
DONE = b"data: [DONE]\n\n"


class GenerationResponse:
    """Writes one Generation to the client and always closes it (``on_done(generation, status)``)."""

    def __init__(self, generation: Generation, renderer: Renderer, *, stream: bool, include_usage: bool = False,
                 on_done: Callable[[Generation, int], None] | None = None):
        self.generation = generation
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
            self.generation.close()
            if self.on_done is not None:
                self.on_done(self.generation, 499 if self.generation.is_cancelled else self.status)

    def _on_disconnect(self, task: asyncio.Future) -> None:
        if not task.cancelled():
            self.generation.cancel()

    async def _send_body(self, send) -> None:
        try:
            choices = await self.generation.collect()
        except APIError as exc:
            await self._send_error(send, exc)
            return
        if self.generation.is_cancelled:
            return
        body = self.renderer.response(choices, self.generation.usage()).model_dump_json().encode()
        await send({"type": "http.response.start", "status": 200, "headers": JSON_HEADERS})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _send_stream(self, scope, send) -> None:
        events = self._events()
        try:
            try:
                first = await anext(events)
            except APIError as exc:  # nothing sent yet: a real HTTP status is still possible
                await self._send_error(send, exc)
                return
            except StopAsyncIteration:
                return
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            await send({"type": "http.response.body", "body": first, "more_body": True})
            self.generation.direct_writer = DirectWriter.attach(scope, self.renderer)  # the per-token fast path
            try:
                async for chunk in events:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except APIError as exc:  # the stream began: one error event, then close
                self.status = exc.status
                await send({"type": "http.response.body", "body": exc.sse_event(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await events.aclose()

    async def _events(self) -> AsyncIterator[bytes]:
        async for choice, out in self.generation.events():
            event = self.renderer.text_event(choice, out)
            if event is not None:
                yield event
                continue
            for chunk in self.renderer.chunks(choice, out):
                yield sse(chunk)
        if self.generation.is_cancelled:
            return
        if self.include_usage:
            yield sse(self.renderer.usage_chunk(self.generation.usage()))
        yield DONE

    async def _send_error(self, send, exc: APIError) -> None:
        self.status = exc.status
        if self.generation.is_cancelled:
            return
        body = exc.response().body
        await send({"type": "http.response.start", "status": exc.status, "headers": JSON_HEADERS})
        await send({"type": "http.response.body", "body": body, "more_body": False})


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
