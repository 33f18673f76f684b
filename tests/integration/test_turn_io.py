"""Outbox.flush_and_read: a busy engine's step output and its next turn's two reads (intake and
ctl) in one pipeline, on a real redis-server. It must read exactly what the separate reads would,
fall back to them whenever a reader has more to do than a plain read, and lose nothing when
Redis fails."""

from __future__ import annotations

import time

from shared.group_reader import GroupReader
from shared.protocol import Abort, GenerateRequest
from shared.streams import Outbox, Producer, StreamReader, connect


def _requests(*ids: str) -> list[GenerateRequest]:
    return [GenerateRequest(request_id=i, reply_to="x:gateway:g:out", prompt=i) for i in ids]


def _readers(client, names):
    intake = GroupReader(client, names.engine_in, "engine", "e0")
    ctl = StreamReader(client, names.engine_ctl, start="0-0")
    assert intake.read(count=10) == [] and ctl.read() == []  # group created, own pending drained
    return intake, ctl


def test_one_round_trip_sends_and_reads_what_separate_reads_would(redis_client, stream_names):
    intake, ctl = _readers(redis_client, stream_names)
    producer = Producer(redis_client)
    producer.send_many([(stream_names.engine_in, r) for r in _requests("a", "b")])
    producer.send(stream_names.engine_ctl, Abort(request_ids=("z",)))
    outbox = Outbox(producer, intake)
    outbox.put([("x:detok:0", r) for r in _requests("out1", "out2")])
    redis_client.config_resetstat()
    ok, (new, aborts) = outbox.flush_and_read([(intake, 10), (ctl, 1024)])
    stats = redis_client.info("commandstats")
    assert ok and not outbox
    assert [e.msg.request_id for e in new] == ["a", "b"] and [e.msg.request_ids for e in aborts] == [("z",)]
    assert [e.msg.request_id for e in StreamReader(redis_client, "x:detok:0", start="0-0").read()] == ["out1", "out2"]
    assert stats["cmdstat_xreadgroup"]["calls"] == 1 and stats["cmdstat_xread"]["calls"] == 1
    assert intake.num_pending() == 2  # read by this consumer, acked once admitted (as with read())
    assert intake.ack(new) == 2
    ok, (new, aborts) = outbox.flush_and_read([(intake, 10), (ctl, 1024)])  # nothing new: cursors moved on
    assert ok and new == [] and aborts == []


def test_falls_back_when_a_reader_has_more_to_do_or_acks_are_waiting(redis_client, stream_names):
    intake = GroupReader(redis_client, stream_names.engine_in, "engine", "e0")
    ctl = StreamReader(redis_client, stream_names.engine_ctl, start="0-0")
    outbox = Outbox(Producer(redis_client), intake)
    outbox.put([("x:detok:0", _requests("o")[0])])
    assert outbox.flush_and_read([(intake, 10), (ctl, 1024)]) == (True, None)  # group not created yet
    assert not outbox and intake.read(count=10) == []  # sent all the same; read() drains
    Producer(redis_client).send(stream_names.engine_in, _requests("q")[0])
    envelopes = intake.read(count=10)
    outbox.put([("x:detok:0", _requests("p")[0])], acks=envelopes)
    assert outbox.flush_and_read([(intake, 10), (ctl, 1024)]) == (True, None)  # acks first: the plain flush
    assert intake.num_pending() == 0
    intake._next_claim = 0.0  # an idle-entry claim is due: read() does it
    assert outbox.flush_and_read([(intake, 10)]) == (True, None)


def test_redis_away_holds_the_output_and_keeps_what_was_read(own_redis, stream_names):
    client = connect(own_redis.url, socket_timeout=1.0, socket_connect_timeout=1.0)
    intake, ctl = _readers(client, stream_names)
    outbox = Outbox(Producer(client), intake)
    own_redis.stop()
    outbox.put([("x:detok:0", r) for r in _requests("o1", "o2")])
    assert outbox.flush_and_read([(intake, 10), (ctl, 1024)]) == (False, None)
    assert outbox and outbox.down_for() > 0  # held, retried by the next flush
    own_redis.start()
    deadline = time.monotonic() + 5
    while not outbox.flush() and time.monotonic() < deadline:
        pass
    assert not outbox
    assert [e.msg.request_id for e in StreamReader(client, "x:detok:0", start="0-0").read()] == ["o1", "o2"]


def test_a_lost_group_in_the_reply_is_recreated(redis_client, stream_names):
    intake, ctl = _readers(redis_client, stream_names)
    outbox = Outbox(Producer(redis_client), intake)
    redis_client.delete(stream_names.engine_in)  # the group goes with its stream: NOGROUP
    outbox.put([("x:detok:0", _requests("o")[0])])
    ok, (new, aborts) = outbox.flush_and_read([(intake, 10), (ctl, 1024)])
    assert ok and new == [] and aborts == [] and not outbox  # the send went through regardless
    Producer(redis_client).send(stream_names.engine_in, _requests("after")[0])
    assert [e.msg.request_id for e in intake.read(count=10)] == ["after"]  # re-created by take()
