"""The pool side of KV transfer (gather / scatter), the entry format's checks, the shared-memory
connector's sweep and the stats; no Redis (tests/integration/test_kv_transfer.py runs the
connector contract against a real redis-server and /dev/shm)."""

from __future__ import annotations

import os
import time

import pytest
import torch

from engine_svc import kv_transfer
from engine_svc.kv_transfer import (KVLayout, KVTransferError, KVTransferStats, ShmKVConnector, decode_entry,
                                    encode_head, gather_kv, scatter_kv, token_slots)

BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def make_pool(num_blocks=12, block_size=4, num_layers=3, heads=2, head_dim=8, dtype=torch.float32, seed=0):
    """Random KV (never zeros), one (K, V) pair per layer, as ModelRunner lays it out."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, heads, head_dim)
    return [(torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
            for _ in range(num_layers)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(BITS[t.dtype])


def token_kv(pool, block_table, num_tokens, layer, i):
    """The K (i=0) or V (i=1) of a request's tokens, read directly by position (the reference)."""
    cache = pool[layer][i]
    bs = cache.shape[1]
    return torch.stack([cache[block_table[p // bs], p % bs] for p in range(num_tokens)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [9, 12])  # a partial last block (9 = 4 + 4 + 1) and full blocks
def test_gather_then_scatter_into_another_block_table_is_bit_exact(dtype, num_tokens):
    src = make_pool(dtype=dtype, seed=1)
    dst = make_pool(num_blocks=16, dtype=dtype, seed=2)
    before = [(k.clone(), v.clone()) for k, v in dst]
    src_table, dst_table = [5, 2, 9], [14, 3, 7]
    kv = gather_kv(src, src_table, num_tokens)
    assert kv.shape == (3, 2, num_tokens, 2, 8) and kv.dtype == dtype and kv.is_contiguous()
    scatter_kv(dst, dst_table, num_tokens, kv)
    for layer in range(3):
        for i in range(2):
            want = token_kv(src, src_table, num_tokens, layer, i)
            assert torch.equal(bits(token_kv(dst, dst_table, num_tokens, layer, i)), bits(want))
            # every other slot of the destination pool is as it was (the tail of a partial block too)
            touched = torch.zeros(16 * 4, dtype=torch.bool)
            for p in range(num_tokens):
                touched[dst_table[p // 4] * 4 + p % 4] = True
            flat_after, flat_before = dst[layer][i].view(64, 2, 8), before[layer][i].view(64, 2, 8)
            assert torch.equal(bits(flat_after[~touched]), bits(flat_before[~touched]))


def test_token_slots_follow_the_block_table():
    slots = token_slots([3, 1, 7], 9, 4, 8, "cpu")
    assert slots.tolist() == [12, 13, 14, 15, 4, 5, 6, 7, 28]


@pytest.mark.parametrize("table, num_tokens, match", [
    ([3, 1], 9, "need 3 blocks"),
    ([3, 0, 5], 9, "0 is the null block"),
    ([3, 1, 8], 9, r"1\.\.7"),
    ([3], 0, "0 tokens"),
])
def test_token_slots_refuse_a_table_that_does_not_hold_the_tokens(table, num_tokens, match):
    with pytest.raises(ValueError, match=match):
        token_slots(table, num_tokens, 4, 8, "cpu")


def test_scatter_refuses_kv_of_another_shape_or_dtype():
    pool = make_pool()
    kv = gather_kv(pool, [1, 2], 5)
    with pytest.raises(ValueError, match="does not fit"):
        scatter_kv(pool, [3, 4], 6, kv)
    with pytest.raises(ValueError, match="does not fit"):
        scatter_kv(pool, [3, 4], 5, kv.to(torch.bfloat16))


def test_layout_of_a_pool_and_its_payload_size():
    layout = KVLayout.of_pool("m", make_pool(dtype=torch.bfloat16))
    assert layout == KVLayout(model_id="m", num_layers=3, dtype="bfloat16", block_size=4, num_kv_heads=2, head_dim=8)
    assert layout.payload_bytes(9) == 2 * 3 * 9 * 2 * 8 * 2
    with pytest.raises(ValueError, match="not torch.int8"):
        KVLayout.of_pool("m", [(torch.zeros(2, 4, 2, 8, dtype=torch.int8),) * 2])


def _entry(pool, num_tokens=5, ttl_s=60.0):
    layout = KVLayout.of_pool("m", pool)
    payload = memoryview(gather_kv(pool, [1, 2], num_tokens).reshape(-1).view(torch.uint8).numpy())
    return layout, bytearray(encode_head(layout, num_tokens, payload, ttl_s)) + payload


def test_an_entry_decodes_to_its_header_and_payload():
    pool = make_pool()
    layout, value = _entry(pool)
    header, payload = decode_entry(value, layout, 5)
    assert header["num_tokens"] == 5 and header["model_id"] == "m" and len(payload) == layout.payload_bytes(5)
    assert abs(header["expires_at"] - (time.time() + 60)) < 5


@pytest.mark.parametrize("damage, reason, match", [
    (lambda v: v[:7], "corrupt", "truncated"),
    (lambda v: b"XXXX" + v[4:], "corrupt", "not a version-1 KV entry"),
    (lambda v: v[:9] + b"\xc1" + v[10:], "corrupt", "header does not decode"),  # 0xc1: never used in msgpack
    (lambda v: v[:-1], "corrupt", "does not hold 5 tokens"),
    (lambda v: v[:-1] + bytes([v[-1] ^ 1]), "corrupt", "checksum"),
])
def test_a_damaged_entry_is_corrupt(damage, reason, match):
    layout, value = _entry(make_pool())
    with pytest.raises(KVTransferError, match=match) as err:
        decode_entry(bytes(damage(bytes(value))), layout, 5)
    assert err.value.reason == reason


def test_a_header_with_a_lease_that_is_not_a_time_is_corrupt():
    import msgpack

    layout, value = _entry(make_pool())
    head_len = int.from_bytes(value[5:9], "little")
    header = msgpack.unpackb(bytes(value[9:9 + head_len]))
    header["expires_at"] = "tomorrow"
    packed = msgpack.packb(header)
    forged = b"PSKV\x01" + len(packed).to_bytes(4, "little") + packed + value[9 + head_len:]
    with pytest.raises(KVTransferError, match=r"names no lease \(expires_at\)") as err:
        decode_entry(forged, layout, 5)
    assert err.value.reason == "corrupt"


def test_an_entry_for_other_tokens_or_layout_is_a_mismatch():
    layout, value = _entry(make_pool())
    with pytest.raises(KVTransferError, match="num_tokens 5 .expected 6.") as err:
        decode_entry(value, layout, 6)
    assert err.value.reason == "mismatch"
    other = KVLayout(model_id="other", num_layers=3, dtype="float32", block_size=8, num_kv_heads=2, head_dim=8)
    with pytest.raises(KVTransferError, match="model_id 'm' .ours 'other'., block_size 4 .ours 8.") as err:
        decode_entry(value, other, None)
    assert err.value.reason == "mismatch"


def test_shm_sweep_removes_entries_past_their_lease_and_abandoned_writes(tmp_path):
    pool = make_pool()
    short = ShmKVConnector(pool, "m", prefix="sw", ttl_s=0.05, directory=str(tmp_path))
    long = ShmKVConnector(pool, "m", prefix="sw", ttl_s=60, directory=str(tmp_path))
    short.save("old", [1, 2], 5)
    long.save("fresh", [1, 2], 5)
    assert os.stat(long.path("fresh")).st_mode & 0o777 == 0o600  # only this user's engines read KV
    abandoned = tmp_path / "sw-kv-0123.tmp999"
    abandoned.write_bytes(b"half")
    os.utime(abandoned, (time.time() - 120, time.time() - 120))
    (tmp_path / "other-kv-x").write_bytes(b"not ours")
    time.sleep(0.1)
    assert long.sweep() == 2  # "old" (its header's lease is over) and the abandoned write
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([os.path.basename(long.path("fresh")), "other-kv-x"])
    long.delete("fresh")
    long.delete("fresh")  # idempotent
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other-kv-x"]


def test_stats_count_exactly_what_moved(tmp_path):
    src, dst = make_pool(seed=1), make_pool(seed=2)
    saver = ShmKVConnector(src, "m", prefix="st", directory=str(tmp_path))
    loader = ShmKVConnector(dst, "m", prefix="st", directory=str(tmp_path))
    saver.save("a", [1, 2, 3], 9)
    saver.save("b", [4], 3)
    loader.load("a", [5, 6, 7], 9)
    with pytest.raises(KVTransferError):
        loader.load("a", [5, 6, 7], 9)  # consumed
    with pytest.raises(KVTransferError):
        loader.load("b", [5], 4)  # a mismatch consumes the entry too
    per_token = 2 * 3 * 2 * 8 * 4
    assert (saver.stats.num_saved, saver.stats.bytes_saved) == (2, 12 * per_token)
    assert (loader.stats.num_loaded, loader.stats.bytes_loaded, loader.stats.num_fallbacks) == (1, 9 * per_token, 2)
    assert loader.stats.fallback_reasons == {"missing": 1, "mismatch": 1}
    assert saver.stats.save_seconds > 0 and loader.stats.load_seconds > 0
    assert KVTransferStats().as_dict()["fallback_reasons"] == {}
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("staging_max", [1 << 20, 0], ids=["staged", "unstaged"])
def test_entries_round_trip_with_and_without_the_staging_buffer(tmp_path, monkeypatch, staging_max):
    monkeypatch.setattr(kv_transfer, "STAGING_MAX_BYTES", staging_max)
    src, dst = make_pool(seed=1), make_pool(seed=2)
    saver = ShmKVConnector(src, "m", prefix="sg", directory=str(tmp_path))
    loader = ShmKVConnector(dst, "m", prefix="sg", directory=str(tmp_path))
    for i, (table, n) in enumerate([([1, 2, 3], 9), ([4], 2), ([5, 6, 7, 8], 16)]):
        loader.load(saver.save(f"r{i}", table, n), [11, 10, 9, 8][:len(table)], n)
        assert torch.equal(bits(gather_kv(dst, [11, 10, 9, 8][:len(table)], n)), bits(gather_kv(src, table, n)))
    largest = 2 * 3 * 16 * 2 * 8 * 4
    assert saver._staging.numel() == (largest if staging_max else 0)  # grown to the largest entry, then reused
    assert list(tmp_path.iterdir()) == []
