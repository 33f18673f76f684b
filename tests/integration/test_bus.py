"""The bus against a real redis-server: pending drain, XAUTOCLAIM, NOGROUP recovery, dead letters."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import redis
import redis.asyncio as aioredis

from shared.protocol import Abort, FinishReason, GenerateRequest, RequestOutput, decode
from shared.group_reader import GroupReader
from shared.streams import AsyncProducer, AsyncStreamReader, Producer, StreamReader


def _requests(n, reply_to="x:gateway:g1:out"):
    return [GenerateRequest(request_id=f"r{i}", reply_to=reply_to, prompt=f"p{i}") for i in range(n)]


def test_producer_trims_and_reader_sees_everything_in_order(redis_client, stream_names):
    stream = stream_names.tokenizer_in
    producer = Producer(redis_client, maxlen=1000)
    ids = producer.send_many((stream, m) for m in _requests(5))
    assert len(ids) == 5 and ids == sorted(ids)
    reader = StreamReader(redis_client, stream, start="0-0")
    got = reader.read(count=10)
    assert [e.msg.request_id for e in got] == [f"r{i}" for i in range(5)]
    assert reader.read(count=10) == []
    for _ in range(3000):
        producer.send(stream, Abort(request_ids=("a",)))
    assert redis_client.xlen(stream) < 3000  # MAXLEN ~ trims (approximately)


def test_a_batched_send_is_one_entry_per_stream_read_back_message_by_message(redis_client, stream_names):
    a, b = stream_names.detok_in(0), stream_names.detok_in(1)
    producer = Producer(redis_client, batch=True)
    msgs = _requests(5)
    ids = producer.send_many([(a, msgs[0]), (b, msgs[1]), (a, msgs[2]), (a, msgs[3]), (b, msgs[4])])
    assert len(ids) == 2 and redis_client.xlen(a) == 1 and redis_client.xlen(b) == 1
    got = StreamReader(redis_client, a, start="0-0").read(count=1)
    assert [e.msg.request_id for e in got] == ["r0", "r2", "r3"] and len({e.id for e in got}) == 1
    group = GroupReader(redis_client, b, "detok", "c")
    got = group.read(count=10)
    assert [e.msg.request_id for e in got] == ["r1", "r4"]
    assert group.ack(got) == 1  # one entry, acked once
    assert redis_client.xpending(b, "detok")["pending"] == 0


def test_per_entry_caps_messages_per_entry_and_a_read_of_one_entry_gets_its_messages(redis_client, stream_names):
    """The engine's entries of 16: a step of 40 deltas is 16 + 16 + 8, read one entry at a time in order."""
    stream = stream_names.detok_in(0)
    producer = Producer(redis_client, batch=True, per_entry=16)
    msgs = _requests(40)
    ids = producer.send_many([(stream, m) for m in msgs])
    assert len(ids) == 3 and redis_client.xlen(stream) == 3
    group = GroupReader(redis_client, stream, "detok", "c")
    sizes, names = [], []
    while got := group.read(count=1):
        sizes.append(len(got))
        names += [e.msg.request_id for e in got]
        group.ack(got)
    assert sizes == [16, 16, 8] and names == [m.request_id for m in msgs]
    assert redis_client.xpending(stream, "detok")["pending"] == 0
    with pytest.raises(ValueError):
        Producer(redis_client, batch=True, per_entry=0).send_many([(stream, msgs[0])])


def test_a_bad_message_in_a_batched_entry_is_dead_lettered_alone(redis_client, stream_names):
    stream, dlq = stream_names.detok_in(0), stream_names.dlq
    good = _requests(2)
    bad = msgpack.packb({"t": 1, "request_id": "bad", "reply_to": 7})
    redis_client.xadd(stream, {b"m": good[0].to_wire(), b"m1": bad, b"m2": good[1].to_wire()})
    redis_client.xadd(stream, {b"m": bad, b"m1": bad})  # nothing valid: acked at once
    redis_client.xadd(stream, {b"m": good[0].to_wire(), b"m2": bad})  # m1 missing: refused whole
    reader = GroupReader(redis_client, stream, "detok", "c", dlq=dlq)
    got = reader.read(count=10)
    assert [e.msg.request_id for e in got] == ["r0", "r1"]
    assert redis_client.xpending(stream, "detok")["pending"] == 1  # the first entry, until the caller acks
    assert redis_client.xlen(dlq) == 4
    reader.ack(got)
    assert redis_client.xpending(stream, "detok")["pending"] == 0


def test_stream_reader_dollar_sees_entries_written_after_construction(redis_client, stream_names):
    stream = stream_names.engine_ctl
    producer = Producer(redis_client)
    producer.send(stream, Abort(request_ids=("old",)))
    reader = StreamReader(redis_client, stream)  # "$": only what comes after now
    producer.send(stream, Abort(request_ids=("new",)))
    got = reader.read(block_ms=100)
    assert [e.msg.request_ids for e in got] == [("new",)]


def test_block_zero_is_refused(redis_client, stream_names):
    reader = GroupReader(redis_client, stream_names.tokenizer_in, "tokenizer", "c1")
    with pytest.raises(ValueError):
        reader.read(block_ms=0)


def test_group_shares_work_and_restarted_consumer_drains_its_own_pending_first(redis_client, stream_names):
    stream = stream_names.tokenizer_in
    producer = Producer(redis_client)
    producer.send_many((stream, m) for m in _requests(6))
    a = GroupReader(redis_client, stream, "tokenizer", "a")
    first = a.read(count=4)
    assert [e.msg.request_id for e in first] == ["r0", "r1", "r2", "r3"]
    a.ack(first[:2])  # crash with r2, r3 unacked
    b = GroupReader(redis_client, stream, "tokenizer", "b")
    assert [e.msg.request_id for e in b.read(count=10)] == ["r4", "r5"]
    restarted = GroupReader(redis_client, stream, "tokenizer", "a")
    again = restarted.read(count=10)
    assert [e.msg.request_id for e in again] == ["r2", "r3"]
    restarted.ack(again)
    assert restarted.read(count=10, block_ms=50) == []
    assert redis_client.xpending(stream, "tokenizer")["pending"] == 2  # b's r4, r5


def test_xautoclaim_takes_over_a_dead_consumers_entries(redis_client, stream_names):
    stream = stream_names.engine_in
    Producer(redis_client).send_many((stream, m) for m in _requests(3))
    dead = GroupReader(redis_client, stream, "engine", "dead", claim_idle_ms=None)
    assert len(dead.read(count=3)) == 3  # then it dies without acking
    live = GroupReader(redis_client, stream, "engine", "live", claim_idle_ms=100)
    assert live.read(count=10, block_ms=20) == []  # nothing new; dead's entries are not idle yet
    time.sleep(0.15)
    live._next_claim = 0.0
    claimed = live.read(count=10, block_ms=20)
    assert sorted(e.msg.request_id for e in claimed) == ["r0", "r1", "r2"]
    live.ack(claimed)
    assert redis_client.xpending(stream, "engine")["pending"] == 0


def test_xautoclaim_skips_entries_trimmed_while_pending(redis_client, stream_names):
    stream = stream_names.engine_in
    ids = Producer(redis_client).send_many((stream, m) for m in _requests(3))
    dead = GroupReader(redis_client, stream, "engine", "dead", claim_idle_ms=None)
    dead.read(count=3)
    redis_client.xdel(stream, ids[0])
    time.sleep(0.12)
    live = GroupReader(redis_client, stream, "engine", "live", claim_idle_ms=100)
    live._draining = False
    claimed = live.read(count=10, block_ms=20)
    assert sorted(e.msg.request_id for e in claimed) == ["r1", "r2"]
    live.ack(claimed)
    assert redis_client.xpending(stream, "engine")["pending"] == 0


def test_pending_drain_skips_entries_trimmed_while_pending(redis_client, stream_names):
    stream = stream_names.engine_in
    ids = Producer(redis_client).send_many((stream, m) for m in _requests(2))
    GroupReader(redis_client, stream, "engine", "a", claim_idle_ms=None).read(count=2)
    redis_client.xdel(stream, ids[1])
    restarted = GroupReader(redis_client, stream, "engine", "a", claim_idle_ms=None)
    got = restarted.read(count=10)
    assert [e.msg.request_id for e in got] == ["r0"]
    restarted.ack(got)
    assert redis_client.xpending(stream, "engine")["pending"] == 0


def test_nogroup_after_flushall_recreates_the_group_without_spinning(redis_client, stream_names):
    stream = stream_names.tokenizer_in
    producer = Producer(redis_client)
    reader = GroupReader(redis_client, stream, "tokenizer", "c")
    producer.send(stream, _requests(1)[0])
    reader.ack(reader.read(count=10))
    redis_client.flushall()
    t0 = time.monotonic()
    assert reader.read(count=10, block_ms=50) == []  # NOGROUP: backs off, re-creates
    assert time.monotonic() - t0 >= 0.04
    assert redis_client.xinfo_groups(stream)[0]["name"] == b"tokenizer"
    producer.send(stream, _requests(2)[1])
    got = reader.read(count=10, block_ms=200)
    assert [e.msg.request_id for e in got] == ["r1"]
    reader.ack(got)


def test_garbage_goes_to_dlq_and_salvageable_sender_gets_an_error(redis_client, stream_names):
    stream, dlq = stream_names.tokenizer_in, stream_names.dlq
    reply_to = stream_names.gateway_out("g1")
    bad_field = msgpack.packb({"t": 1, "request_id": "bad1", "reply_to": reply_to, "prompt": 42})
    redis_client.xadd(stream, {b"m": bad_field})
    redis_client.xadd(stream, {b"m": b"\xc1 not msgpack"})
    redis_client.xadd(stream, {b"other": b"x"})
    Producer(redis_client).send(stream, _requests(1, reply_to)[0])
    reader = GroupReader(redis_client, stream, "tokenizer", "c", dlq=dlq)
    got = reader.read(count=10)
    assert [e.msg.request_id for e in got] == ["r0"]  # garbage never reaches the caller
    reader.ack(got)
    assert redis_client.xpending(stream, "tokenizer")["pending"] == 0
    assert redis_client.xlen(dlq) == 3
    replies = [decode(f[b"m"]) for _, f in redis_client.xrange(reply_to)]
    assert len(replies) == 1
    (err,) = replies
    assert isinstance(err, RequestOutput) and err.request_id == "bad1"
    assert err.finish_reason == FinishReason.ERROR and err.error.code == 400


def test_salvage_refuses_reply_streams_outside_the_gateway_namespace(redis_client, stream_names):
    stream, dlq = stream_names.tokenizer_in, stream_names.dlq
    bad = msgpack.packb({"t": 1, "request_id": "x", "reply_to": "some:other:key", "prompt": 1})
    redis_client.xadd(stream, {b"m": bad})
    GroupReader(redis_client, stream, "tokenizer", "c", dlq=dlq).read(count=10)
    assert redis_client.xlen(dlq) == 1 and not redis_client.exists("some:other:key")


def test_async_producer_and_reader(redis_url, stream_names):
    stream = stream_names.gateway_out("g2")

    async def main():
        client = aioredis.Redis.from_url(redis_url)
        reader = AsyncStreamReader(client, stream, start="$")
        await reader.resolve_start()
        producer = AsyncProducer(client)
        await producer.send_many((stream, RequestOutput(request_id=f"r{i}", text_delta="hi")) for i in range(3))
        got = await reader.read(count=10, block_ms=100)
        empty = await reader.read(count=10, block_ms=30)
        await reader.close()
        await client.aclose()
        return got, empty

    got, empty = asyncio.run(main())
    assert [e.msg.request_id for e in got] == ["r0", "r1", "r2"] and empty == []


def test_blocking_read_returns_when_data_arrives(redis_client, stream_names):
    stream = stream_names.tokenizer_in
    reader = GroupReader(redis_client, stream, "tokenizer", "c")
    reader.read(count=1, block_ms=10)
    other = redis.Redis.from_url(redis_client.connection_pool.connection_kwargs and _url(redis_client))
    import threading

    threading.Timer(0.1, lambda: Producer(other).send(stream, _requests(1)[0])).start()
    t0 = time.monotonic()
    got = reader.read(count=1, block_ms=5000)
    assert [e.msg.request_id for e in got] == ["r0"] and time.monotonic() - t0 < 2.0
    reader.ack(got)


def _url(client) -> str:
    kw = client.connection_pool.connection_kwargs
    return f"redis://{kw['host']}:{kw['port']}/{kw.get('db', 0)}"


def test_heartbeats_are_written_read_and_removed(redis_client, stream_names):
    from shared.heartbeat import HeartbeatWriter, read_heartbeats

    key = stream_names.heartbeat
    writer = HeartbeatWriter(redis_client, key, "engine", "engine-0", interval_s=60)
    assert writer.beat({"num_running": 2}) and not writer.beat({"num_running": 3})  # rate-limited
    redis_client.hset(key, "junk", b"\x00")
    beats = read_heartbeats(redis_client, key)
    assert list(beats) == ["engine-0"] and beats["engine-0"].stats == {"num_running": 2.0}
    assert read_heartbeats(redis_client, key, max_age_s=-1) == {}
    writer.remove()
    assert read_heartbeats(redis_client, key) == {}
