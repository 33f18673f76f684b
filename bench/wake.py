"""What one bus hop costs on this machine when the bus has been idle: a Redis round trip
(PING, and an XADD of one engine step's 64 deltas) back to back and after idle gaps as long as
an engine step. Every token crosses four such wake-ups (engine -> Redis -> detok -> Redis ->
gateway), so this is the floor under bench/serve.py's per-token bus latency.

    .venv/bin/python bench/wake.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis  # noqa: E402

from shared.redis_server import RedisServer  # noqa: E402

GAPS_S = (0.0, 0.01, 0.05, 0.15)
ROUNDS = 40


def round_trip_us(fn, gap_s: float) -> float:
    """Median microseconds of ``fn()`` when each call follows ``gap_s`` of sleep."""
    times = []
    for _ in range(ROUNDS):
        time.sleep(gap_s)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[ROUNDS // 2] * 1e6


def main() -> None:
    server = RedisServer().start()
    try:
        client = redis.Redis.from_url(server.url)
        step = {(b"m" if i == 0 else b"m%d" % i): b"x" * 150 for i in range(64)}  # ~ one step's deltas
        probes = {"PING": client.ping,
                  "XADD of 64 deltas": lambda: client.xadd("wake", step, maxlen=1000, approximate=True)}
        print(f"Redis round trip after an idle gap, median of {ROUNDS} (us)")
        print(f"  {'probe':<20}" + "".join(f"{f'gap {g * 1e3:g} ms':>14}" for g in GAPS_S))
        for name, fn in probes.items():
            print(f"  {name:<20}" + "".join(f"{round_trip_us(fn, g):>14.0f}" for g in GAPS_S), flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
