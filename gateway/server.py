"""uvicorn's Server with a quieter housekeeping loop.

uvicorn's ``Server.main_loop`` wakes every 0.1 s: to notice a shutdown signal, and on every tenth
wake-up to refresh the ``Date`` header. On the small boxes this runs on, a process that wakes after
tens of milliseconds asleep finds its caches cold, and that wake-up costs a whole Redis call's worth
of CPU (``bench/wake.py``), taken from the engine's threads: with them the idle gateway took ~30 ms
of CPU a second, without them 17-24 (16 -> 6-7 wake-ups a second). Here the loop ticks once a second
(the header is refreshed at every tick, as uvicorn refreshes it once a second) and a shutdown
signal wakes it at once.
"""

from __future__ import annotations

import asyncio
from types import FrameType

import uvicorn

TICK_S = 1.0


class QuietServer(uvicorn.Server):
    """Owns the tick's wake-up: ``handle_exit`` (uvicorn's signal handler) sets it."""

    def __init__(self, config: uvicorn.Config):
        super().__init__(config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None

    async def main_loop(self) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 10) % 864000  # a multiple of 10: on_tick refreshes the Date header
            try:
                await asyncio.wait_for(self._wake.wait(), TICK_S)
            except TimeoutError:
                pass
            self._wake.clear()
            should_exit = await self.on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._loop is not None and self._wake is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)


__all__ = ["QuietServer", "TICK_S"]
