"""Which CPUs the bus services of one machine may run on (`pagedserve serve --bus-cpus`).

The engine keeps every CPU, at SCHED_IDLE by default: it fills whatever the bus leaves. The bus
services work in a burst after every engine step (the step's tokens through Redis, the
detokenizer and the gateway), and left to itself the kernel tends to stack them on one CPU: a
socket wake-up is a "sync" wake-up that pulls the woken task next to its waker, and with the
engine keeping every CPU busy the scheduler skips its search for an idle one. The detokenizer
and the gateway then take turns on one CPU while the other runs the engine, and a burst takes
nearly twice as long. ``spread`` gives each gateway and each detok shard a CPU of its own where
there are CPUs enough (gateways from the last CPU down, then detok shards), and Redis and the
tokenizers the detok shards' CPUs; on one CPU nothing is pinned.

P/D (`serve --pd`): each engine gets CPUs of its own (``engine_cpus``), so that a prefill
engine's long steps never take a decode engine's cores.
"""

from __future__ import annotations

import os

MODES = ("spread", "none")


def bus_cpus(mode: str, num_gateways: int, num_detoks: int,
             cpus: list[int] | None = None) -> dict[str, set[int]]:
    """Service kind ("gateway-0", "detok-0", "redis", "tokenizer") -> its CPUs; empty: unpinned."""
    if mode not in MODES:
        raise ValueError(f"unknown --bus-cpus mode {mode!r}; one of {MODES}")
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if mode == "none" or len(cpus) < 2:
        return {}
    slots = cpus[::-1]  # the engine's first threads tend to start low
    plan = {f"gateway-{i}": {slots[i % len(slots)]} for i in range(num_gateways)}
    detok_cpus = [slots[(num_gateways + k) % len(slots)] for k in range(num_detoks)]
    plan |= {f"detok-{k}": {cpu} for k, cpu in enumerate(detok_cpus)}
    plan["redis"] = plan["tokenizer"] = set(detok_cpus)
    return plan


def pin(pid: int, cpus: set[int] | None) -> None:
    """Restrict ``pid`` (0: this process; threads started later inherit it) to ``cpus``. A
    placement is an optimization: where the kernel refuses it (a CPU taken away since), the
    process runs unpinned rather than not at all."""
    if cpus:
        try:
            os.sched_setaffinity(pid, cpus)
        except OSError:
            pass


def engine_cpus(num_engines: int, cpus: list[int] | None = None) -> list[set[int]]:
    """P/D: each engine's CPUs, the machine's split into ``num_engines`` contiguous parts (the last
    takes the remainder); with more engines than CPUs, engines share them round-robin."""
    if num_engines < 1:
        raise ValueError(f"need at least one engine, got {num_engines}")
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if num_engines >= len(cpus):
        return [{cpus[i % len(cpus)]} for i in range(num_engines)]
    size = len(cpus) // num_engines
    parts = [set(cpus[i * size:(i + 1) * size]) for i in range(num_engines)]
    parts[-1] |= set(cpus[num_engines * size:])
    return parts
