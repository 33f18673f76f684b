"""The KV connector contract, run against a real redis-server and a real /dev/shm: what one engine's
pool saves, another engine's pool loads bit for bit into other blocks; every entry that cannot be
loaded raises KVTransferError with its reason and is gone afterwards; no ps:kv:* key and no
shared-memory file is left behind by any test."""

from __future__ import annotations

import os
import socket
import tempfile
import time

import pytest
import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from engine_svc.kv_transfer import (KVConnector, KVTransferConfig, KVTransferError, RedisKVConnector,
                                    ShmKVConnector, gather_kv, make_connector)
from tests.unit.test_kv_transfer import bits, make_pool

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class Store:
    """One kind of store under a fresh namespace: builds connectors, tampers with and lists entries."""

    def __init__(self, kind: str, client: redis.Redis, prefix: str):
        self.kind, self.client, self.prefix = kind, client, prefix

    def connector(self, pool, model_id="smollm", ttl_s=60.0) -> KVConnector:
        config = KVTransferConfig(connector=self.kind, ttl_s=ttl_s, shm_dir=SHM_DIR)
        return make_connector(config, pool, model_id, prefix=self.prefix, client=self.client)

    def leftovers(self) -> list[str]:
        if self.kind == "redis":
            return sorted(k.decode() for k in self.client.scan_iter(f"{self.prefix}:kv:*"))
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"{self.prefix}-"))

    def remove(self, names: list[str]) -> None:
        for name in names:
            if self.kind == "redis":
                self.client.delete(name)
            else:
                os.unlink(os.path.join(SHM_DIR, name))

    def flip_byte(self, conn, handle: str, from_end: int) -> None:
        if self.kind == "redis":
            key = conn.key(handle)
            value, ttl = bytearray(self.client.get(key)), self.client.pttl(key)
            value[-from_end] ^= 0x10
            self.client.set(key, bytes(value), px=ttl)
        else:
            with open(conn.path(handle), "r+b") as f:
                f.seek(-from_end, os.SEEK_END)
                byte = f.read(1)[0]
                f.seek(-from_end, os.SEEK_END)
                f.write(bytes([byte ^ 0x10]))


@pytest.fixture(params=["redis", "shm"])
def store(request, redis_client, prefix):
    s = Store(request.param, redis_client, prefix)
    yield s
    left = s.leftovers()
    s.remove(left)  # so that a failing run leaves nothing either
    assert left == []


def _fails(conn, handle, table, num_tokens, reason, match):
    with pytest.raises(KVTransferError, match=match) as err:
        conn.load(handle, table, num_tokens)
    assert err.value.reason == reason


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_into_another_pool_is_bit_exact(store, dtype):
    # a 4-layer pool of 6-token blocks; 21 tokens fill 3 blocks and 3 tokens of a fourth
    prefill = store.connector(make_pool(num_blocks=20, block_size=6, num_layers=4, dtype=dtype, seed=3))
    decode_pool = make_pool(num_blocks=30, block_size=6, num_layers=4, dtype=dtype, seed=4)
    decode = store.connector(decode_pool)
    handle = prefill.save("cmpl-1", [17, 4, 9, 12], 21)
    assert store.leftovers() != []
    decode.load(handle, [29, 1, 16, 2], 21)
    sent = gather_kv(prefill.kv_caches, [17, 4, 9, 12], 21)
    assert torch.equal(bits(gather_kv(decode_pool, [29, 1, 16, 2], 21)), bits(sent))
    nbytes = 2 * 4 * 21 * 2 * 8 * dtype.itemsize
    assert (prefill.stats.num_saved, prefill.stats.bytes_saved) == (1, nbytes)
    assert (decode.stats.num_loaded, decode.stats.bytes_loaded, decode.stats.num_fallbacks) == (1, nbytes, 0)
    _fails(decode, handle, [29, 1, 16, 2], 21, "missing", "already loaded")  # a handle is single-use
    assert decode.stats.fallback_reasons == {"missing": 1}


def test_a_missing_entry(store):
    conn = store.connector(make_pool())
    _fails(conn, "never-saved", [1, 2], 5, "missing", "never saved")
    _fails(conn, "", [1, 2], 5, "missing", "1..256 characters")


def test_an_entry_past_its_lease(store):
    pool = make_pool()
    saver = store.connector(pool, ttl_s=0.2)
    handle = saver.save("r-ttl", [1, 2], 5)
    time.sleep(0.6)
    # Redis drops the key itself (missing); a file stays until a load or sweep finds its lease over
    reason, match = ("missing", "lease") if store.kind == "redis" else ("expired", r"past its lease \(by [0-9.]+ s\)")
    _fails(store.connector(make_pool(seed=9)), handle, [3, 4], 5, reason, match)


@pytest.mark.parametrize("from_end", [1, 300], ids=["last-byte", "mid-payload"])
def test_a_flipped_byte_fails_the_checksum(store, from_end):
    saver = store.connector(make_pool())
    handle = saver.save("r-flip", [1, 2, 3], 10)
    store.flip_byte(saver, handle, from_end)
    dst = make_pool(seed=5)
    before = [k.clone() for k, _ in dst]
    _fails(store.connector(dst), handle, [4, 5, 6], 10, "corrupt", "checksum")
    assert all(torch.equal(k, b) for (k, _), b in zip(dst, before))  # nothing was written


@pytest.mark.parametrize("loader, match", [
    (dict(model_id="llama-3"), "model_id 'smollm' .ours 'llama-3'."),
    (dict(block_size=8), "block_size 4 .ours 8."),
    (dict(dtype=torch.bfloat16), "dtype 'float32' .ours 'bfloat16'."),
    (dict(num_layers=2), "num_layers 3 .ours 2."),
    (dict(heads=3), "num_kv_heads 2 .ours 3."),
])
def test_an_entry_for_another_model_or_layout_is_refused(store, loader, match):
    handle = store.connector(make_pool()).save("r-other", [1, 2], 5)
    pool_args = {k: v for k, v in loader.items() if k != "model_id"}
    conn = store.connector(make_pool(**pool_args), model_id=loader.get("model_id", "smollm"))
    _fails(conn, handle, [3, 4], 5, "mismatch", match)


def test_an_entry_of_another_length_is_refused(store):
    handle = store.connector(make_pool()).save("r-len", [1, 2], 5)
    _fails(store.connector(make_pool()), handle, [3, 4], 6, "mismatch", r"num_tokens 5 \(expected 6\)")


def test_delete_drops_an_entry_nobody_will_load(store):
    conn = store.connector(make_pool())
    handle = conn.save("r-abort", [1, 2], 5)
    conn.delete(handle)
    conn.delete(handle)  # idempotent
    _fails(conn, handle, [1, 2], 5, "missing", "never saved")


def test_saving_again_replaces_the_entry(store):
    pool = make_pool()
    conn = store.connector(pool)
    conn.save("r-twice", [1, 2], 5)
    handle = conn.save("r-twice", [3, 4], 6)  # a redelivered handoff, a longer prefill
    dst = make_pool(seed=7)
    store.connector(dst).load(handle, [5, 6], 6)
    assert torch.equal(gather_kv(dst, [5, 6], 6), gather_kv(pool, [3, 4], 6))


def test_redis_entries_carry_the_lease_as_a_ttl(redis_client, prefix):
    conn = RedisKVConnector(redis_client, make_pool(), "smollm", prefix=prefix, ttl_s=30)
    handle = conn.save("r-pttl", [1, 2], 5)
    assert conn.key(handle) == f"{prefix}:kv:r-pttl"
    assert 25_000 < redis_client.pttl(conn.key(handle)) <= 30_000
    conn.delete(handle)


def test_redis_down_is_unavailable_and_a_fallback():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = redis.Redis(port=port, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    conn = RedisKVConnector(client, make_pool(), "smollm", prefix="down")
    with pytest.raises(KVTransferError, match="cannot store KV in Redis") as err:
        conn.save("r", [1, 2], 5)
    assert err.value.reason == "unavailable"
    _fails(conn, "r", [1, 2], 5, "unavailable", "cannot read KV from Redis")
    with pytest.raises(KVTransferError, match="cannot delete KV in Redis"):
        conn.delete("r")
    assert conn.stats.fallback_reasons == {"unavailable": 1} and conn.stats.num_saved == 0


def test_connector_settings_are_checked(redis_url, prefix):
    text_client = redis.Redis.from_url(redis_url, decode_responses=True)
    with pytest.raises(ValueError, match="decode_responses=False"):
        RedisKVConnector(text_client, make_pool(), "smollm", prefix=prefix)
    text_client.close()
    with pytest.raises(ValueError, match="positive"):
        ShmKVConnector(make_pool(), "smollm", prefix=prefix, ttl_s=0)
    with pytest.raises(ValueError, match="needs a Redis client"):
        make_connector(KVTransferConfig(), make_pool(), "smollm")
    with pytest.raises(ValueError, match="redis or shm"):
        make_connector(KVTransferConfig(connector="nixl"), make_pool(), "smollm")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_decode_engine_continues_from_loaded_kv_as_the_prefill_engine_would(store, tiny_llama_dir, dtype):
    """Two ModelRunners of one model: the decode runner's next-token logits over the KV it loaded
    equal the prefill runner's over its own, bit for bit (a partial block included), and differ
    without the load -- so gather and scatter match what the attention reads."""
    from engine_svc.config import EngineConfig
    from engine_svc.model_runner import ModelRunner
    from engine_svc.scheduler_output import ScheduledChunk, SchedulerOutput

    config = EngineConfig(model=str(tiny_llama_dir), dtype=dtype, block_size=4, num_gpu_blocks_override=12,
                          enforce_eager=True)
    prefill, decode = ModelRunner(config, str(tiny_llama_dir)), ModelRunner(config, str(tiny_llama_dir))
    prompt, next_token = [5, 81, 300, 17, 9, 44, 123, 7, 250, 31], 77  # 10 tokens: 4 + 4 + 2
    p_table, d_table = (3, 5, 2), (7, 1, 4)

    def step(runner, table, token_ids, start):
        chunk = ScheduledChunk("r", token_ids, start, table, True)
        return runner.execute(SchedulerOutput(chunks=[chunk]))

    step(prefill, p_table, prompt, 0)
    saver, loader = store.connector(prefill.kv_caches, "tiny"), store.connector(decode.kv_caches, "tiny")
    without_kv = step(decode, d_table, [next_token], len(prompt))  # attends over an empty (zero) prefix
    loader.load(saver.save("r", p_table, len(prompt)), d_table, len(prompt))
    want = step(prefill, p_table, [next_token], len(prompt))
    got = step(decode, d_table, [next_token], len(prompt))
    assert torch.equal(got, want)
    assert not torch.equal(without_kv, want)
