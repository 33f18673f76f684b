"""The bus's trust boundary against a real redis-server: readers refuse unsigned and forged
entries (dead-lettered, acked, nobody answered), and the embedded Redis's ACL users (one per
role) can do their service's work and nothing else."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis
import redis.asyncio as aioredis

from shared.bus_auth import BusSigner
from shared.group_reader import GroupReader
from shared.protocol import GenerateRequest, RequestOutput, SamplingParams, StreamNames, TokenDelta
from shared.redis_server import RedisAcl, RedisServer
from shared.streams import AsyncStreamReader, Producer, StreamReader

SECRET = "integration-test-bus-secret"


def _request(names: StreamNames, rid: str) -> GenerateRequest:
    return GenerateRequest(request_id=rid, reply_to=names.gateway_out("g0"), prompt="hi", sampling=SamplingParams())


def _forge(client: redis.Redis, stream: str, msg) -> tuple[str, str]:
    """An attacker with Redis access: one entry without a MAC, one signed with another key."""
    no_mac = client.xadd(stream, {b"m": msg.to_wire()}).decode()
    wrong = BusSigner("not-the-deployment-secret").sign(stream, {b"m": msg.to_wire()})
    return no_mac, client.xadd(stream, wrong).decode()


def _dead_letters(client: redis.Redis, names: StreamNames) -> list[dict]:
    return [fields for _, fields in client.xrange(names.dlq)]


def test_a_group_reader_refuses_forged_entries_unread_and_answers_nobody(redis_client, stream_names):
    names, signer = stream_names, BusSigner(SECRET)
    producer = Producer(redis_client, signer=signer)
    reader = GroupReader(redis_client, names.tokenizer_in, "tokenizer", "c0", dlq=names.dlq, signer=signer)
    reader.ensure_group()
    producer.send(names.tokenizer_in, _request(names, "good-1"))
    forged = _forge(redis_client, names.tokenizer_in, _request(names, "forged"))
    producer.send(names.tokenizer_in, _request(names, "good-2"))
    got = reader.read(count=10)
    assert [env.msg.request_id for env in got] == ["good-1", "good-2"]
    reader.ack(got)
    assert reader.num_pending() == 0 and reader.refusals.num_refused == 2
    letters = _dead_letters(redis_client, names)
    assert [(d[b"id"].decode(), d[b"error"]) for d in letters] == \
        [(forged[0], b"entry has no MAC"), (forged[1], b"entry MAC does not match")]
    assert all(d[b"stream"] == names.tokenizer_in.encode() for d in letters)
    signer.verify(names.dlq, redis_client.xrange(names.dlq)[0][1])  # the dead letters are signed by us
    assert not redis_client.exists(names.gateway_out("g0"))  # the forged reply_to got no error reply


def test_plain_readers_refuse_forged_entries_sync_and_async(redis_client, redis_url, stream_names):
    names, signer = stream_names, BusSigner(SECRET)
    stream = names.gateway_out("g0")
    reader = StreamReader(redis_client, stream, start="0-0", signer=signer)
    Producer(redis_client, signer=signer, batch=True).send_many(
        [(stream, RequestOutput(request_id="r", seq=0, text_delta="Hello")),
         (stream, RequestOutput(request_id="r", seq=1, text_delta=" world"))])
    _forge(redis_client, stream, RequestOutput(request_id="r", seq=2, text_delta="FORGED"))
    assert [env.msg.text_delta for env in reader.read()] == ["Hello", " world"]
    assert reader.refusals.num_refused == 2 and len(_dead_letters(redis_client, names)) == 2

    async def read_async(signer):
        client = aioredis.Redis.from_url(redis_url)
        areader = AsyncStreamReader(client, stream, start="0-0", signer=signer)
        try:
            return [env.msg.text_delta for env in await areader.read()], areader.refusals.num_refused
        finally:
            await areader.close()
            await client.aclose()

    assert asyncio.run(read_async(signer)) == (["Hello", " world"], 2)
    assert len(_dead_letters(redis_client, names)) == 4
    # what the check stops: a reader without the key takes the forgeries as text
    assert asyncio.run(read_async(None)) == (["Hello", " world", "FORGED", "FORGED"], 0)


def test_signed_entries_stay_readable_without_a_key(redis_client, stream_names):
    """A bus without a secret works as before; a keyless reader skips the MAC field."""
    stream = stream_names.detok_in(0)
    Producer(redis_client, signer=BusSigner(SECRET), batch=True).send_many(
        [(stream, TokenDelta(request_id="r", seq=i, new_token_ids=(i,))) for i in range(3)])
    reader = GroupReader(redis_client, stream, "detok", "shard-0", claim_idle_ms=None)
    reader.ensure_group()
    got = reader.read(count=10)
    assert [env.msg.seq for env in got] == [0, 1, 2]
    reader.ack(got)


# --------------------------------------------------------------------------- the embedded Redis's ACL


@pytest.fixture(scope="module")
def secured_redis():
    with RedisServer(acl=RedisAcl.generate("ps")) as server:
        yield server


def _client(server: RedisServer, role: str) -> redis.Redis:
    return redis.Redis.from_url(server.role_url(role))


def test_unauthenticated_and_wrong_password_clients_are_refused(secured_redis):
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(secured_redis.address).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host=secured_redis.host, port=secured_redis.port, username="engine", password="guess").ping()
    assert redis.Redis.from_url(secured_redis.url).ping()  # the admin


@pytest.mark.parametrize("role,allowed,refused", [
    ("gateway", ["tokenizer:in", "engine:ctl", "gateway:g1:out", "dlq"], ["kv:r1", "decode:in"]),
    ("tokenizer", ["tokenizer:in", "engine:in", "gateway:g1:out", "dlq"], ["detok:in:0", "engine:ctl", "kv:r1"]),
    ("engine", ["engine:in", "detok:in:0", "gateway:g1:out", "engine:ctl", "decode:in", "dlq"], ["tokenizer:in"]),
    ("detok", ["detok:in:0", "gateway:g1:out", "engine:ctl", "dlq"], ["tokenizer:in", "engine:in", "kv:r1"]),
])
def test_each_role_writes_its_streams_and_no_other_keys(secured_redis, role, allowed, refused):
    client = _client(secured_redis, role)
    for key in allowed:
        assert client.xadd(f"ps:{key}", {b"m": b"x"}, maxlen=10)
    for key in refused:
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.xadd(f"ps:{key}", {b"m": b"x"})
    for command in (client.flushall, client.flushdb, lambda: client.keys("*"), lambda: client.config_get("*"),
                    lambda: client.scan(0), lambda: client.acl_list(), lambda: client.set("elsewhere", 1),
                    lambda: client.eval("return 1", 0)):
        with pytest.raises(redis.exceptions.NoPermissionError):
            command()
    assert client.hset("ps:heartbeat", f"{role}-test", b"x") == 1 and client.hdel("ps:heartbeat", f"{role}-test") == 1


def test_each_role_runs_its_service_calls(secured_redis):
    """What the services do with their own users: groups, reads, claims, acks, deletes, MULTI."""
    signer = BusSigner(SECRET)
    names = StreamNames("ps")
    gateway, tokenizer = _client(secured_redis, "gateway"), _client(secured_redis, "tokenizer")
    rid = f"r-{uuid.uuid4().hex[:8]}"
    Producer(gateway, signer=signer).send(names.tokenizer_in, _request(names, rid))
    reader = GroupReader(tokenizer, names.tokenizer_in, "tokenizer", "t0", dlq=names.dlq, signer=signer,
                         claim_idle_ms=1)
    reader.ensure_group()
    got = reader.read(count=10)
    assert rid in [env.msg.request_id for env in got]
    reader.ack(got)
    assert reader.num_pending() == 0
    Producer(tokenizer, signer=signer).send(names.gateway_out("g0"),
                                            RequestOutput(request_id=rid, seq=0, text_delta="ok"))
    out = StreamReader(gateway, names.gateway_out("g0"), start="0-0", signer=signer).read()
    assert [env.msg.text_delta for env in out if env.msg.request_id == rid] == ["ok"]
    assert gateway.delete(names.gateway_out("g0")) == 1
    tokenizer.hset(names.heartbeat, "tokenizer-t0", b"beat")
    status = _client(secured_redis, "status")
    assert status.hgetall(names.heartbeat)[b"tokenizer-t0"] == b"beat"
    with pytest.raises(redis.exceptions.NoPermissionError):
        status.xrange(names.tokenizer_in)
