"""The flag table (shared/flags.py): each flag once, each landing in a typed config field, and
`pagedserve serve` handing every child the config that child's own entry point parses back."""

from __future__ import annotations

import dataclasses

import pytest

from shared import flags
from shared.cli import MODULES, build_children
from shared.config import EngineConfig, EngineServiceConfig, GatewayConfig, GatewayLimits, ServeConfig

COMMANDS = {module: command for command, module in MODULES.items()}


@pytest.fixture(autouse=True)
def _no_pagedserve_env(monkeypatch):
    import os

    for name in [n for n in os.environ if n.startswith("PAGEDSERVE_") and n != "PAGEDSERVE_CACHE"]:
        monkeypatch.delenv(name)


def _sample(flag: flags.Flag) -> tuple[list[str], object]:
    """A command line giving ``flag`` a value other than its default, and that value typed."""
    if flag.parse is None:
        return ["--no-" + flag.name[2:]], False
    text = {int: "7", float: "0.25", flags.parse_size: "2M", flags.parse_bool: "true"}.get(flag.parse, "x")
    text = flag.choices[-1] if flag.choices else text
    return [flag.name, text], flag.parse(text)


def _children(config: ServeConfig, monkeypatch):
    """serve's children, with the secrets serve puts in their environment set here."""
    for name, value in flags.to_env("gateway", config.gateway).items():
        monkeypatch.setenv(name, value)
    return build_children(config, config.redis_url or "redis://h:1/0", config.model or "/m")


def test_each_flag_once_and_each_field_once_per_command():
    names = [f.name for f in flags.FLAGS]
    assert len(names) == len(set(names))
    for command in flags.CONFIGS:
        fields = [f.field for f in flags.flags_of(command)]
        assert len(fields) == len(set(fields)), command
        flags.parser(command)  # argparse refuses a flag declared twice


def test_every_flag_fills_a_field_of_each_config_it_is_used_by():
    for flag in flags.FLAGS:
        for command in flag.used_by:
            flags.value_of(flags.CONFIGS[command](), flag.field)  # KeyError: a flag with nowhere to go
    serve_fields = {f.name for f in dataclasses.fields(ServeConfig)}
    assert {f.field for f in flags.FLAGS if f.used_by == {"serve"}} <= serve_fields


@pytest.mark.parametrize("flag", [f for f in flags.FLAGS if "serve" in f.used_by and f.used_by - {"serve"}],
                         ids=lambda f: f.name)
def test_serve_and_each_service_parse_a_flag_to_the_same_typed_value(flag, monkeypatch):
    argv, typed = _sample(flag)
    config = flags.parse_serve(argv)
    children = [c for c in _children(config, monkeypatch) if COMMANDS[c.argv[0]] in flag.used_by]
    assert children, flag.name
    for child in children:
        command = COMMANDS[child.argv[0]]
        own = flags.parse(command, argv)  # the service's own entry point, given the same flag
        parsed = flags.parse(command, child.argv[1:])  # what the child parses from serve's command line
        assert flags.value_of(own, flag.field) == flags.value_of(parsed, flag.field) == typed, (flag.name, command)
        assert parsed == child.config


def test_serve_hands_each_child_its_config_typed(monkeypatch):
    config = flags.parse_serve(["--max-model-len", "64", "--kv-cache-memory", "1G", "--no-enable-prefix-caching",
                                "--api-key", "k", "--request-timeout", "5", "--gateways", "2", "--detokenizers", "2",
                                "--tokenizer", "/tok"])
    children = {c.name: c for c in _children(config, monkeypatch)}
    for child in children.values():
        assert flags.parse(COMMANDS[child.argv[0]], child.argv[1:]) == child.config
    assert "k" not in children["gateway-0"].argv  # the key travels in the environment, not in `ps`
    gateway = children["gateway-1"].config
    assert gateway.api_key == "k" and gateway.reuse_port and gateway.limits == GatewayLimits(idle_timeout_s=5.0)
    engine = children["engine"].config
    assert isinstance(engine, EngineServiceConfig) and engine.num_detok_shards == 2
    assert engine.engine == EngineConfig(model="/m", tokenizer="/tok", max_model_len=64, kv_cache_memory=1 << 30,
                                         enable_prefix_caching=False)
    assert children["tokenizer-0"].config.max_model_len == 64 and children["tokenizer-0"].config.tokenizer == "/tok"
    assert [children[f"detok-{k}"].config.shard for k in range(2)] == [0, 1]


def test_the_environment_gives_defaults_and_flags_win(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_PORT", "9")
    monkeypatch.setenv("PAGEDSERVE_MAX_MODEL_LEN", "")  # empty: not set (compose writes ${X:-})
    assert flags.parse_gateway([]).port == 9 and flags.parse_serve([]).gateway.port == 9
    assert flags.parse_gateway(["--port", "8000"]).port == 8000
    assert flags.parse_gateway([]).max_model_len is None
    # a child's command line carries every value, so its environment cannot change what serve chose
    (gateway,) = [c for c in _children(flags.parse_serve(["--port", "8000"]), monkeypatch) if c.name == "gateway"]
    assert flags.parse_gateway(gateway.argv[1:]) == gateway.config and gateway.config.port == 8000


def test_services_accept_the_shared_command_line_and_derive_their_ids():
    shared = ["--redis-url", "redis://h:1/0", "--prefix", "p", "--model", "/m", "--max-model-len", "64",
              "--num-detok-shards", "2"]
    detok = flags.parse_detok([*shared, "--shard", "1"])
    assert (detok.bus.prefix, detok.num_detok_shards, detok.service_id) == ("p", 2, "detok-1")
    engine = flags.parse_engine([*shared, "--service-id", "e-1"])
    assert engine.service_id == "e-1" and engine.engine.max_model_len == 64
    assert flags.parse_tokenizer(shared).service_id.startswith("tokenizer-")
    assert flags.parse_gateway(shared) == GatewayConfig(bus=flags.parse_detok(shared).bus, model="/m",
                                                        max_model_len=64, num_detok_shards=2)
    with pytest.raises(SystemExit):
        flags.parse_detok([*shared, "--shard", "2"])


def test_sizes():
    assert [flags.parse_size(t) for t in ("123", "512M", "2G", "1.5GiB", "8k")] == [
        123, 512 << 20, 2 << 30, int(1.5 * (1 << 30)), 8 << 10]
