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
import logging
import os
import struct
import time
import warnings
import zlib
from abc import abstractmethod
from dataclasses import asdict, replace

import msgpack
import redis
import torch

from engine_svc.kv_pool import (_DTYPES, KVConnector, KVLayout, KVTransferError,  # noqa: F401 (re-exported)
                                KVTransferStats, gather_kv, scatter_kv, token_slots)
from shared.config import KVTransferConfig  # noqa: F401 (re-exported)

MAGIC, VERSION = b"PSKV", 1
_PREAMBLE = struct.Struct("<4sBI")  # magic, version, header length
_MAX_HEADER = 4096
FAULTS = ("delete", "flip", "foreign", "stall")  # the test hook's ways to spoil a saved entry, or stall a load
STALL_S = 5.0  # test hook "stall": a decode engine sleeps this long before each load (under the 10 s heartbeat)
STAGING_MAX_BYTES = 256 << 20  # larger entries get a buffer of their own, so an idle engine holds at most this

log = logging.getLogger(__name__)


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
class ByteStoreConnector(KVConnector):
    """Save/load through a store of whole values (``_put`` / ``_take`` / ``_drop``); keeps the stats."""

    _checks_expiry = False  # True where the store keeps no TTL of its own

    def __init__(self, kv_caches, model_id: str, ttl_s: float, faults: tuple[str, ...] = ()):
        super().__init__(kv_caches, model_id)
        if ttl_s <= 0:
            raise ValueError(f"the KV lease must be positive, got {ttl_s}")
        unknown = set(faults) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown KV transfer faults {sorted(unknown)}; known: {FAULTS}")
        self.ttl_s = ttl_s
        # test hook (--kv-transfer-fault): spoil the saved entries, in turn; "stall": sleep before each load
        self.faults = tuple(f for f in faults if f != "stall")
        self.stall_s = STALL_S if "stall" in faults else 0.0
        self._num_faulted = 0
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
        fault = self._next_fault()
        layout = replace(self.layout, block_size=self.layout.block_size * 2) if fault == "foreign" else self.layout
        head = encode_head(layout, num_tokens, payload, self.ttl_s)
        if fault == "flip":  # after the checksum: the loader's check must catch it
            payload = bytearray(payload)
            payload[len(payload) // 2] ^= 0x10
        self._put(handle, head, payload)
        if fault == "delete":
            self._drop(handle)
        self.stats.num_saved += 1
        self.stats.bytes_saved += len(payload)
        self.stats.save_seconds += time.perf_counter() - start
        return handle

    def load(self, handle: str, block_table, num_tokens: int | None = None) -> None:
        if self.stall_s:  # test hook: a window in which the engine holds the request but not yet its KV
            log.warning("test hook: stalling %.1f s before loading KV entry %s", self.stall_s, handle)
            time.sleep(self.stall_s)
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

    def _next_fault(self) -> str | None:
        if not self.faults:
            return None
        self._num_faulted += 1
        return self.faults[(self._num_faulted - 1) % len(self.faults)]

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

    def __init__(self, client: redis.Redis, kv_caches, model_id: str, *, prefix: str = "ps", ttl_s: float = 60.0,
                 faults: tuple[str, ...] = ()):
        super().__init__(kv_caches, model_id, ttl_s, faults)
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
                 directory: str = "/dev/shm", faults: tuple[str, ...] = ()):
        super().__init__(kv_caches, model_id, ttl_s, faults)
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
    faults = tuple(f.strip() for f in config.fault.split(",") if f.strip()) if config.fault else ()
    if config.connector == "redis":
        if client is None:
            raise ValueError("the redis KV connector needs a Redis client")
        return RedisKVConnector(client, kv_caches, model_id, prefix=prefix, ttl_s=config.ttl_s, faults=faults)
    if config.connector == "shm":
        return ShmKVConnector(kv_caches, model_id, prefix=prefix, ttl_s=config.ttl_s, directory=config.shm_dir,
                              faults=faults)
    raise ValueError(f"KV connector must be redis or shm, got {config.connector!r}")
