"""`--bus-cpus`: which CPU each bus service gets, and that the processes really run there."""

import os

import pytest

from shared.cli import build_children
from shared.flags import parse_serve
from shared.placement import bus_cpus
from shared.redis_server import RedisServer


def test_two_cpus_gateway_and_detok_apart():
    plan = bus_cpus("spread", 1, 1, cpus=[0, 1])
    assert plan["gateway-0"] == {1} and plan["detok-0"] == {0}
    assert plan["redis"] == plan["tokenizer"] == {0}


def test_more_cpus_one_each_then_wrap():
    plan = bus_cpus("spread", 2, 2, cpus=[0, 1, 2, 3, 4, 5])
    assert [plan[k] for k in ("gateway-0", "gateway-1", "detok-0", "detok-1")] == [{5}, {4}, {3}, {2}]
    assert plan["redis"] == {3, 2}
    wrapped = bus_cpus("spread", 2, 2, cpus=[0, 1, 2])
    assert [wrapped[k] for k in ("gateway-0", "gateway-1", "detok-0", "detok-1")] == [{2}, {1}, {0}, {2}]


def test_one_cpu_or_none_pins_nothing():
    assert bus_cpus("spread", 1, 1, cpus=[3]) == {}
    assert bus_cpus("none", 1, 1, cpus=[0, 1]) == {}
    with pytest.raises(ValueError):
        bus_cpus("everywhere", 1, 1, cpus=[0, 1])


def test_serve_gives_children_their_cpus():
    config = parse_serve(["--gateways", "2", "--detokenizers", "1", "--tokenizers", "2"])
    children = {c.name: c for c in build_children(config, "redis://127.0.0.1:1/0", "/m")}
    plan = bus_cpus("spread", 2, 1)
    assert children["gateway-0"].cpus == plan.get("gateway-0")
    assert children["detok-0"].cpus == plan.get("detok-0")
    assert children["tokenizer-1"].cpus == plan.get("tokenizer")
    assert children["engine"].cpus is None  # the engine keeps every CPU
    off = parse_serve(["--bus-cpus", "none"])
    assert all(c.cpus is None for c in build_children(off, "redis://127.0.0.1:1/0", "/m"))


def test_redis_server_runs_on_its_cpus():
    cpu = max(os.sched_getaffinity(0))
    with RedisServer(cpus={cpu}) as server:
        assert os.sched_getaffinity(server.process.pid) == {cpu}


def test_child_process_starts_pinned():
    import signal
    import time

    from shared.cli import Child

    class Probe(Child):  # a plain process instead of a service and its config
        @property
        def argv(self) -> list[str]:
            return ["http.server", "--bind", "127.0.0.1", "0"]

    cpu = max(os.sched_getaffinity(0))
    child = Probe("probe", "probe", None, cpus={cpu})
    child.start(dict(os.environ))
    try:
        time.sleep(0.2)
        assert os.sched_getaffinity(child.proc.pid) == {cpu}
    finally:
        child.signal(signal.SIGKILL)
        child.proc.wait()


def test_a_refused_placement_leaves_the_process_unpinned():
    from shared.placement import pin

    before = os.sched_getaffinity(0)
    pin(0, {10_000})  # no such CPU: the kernel refuses, nothing raises
    assert os.sched_getaffinity(0) == before
