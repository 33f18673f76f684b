"""KV transfer for prefill/decode disaggregation: a request's KV blocks out of one pool, into another.

A prefill engine calls ``connector.save(request_id, block_table, num_tokens)`` and hands the
returned handle to a decode engine, which allocates fresh blocks and calls
``connector.load(handle, block_table, num_tokens)``. A connector is bound to its engine's pool
(one K and one V tensor per layer of [num_blocks, block_size, num_kv_heads, head_dim]) at
construction, as vLLM's connectors register their KV caches once. Every failure to load --
missing, expired, mismatched, corrupt, store unreachable -- is one :class:`KVTransferError`; the
caller then recomputes the prompt. **Load consumes the entry** (GETDEL / unlink before reading), so
a handle is single-use and nothing is left behind on success or failure; ``delete`` is for a
prefill engine whose request is aborted before any decode engine took it; a lease (TTL) bounds
the rest.

Byte stores (Redis, a file in /dev/shm) hold one value per request::

    b"PSKV" | version u8 | header length u32 LE | header (msgpack map) | payload
    header: model_id, num_layers, dtype, block_size, num_kv_heads, head_dim,
            num_tokens, crc32 (of the payload), expires_at (unix seconds)
    payload: for each layer, K then V, each [num_tokens, num_kv_heads, head_dim] in the
             pool's dtype, little-endian -- only the request's tokens, no block padding

CRC-32 rather than a cryptographic hash: it guards against corruption and truncation, not an
attacker (who could write any key), and runs at several GB/s, ~3x SHA-256 here.

How NIXL or NCCL slot in: they subclass :class:`KVConnector` directly, not ``ByteStoreConnector``
(no bytes on the host). At construction they register the pool tensors with the transfer agent
(NIXL's ``register_memory`` over the same ``kv_caches`` list); ``save`` returns a handle naming
(agent, block ids, layout) instead of copying; ``load`` reads the remote blocks straight into the
local ones (a NIXL READ, or an NCCL send/recv pair per layer over a communicator the two engines
opened) and checks the same :class:`KVLayout`. The calls stay save/load/delete; the one change
for the engine is when the prefill side may free the blocks: a byte store is done when ``save``
returns, a NIXL-style connector only when the decode side's done-notification arrives (vLLM's
``get_finished``), so the engine would hold them until then.

Only this module (the Redis connector) may import redis; the rest of the engine never does.
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
import sys
import time
import warnings
import zlib
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field

import msgpack
import redis
import torch

MAGIC, VERSION = b"PSKV", 1
_PREAMBLE = struct.Struct("<4sBI")  # magic, version, header length
_MAX_HEADER = 4096
STAGING_MAX_BYTES = 256 << 20  # larger entries get a buffer of their own, so an idle engine holds at most this
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class KVTransferError(Exception):
    """A KV entry that cannot be loaded; ``reason`` is missing | expired | mismatch | corrupt |
    unavailable. The caller recomputes the prompt instead."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True, kw_only=True)
class KVTransferConfig:
    """How KV travels between engines: which connector, and how long an unclaimed entry lives."""

    connector: str = "redis"  # redis | shm
    ttl_s: float = 60.0  # the lease: an entry no decode engine loaded within this is dropped
    shm_dir: str = "/dev/shm"


@dataclass(frozen=True, slots=True, kw_only=True)
class KVLayout:
    """What a pool's KV bytes mean; a loader accepts only an entry written for its own layout."""

    model_id: str
    num_layers: int
    dtype: str  # float32 | bfloat16 | float16
    block_size: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of_pool(cls, model_id: str, kv_caches) -> KVLayout:
        k = kv_caches[0][0]
        dtype = next((name for name, dt in _DTYPES.items() if dt == k.dtype), None)
        if dtype is None:
            raise ValueError(f"KV transfer supports {', '.join(_DTYPES)}, not {k.dtype}")
        _, block_size, num_kv_heads, head_dim = k.shape
        return cls(model_id=model_id, num_layers=len(kv_caches), dtype=dtype, block_size=block_size,
                   num_kv_heads=num_kv_heads, head_dim=head_dim)

    def payload_bytes(self, num_tokens: int) -> int:
        elem = torch.empty((), dtype=_DTYPES[self.dtype]).element_size()
        return 2 * self.num_layers * num_tokens * self.num_kv_heads * self.head_dim * elem


@dataclass(slots=True)
class KVTransferStats:
    """What one connector moved, cumulative (the engine reports them as counters); only the
    connector writes them."""

    num_saved: int = 0
    num_loaded: int = 0
    bytes_saved: int = 0
    bytes_loaded: int = 0
    save_seconds: float = 0.0  # gather + encode + store, summed over saves
    load_seconds: float = 0.0  # fetch + check + scatter, summed over successful loads
    num_fallbacks: int = 0  # loads that raised: the caller recomputed
    fallback_reasons: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------- the pool side
def token_slots(block_table, num_tokens: int, block_size: int, num_blocks: int, device) -> torch.Tensor:
    """int64 [num_tokens]: the pool slot of each of a request's first num_tokens tokens."""
    needed = -(-num_tokens // block_size)
    if num_tokens <= 0 or len(block_table) < needed:
        raise ValueError(f"{num_tokens} tokens need {needed} blocks, the block table has {len(block_table)}")
    blocks = torch.as_tensor(list(block_table[:needed]), dtype=torch.int64)
    if int(blocks.min()) < 1 or int(blocks.max()) >= num_blocks:
        raise ValueError(f"block ids must be in 1..{num_blocks - 1} (0 is the null block)")
    offsets = torch.arange(block_size, dtype=torch.int64)
    return (blocks[:, None] * block_size + offsets).reshape(-1)[:num_tokens].to(device)


def gather_kv(kv_caches, block_table, num_tokens: int, staging: torch.Tensor | None = None) -> torch.Tensor:
    """A request's KV as one contiguous CPU tensor [num_layers, 2 (K, V), num_tokens, heads, head_dim],
    in ``staging`` (CPU uint8, large enough) when given."""
    k0 = kv_caches[0][0]
    num_blocks, block_size, heads, head_dim = k0.shape
    slots = token_slots(block_table, num_tokens, block_size, num_blocks, k0.device)
    shape = (len(kv_caches), 2, num_tokens, heads, head_dim)
    if staging is None:
        out = torch.empty(shape, dtype=k0.dtype)
    else:
        out = staging[:k0.element_size() * math.prod(shape)].view(k0.dtype).view(shape)
    on_device = out if k0.device.type == "cpu" else torch.empty(shape, dtype=k0.dtype, device=k0.device)
    for layer, pair in enumerate(kv_caches):
        for i, cache in enumerate(pair):
            torch.index_select(cache.view(-1, heads, head_dim), 0, slots, out=on_device[layer, i])
    if on_device is not out:
        out.copy_(on_device)
    return out


def scatter_kv(kv_caches, block_table, num_tokens: int, kv: torch.Tensor) -> None:
    """Write ``kv`` (as gather_kv returns it) into the pool's blocks named by ``block_table``."""
    k0 = kv_caches[0][0]
    num_blocks, block_size, heads, head_dim = k0.shape
    expected = (len(kv_caches), 2, num_tokens, heads, head_dim)
    if tuple(kv.shape) != expected or kv.dtype != k0.dtype:
        raise ValueError(f"KV of shape {tuple(kv.shape)} {kv.dtype} does not fit {expected} {k0.dtype}")
    slots = token_slots(block_table, num_tokens, block_size, num_blocks, k0.device)
    kv = kv.to(k0.device)
    with torch.no_grad():
        for layer, pair in enumerate(kv_caches):
            for i, cache in enumerate(pair):
                cache.view(-1, heads, head_dim).index_copy_(0, slots, kv[layer, i])


# ---------------------------------------------------------------------------- the entry format
def encode_head(layout: KVLayout, num_tokens: int, payload: memoryview, ttl_s: float) -> bytes:
    header = msgpack.packb({**asdict(layout), "num_tokens": num_tokens, "crc32": zlib.crc32(payload),
                            "expires_at": time.time() + ttl_s}, use_bin_type=True)
    return _PREAMBLE.pack(MAGIC, VERSION, len(header)) + header


def decode_entry(value, layout: KVLayout, num_tokens: int | None) -> tuple[dict, memoryview]:
    """Check an entry against the loader's layout; (header, payload) or KVTransferError."""
    view = memoryview(value)
    if len(view) < _PREAMBLE.size:
        raise KVTransferError("corrupt", f"KV entry of {len(view)} bytes is truncated")
    magic, version, head_len = _PREAMBLE.unpack_from(view)
    if magic != MAGIC or version != VERSION or head_len > min(_MAX_HEADER, len(view) - _PREAMBLE.size):
        raise KVTransferError("corrupt", f"not a version-{VERSION} KV entry (magic {bytes(magic)!r}, "
                                         f"version {version})")
    try:
        header = msgpack.unpackb(view[_PREAMBLE.size:_PREAMBLE.size + head_len], raw=False, max_map_len=16,
                                 max_str_len=1024, max_bin_len=0, max_array_len=0)
    except (ValueError, msgpack.UnpackException) as exc:
        raise KVTransferError("corrupt", f"KV entry header does not decode: {exc}") from None
    ours = asdict(layout)
    if not isinstance(header, dict) or any(type(header.get(k)) is not type(v) for k, v in ours.items()):
        raise KVTransferError("corrupt", "KV entry header lacks layout fields")
    wrong = [f"{k} {header[k]!r} (ours {v!r})" for k, v in ours.items() if header[k] != v]
    if num_tokens is not None and header.get("num_tokens") != num_tokens:
        wrong.append(f"num_tokens {header.get('num_tokens')!r} (expected {num_tokens})")
    if wrong:
        raise KVTransferError("mismatch", "KV entry was written for another layout: " + ", ".join(wrong))
    payload = view[_PREAMBLE.size + head_len:]
    tokens = header.get("num_tokens")
    if type(tokens) is not int or tokens <= 0 or len(payload) != layout.payload_bytes(tokens):
        raise KVTransferError("corrupt", f"KV payload of {len(payload)} bytes does not hold {tokens!r} tokens")
    if type(header.get("expires_at")) is not float:
        raise KVTransferError("corrupt", "KV entry header names no lease (expires_at)")
    if header.get("crc32") != zlib.crc32(payload):
        raise KVTransferError("corrupt", "KV payload fails its checksum")
    return header, payload


# ---------------------------------------------------------------------------- connectors
class KVConnector(ABC):
    """Moves a request's KV between engines by handle; owns its stats. Bound to one engine's pool."""

    def __init__(self, kv_caches, model_id: str):
        if sys.byteorder != "little":
            raise RuntimeError("KV entries are little-endian; this host is not")
        self.kv_caches = kv_caches
        self.layout = KVLayout.of_pool(model_id, kv_caches)
        self.stats = KVTransferStats()

    @abstractmethod
    def save(self, request_id: str, block_table, num_tokens: int) -> str:
        """Store the request's first num_tokens tokens of KV; returns the handle a loader needs."""

    @abstractmethod
    def load(self, handle: str, block_table, num_tokens: int | None = None) -> None:
        """Fill block_table's blocks from the entry and consume it; KVTransferError when it cannot."""

    @abstractmethod
    def delete(self, handle: str) -> None:
        """Drop an entry nobody will load (idempotent)."""


class ByteStoreConnector(KVConnector):
    """Save/load through a store of whole values (``_put`` / ``_take`` / ``_drop``); keeps the stats."""

    _checks_expiry = False  # True where the store keeps no TTL of its own

    def __init__(self, kv_caches, model_id: str, ttl_s: float):
        super().__init__(kv_caches, model_id)
        if ttl_s <= 0:
            raise ValueError(f"the KV lease must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self._staging = torch.empty(0, dtype=torch.uint8)

    def staging(self, nbytes: int) -> torch.Tensor | None:
        """A reused host buffer (pinned next to a GPU pool) for entries up to STAGING_MAX_BYTES: a
        fresh 47 MB tensor costs ~60 ms of page faults here, a reused one ~1 ms. None above that."""
        if nbytes > STAGING_MAX_BYTES:
            return None
        if self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.kv_caches[0][0].is_cuda)
        return self._staging[:nbytes]

    def save(self, request_id: str, block_table, num_tokens: int) -> str:
        start = time.perf_counter()
        handle = _check_handle(request_id)
        kv = gather_kv(self.kv_caches, block_table, num_tokens, self.staging(self.layout.payload_bytes(num_tokens)))
        payload = memoryview(kv.reshape(-1).view(torch.uint8).numpy())
        self._put(handle, encode_head(self.layout, num_tokens, payload, self.ttl_s), payload)
        self.stats.num_saved += 1
        self.stats.bytes_saved += len(payload)
        self.stats.save_seconds += time.perf_counter() - start
        return handle

    def load(self, handle: str, block_table, num_tokens: int | None = None) -> None:
        start = time.perf_counter()
        try:
            value = self._take(_check_handle(handle))
            header, payload = decode_entry(value, self.layout, num_tokens)
            late = time.time() - header["expires_at"]
            if self._checks_expiry and late > 0:
                raise KVTransferError("expired", f"KV entry {handle!r} is past its lease (by {late:.1f} s)")
        except KVTransferError as exc:
            self.stats.num_fallbacks += 1
            self.stats.fallback_reasons[exc.reason] = self.stats.fallback_reasons.get(exc.reason, 0) + 1
            raise
        tokens = header["num_tokens"]
        with warnings.catch_warnings():  # a read-only buffer: the tensor is only read, by the copy into the pool
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            flat = torch.frombuffer(payload, dtype=torch.uint8)
        kv = flat.view(_DTYPES[self.layout.dtype]).view(self.layout.num_layers, 2, tokens, self.layout.num_kv_heads,
                                                        self.layout.head_dim)
        scatter_kv(self.kv_caches, block_table, tokens, kv)
        self.stats.num_loaded += 1
        self.stats.bytes_loaded += len(payload)
        self.stats.load_seconds += time.perf_counter() - start

    def delete(self, handle: str) -> None:
        self._drop(_check_handle(handle))

    @abstractmethod
    def _put(self, handle: str, head: bytes, payload: memoryview) -> None: ...

    @abstractmethod
    def _take(self, handle: str):
        """The whole value, removed from the store; KVTransferError('missing') when there is none."""

    @abstractmethod
    def _drop(self, handle: str) -> None: ...


def _check_handle(handle) -> str:
    if not isinstance(handle, str) or not 0 < len(handle) <= 256:
        raise KVTransferError("missing", "a KV handle is a request id of 1..256 characters")
    return handle


class RedisKVConnector(ByteStoreConnector):
    """KV entries as Redis strings under ``{prefix}:kv:{request_id}``, expiring after the lease."""

    def __init__(self, client: redis.Redis, kv_caches, model_id: str, *, prefix: str = "ps", ttl_s: float = 60.0):
        super().__init__(kv_caches, model_id, ttl_s)
        if client.get_encoder().decode_responses:
            raise ValueError("the KV connector needs a Redis client with decode_responses=False")
        self.client, self.prefix = client, prefix

    def key(self, handle: str) -> str:
        return f"{self.prefix}:kv:{handle}"

    def _put(self, handle: str, head: bytes, payload: memoryview) -> None:
        # One SET written to the socket straight from the gathered tensor: client.set() would first
        # copy the payload into a packed command, and SET + APPEND makes Redis grow the value;
        # either takes ~5x the time of this for a 24 MB entry (measured).
        key, px = self.key(handle).encode(), b"%d" % max(1, int(self.ttl_s * 1000))
        pre = b"*5\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, len(head) + len(payload))
        tail = b"\r\n$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(px), px)
        pool = self.client.connection_pool
        try:
            conn = pool.get_connection()
            try:
                conn.send_packed_command([pre + head, payload, tail])
                conn.read_response()  # +OK, or raises
            except BaseException:
                conn.disconnect()  # a half-written command must not reach the next user of the connection
                raise
            finally:
                pool.release(conn)
        except redis.RedisError as exc:
            raise KVTransferError("unavailable", f"cannot store KV in Redis: {exc}") from exc

    def _take(self, handle: str):
        try:
            value = self.client.getdel(self.key(handle))
        except redis.RedisError as exc:
            raise KVTransferError("unavailable", f"cannot read KV from Redis: {exc}") from exc
        if value is None:
            raise KVTransferError("missing", f"no KV under {self.key(handle)} (never saved, past its lease, "
                                             "or already loaded)")
        return value

    def _drop(self, handle: str) -> None:
        try:
            self.client.delete(self.key(handle))
        except redis.RedisError as exc:
            raise KVTransferError("unavailable", f"cannot delete KV in Redis: {exc}") from exc


class ShmKVConnector(ByteStoreConnector):
    """KV entries as files in a tmpfs (/dev/shm) for engines of one host; the lease is the header's
    ``expires_at``, checked on load and by ``sweep()``, which the engine calls now and then.

    Plain files rather than ``multiprocessing.shared_memory``: before Python 3.13 its resource
    tracker unlinks a segment when the process that made it exits, i.e. before the decode engine
    reads it. A file appears by rename, so a reader never sees half of one.
    """

    _checks_expiry = True

    def __init__(self, kv_caches, model_id: str, *, prefix: str = "ps", ttl_s: float = 60.0,
                 directory: str = "/dev/shm"):
        super().__init__(kv_caches, model_id, ttl_s)
        self.directory, self.prefix = directory, prefix

    def path(self, handle: str) -> str:
        # request ids may hold any character; a file name may not
        return os.path.join(self.directory, f"{self.prefix}-kv-{hashlib.sha256(handle.encode()).hexdigest()[:32]}")

    def _put(self, handle: str, head: bytes, payload: memoryview) -> None:
        final = self.path(handle)
        tmp = f"{final}.tmp{os.getpid()}"
        try:
            with open(tmp, "wb", buffering=0, opener=_private) as f:
                for part in (head, payload):
                    _write_all(f, part)
            os.replace(tmp, final)
        except OSError as exc:
            _unlink(tmp)
            raise KVTransferError("unavailable", f"cannot store KV in {self.directory}: {exc}") from exc

    def _take(self, handle: str):
        try:
            with open(self.path(handle), "rb", buffering=0) as f:
                os.unlink(self.path(handle))  # consumed: gone whatever the checks below find
                size = os.fstat(f.fileno()).st_size
                staging = self.staging(size)
                value = bytearray(size) if staging is None else memoryview(staging.numpy())
                view = memoryview(value)
                while view:
                    view = view[f.readinto(view) or len(view):]  # 0 at an early end: the checksum catches it
        except FileNotFoundError:
            raise KVTransferError("missing", f"no KV entry for {handle!r} in {self.directory} (never saved, "
                                             "swept after its lease, or already loaded)") from None
        except OSError as exc:
            raise KVTransferError("unavailable", f"cannot read KV from {self.directory}: {exc}") from exc
        return value

    def _drop(self, handle: str) -> None:
        _unlink(self.path(handle))

    def sweep(self) -> int:
        """Remove this namespace's entries past their lease (and writes abandoned as long); returns how many."""
        removed, now, mine = 0, time.time(), f"{self.prefix}-kv-"
        for name in os.listdir(self.directory):
            if not name.startswith(mine):
                continue
            path = os.path.join(self.directory, name)
            try:
                if ".tmp" in name:
                    expired = os.stat(path).st_mtime + self.ttl_s < now
                else:
                    with open(path, "rb") as f:
                        head = f.read(_PREAMBLE.size + _MAX_HEADER)
                    expired = _expires_at(head) < now
            except FileNotFoundError:
                continue  # loaded meanwhile
            if expired:
                removed += _unlink(path)
        return removed


def _expires_at(head: bytes) -> float:
    """The lease end a file's first bytes name; 0 (expired) when they name none."""
    try:
        _, _, head_len = _PREAMBLE.unpack_from(head)
        header = msgpack.unpackb(head[_PREAMBLE.size:_PREAMBLE.size + head_len], raw=False)
        return float(header["expires_at"])
    except Exception:  # noqa: BLE001 - anything unreadable is garbage to sweep
        return 0.0


def _private(path: str, flags: int) -> int:
    return os.open(path, flags, 0o600)  # KV says much about a prompt: only this user's engines read it


def _write_all(f, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[f.write(view):]


def _unlink(path: str) -> int:
    try:
        os.unlink(path)
        return 1
    except FileNotFoundError:
        return 0


def make_connector(config: KVTransferConfig, kv_caches, model_id: str, *, prefix: str = "ps",
                   client: redis.Redis | None = None) -> KVConnector:
    """The connector ``config`` names, bound to this engine's pool."""
    if config.connector == "redis":
        if client is None:
            raise ValueError("the redis KV connector needs a Redis client")
        return RedisKVConnector(client, kv_caches, model_id, prefix=prefix, ttl_s=config.ttl_s)
    if config.connector == "shm":
        return ShmKVConnector(kv_caches, model_id, prefix=prefix, ttl_s=config.ttl_s, directory=config.shm_dir)
    raise ValueError(f"KV connector must be redis or shm, got {config.connector!r}")
