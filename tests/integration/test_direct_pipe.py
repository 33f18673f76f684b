"""shared/direct_pipe.py on a real redis-server: the hot loops' round trips on a held connection
must answer exactly what redis-py's client and pipeline answer (on either wire protocol), keep error
replies in their places, and survive a lost connection."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis
import redis.asyncio as aioredis

from shared.direct_pipe import AsyncHeldConnection, DirectPipe, HeldConnection
from shared.group_reader import GroupReader
from shared.protocol import GenerateRequest
from shared.streams import Outbox, Producer, StreamReader


@pytest.fixture(params=[None, 2], ids=["default", "resp2"])
def client(request, redis_url):
    """The bus's clients leave the protocol to redis-py (RESP3 on the wire here, replies shaped
    as RESP2's); RESP2 itself answers in the other wire shape."""
    c = redis.Redis.from_url(redis_url, **({} if request.param is None else {"protocol": request.param}))
    yield c
    c.close()


def _fill(client, stream: str) -> list[bytes]:
    ids = [client.xadd(stream, {"m": f"v{i}".encode(), "k": b"\x00\xff"}) for i in range(3)]
    client.xgroup_create(stream, "g", id="0")
    return ids


def test_replies_match_the_clients_in_both_protocols(client, prefix):
    stream, out = f"{prefix}:s", f"{prefix}:o"
    _fill(client, stream)
    ref = client.pipeline(transaction=False)
    ref.xread({stream: "0-0"}, count=2)
    ref.xreadgroup("g", "c1", {stream: ">"}, count=2)
    ref.xread({f"{prefix}:none": "0-0"})
    expected = ref.execute()
    pipe = DirectPipe(HeldConnection(client.connection_pool))
    pipe.xread({stream: "0-0"}, count=2)
    pipe.xreadgroup("g", "c2", {stream: ">"}, count=2)  # the entry c1 did not take, then nothing
    pipe.xread({f"{prefix}:none": "0-0"})
    pipe.xadd(out, {"m": b"x"}, maxlen=10, approximate=True)
    got = pipe.execute()
    assert got[0] == expected[0] and got[2] == expected[2] == []
    assert got[1] == [[stream.encode(), [client.xrange(stream)[2]]]]
    assert isinstance(got[3], bytes) and client.xrange(out)[0][0] == got[3]
    assert len(pipe) == 0 and pipe.execute() == []  # executed: empty


def test_a_pending_entry_deleted_reads_as_redis_py_reads_it(client, prefix):
    stream = f"{prefix}:s"
    ids = _fill(client, stream)
    client.xreadgroup("g", "c", {stream: ">"}, count=3)
    client.xdel(stream, ids[1])
    expected = client.xreadgroup("g", "c", {stream: "0"}, count=10)
    got = DirectPipe(HeldConnection(client.connection_pool)).xreadgroup("g", "c", {stream: "0"}, count=10).execute()
    assert got == [expected] and got[0][0][1][1] == (ids[1], {})


def test_error_replies_keep_their_place_and_the_connection(client, prefix):
    held = HeldConnection(client.connection_pool)
    pipe = DirectPipe(held)
    pipe.xreadgroup("nosuchgroup", "c", {f"{prefix}:s": ">"})
    pipe.xadd(f"{prefix}:o", {"m": b"x"})
    replies = pipe.execute(raise_on_error=False)
    assert isinstance(replies[0], redis.ResponseError) and "NOGROUP" in str(replies[0])
    assert isinstance(replies[1], bytes)
    with pytest.raises(redis.ResponseError, match="NOGROUP"):
        DirectPipe(held).xreadgroup("nosuchgroup", "c", {f"{prefix}:s": ">"}).execute()
    assert DirectPipe(held).xread({f"{prefix}:o": "0-0"}).execute()[0][0][1][0][1] == {b"m": b"x"}


def test_a_lost_connection_raises_once_then_reconnects(client, prefix):
    held = HeldConnection(client.connection_pool)
    stream = f"{prefix}:s"
    client.xadd(stream, {"m": b"1"})
    assert DirectPipe(held).xread({stream: "0-0"}).execute()[0][0][1][0][1] == {b"m": b"1"}
    client.client_kill_filter(_id=held.execute([("CLIENT", "ID")])[0])
    with pytest.raises(redis.ConnectionError):
        DirectPipe(held).xread({stream: "0-0"}).execute()
    assert DirectPipe(held).xread({stream: "0-0"}).execute()[0][0][1][0][1] == {b"m": b"1"}
    held.close()


def test_the_async_connection_reads_as_the_async_client(redis_url, prefix):
    async def run():
        client = aioredis.Redis.from_url(redis_url)
        stream = f"{prefix}:a"
        await client.xadd(stream, {"m": b"1"})
        held = AsyncHeldConnection(client.connection_pool)
        got = await held.run(DirectPipe().xread({stream: "0-0"}, count=5, block=100))
        assert got == [await client.xread({stream: "0-0"}, count=5)]
        assert await held.run(DirectPipe().xread({stream: "$"}, block=50)) == [[]]  # the block timed out: nil
        await client.client_kill_filter(_id=(await held.execute([("CLIENT", "ID")]))[0])
        with pytest.raises(redis.ConnectionError):
            await held.run(DirectPipe().xread({stream: "0-0"}))
        assert (await held.run(DirectPipe().xread({stream: "0-0"})))[0][0][1][0][1] == {b"m": b"1"}
        await held.close()
        await client.aclose()

    asyncio.run(run())


def test_a_blocking_flush_and_read_sends_then_waits_for_the_next_input(redis_client, stream_names):
    """The detokenizer's turn: its replies go out at once, and the round trip ends when the
    engine's next entry arrives (on the reader's blocking connection)."""
    intake = GroupReader(redis_client, stream_names.detok_in(0), "detok", "shard-0", claim_idle_ms=None)
    assert intake.read(count=10) == []
    producer = Producer(redis_client)
    outbox = Outbox(producer, intake)
    outbox.put([("x:gateway:g:out", GenerateRequest(request_id="out", reply_to="x:gateway:g:out", prompt="o"))])
    seen_while_waiting = []

    def later():
        time.sleep(0.3)
        seen_while_waiting.append(len(redis_client.xrange("x:gateway:g:out")))
        producer.send(stream_names.detok_in(0), GenerateRequest(request_id="in", reply_to="r", prompt="i"))

    writer = threading.Thread(target=later)
    start = time.monotonic()
    writer.start()
    ok, reads = outbox.flush_and_read([(intake, 10)], block_ms=5_000)
    writer.join()
    assert ok and not outbox and 0.25 < time.monotonic() - start < 4.0
    assert seen_while_waiting == [1]  # the reply was out before the read returned
    assert [e.msg.request_id for e in reads[0]] == ["in"]
    assert intake.ack(reads[0]) == 1 and intake.num_pending() == 0
    with pytest.raises(ValueError):
        outbox.flush_and_read([(intake, 10), (StreamReader(redis_client, "x:ctl", start="0-0"), 10)], block_ms=10)


def test_the_gateways_reader_times_out_its_reads_not_its_sends(redis_url, prefix):
    """The reply-stream reader's connection sends without a timer and reads with one
    (streams.async_held_connection): a block longer than the client's socket timeout plus 5 s is
    cut off there, not left waiting forever."""
    from shared.streams import async_held_connection

    async def run():
        client = aioredis.Redis.from_url(redis_url, socket_timeout=0.2)
        held = async_held_connection(client, block_ms=100)  # reads time out after max(0.2, 0.1 + 5) s
        assert held.pool.connection_kwargs["socket_timeout"] is None and held.read_timeout_s == pytest.approx(5.1)
        held.read_timeout_s = 0.3
        start = time.monotonic()
        with pytest.raises(redis.TimeoutError):
            await held.run(DirectPipe().xread({f"{prefix}:quiet": "$"}, block=5_000))
        assert time.monotonic() - start < 2.0
        assert await held.run(DirectPipe().xread({f"{prefix}:quiet": "$"}, block=50)) == [[]]  # connected again
        await held.close()
        await client.aclose()

    asyncio.run(run())
