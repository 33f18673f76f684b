"""Every service's config: frozen dataclasses, one per service, nested where a part is shared.

Nothing in this module touches the disk or the network: a config names a model folder or a
Redis URL, it never checks them, so a test can build any of them from keywords. The command
line (and the ``PAGEDSERVE_*`` environment) becomes these types in one place, ``shared.flags``;
`pagedserve serve` hands a child its config as that child's command line, built from the same
flag table, so a setting crosses the process wall typed and parsed once.
``EngineConfig`` lives here, not in ``engine_svc``, because ``shared`` imports no service and
the engine service's config holds one (``engine_svc.config`` re-exports it).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from shared.bus_auth import BusSigner
from shared.protocol import StreamNames

ENGINE_ROLES = ("both", "prefill", "decode")  # an engine's heartbeat stat "role" is the index

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def default_service_id(service: str) -> str:
    return f"{service}-{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True, slots=True, kw_only=True)
class BusConfig:
    """Where the bus is: the Redis URL, the key namespace and how long streams may grow; who we
    are to Redis (an ACL user and its password) and the key that signs every entry."""

    redis_url: str = DEFAULT_REDIS_URL
    prefix: str = "ps"
    redis_username: str | None = None  # None: the URL's (or Redis's default user)
    redis_password: str | None = field(default=None, repr=False)  # None: the URL's
    bus_secret: str | None = field(default=None, repr=False)  # HMAC key of every entry; None: unsigned
    maxlen: int = 100_000
    heartbeat_ttl_s: float = 60.0  # live services delete beats older than this from the heartbeat hash

    @property
    def names(self) -> StreamNames:
        return StreamNames(self.prefix)

    @property
    def redis_auth(self) -> dict[str, str]:
        """redis-py's username/password keywords for what is set (credentials in the URL win)."""
        auth = {"username": self.redis_username, "password": self.redis_password}
        return {k: v for k, v in auth.items() if v is not None}

    @property
    def signer(self) -> BusSigner | None:
        """What signs and checks this bus's entries (shared/bus_auth.py); None without a secret."""
        return BusSigner.of(self.bus_secret)


@dataclass(frozen=True, slots=True, kw_only=True)
class TelemetryConfig:
    """How a service reports itself: traces (OTLP), log lines, and the status line's period."""

    otlp_traces_endpoint: str | None = None  # e.g. http://collector:4318/v1/traces; None: no tracing
    collect_detailed_traces: bool = False  # the engine: a span per step of each request, not only per phase
    log_format: str = "text"  # text | json
    enable_log_requests: bool = False  # the gateway: one log line per request received and finished
    status_log_s: float = 5.0  # a status line this often while busy


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """What the engine is asked to be, with vLLM's names; building one never touches the disk or the network."""

    model: str | None = None  # HF folder; None means the default model (shared.models)
    tokenizer: str | None = None  # defaults to `model`
    served_model_name: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: bfloat16 on CUDA and native-bf16 CPUs)
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0
    # KV cache
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; the CPU default is DEFAULT_CPU_KV_BYTES
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    # scheduling
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    enable_chunked_prefill: bool = True
    max_num_queued_reqs: int = 4096
    max_logprobs: int = 20
    attention_backend: str = "auto"  # auto | torch | cupy
    enforce_eager: bool = False  # True: no torch.compile of the forward (engine_svc.compiled)


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewayLimits:
    """Timeouts and size limits of one gateway."""

    # --request-timeout: a request's deadline is its arrival plus this (or the client's shorter
    # request_timeout); at it the request fails (503) and is aborted. The name is historical: it is
    # a limit on the whole request, not on silence
    idle_timeout_s: float = 600.0
    max_body_bytes: int = 16 << 20  # larger bodies answer 413
    max_pending_requests: int = 4096  # more HTTP requests in flight answer 429
    heartbeat_max_age_s: float = 10.0  # /health: an engine heartbeat younger than this
    body_timeout_s: float = 30.0  # a request body not fully received in this long answers 408
    # the gateway's Redis commands share this many connections; a request waits up to
    # redis_pool_timeout_s for one (then 503) instead of failing while all are busy
    redis_max_connections: int = 128
    redis_pool_timeout_s: float = 10.0
    health_poll_s: float = 0.5  # /health answers from the heartbeats read this often in the background


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewayConfig:
    """The HTTP front door: where it listens, what it serves, how it reaches the bus, what it tolerates."""

    bus: BusConfig = field(default_factory=BusConfig)
    limits: GatewayLimits = field(default_factory=GatewayLimits)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    reuse_port: bool = False  # SO_REUSEPORT: several gateways share the port
    log_level: str = "info"
    model: str | None = None
    tokenizer: str | None = None  # None: the model's
    served_model_name: str | None = None
    api_key: str | None = None
    num_detok_shards: int = 1
    max_model_len: int | None = None
    gateway_id: str | None = None  # None: a fresh random id at start
    # tool calling and structured outputs (vLLM's flags): "auto" tool choice parses calls out of the
    # text with tool_call_parser, and only when enable_auto_tool_choice is set
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # hermes
    disable_any_whitespace: bool = False  # JSON constraints allow no free whitespace


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenizerConfig:
    """One tokenizer replica: which tokenizer, the prompt length limit, how it reads its group."""

    bus: BusConfig = field(default_factory=BusConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    model: str | None = None  # None: the default model (shared.models)
    tokenizer: str | None = None  # None: the model's
    max_model_len: int | None = None  # the engine's cap; None: the model's (shared.models.model_max_len)
    service_id: str = ""
    batch_size: int = 64
    block_ms: int = 500
    claim_idle_ms: int = 30_000
    heartbeat_s: float = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class DetokConfig:
    """One detokenizer shard: which tokenizer, which shard of how many."""

    bus: BusConfig = field(default_factory=BusConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    model: str | None = None
    tokenizer: str | None = None  # None: the model's
    shard: int = 0
    num_detok_shards: int = 1
    service_id: str = ""
    # one: each of the engine's entries (16 deltas) is published before the next is decoded
    entries_per_read: int = 1
    block_ms: int = 500
    heartbeat_s: float = 1.0
    request_idle_timeout_s: float = 900.0  # no delta for this long: its engine is gone, fail it
    engine_max_age_s: float = 10.0  # an engine whose heartbeat is older is dead: fail its requests
    engine_check_s: float = 2.0


@dataclass(frozen=True, slots=True, kw_only=True)
class KVTransferConfig:
    """How KV travels between engines (P/D, engine_svc/kv_transfer.py): which connector, and how
    long an unclaimed entry lives."""

    connector: str = "redis"  # redis | shm
    ttl_s: float = 60.0  # the lease: an entry no decode engine loaded within this is dropped
    shm_dir: str = "/dev/shm"
    # test hook (--kv-transfer-fault): the prefill engine spoils its saved entries, in turn, in these
    # ways ("delete", "flip" a payload byte, "foreign" header), so the decode side's fallback is exercised;
    # "stall": a decode engine sleeps before each load (a test kills it there)
    fault: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineServiceConfig:
    """The engine process: its Redis loop, and the engine it runs (``engine``)."""

    bus: BusConfig = field(default_factory=BusConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    metrics_port: int = 0  # its Prometheus /metrics on this port (all interfaces); 0: none
    num_detok_shards: int = 1
    service_id: str = ""
    batch_size: int = 64
    idle_block_ms: int = 500
    claim_idle_ms: int = 30_000
    heartbeat_s: float = 1.0
    deltas_per_entry: int = 16  # a step's deltas for one shard leave in entries of this many (entries.py)
    # Redis unreachable for longer than this: when it is back, the requests held meanwhile are
    # failed (503) instead of computed for clients whose gateways have most likely given up
    max_outage_s: float = 60.0
    # a starting engine applies the aborts of this many seconds back: it may claim (after
    # claim_idle_ms) requests a dead engine never admitted, whose clients left meanwhile. It is
    # also how long the engine remembers an abort (or a finished id). Keep it >= the gateways'
    # --request-timeout (their longest deadline): an older abort is moot, its request has expired.
    ctl_lookback_s: float = 600.0
    # prefill/decode disaggregation: prefill engines read ps:engine:in and hand each request, after
    # its first token, to ps:decode:in with its KV (kv_transfer); decode engines read ps:decode:in
    role: str = "both"  # one of ENGINE_ROLES; its heartbeat carries the index as stat "role"
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)


@dataclass(frozen=True, slots=True, kw_only=True)
class StatusConfig:
    """`pagedserve status`: which stack to look at, and when a heartbeat counts as stale."""

    bus: BusConfig = field(default_factory=BusConfig)
    stale_after_s: float = 10.0
    json: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class RestartConfig:
    """How `serve` restarts a child that died (shared.lifecycle.RestartTracker): the backoff
    before each restart, and how many start-up failures in a row stop the stack. The defaults
    are ServeConfig's (``ServeConfig.restart``)."""

    restart_backoff_s: float
    restart_backoff_max_s: float
    restart_reset_after_s: float
    max_start_failures: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeConfig:
    """`pagedserve serve`: the stack's shape (how many of each service, where they run) and the
    config every child of a kind starts from (its identity is added per child)."""

    redis_url: str | None = None  # None: start an embedded redis-server
    model: str | None = None  # None: the default model, converted once before any child starts
    num_gateways: int = 1
    num_tokenizers: int = 1
    num_detokenizers: int = 1
    engine_nice: int = 0
    engine_sched: str = "idle"  # idle: SCHED_IDLE (see shared/cli.py) | normal
    bus_cpus: str = "spread"  # shared.placement.MODES
    startup_timeout_s: float = 1800.0
    # restarts (RestartConfig): a dead child waits 1 s, 2, 4, ... up to 30 s; 60 s up starts over;
    # 3 deaths in a row before it is healthy stop the stack
    restart_backoff_s: float = 1.0
    restart_backoff_max_s: float = 30.0
    restart_reset_after_s: float = 60.0
    max_start_failures: int = 3
    pd: bool = False  # prefill/decode disaggregation: prefill and decode engines instead of one engine
    num_prefill_engines: int = 1  # with pd
    num_decode_engines: int = 1  # with pd
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    engine: EngineServiceConfig = field(default_factory=EngineServiceConfig)
    detok: DetokConfig = field(default_factory=DetokConfig)

    @property
    def restart(self) -> RestartConfig:
        return RestartConfig(restart_backoff_s=self.restart_backoff_s, restart_backoff_max_s=self.restart_backoff_max_s,
                             restart_reset_after_s=self.restart_reset_after_s,
                             max_start_failures=self.max_start_failures)
