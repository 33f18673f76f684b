"""`serve --pd`: the engines it starts (roles, ids, CPUs of their own) and the P/D flags' round trip
through a child's command line (no processes, no Redis)."""

import pytest

from shared import flags
from shared.cli import build_children
from shared.placement import engine_cpus


def test_engine_cpus_split_the_machine_evenly():
    assert engine_cpus(2, [0, 1]) == [{0}, {1}]
    assert engine_cpus(2, [0, 1, 2, 3, 4]) == [{0, 1}, {2, 3, 4}]
    assert engine_cpus(3, [0, 1]) == [{0}, {1}, {0}]  # more engines than CPUs: shared round-robin
    assert engine_cpus(1, [3, 1]) == [{1, 3}]
    with pytest.raises(ValueError):
        engine_cpus(0, [0])


def test_serve_pd_starts_prefill_and_decode_engines_on_their_own_cpus(monkeypatch):
    monkeypatch.setattr("shared.cli.engine_cpus", lambda n: engine_cpus(n, [0, 1, 2, 3]))
    config = flags.parse_serve(["--pd", "--prefill-engines", "1", "--decode-engines", "3", "--kv-connector", "shm",
                                "--kv-transfer-ttl", "30"])
    engines = [c for c in build_children(config, "redis://h:1/0", "/m") if c.command == "engine"]
    assert [(c.name, c.config.role, c.cpus) for c in engines] == [
        ("engine-p0", "prefill", {0}), ("engine-d0", "decode", {1}), ("engine-d1", "decode", {2}),
        ("engine-d2", "decode", {3})]
    child = flags.parse_engine(engines[1].argv[1:])  # what the child parses from its command line
    assert child == engines[1].config
    assert (child.role, child.kv_transfer.connector, child.kv_transfer.ttl_s, child.service_id) == (
        "decode", "shm", 30.0, "engine-d0")


def test_serve_without_pd_starts_one_engine_of_both_roles():
    (engine,) = [c for c in build_children(flags.parse_serve([]), "redis://h:1/0", "/m") if c.command == "engine"]
    assert (engine.name, engine.config.role, engine.cpus) == ("engine", "both", None)


def test_engine_role_and_fault_hook_flags():
    config = flags.parse_engine(["--role", "prefill", "--kv-transfer-fault", "delete,flip"])
    assert (config.role, config.kv_transfer.fault) == ("prefill", "delete,flip")
    with pytest.raises(SystemExit):
        flags.parse_engine(["--role", "middle"])
