"""The gateway's one reader of its reply stream, routing each RequestOutput to its request's inbox."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from shared.protocol import RequestOutput, Resume

log = logging.getLogger(__name__)


class _Reader(Protocol):
    async def read(self, count: int = ..., block_ms: int | None = ...) -> list[Any]: ...


class _Inbox(Protocol):
    def put(self, out: RequestOutput) -> None: ...

    def resume(self, msg: Resume) -> None: ...


class Collector:
    """Owns the routing table ``inboxes: request_id -> inbox`` and the task that fills it.

    Exactly one task per gateway reads ``ps:gateway:{gid}:out`` (plain XREAD), so N requests in
    flight cost one blocking Redis call, not N. A read's outputs are all delivered before the task
    yields, so each request's task wakes once per read with everything the read held for it.
    An output for a request that is not registered (it finished, timed out or its client left)
    is dropped: nobody is waiting for it. A ``Resume`` (the request's engine died) goes to the
    inbox's ``resume``, which resubmits the request.
    """

    def __init__(self, reader: _Reader, *, batch: int = 512, block_ms: int = 1000, retry_s: float = 0.5,
                 trim: Callable[[str], Awaitable[object]] | None = None, trim_every_s: float = 5.0):
        self.reader = reader
        # entries already delivered are worthless: trim(last_id) drops them now and then
        self.trim = trim
        self.trim_every_s = trim_every_s
        self._next_trim = 0.0
        self.batch = batch
        self.block_ms = block_ms
        self.retry_s = retry_s
        self.inboxes: dict[str, _Inbox] = {}
        self.num_dropped = 0
        self._task: asyncio.Task | None = None

    def register(self, request_id: str, inbox: _Inbox) -> None:
        self.inboxes[request_id] = inbox

    def unregister(self, request_id: str) -> None:
        self.inboxes.pop(request_id, None)

    @property
    def num_pending(self) -> int:
        return len(self.inboxes)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run(), name="gateway-collector")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def run(self) -> None:
        while True:
            try:
                envelopes = await self.reader.read(count=self.batch, block_ms=self.block_ms)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis restarting or unreachable: keep trying, never die
                log.warning("reply stream read failed (%s); retrying in %.1fs", exc, self.retry_s)
                await asyncio.sleep(self.retry_s)
                continue
            for envelope in envelopes:
                self.deliver(getattr(envelope, "msg", envelope))
            if envelopes and self.trim is not None and time.monotonic() >= self._next_trim:
                self._next_trim = time.monotonic() + self.trim_every_s
                try:
                    await self.trim(envelopes[-1].id)
                except Exception as exc:  # trimming is housekeeping: never worth dying for
                    log.warning("reply stream trim failed: %s", exc)

    def deliver(self, msg: Any) -> None:
        if not isinstance(msg, (RequestOutput, Resume)):
            log.warning("unexpected %s on the reply stream", type(msg).__name__)
            return
        inbox = self.inboxes.get(msg.request_id)
        if inbox is None:
            self.num_dropped += 1
            return
        if isinstance(msg, Resume):
            inbox.resume(msg)
        else:
            inbox.put(msg)
