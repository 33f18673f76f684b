"""The command line: one table of flags, and the typed config (shared.config) each command builds from it.

Every flag is one ``Flag`` record in ``FLAGS``: its name (vLLM's where vLLM has one), the config
field it fills, how its text parses, which commands use it and which ``PAGEDSERVE_*`` variable
gives its default. A flag left out leaves its field at the dataclass default, so every default
has one owner: the dataclass. `pagedserve serve` parses its command line into a ``ServeConfig``
and hands each child its config back as a command line (``to_argv``) built from the same
table; the child parses it into an equal config (tests/unit/test_flags.py checks the round trip).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from shared.config import (ENGINE_ROLES, DetokConfig, EngineServiceConfig, GatewayConfig, ServeConfig, StatusConfig,
                           TokenizerConfig, default_service_id)
from shared.placement import MODES

CONFIGS: dict[str, type] = {"serve": ServeConfig, "gateway": GatewayConfig, "tokenizer": TokenizerConfig,
                            "engine": EngineServiceConfig, "detok": DetokConfig, "status": StatusConfig}
SERVICES = ("gateway", "tokenizer", "engine", "detok")
ALL = frozenset({"serve", *SERVICES})  # `status` only reads the bus
ENGINE = frozenset({"serve", "engine"})
GATEWAY = frozenset({"serve", "gateway"})


def parse_size(text: str) -> int:
    """Bytes from '123', '512M', '2G', '1.5GiB'."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    return int(float(t[:-1] if scale > 1 else t) * scale)


def parse_bool(text: str) -> bool:
    """A boolean flag's value, as vLLM's dotted config flags take it (``--x.y true``)."""
    value = text.strip().lower()
    if value not in ("true", "false", "1", "0", "yes", "no"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value in ("true", "1", "yes")


@dataclass(frozen=True, slots=True, kw_only=True)
class Flag:
    """One command-line flag: the config field it fills (found by name in the command's config,
    nested ones included) and the commands whose config it fills (``used_by``). ``parse`` None
    makes a switch (``--x`` / ``--no-x``). ``accepted_by`` adds commands that take the flag and
    ignore it, so one shared command line (or environment) can start every service. A ``secret``
    never goes on a child's command line (visible in ``ps``): it travels in the ``env`` variable."""

    name: str
    field: str
    parse: Callable[[str], Any] | None
    used_by: frozenset[str]
    accepted_by: frozenset[str] = frozenset()
    env: str | None = None  # PAGEDSERVE_<env> gives the default
    choices: tuple[str, ...] | None = None
    secret: bool = False
    help: str = ""

    def default(self) -> Any:
        text = os.environ.get(f"PAGEDSERVE_{self.env}") if self.env else None
        return None if text in (None, "") else (self.parse or _truth)(text)


def _truth(text: str) -> bool:
    return text.strip().lower() in ("1", "true", "yes", "on")


def _engine(name: str, parse: Callable[[str], Any] | None, help_: str, **kw) -> Flag:
    return Flag(name=name, field=name[2:].replace("-", "_"), parse=parse, used_by=ENGINE, help=help_, **kw)


FLAGS: tuple[Flag, ...] = (
    # the bus and the model: every service takes them
    Flag(name="--redis-url", field="redis_url", parse=str, used_by=ALL | {"status"}, env="REDIS_URL",
         help="the bus (serve: use this Redis instead of starting one)"),
    Flag(name="--prefix", field="prefix", parse=str, used_by=ALL | {"status"}, env="PREFIX",
         help="namespace of every Redis key"),
    Flag(name="--stream-maxlen", field="maxlen", parse=int, used_by=ALL, env="STREAM_MAXLEN"),
    # the bus's trust boundary (README: Security)
    Flag(name="--redis-username", field="redis_username", parse=str, used_by=ALL | {"status"}, env="REDIS_USERNAME",
         help="the Redis ACL user (default: the URL's; serve with its own Redis: one per role)"),
    Flag(name="--redis-password", field="redis_password", parse=str, used_by=ALL | {"status"}, env="REDIS_PASSWORD",
         secret=True, help="the Redis password (better in PAGEDSERVE_REDIS_PASSWORD: a command line shows in ps)"),
    Flag(name="--bus-secret", field="bus_secret", parse=str, used_by=ALL, env="BUS_SECRET", secret=True,
         help="key (16+ characters) of the HMAC every stream entry carries; entries without it are refused (serve: "
              "a fresh one per run when none is given; better in PAGEDSERVE_BUS_SECRET)"),
    Flag(name="--heartbeat-ttl", field="heartbeat_ttl_s", parse=float, used_by=ALL, env="HEARTBEAT_TTL",
         help="seconds after which a service's heartbeat is deleted by the live ones (the service is gone)"),
    Flag(name="--model", field="model", parse=str, used_by=ALL, env="MODEL",
         help="HF model folder (default: SmolLM2-135M-Instruct, converted once)"),
    Flag(name="--tokenizer", field="tokenizer", parse=str, used_by=ALL, help="tokenizer folder (default: the model's)"),
    Flag(name="--max-model-len", field="max_model_len", parse=int, used_by=ALL - {"detok"}, accepted_by=ALL,
         env="MAX_MODEL_LEN", help="longest prompt + completion; the tokenizer refuses longer requests (400)"),
    Flag(name="--num-detok-shards", field="num_detok_shards", parse=int,
         used_by=frozenset({"gateway", "engine", "detok"}), accepted_by=ALL - {"serve"}, env="NUM_DETOK_SHARDS"),
    Flag(name="--service-id", field="service_id", parse=str, used_by=frozenset({"tokenizer", "engine", "detok"}),
         accepted_by=ALL - {"serve"}, env="SERVICE_ID"),
    Flag(name="--served-model-name", field="served_model_name", parse=str, used_by=GATEWAY | ENGINE,
         env="SERVED_MODEL_NAME", help="model name clients use"),
    # the gateway
    Flag(name="--host", field="host", parse=str, used_by=GATEWAY, env="HOST"),
    Flag(name="--port", field="port", parse=int, used_by=GATEWAY, env="PORT"),
    Flag(name="--api-key", field="api_key", parse=str, used_by=GATEWAY, env="API_KEY", secret=True),
    Flag(name="--gateway-id", field="gateway_id", parse=str, used_by=frozenset({"gateway"}), env="GATEWAY_ID"),
    Flag(name="--reuse-port", field="reuse_port", parse=None, used_by=frozenset({"gateway"}),
         help="bind with SO_REUSEPORT, so that several gateways share the port (the kernel spreads connections)"),
    Flag(name="--log-level", field="log_level", parse=str, used_by=GATEWAY),
    Flag(name="--request-timeout", field="idle_timeout_s", parse=float, used_by=GATEWAY,
         help="seconds a request may take, and the longest a client may ask (request_timeout): its deadline is "
              "its arrival plus this; at the deadline it fails (503) and is aborted, and no service computes it "
              "any more"),
    Flag(name="--max-body-bytes", field="max_body_bytes", parse=int, used_by=GATEWAY),
    Flag(name="--max-pending-requests", field="max_pending_requests", parse=int, used_by=GATEWAY,
         help="HTTP requests in flight on this gateway beyond which it answers 429 (with Retry-After)"),
    Flag(name="--body-timeout", field="body_timeout_s", parse=float, used_by=GATEWAY,
         help="seconds to receive a whole request body, else 408"),
    Flag(name="--redis-max-connections", field="redis_max_connections", parse=int, used_by=GATEWAY,
         help="the gateway's Redis connections for commands; more concurrent commands wait for one"),
    Flag(name="--redis-pool-timeout", field="redis_pool_timeout_s", parse=float, used_by=GATEWAY,
         help="seconds a request waits for a Redis connection before a 503 (with Retry-After)"),
    Flag(name="--enable-auto-tool-choice", field="enable_auto_tool_choice", parse=None, used_by=GATEWAY,
         help='tool_choice "auto" (the default when a request has tools): calls are parsed out of the text '
              "with --tool-call-parser; without this flag such a request is a 400"),
    Flag(name="--tool-call-parser", field="tool_call_parser", parse=str, used_by=GATEWAY, choices=("hermes",),
         help="hermes: <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>"),
    Flag(name="--structured-outputs-config.disable_any_whitespace", field="disable_any_whitespace",
         parse=parse_bool, used_by=GATEWAY,
         help="true: JSON constraints (schemas, json_object, forced tool calls) allow no free whitespace "
              "(vLLM's spelling; the value is required: true or false)"),
    # observability (README: Observability)
    Flag(name="--otlp-traces-endpoint", field="otlp_traces_endpoint", parse=str, used_by=ALL,
         env="OTLP_TRACES_ENDPOINT", help="send a trace per request to this OTLP/HTTP endpoint (e.g. "
                                          "http://collector:4318/v1/traces)"),
    Flag(name="--collect-detailed-traces", field="collect_detailed_traces", parse=None, used_by=ENGINE,
         help="the engine adds a span per step of each request (costs per token)"),
    Flag(name="--log-format", field="log_format", parse=str, used_by=ALL, env="LOG_FORMAT", choices=("text", "json")),
    Flag(name="--enable-log-requests", field="enable_log_requests", parse=None, used_by=GATEWAY,
         help="log each request as it arrives and ends"),
    Flag(name="--metrics-port", field="metrics_port", parse=int, used_by=ENGINE, env="ENGINE_METRICS_PORT",
         help="the engine serves its Prometheus /metrics on this port (0: not at all)"),
    Flag(name="--stale-after", field="stale_after_s", parse=float, used_by=frozenset({"status"}),
         help="seconds after which a heartbeat counts as stale"),
    Flag(name="--json", field="json", parse=None, used_by=frozenset({"status"}), help="print JSON, not a table"),
    # the tokenizer and the detokenizer
    Flag(name="--batch-size", field="batch_size", parse=int, used_by=frozenset({"tokenizer"})),
    Flag(name="--shard", field="shard", parse=int, used_by=frozenset({"detok"}), env="DETOK_SHARD"),
    # the engine (vLLM's names)
    _engine("--dtype", str, "auto | float32 | bfloat16 | float16"),
    _engine("--device", str, "auto | cpu | cuda"),
    _engine("--seed", int, "engine seed"),
    _engine("--block-size", int, "tokens per KV block"),
    _engine("--kv-cache-memory", parse_size, "KV cache bytes (e.g. 2G)"),
    _engine("--gpu-memory-utilization", float, "fraction of GPU memory"),
    _engine("--num-gpu-blocks-override", int, "fixed number of KV blocks"),
    _engine("--max-num-seqs", int, "sequences per step"),
    _engine("--max-num-batched-tokens", int, "tokens per step"),
    _engine("--max-num-queued-reqs", int, "waiting requests before 503"),
    _engine("--max-logprobs", int, "most logprobs a request may ask"),
    _engine("--attention-backend", str, "auto | torch | cupy"),
    _engine("--enable-prefix-caching", None, ""),
    _engine("--enable-chunked-prefill", None, ""),
    _engine("--enforce-eager", None, "no torch.compile of the forward"),
    Flag(name="--ctl-lookback", field="ctl_lookback_s", parse=float, used_by=ENGINE,
         help="seconds of aborts a starting engine replays, and how long it remembers one; keep it at least the "
              "gateways' --request-timeout"),
    Flag(name="--max-outage", field="max_outage_s", parse=float, used_by=ENGINE,
         help="Redis unreachable for longer than this many seconds: the requests the engine held meanwhile are "
              "failed (503) when it is back, not computed"),
    # prefill/decode disaggregation (README: Prefill/decode disaggregation)
    Flag(name="--role", field="role", parse=str, used_by=frozenset({"engine"}), choices=ENGINE_ROLES,
         env="ENGINE_ROLE", help="both (default): prompt and generation; prefill: the prompt and first token, then "
                                 "the request and its KV go to a decode engine; decode: takes those"),
    Flag(name="--kv-connector", field="connector", parse=str, used_by=ENGINE, choices=("redis", "shm"),
         env="KV_CONNECTOR", help="how KV moves from prefill to decode engines: redis (ps:kv:{request_id}) or shm "
                                  "(files in --kv-shm-dir, engines of one host)"),
    Flag(name="--kv-transfer-ttl", field="ttl_s", parse=float, used_by=ENGINE,
         help="seconds a saved KV entry waits for its decode engine before it is dropped"),
    Flag(name="--kv-shm-dir", field="shm_dir", parse=str, used_by=ENGINE, help="the tmpfs of the shm KV connector"),
    Flag(name="--kv-transfer-fault", field="fault", parse=str, used_by=frozenset({"engine"}),
         help="test hook: comma-separated faults (delete, flip, foreign) a prefill engine applies in turn to the KV "
              "entries it saves; stall: a decode engine sleeps 5 s before each load"),
    # serve: the stack's shape
    Flag(name="--gateways", field="num_gateways", parse=int, used_by=frozenset({"serve"}),
         help="gateway processes sharing the port (SO_REUSEPORT), each with its own reply stream"),
    Flag(name="--tokenizers", field="num_tokenizers", parse=int, used_by=frozenset({"serve"})),
    Flag(name="--detokenizers", field="num_detokenizers", parse=int, used_by=frozenset({"serve"})),
    Flag(name="--pd", field="pd", parse=None, used_by=frozenset({"serve"}),
         help="prefill/decode disaggregation: prefill engines and decode engines, each on CPUs of its own"),
    Flag(name="--prefill-engines", field="num_prefill_engines", parse=int, used_by=frozenset({"serve"}),
         help="with --pd: how many prefill engines"),
    Flag(name="--decode-engines", field="num_decode_engines", parse=int, used_by=frozenset({"serve"}),
         help="with --pd: how many decode engines"),
    Flag(name="--engine-nice", field="engine_nice", parse=int, used_by=frozenset({"serve"}),
         help="run the engine at this niceness"),
    Flag(name="--engine-sched", field="engine_sched", parse=str, used_by=frozenset({"serve"}),
         choices=("normal", "idle"),
         help="idle (default): SCHED_IDLE, so that the bus services, which need ~1%% of the engine's CPU, get a "
              "core the moment a step's tokens wake them; normal: when other CPU-bound work shares this session "
              "and must not starve the engine"),
    Flag(name="--bus-cpus", field="bus_cpus", parse=str, used_by=frozenset({"serve"}), choices=MODES,
         help="spread (default): each gateway and detok shard on a CPU of its own, Redis and the tokenizers with "
              "the detok shards, the engine on every CPU (shared/placement.py); none: the kernel places them"),
    Flag(name="--startup-timeout", field="startup_timeout_s", parse=float, used_by=frozenset({"serve"}),
         help="seconds to wait for /health"),
    Flag(name="--restart-backoff", field="restart_backoff_s", parse=float, used_by=frozenset({"serve"}),
         help="seconds before a dead child's first restart; doubled for each further one"),
    Flag(name="--restart-backoff-max", field="restart_backoff_max_s", parse=float, used_by=frozenset({"serve"}),
         help="the longest wait before a restart"),
    Flag(name="--restart-reset-after", field="restart_reset_after_s", parse=float, used_by=frozenset({"serve"}),
         help="a child that stayed up this many seconds starts its backoff over"),
    Flag(name="--max-start-failures", field="max_start_failures", parse=int, used_by=frozenset({"serve"}),
         help="a child that dies this many times in a row before it is healthy stops serve (exit 1)"),
)

DESCRIPTIONS = {"serve": "the whole stack on one machine", "gateway": "the OpenAI-compatible HTTP gateway",
                "tokenizer": "one tokenizer replica (consumer group 'tokenizer')",
                "engine": "the engine service (consumer group 'engine')", "detok": "one detokenizer shard",
                "status": "every live service of a stack, from its heartbeats"}


def flags_of(command: str) -> list[Flag]:
    """The flags whose value fills ``command``'s config."""
    return [f for f in FLAGS if command in f.used_by]


def parser(command: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"pagedserve {command}", description=DESCRIPTIONS[command])
    for f in FLAGS:
        if command in f.used_by or command in f.accepted_by:
            kw: dict[str, Any] = {"dest": f.field, "default": f.default(), "help": f.help or None,
                                  "metavar": None if f.choices else f.name[2:].upper().replace("-", "_")}
            if f.parse is None:
                kw["action"] = argparse.BooleanOptionalAction
            else:
                kw.update(type=f.parse, choices=f.choices)
            p.add_argument(f.name, **kw)
    return p


def fill(config: Any, values: Mapping[str, Any]) -> Any:
    """``config`` with every field named in ``values`` replaced, nested configs included (a nested
    config is never replaced by a value, only filled). Names it has no field for are left out."""
    changes = {}
    for f in dataclasses.fields(config):
        current = getattr(config, f.name)
        if dataclasses.is_dataclass(current):
            changes[f.name] = fill(current, values)
        elif f.name in values:
            changes[f.name] = values[f.name]
    return dataclasses.replace(config, **changes)


def value_of(config: Any, name: str) -> Any:
    """The field ``name`` of ``config`` or of the first nested config that has one."""
    for f in dataclasses.fields(config):
        current = getattr(config, f.name)
        if f.name == name and not dataclasses.is_dataclass(current):
            return current
        if dataclasses.is_dataclass(current):
            try:
                return value_of(current, name)
            except KeyError:
                pass
    raise KeyError(name)


def build(command: str, values: Mapping[str, Any]) -> Any:
    """``command``'s config from parsed values (field -> value; None: not given). For serve, each
    kind of child gets the values of the flags it uses."""
    used = {f.field for f in flags_of(command)}
    config = fill(CONFIGS[command](), {k: v for k, v in values.items() if k in used and v is not None})
    if command == "serve":
        config = dataclasses.replace(config, **{s: build(s, values) for s in SERVICES})
    return config


def with_identity(command: str, config: Any) -> Any:
    """What a service's config derives from the rest: its id when none was given (an engine's
    admissions name it as ``engine_id``), and the shard's range."""
    if command == "detok" and not 0 <= config.shard < config.num_detok_shards:
        raise SystemExit(f"--shard must be in [0, {config.num_detok_shards})")
    if command in ("tokenizer", "engine", "detok"):
        service_id = config.service_id or (f"detok-{config.shard}" if command == "detok"
                                           else default_service_id(command))
        config = fill(config, {"service_id": service_id})
    return config


def parse(command: str, argv: list[str] | None = None) -> Any:
    """``command``'s typed config from its command line (None: sys.argv)."""
    values = vars(parser(command).parse_args(argv))
    return with_identity(command, build(command, values))


def to_argv(command: str, config: Any) -> list[str]:
    """The command line that ``parse(command, ...)`` turns back into ``config`` (secrets left out:
    see ``to_env``). Every flag with a value is written, so the child's environment cannot change it."""
    argv: list[str] = []
    for f in flags_of(command):
        value = value_of(config, f.field)
        if f.secret or value is None:
            continue
        if f.parse is None:
            argv.append(f.name if value else "--no-" + f.name[2:])
        else:
            argv += [f.name, str(value)]
    return argv


def to_env(command: str, config: Any) -> dict[str, str]:
    """The secrets of ``config`` as the PAGEDSERVE_* variables their flags read ("" for none)."""
    return {f"PAGEDSERVE_{f.env}": value_of(config, f.field) or "" for f in flags_of(command) if f.secret}


def parse_gateway(argv: list[str] | None = None) -> GatewayConfig:
    return parse("gateway", argv)


def parse_tokenizer(argv: list[str] | None = None) -> TokenizerConfig:
    return parse("tokenizer", argv)


def parse_engine(argv: list[str] | None = None) -> EngineServiceConfig:
    return parse("engine", argv)


def parse_detok(argv: list[str] | None = None) -> DetokConfig:
    return parse("detok", argv)


def parse_serve(argv: list[str] | None = None) -> ServeConfig:
    return parse("serve", argv)
