"""The gateway's uvicorn Server (gateway/server.py): its housekeeping loop wakes once a second, not
ten times, and a shutdown signal still stops it at once."""

from __future__ import annotations

import asyncio
import signal
import time

import uvicorn

from gateway.server import TICK_S, QuietServer


async def _ok(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def test_ticks_once_a_second_refreshing_the_date_and_exits_on_a_signal_at_once():
    async def run():
        server = QuietServer(uvicorn.Config(_ok, host="127.0.0.1", port=0, lifespan="off", log_level="warning"))
        ticks: list[int] = []
        on_tick = server.on_tick

        async def counted(counter: int) -> bool:
            ticks.append(counter)
            return await on_tick(counter)

        server.on_tick = counted
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        await asyncio.sleep(2.5 * TICK_S)
        num_ticks = len(ticks)
        start = time.monotonic()
        server.handle_exit(signal.SIGINT, None)
        await asyncio.wait_for(serving, 5)
        return num_ticks, time.monotonic() - start, ticks, server.server_state.default_headers

    num_ticks, exit_s, ticks, headers = asyncio.run(run())
    assert 2 <= num_ticks <= 4  # uvicorn's own loop ticks every 0.1 s: ~25 here
    assert all(counter % 10 == 0 for counter in ticks)  # each tick refreshes the Date header, as uvicorn's tenth
    assert any(name == b"date" for name, _ in headers)
    assert exit_s < 0.6  # woken by the signal, not at the next tick (shutdown itself waits 0.1 s)
