"""What the e2e tests that add an engine to a running stack and kill one share: starting the
engine and waiting for its first heartbeat, and the idle check once it is dead."""

from __future__ import annotations

import time

from tests.e2e.stack import Service, Stack


def start_engine(stack: Stack, name: str, service_id: str, *args: str, timeout_s: float = 120.0) -> Service:
    """One more engine process (``name``'s log, ``service_id`` on the bus), once it beats."""
    engine = stack.start_service(name, "engine_svc", "--service-id", service_id, *args)
    deadline = time.monotonic() + timeout_s
    while service_id not in stack.heartbeats():
        assert time.monotonic() < deadline, stack.logs()
        time.sleep(0.25)
    return engine


def forget_heartbeat(stack: Stack, service_id: str) -> None:
    """A SIGKILLed engine's stale heartbeat is no request state: drop it before the idle check."""
    with stack.redis() as client:
        client.hdel(stack.names.heartbeat, service_id)


def assert_idle_without(stack: Stack, dead: str, timeout_s: float) -> None:
    """The idle invariant on every service but ``dead`` (SIGKILLed): its heartbeat is dropped and
    what names it does not count; the rest must show idle on a beat younger than the check."""
    forget_heartbeat(stack, dead)
    deadline = time.monotonic() + timeout_s
    problems = ["not checked"]
    while problems and time.monotonic() < deadline:
        since = time.time()
        time.sleep(1.2)
        problems = [p for p in stack.idle_problems(since) if dead not in p]
    assert not problems, (problems, stack.logs())
