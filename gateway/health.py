"""What /health says, kept fresh in the background so that the handler never waits on Redis.

``HealthPoller`` reads the heartbeat hash every ``health_poll_s`` on a Redis client of its own
(a busy command pool cannot delay it) with a short timeout; ``readiness`` judges its last
reading when asked (``shared.heartbeat.parse_heartbeats`` decides who is alive), so a reading
that is not refreshed ages like the beats in it. The stack is ready when the last poll was
answered and at least one tokenizer, one engine, and one detokenizer of every shard beat within
``max_age_s``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import redis.asyncio as aioredis

from shared.config import ENGINE_ROLES
from shared.heartbeat import parse_heartbeats

log = logging.getLogger(__name__)

BUS = "the request bus"


@dataclass(frozen=True, slots=True)
class Readiness:
    """Ready or not, what is missing (roles, never addresses), and the live service ids (for an
    authenticated caller only: ids name hosts and processes)."""

    is_ready: bool
    missing: tuple[str, ...] = ()
    live: tuple[str, ...] = ()

    @property
    def problem(self) -> str:
        """Why the stack is not ready (the 503's message): roles, no addresses, no exception text."""
        if BUS in self.missing:
            return f"not ready: {BUS} does not answer"
        return "not ready: no live " + ", ".join(self.missing)


def readiness(raw: Mapping[bytes | str, bytes] | None, *, num_detok_shards: int, max_age_s: float) -> Readiness:
    """The heartbeat hash as last read (HGETALL; None: the read failed), judged now."""
    if raw is None:
        return Readiness(False, (BUS,))
    fresh = parse_heartbeats(raw, max_age_s=max_age_s)
    kinds = {b.service for b in fresh.values()}
    shards = {int(b.stats.get("shard", 0)) for b in fresh.values() if b.service == "detok"}
    missing = [kind for kind in ("tokenizer", "engine") if kind not in kinds]
    missing += _missing_engine_roles({_role(b.stats) for b in fresh.values() if b.service == "engine"})
    missing += ["detok" if num_detok_shards == 1 else f"detok shard {k}"
                for k in range(num_detok_shards) if k not in shards]
    return Readiness(not missing, tuple(missing), tuple(sorted(fresh)))


def _role(stats: Mapping[str, float]) -> str:
    index = int(stats.get("role", 0))
    return ENGINE_ROLES[index] if 0 <= index < len(ENGINE_ROLES) else "both"


def _missing_engine_roles(roles: set[str]) -> list[str]:
    """Under P/D a request needs an engine that takes it (both or prefill) and, when only prefill
    engines take requests, a decode engine to go on."""
    if not roles:
        return []  # "engine" is missing already
    if not roles & {"both", "prefill"}:
        return ["prefill engine"]
    if "both" not in roles and "decode" not in roles:
        return ["decode engine"]
    return []


class HealthPoller:
    """Owns the last reading of the heartbeat hash and the task that refreshes it."""

    def __init__(self, client: aioredis.Redis, key: str, *, interval_s: float, timeout_s: float):
        self.client = client
        self.key = key
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.raw: dict | None = None  # the hash as last read; None: not read yet, or the last read failed
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._poll_forever(), name="gateway-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.client.aclose()

    async def poll_once(self) -> None:
        try:
            raw = await asyncio.wait_for(self.client.hgetall(self.key), self.timeout_s)
        except Exception as exc:  # Redis stopped, restarting or gone: not ready until it answers
            if self.raw is not None:
                log.warning("heartbeats unreadable, /health is 503 until Redis answers: %s", exc)
            self.raw = None
            return
        self.raw = raw

    async def _poll_forever(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.interval_s)
