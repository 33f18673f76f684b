"""The bus under Redis faults, on a redis-server of the test's own that it kills, restarts empty,
pauses (SIGSTOP) and flushes: readers and writers never raise, back off instead of spinning, and
carry on when Redis is back; acked entries are deleted; heartbeats tell a flush from a death,
expire, and leave a marker on a clean stop; a detok shard drops the requests of a gone gateway.
No Redis is mocked."""

from __future__ import annotations

import dataclasses
import signal
import threading
import time

import pytest
import redis

from detok_svc.processor import DetokProcessor
from detok_svc.service import DetokService
from shared.config import BusConfig, DetokConfig
from shared.group_reader import GroupReader
from shared.heartbeat import (EPOCH_FIELD, STOPPED, HeartbeatWriter, expire_heartbeats, heartbeat_value,
                              parse_heartbeats, read_heartbeats)
from shared.protocol import (Abort, Admission, DetokParams, FinishReason, GenerateRequest, RequestOutput, StreamNames,
                             TokenDelta)
from shared.streams import Outbox, Producer, StreamReader, connect
from tests.fixtures.redis import restart_empty


def _requests(n: int) -> list[GenerateRequest]:
    return [GenerateRequest(request_id=f"r{i}", reply_to="x:gateway:g:out", prompt=f"p{i}") for i in range(n)]


def _client(server, timeout_s: float = 1.0):
    return connect(server.url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)


# --------------------------------------------------------------------------- readers and writers


def test_group_reader_survives_a_kill_and_an_empty_restart_without_spinning(own_redis, stream_names):
    client = _client(own_redis)
    stream = stream_names.tokenizer_in
    reader = GroupReader(client, stream, "tokenizer", "t0")
    Producer(client).send_many((stream, r) for r in _requests(2))
    got = reader.read(count=10)
    assert [e.msg.request_id for e in got] == ["r0", "r1"]
    own_redis.stop()
    assert reader.ack(got) == 0 and reader.num_unacked == 2  # deferred, not raised
    started, num_reads = time.monotonic(), 0
    while time.monotonic() - started < 1.0:
        assert reader.read(count=10, block_ms=50) == []  # no exception escapes
        num_reads += 1
    assert num_reads <= 12  # backed off (0.05 s doubling to 2 s), not a busy loop
    restart_empty(own_redis)
    Producer(client).send(stream, _requests(3)[2])
    deadline, after = time.monotonic() + 10, []
    while not after and time.monotonic() < deadline:
        after = reader.read(count=10, block_ms=100)  # NOGROUP: the group is re-created, then read
    assert [e.msg.request_id for e in after] == ["r2"]
    reader.ack(after)
    assert reader.num_unacked == 0  # the old acks went with the old group
    assert client.xpending(stream, "tokenizer")["pending"] == 0


def test_an_ack_during_a_stall_is_retried_and_acked_entries_are_deleted(own_redis, stream_names):
    client = _client(own_redis, timeout_s=0.5)
    stream = stream_names.engine_in
    Producer(client).send_many((stream, r) for r in _requests(3))
    reader = GroupReader(client, stream, "engine", "e0")
    got = reader.read(count=2)
    reader.ack(got[:1])
    assert client.xlen(stream) == 2  # the acked entry is gone from the stream (XACK + XDEL)
    own_redis.process.send_signal(signal.SIGSTOP)
    try:
        assert reader.ack(got[1:]) == 0 and reader.num_unacked == 1  # timed out: kept for later
    finally:
        own_redis.process.send_signal(signal.SIGCONT)
    rest = reader.read(count=10, block_ms=100)  # retries the deferred ack first
    assert reader.num_unacked == 0 and [e.msg.request_id for e in rest] == ["r2"]
    reader.ack(rest)
    assert client.xlen(stream) == 0 and client.xpending(stream, "engine")["pending"] == 0


def test_refused_entries_are_deleted_with_their_ack(own_redis, stream_names):
    client = _client(own_redis)
    stream = stream_names.tokenizer_in
    client.xadd(stream, {b"m": b"\xc1 not msgpack"})
    reader = GroupReader(client, stream, "tokenizer", "t0", dlq=stream_names.dlq)
    assert reader.read(count=10) == []
    assert client.xlen(stream) == 0 and client.xlen(stream_names.dlq) == 1


def test_outbox_holds_what_redis_did_not_take_and_sends_it_once_redis_is_back(own_redis, stream_names):
    client = _client(own_redis)
    stream = stream_names.engine_in
    reader = GroupReader(client, stream_names.tokenizer_in, "tokenizer", "t0")
    Producer(client).send_many((stream_names.tokenizer_in, r) for r in _requests(1))
    envelopes = reader.read(count=1)
    outbox = Outbox(Producer(client), reader)
    own_redis.stop()
    outbox.put([(stream, r) for r in _requests(2)], acks=envelopes)
    started = time.monotonic()
    assert not outbox.flush() and not outbox.flush()  # held; each failure sleeps its backoff
    assert time.monotonic() - started >= 0.1 and outbox.down_for() > 0 and outbox
    own_redis.start()  # same port, empty
    assert outbox.flush() and not outbox and outbox.last_outage_s > 0
    assert [m.request_id for _, m in _read_all(client, stream)] == ["r0", "r1"]


def test_stream_reader_reads_on_after_a_restart(own_redis, stream_names):
    client = _client(own_redis)
    stream = stream_names.engine_ctl
    reader = StreamReader(client, stream, start="0-0")
    Producer(client).send(stream, Abort(request_ids=("a",)))
    assert [e.msg.request_ids for e in reader.read()] == [("a",)]
    own_redis.stop()
    assert reader.read(block_ms=50) == []
    restart_empty(own_redis)
    Producer(client).send(stream, Abort(request_ids=("b",)))  # a later id than any before the restart
    deadline, got = time.monotonic() + 5, []
    while not got and time.monotonic() < deadline:
        got = reader.read(block_ms=50)
    assert [e.msg.request_ids for e in got] == [("b",)]


def _read_all(client, stream):
    reader = StreamReader(client, stream, start="0-0")
    return [(e.id, e.msg) for e in reader.read(count=1000)]


# --------------------------------------------------------------------------- heartbeats


def test_a_flush_is_told_from_a_field_merely_deleted(redis_client, stream_names):
    key = stream_names.heartbeat
    writer = HeartbeatWriter(redis_client, key, "engine", "engine-0", interval_s=60)
    assert writer.beat({}) and writer.num_losses == 0
    redis_client.hdel(key, "engine-0")  # e.g. expired by others while this process was stalled
    writer.beat({}, force=True)
    assert writer.num_losses == 0
    redis_client.delete(key)  # what FLUSHALL or an empty restart does to it
    writer.beat({}, force=True)
    assert writer.num_losses == 1
    writer.beat({}, force=True)
    assert writer.num_losses == 1


def test_a_clean_stop_leaves_a_marker_that_counts_as_gone(redis_client, stream_names):
    key = stream_names.heartbeat
    writer = HeartbeatWriter(redis_client, key, "engine", "engine-0", interval_s=60)
    writer.beat({"num_running": 1})
    assert set(read_heartbeats(redis_client, key, max_age_s=10)) == {"engine-0"}
    writer.remove()
    assert read_heartbeats(redis_client, key, max_age_s=10) == {}  # not alive
    assert read_heartbeats(redis_client, key) == {}  # and not listed
    marker = read_heartbeats(redis_client, key, stopped=True)["engine-0"]
    assert marker.stats == {STOPPED: 1.0}
    assert EPOCH_FIELD in redis_client.hgetall(key)  # the epoch is no service
    assert "_epoch" not in parse_heartbeats(redis_client.hgetall(key), stopped=True)


def _old_beat(service: str, service_id: str, age_s: float, stats=None) -> bytes:
    from shared.protocol import Heartbeat

    beat = Heartbeat.from_wire(heartbeat_value(service, service_id, stats or {}))
    return dataclasses.replace(beat, time=time.time() - age_s).to_wire()


def test_live_writers_delete_beats_older_than_the_ttl(redis_client, stream_names):
    key = stream_names.heartbeat
    redis_client.hset(key, mapping={"tokenizer-dead": _old_beat("tokenizer", "tokenizer-dead", 30),
                                    "engine-stopped": _old_beat("engine", "engine-stopped", 30, {STOPPED: 1})})
    writer = HeartbeatWriter(redis_client, key, "tokenizer", "tokenizer-live", interval_s=0.2, ttl_s=2.0)
    other = HeartbeatWriter(redis_client, key, "detok", "detok-live", interval_s=0.2, ttl_s=2.0)
    writer.beat({})
    other.beat({})
    assert len(read_heartbeats(redis_client, key, stopped=True)) == 4  # not before it has had Redis for the TTL
    deadline = time.monotonic() + 10
    while b"tokenizer-dead" in redis_client.hgetall(key) and time.monotonic() < deadline:
        time.sleep(0.2)
        writer.beat({})
        other.beat({})
    assert set(read_heartbeats(redis_client, key, stopped=True)) == {"tokenizer-live", "detok-live"}
    time.sleep(0.6)
    writer.beat({}, force=True)
    assert expire_heartbeats(redis_client, key, ttl_s=0.5) == ["detok-live"]
    assert set(read_heartbeats(redis_client, key, stopped=True)) == {"tokenizer-live"}


def test_expiry_never_deletes_a_beat_written_after_it_read_the_hash(redis_url, redis_client, stream_names,
                                                                      monkeypatch):
    """The read and the delete are one WATCHed transaction: a beat that lands in between (from
    another connection, injected right after the expiry's read) makes it read again, and keep it."""
    key = stream_names.heartbeat
    redis_client.hset(key, "engine-0", _old_beat("engine", "engine-0", 30))
    engine = connect(redis_url)
    real_hgetall = redis.client.Pipeline.hgetall
    reads = []

    def hgetall_then_the_engine_beats(pipe, name):
        out = real_hgetall(pipe, name)
        if not reads:
            engine.hset(key, "engine-0", heartbeat_value("engine", "engine-0", {}))
        reads.append(out)
        return out

    monkeypatch.setattr(redis.client.Pipeline, "hgetall", hgetall_then_the_engine_beats)
    assert expire_heartbeats(redis_client, key, ttl_s=10) == []
    assert len(reads) == 2  # the first attempt failed its WATCH; the second read saw the fresh beat
    assert set(read_heartbeats(redis_client, key, max_age_s=10)) == {"engine-0"}


def test_a_late_beat_restarts_the_writers_healthy_time(own_redis, stream_names):
    client = _client(own_redis, timeout_s=0.5)
    writer = HeartbeatWriter(client, stream_names.heartbeat, "detok", "detok-0", interval_s=0.1)
    writer.beat({})
    time.sleep(0.3)
    writer.beat({})
    assert writer.healthy_for() >= 0.3
    own_redis.process.send_signal(signal.SIGSTOP)
    try:
        writer.beat({}, force=True)  # times out
    finally:
        own_redis.process.send_signal(signal.SIGCONT)
    assert writer.healthy_for() == 0.0
    writer.beat({}, force=True)
    assert 0.0 <= writer.healthy_for() < 0.3


# --------------------------------------------------------------------------- the detokenizer's verdicts


def _detok(redis_url, prefix, tokenizer, **kw) -> DetokService:
    config = DetokConfig(bus=BusConfig(redis_url=redis_url, prefix=prefix), service_id="detok-0", block_ms=50,
                         heartbeat_s=0.05, engine_check_s=0.0, **kw)
    return DetokService(config, DetokProcessor(tokenizer, StreamNames(prefix)))


def _request(hf_tokenizer, rid: str, reply_to: str, text: str = "Hello world", engine_id: str = "engine-0"):
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    return [Admission(request_id=rid, reply_to=reply_to, engine_id=engine_id, detok=DetokParams()),
            TokenDelta(request_id=rid, seq=0, new_token_ids=tuple(ids[:1]))]


def _run(service, seconds: float = 0.5) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        service.run_once(20)


def _detok_serving_a(redis_url, redis_client, names, hf_tokenizer, engine_max_age_s: float):
    """A detok shard that holds request "a" of gateway "g" on engine-0, both beating; returns the
    engine's HeartbeatWriter, the shard and g's reply stream."""
    reply = names.gateway_out("g")
    engine = HeartbeatWriter(redis_client, names.heartbeat, "engine", "engine-0", interval_s=0.05)
    engine.beat({})
    redis_client.hset(names.heartbeat, "gateway-g", heartbeat_value("gateway", "gateway-g", {}))
    service = _detok(redis_url, names.prefix, hf_tokenizer, engine_max_age_s=engine_max_age_s)
    Producer(redis_client).send_many((names.detok_in(0), m) for m in _request(hf_tokenizer, "a", reply))
    _run(service, 0.3)
    assert set(service.processor.requests) == {"a"}
    return engine, service, reply


def test_a_restarted_detok_drops_the_requests_of_a_gone_gateway_and_never_recreates_its_stream(
        redis_url, redis_client, stream_names, hf_tokenizer):
    names = stream_names
    gone, live = names.gateway_out("gone"), names.gateway_out("live")
    redis_client.hset(names.heartbeat, mapping={EPOCH_FIELD: repr(time.time() - 100),  # not fresh from a flush
                                                "gateway-live": heartbeat_value("gateway", "gateway-live", {})})
    Producer(redis_client).send_many((names.detok_in(0), m) for m in
                                     _request(hf_tokenizer, "a", gone) + _request(hf_tokenizer, "b", live))
    service = _detok(redis_url, names.prefix, hf_tokenizer)
    _run(service)
    assert redis_client.exists(gone) == 0  # nothing written to the gone gateway
    assert [m.request_id for m in _msgs(redis_client, live)] == ["b"]
    assert [m.request_ids for m in _msgs(redis_client, names.engine_ctl)] == [("a",)]  # its engine stops
    assert set(service.processor.requests) == {"b"} and service.stats()["num_dropped"] == 1
    # a's entry is acked and deleted; b's stays pending until b finishes
    assert redis_client.xpending(names.detok_in(0), "detok")["pending"] == 2


def test_right_after_a_flush_a_missing_gateway_or_engine_is_not_gone(redis_url, redis_client, stream_names,
                                                                     hf_tokenizer):
    names = stream_names
    _, service, reply = _detok_serving_a(redis_url, redis_client, names, hf_tokenizer, engine_max_age_s=3.0)
    assert service._seen_engines == {"engine-0"}
    redis_client.delete(names.heartbeat)  # FLUSHALL, as far as the hash goes
    Producer(redis_client).send(names.detok_in(0), TokenDelta(
        request_id="a", seq=1, new_token_ids=tuple(hf_tokenizer.encode(" again", add_special_tokens=False)),
        finish_reason=FinishReason.LENGTH))
    _run(service, 0.5)  # the engine and the gateway have not beaten since
    outputs = _msgs(redis_client, reply)
    assert outputs[-1].finish_reason == FinishReason.LENGTH and all(o.error is None for o in outputs)
    assert service.processor.requests == {} and service.stats()["num_dropped"] == 0


def test_an_engine_that_stopped_cleanly_fails_its_requests_at_once(redis_url, redis_client, stream_names,
                                                                   hf_tokenizer):
    engine, service, reply = _detok_serving_a(redis_url, redis_client, stream_names, hf_tokenizer,
                                              engine_max_age_s=30.0)
    engine.remove()
    _run(service, 0.3)
    last = _msgs(redis_client, reply)[-1]
    # failed (503) or handed back for failover (Resume): either way the shard lets go of it
    assert service.processor.requests == {}
    assert getattr(last, "error", None) is None or last.error.code == 503


def _msgs(client, stream):
    return [m for _, m in _read_all(client, stream)]


# --------------------------------------------------------------------------- services keep running


def test_services_keep_running_through_a_kill_and_restart(own_redis, prefix, hf_tokenizer):
    """A detok loop in a thread over a Redis that is killed for a second and comes back empty:
    the thread is alive throughout, and it serves a request sent after the restart."""
    names = StreamNames(prefix)
    service = _detok(own_redis.url, prefix, hf_tokenizer)
    thread = threading.Thread(target=service.run, daemon=True)
    thread.start()
    try:
        time.sleep(0.3)
        own_redis.stop()
        time.sleep(1.0)
        assert thread.is_alive()
        restart_empty(own_redis)
        client = _client(own_redis)
        reply = names.gateway_out("g")
        client.hset(names.heartbeat, "gateway-g", heartbeat_value("gateway", "gateway-g", {}))
        ids = hf_tokenizer.encode("Hi there", add_special_tokens=False)
        Producer(client).send_many([(names.detok_in(0), Admission(request_id="n", reply_to=reply,
                                                                  detok=DetokParams())),
                                    (names.detok_in(0), TokenDelta(request_id="n", seq=0, new_token_ids=tuple(ids),
                                                                   finish_reason=FinishReason.LENGTH))])
        deadline, outputs = time.monotonic() + 15, []
        while time.monotonic() < deadline and not (outputs and outputs[-1].finish_reason is not None):
            time.sleep(0.1)
            outputs = _msgs(client, reply)
        assert isinstance(outputs[-1], RequestOutput) and outputs[-1].finish_reason == FinishReason.LENGTH
        assert "".join(o.text_delta for o in outputs) == hf_tokenizer.decode(ids)
        assert thread.is_alive()
    finally:
        service.stop()
        thread.join(15)
    assert not thread.is_alive()


def test_the_engine_holds_its_output_through_an_outage_and_fails_it_after_max_outage(own_redis, prefix,
                                                                                      tiny_llama_dir):
    """The engine loop over a Redis that is killed: run_once never raises, computes at most the
    step it could not send, and when Redis is back (empty) after more than max_outage_s, the
    request ends with one 503, to its gateway and to its detok shard; the engine holds nothing."""
    from engine_svc import EngineConfig, LLMEngine
    from engine_svc.service import EngineService
    from shared.config import EngineServiceConfig
    from shared.protocol import EngineRequest, SamplingParams

    names = StreamNames(prefix)
    engine = LLMEngine(EngineConfig(enforce_eager=True, model=str(tiny_llama_dir), device="cpu", dtype="float32",
                                    kv_cache_memory=4 << 20, max_model_len=256, attention_backend="torch"))
    config = EngineServiceConfig(bus=BusConfig(redis_url=own_redis.url, prefix=prefix), service_id="engine-0",
                                 idle_block_ms=50, heartbeat_s=0.05, max_outage_s=1.0)
    service = EngineService(config, engine, client=_client(own_redis))
    reply = names.gateway_out("g")
    Producer(_client(own_redis)).send(names.engine_in, EngineRequest(
        request_id="a", reply_to=reply, prompt_token_ids=(1, 2, 3),
        sampling=SamplingParams(max_tokens=200, ignore_eos=True)))
    deadline = time.monotonic() + 30
    while not (engine.has_request("a") and service.outbox.down_for() == 0 and engine.stats()["num_running"]):
        service.run_once()
        assert time.monotonic() < deadline
    own_redis.stop()
    steps_before = _num_output_tokens(engine, "a")
    started = time.monotonic()
    while time.monotonic() - started < 1.5:
        service.run_once()  # no exception escapes
    assert service.outbox and engine.has_request("a")
    assert _num_output_tokens(engine, "a") <= steps_before + 1  # nothing computed for nobody
    restart_empty(own_redis)
    deadline = time.monotonic() + 30
    while engine.has_request("a"):
        service.run_once()
        assert time.monotonic() < deadline
    client = _client(own_redis)
    errors = [m for m in _msgs(client, reply) if m.error is not None]
    assert [(m.request_id, m.error.code) for m in errors] == [("a", 503)]
    assert "unreachable" in errors[0].error.message
    final = [m for m in _msgs(client, names.detok_in(0)) if isinstance(m, TokenDelta) and m.finish_reason is not None]
    assert [(m.request_id, m.error.code) for m in final] == [("a", 503)]
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_total_blocks"] and service.reply_to == {}


def _num_output_tokens(engine, request_id: str) -> int:
    return sum(r.num_output_tokens for r in engine.scheduler.requests[request_id])
