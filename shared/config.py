"""Every service's config: frozen dataclasses, built from the command line and the environment here.

Nothing in this module touches the disk or the network: a config names a model folder or a
Redis URL, it never checks them. Environment variables (``PAGEDSERVE_*``) give the defaults of
the matching flags, so compose files and several hosts can share one set of settings.
Engine flags keep vLLM's names; ``engine_kwargs()`` turns them into ``EngineConfig`` keyword
arguments (``shared`` cannot import ``engine_svc``, so the engine builds its own config from them).
"""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass, field

from shared.protocol import StreamNames

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def _env(name: str, default=None):
    return os.environ.get(f"PAGEDSERVE_{name}", default)


def _env_int(name: str, default: int | None) -> int | None:
    value = _env(name)
    return int(value) if value not in (None, "") else default


def default_service_id(service: str) -> str:
    return f"{service}-{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True, slots=True, kw_only=True)
class BusConfig:
    """Where the bus is: the Redis URL, the key namespace and how long streams may grow."""

    redis_url: str = DEFAULT_REDIS_URL
    prefix: str = "ps"
    maxlen: int = 100_000

    @property
    def names(self) -> StreamNames:
        return StreamNames(self.prefix)


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewayConfig:
    """The HTTP front door: where it listens, what it serves and how it reaches the bus."""

    bus: BusConfig = field(default_factory=BusConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    model: str | None = None
    served_model_name: str | None = None
    api_key: str | None = None
    num_detok_shards: int = 1
    max_model_len: int | None = None
    gateway_id: str | None = None  # None: a fresh random id at start


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenizerConfig:
    """One tokenizer replica: which tokenizer, the prompt length limit, how it reads its group."""

    bus: BusConfig = field(default_factory=BusConfig)
    model: str | None = None  # None: the default model (shared.models)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    service_id: str = ""
    batch_size: int = 64
    block_ms: int = 500
    claim_idle_ms: int = 30_000
    heartbeat_s: float = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class DetokConfig:
    """One detokenizer shard: which tokenizer, which shard of how many."""

    bus: BusConfig = field(default_factory=BusConfig)
    model: str | None = None
    shard: int = 0
    num_shards: int = 1
    service_id: str = ""
    # one: each of the engine's entries (16 deltas) is published before the next is decoded
    entries_per_read: int = 1
    block_ms: int = 500
    heartbeat_s: float = 1.0
    request_idle_timeout_s: float = 900.0  # no delta for this long: its engine is gone, fail it
    engine_max_age_s: float = 10.0  # an engine whose heartbeat is older is dead: fail its requests
    engine_check_s: float = 2.0


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineServiceConfig:
    """The engine's Redis loop (the engine itself is configured by EngineConfig)."""

    bus: BusConfig = field(default_factory=BusConfig)
    num_detok_shards: int = 1
    service_id: str = ""
    batch_size: int = 64
    idle_block_ms: int = 500
    claim_idle_ms: int = 30_000
    heartbeat_s: float = 1.0
    deltas_per_entry: int = 16  # a step's deltas for one shard leave in entries of this many (entries.py)
    # a starting engine applies the aborts of this many seconds back: it may claim (after
    # claim_idle_ms) requests a dead engine never admitted, whose clients left meanwhile
    ctl_lookback_s: float = 120.0


# --------------------------------------------------------------------------- flags


def add_bus_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis-url", default=_env("REDIS_URL", DEFAULT_REDIS_URL))
    parser.add_argument("--prefix", default=_env("PREFIX", "ps"), help="namespace of every Redis key")
    parser.add_argument("--stream-maxlen", type=int, default=_env_int("STREAM_MAXLEN", 100_000))


def bus_from_args(args: argparse.Namespace) -> BusConfig:
    return BusConfig(redis_url=args.redis_url, prefix=args.prefix, maxlen=args.stream_maxlen)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=_env("MODEL"), help="HF model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--max-model-len", type=int, default=_env_int("MAX_MODEL_LEN", None))
    parser.add_argument("--num-detok-shards", type=int, default=_env_int("NUM_DETOK_SHARDS", 1))
    parser.add_argument("--service-id", default=_env("SERVICE_ID"))


def parse_size(text: str) -> int:
    """Bytes from '123', '512M', '2G', '1.5GiB'."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    return int(float(t[:-1] if scale > 1 else t) * scale)


# (flag, dest, type, default, help); None means "the engine's own default"
ENGINE_FLAGS: list[tuple[str, str, object, object, str]] = [
    ("--served-model-name", "served_model_name", str, None, "model name clients use"),
    ("--tokenizer", "tokenizer", str, None, "tokenizer folder (default: the model's)"),
    ("--dtype", "dtype", str, None, "auto | float32 | bfloat16 | float16"),
    ("--device", "device", str, None, "auto | cpu | cuda"),
    ("--seed", "seed", int, None, "engine seed"),
    ("--block-size", "block_size", int, None, "tokens per KV block"),
    ("--kv-cache-memory", "kv_cache_memory", parse_size, None, "KV cache bytes (e.g. 2G)"),
    ("--gpu-memory-utilization", "gpu_memory_utilization", float, None, "fraction of GPU memory"),
    ("--num-gpu-blocks-override", "num_gpu_blocks_override", int, None, "fixed number of KV blocks"),
    ("--max-num-seqs", "max_num_seqs", int, None, "sequences per step"),
    ("--max-num-batched-tokens", "max_num_batched_tokens", int, None, "tokens per step"),
    ("--max-num-queued-reqs", "max_num_queued_reqs", int, None, "waiting requests before 503"),
    ("--max-logprobs", "max_logprobs", int, None, "most logprobs a request may ask"),
    ("--attention-backend", "attention_backend", str, None, "auto | torch | cupy"),
]
ENGINE_SWITCHES = [("--enable-prefix-caching", "enable_prefix_caching"),
                   ("--enable-chunked-prefill", "enable_chunked_prefill"),
                   ("--enforce-eager", "enforce_eager")]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine (vLLM names)")
    for flag, dest, type_, default, help_ in ENGINE_FLAGS:
        group.add_argument(flag, dest=dest, type=type_, default=default, help=help_)
    for flag, dest in ENGINE_SWITCHES:
        group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig keyword arguments for the flags that were given (the rest keep its defaults)."""
    out = {"model": args.model, "max_model_len": args.max_model_len}
    for _flag, dest, *_ in ENGINE_FLAGS:
        out[dest] = getattr(args, dest)
    for _flag, dest in ENGINE_SWITCHES:
        out[dest] = getattr(args, dest)
    if getattr(args, "service_id", None):
        out["engine_id"] = args.service_id
    return {k: v for k, v in out.items() if v is not None}


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of a parsed `serve` command line, to hand to the engine process."""
    argv: list[str] = []
    for flag, dest, *_ in ENGINE_FLAGS:
        value = getattr(args, dest, None)
        if value is not None:
            argv += [flag, str(value)]
    for flag, dest in ENGINE_SWITCHES:
        value = getattr(args, dest, None)
        if value is not None:
            argv.append(flag if value else "--no-" + flag[2:])
    return argv


# --------------------------------------------------------------------------- per service


def _parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_bus_args(parser)
    add_model_args(parser)
    return parser


def tokenizer_parser() -> argparse.ArgumentParser:
    parser = _parser("pagedserve tokenizer", "one tokenizer replica (consumer group 'tokenizer')")
    parser.add_argument("--batch-size", type=int, default=64)
    return parser


def parse_tokenizer(argv: list[str] | None = None) -> TokenizerConfig:
    args = tokenizer_parser().parse_args(argv)
    return TokenizerConfig(bus=bus_from_args(args), model=args.model, max_model_len=args.max_model_len,
                           service_id=args.service_id or default_service_id("tokenizer"),
                           batch_size=args.batch_size)


def detok_parser() -> argparse.ArgumentParser:
    parser = _parser("pagedserve detok", "one detokenizer shard")
    parser.add_argument("--shard", type=int, default=_env_int("DETOK_SHARD", 0))
    return parser


def parse_detok(argv: list[str] | None = None) -> DetokConfig:
    args = detok_parser().parse_args(argv)
    if not 0 <= args.shard < args.num_detok_shards:
        raise SystemExit(f"--shard must be in [0, {args.num_detok_shards})")
    return DetokConfig(bus=bus_from_args(args), model=args.model, shard=args.shard,
                       num_shards=args.num_detok_shards,
                       service_id=args.service_id or f"detok-{args.shard}")


def engine_parser() -> argparse.ArgumentParser:
    parser = _parser("pagedserve engine", "the engine service (consumer group 'engine')")
    add_engine_args(parser)
    return parser


def parse_engine(argv: list[str] | None = None) -> tuple[EngineServiceConfig, dict]:
    args = engine_parser().parse_args(argv)
    service_id = args.service_id or default_service_id("engine")
    service = EngineServiceConfig(bus=bus_from_args(args), num_detok_shards=args.num_detok_shards,
                                  service_id=service_id)
    return service, {**engine_kwargs(args), "engine_id": service_id}


def gateway_parser() -> argparse.ArgumentParser:
    parser = _parser("pagedserve gateway", "the OpenAI-compatible HTTP gateway")
    parser.add_argument("--host", default=_env("HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=_env_int("PORT", 8000))
    parser.add_argument("--served-model-name", default=_env("SERVED_MODEL_NAME"))
    parser.add_argument("--api-key", default=_env("API_KEY"))
    parser.add_argument("--gateway-id", default=_env("GATEWAY_ID"))
    return parser


def parse_gateway(argv: list[str] | None = None) -> GatewayConfig:
    args = gateway_parser().parse_args(argv)
    return GatewayConfig(bus=bus_from_args(args), host=args.host, port=args.port, model=args.model,
                         served_model_name=args.served_model_name, api_key=args.api_key,
                         num_detok_shards=args.num_detok_shards, max_model_len=args.max_model_len,
                         gateway_id=args.gateway_id)
