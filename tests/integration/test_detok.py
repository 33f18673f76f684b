"""Detokenizer: incremental UTF-8 safety, stop strings, logprob strings, and the shard service on Redis."""

from __future__ import annotations

import dataclasses
import random

import pytest

from detok_svc.incremental import IncrementalDetokenizer, TokenStrings
from detok_svc.processor import DetokProcessor
from detok_svc.service import DetokService
from detok_svc.stop import StopChecker
from shared.config import BusConfig, DetokConfig
from shared.protocol import (Abort, Admission, DetokParams, FinishReason, RequestOutput, StreamNames, TokenDelta,
                             TokenLogprobs, decode)
from shared.entries import payloads
from shared.streams import Producer

TEXTS = ["Hello world, the capital of France is Paris.", "中文字符 和 日本語 テキスト 🙂🚀 café",
         "The quick brown fox jumps over the lazy dog. 🙂"]
REPLY = "x:gateway:g:out"


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_never_hold_broken_utf8_and_join_to_decode(hf_tokenizer, text):
    ids = _ids(hf_tokenizer, text)
    detok = IncrementalDetokenizer(hf_tokenizer)
    deltas = [detok.push([t]) for t in ids] + [detok.finish()]
    assert "".join(deltas) == hf_tokenizer.decode(ids, skip_special_tokens=True) == detok.text
    assert all("\ufffd" not in d for d in deltas)
    assert sum(1 for d in deltas if d) > 3  # it streamed, not one lump at the end


def test_random_ids_join_to_decode(hf_tokenizer):
    # ByteFallback decodes a run of byte tokens as one group (a broken run turns into one U+FFFD per
    # byte, the valid bytes next to it too), which no incremental decoder can agree with. So byte
    # tokens are sampled as whole UTF-8 characters; byte-level BPE gets fully random ids.
    byte_ids = {hf_tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>"): b for b in range(256)}
    byte_ids = {t: b for t, b in byte_ids.items() if t is not None and t != hf_tokenizer.unk_token_id}
    pool = [t for t in range(len(hf_tokenizer)) if t not in byte_ids]
    chars = [[hf_tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in c.encode()] for c in "é中🙂語"]
    rng = random.Random(0)
    for skip in (True, False):
        for _ in range(30):
            ids = []
            while len(ids) < rng.randrange(1, 40):
                ids += rng.choice(chars) if byte_ids and rng.random() < 0.2 else [rng.choice(pool)]
            detok = IncrementalDetokenizer(hf_tokenizer, skip_special_tokens=skip)
            out, i = "", 0
            while i < len(ids):  # engines may send several tokens at once
                k = rng.randrange(1, 4)
                out += detok.push(ids[i:i + k])
                i += k
            out += detok.finish()
            assert out == hf_tokenizer.decode(ids, skip_special_tokens=skip)


def test_skip_special_tokens(hf_tokenizer):
    ids = _ids(hf_tokenizer, "Hello") + [hf_tokenizer.eos_token_id]
    for skip in (True, False):
        detok = IncrementalDetokenizer(hf_tokenizer, skip_special_tokens=skip)
        text = "".join(detok.push([t]) for t in ids) + detok.finish()
        assert (hf_tokenizer.eos_token in text) is (not skip)


def test_stop_checker_unit():
    checker = StopChecker(["abc", "xy"])
    assert checker.holdback == 2
    assert checker.check("zzab", 2) is None
    m = checker.check("zzabc", 1)
    assert (m.end, m.stop) == (2, "abc")
    m = StopChecker(["abc"], include_stop_str_in_output=True).check("zzabcd", 2)
    assert (m.end, m.stop) == (5, "abc")
    assert StopChecker(["bc", "abc"]).check("xabc", 3).stop == "abc"  # earliest start wins


def _deltas(tok, text, request_id="r1", *, n_per=1, index=0, params=None, num_choices=1, finish=True,
            stop_reason=None, reply_to=REPLY, admit=True):
    """What an engine sends for one choice: the request's Admission (unless ``admit`` is off),
    then its deltas."""
    ids = _ids(tok, text)
    chunks = [ids[i:i + n_per] for i in range(0, len(ids), n_per)]
    out = [Admission(request_id=request_id, num_choices=num_choices, reply_to=reply_to,
                     detok=params or DetokParams())] if admit else []
    for seq, chunk in enumerate(chunks):
        last = seq == len(chunks) - 1
        out.append(TokenDelta(request_id=request_id, seq=seq, index=index, new_token_ids=tuple(chunk),
                              finish_reason=FinishReason.LENGTH if (last and finish) else None,
                              stop_reason=stop_reason if last else None, num_prompt_tokens=3,
                              num_choices=num_choices))
    return out


def _run(processor, deltas):
    outputs, aborts, acked = [], [], []
    for k, d in enumerate(deltas):
        messages = processor.process(f"{k}-0", d)
        acked += processor.take_ackable()
        for stream, msg in messages:
            (outputs if isinstance(msg, RequestOutput) else aborts).append((stream, msg))
    return [m for _, m in outputs], aborts, acked


@pytest.mark.parametrize("stop,include,expected", [
    ("fox jumps", False, "The quick brown "),
    ("fox jumps", True, "The quick brown fox jumps"),
    ("🙂", False, "The quick brown fox jumps over the lazy dog. "),
])
def test_stop_string_spanning_tokens(hf_tokenizer, stop, include, expected):
    text = "The quick brown fox jumps over the lazy dog. 🙂 and more"
    processor = DetokProcessor(hf_tokenizer, StreamNames("x"))
    params = DetokParams(stop=(stop, "never-there"), include_stop_str_in_output=include)
    deltas = _deltas(hf_tokenizer, text, params=params, finish=False)
    assert " " not in stop or len(_ids(hf_tokenizer, stop)) > 1  # "fox jumps" spans tokens
    outputs, aborts, acked = _run(processor, deltas)
    assert "".join(o.text_delta for o in outputs) == expected
    final = outputs[-1]
    assert final.finish_reason == FinishReason.STOP and final.stop_reason == stop
    assert all(o.finish_reason is None for o in outputs[:-1])
    assert final.usage is not None and final.usage.prompt_tokens == 3
    assert [a.request_ids for _, a in aborts] == [("r1",)]  # the engine is told to stop
    assert aborts[0][0] == "x:engine:ctl"
    assert processor.requests == {} and len(acked) == sum(1 for _ in acked) > 0
    # late deltas of the stopped request are acked and dropped
    late = TokenDelta(request_id="r1", seq=len(deltas) + 5, new_token_ids=(5,))
    assert processor.process("late", late) == [] and processor.take_ackable() == ["late"]


def test_stop_strings_wait_for_min_tokens(hf_tokenizer):
    text = "one. two. three. four."
    ids = _ids(hf_tokenizer, text)
    first_stop = len(_ids(hf_tokenizer, "one."))
    params = DetokParams(stop=(".",), min_tokens=first_stop)  # the first "." arrives with token min_tokens
    outputs, aborts, _ = _run(DetokProcessor(hf_tokenizer, StreamNames("x")),
                              _deltas(hf_tokenizer, text, params=params, finish=False))
    assert "".join(o.text_delta for o in outputs) == "one. two"
    assert outputs[-1].finish_reason == FinishReason.STOP and len(aborts) == 1
    assert len(ids) > first_stop + 2


def test_streamed_text_never_shows_a_trimmed_stop_prefix(hf_tokenizer):
    text = "Hello world, the capital of France is Paris."
    processor = DetokProcessor(hf_tokenizer, StreamNames("x"))
    deltas = _deltas(hf_tokenizer, text, params=DetokParams(stop=("capital of",)), finish=False)
    outputs, _, _ = _run(processor, deltas)
    streamed = "".join(o.text_delta for o in outputs)
    assert streamed == "Hello world, the " and "capital"[:3] not in streamed[len("Hello world, the "):]


def test_finish_by_engine_flushes_held_back_text_and_sets_usage(hf_tokenizer):
    text = "中文字符 和 日本語"
    processor = DetokProcessor(hf_tokenizer, StreamNames("x"))
    deltas = _deltas(hf_tokenizer, text, params=DetokParams(stop=("zzzzzz",)), stop_reason=7)
    outputs, aborts, acked = _run(processor, deltas)
    assert "".join(o.text_delta for o in outputs) == text
    assert outputs[-1].finish_reason == FinishReason.LENGTH and outputs[-1].stop_reason == 7
    assert outputs[-1].usage.completion_tokens == len(_ids(hf_tokenizer, text))
    assert sum(len(o.token_ids) for o in outputs) == len(_ids(hf_tokenizer, text))
    assert aborts == [] and len(acked) == len(deltas) and processor.requests == {}


def test_duplicates_are_ignored(hf_tokenizer):
    processor = DetokProcessor(hf_tokenizer, StreamNames("x"))
    deltas = _deltas(hf_tokenizer, "Hello world, the capital")
    doubled = [d for d in deltas[:-1] for _ in range(2)] + [deltas[-1]]
    outputs, _, _ = _run(processor, doubled)
    assert "".join(o.text_delta for o in outputs) == "Hello world, the capital"


def test_n2_stop_in_one_choice_does_not_end_the_other(hf_tokenizer):
    processor = DetokProcessor(hf_tokenizer, StreamNames("x"))
    params = DetokParams(stop=("fox",))
    a = _deltas(hf_tokenizer, "The quick brown fox jumps", index=0, params=params, num_choices=2, finish=False)
    b = _deltas(hf_tokenizer, "Hello world", index=1, params=params, num_choices=2)
    outputs, aborts, _ = _run(processor, a + b)
    texts = {i: "".join(o.text_delta for o in outputs if o.index == i) for i in (0, 1)}
    assert texts == {0: "The quick brown ", 1: "Hello world"}
    assert [o.usage is not None for o in outputs].count(True) == 1 and outputs[-1].usage is not None
    assert len(aborts) == 1 and processor.requests == {}


def test_logprob_token_strings(hf_tokenizer):
    text = "Hello café 🙂 world"
    ids = _ids(hf_tokenizer, text)
    strings = TokenStrings(hf_tokenizer)
    raw = b"".join(bytes(strings.bytes(t)) for t in ids)
    assert raw.decode() == text or raw.decode() == " " + text  # SentencePiece's first piece has "▁"
    assert all(strings.text(t) == bytes(strings.bytes(t)).decode(errors="replace") for t in ids)
    processor = DetokProcessor(hf_tokenizer, StreamNames("x"))
    lps = tuple(TokenLogprobs(token_id=t, logprob=-0.5, rank=1, top_ids=(t, 0), top_logprobs=(-0.5, -3.0))
                for t in ids)
    delta = TokenDelta(request_id="r", seq=0, new_token_ids=tuple(ids), logprobs=lps, finish_reason=2)
    assert processor.process("0-0", Admission(request_id="r", reply_to=REPLY, detok=DetokParams(logprobs=True))) == []
    (_, out), = processor.process("1-0", delta)
    assert [lp.token for lp in out.logprobs] == [strings.text(t) for t in ids]
    assert [lp.token_id for lp in out.logprobs] == ids
    assert out.logprobs[0].top_tokens == (strings.text(ids[0]), strings.text(0))
    assert out.text_delta == hf_tokenizer.decode(ids)


# --------------------------------------------------------------------------- the service over Redis


def _service(redis_url, prefix, tokenizer):
    config = DetokConfig(bus=BusConfig(redis_url=redis_url, prefix=prefix), shard=0, num_detok_shards=1,
                         service_id="detok-0", block_ms=50)
    return DetokService(config, DetokProcessor(tokenizer, StreamNames(prefix)))


def _messages(client, stream):
    return [decode(wire) for _, fields in client.xrange(stream) for wire in payloads(fields)]


def _replies(client, names):
    return _messages(client, names.gateway_out("g"))


def test_service_acks_only_finished_requests_and_resumes_after_restart(redis_url, redis_client, prefix,
                                                                       hf_tokenizer):
    names = StreamNames(prefix)
    reply = names.gateway_out("g")
    text = "The quick brown fox jumps over the lazy dog."
    deltas = _deltas(hf_tokenizer, text, reply_to=reply)
    producer = Producer(redis_client)
    half = len(deltas) // 2
    for d in deltas[:half]:  # one entry per engine step
        producer.send_many([(names.detok_in(0), d)])
    first = _service(redis_url, prefix, hf_tokenizer)
    while first.run_once(50):
        pass
    assert redis_client.xpending(names.detok_in(0), "detok")["pending"] == half  # unfinished: not acked
    sent_before = _replies(redis_client, names)
    # the shard restarts (state lost) and the rest of the tokens arrive
    producer.send_many((names.detok_in(0), d) for d in deltas[half:])
    second = _service(redis_url, prefix, hf_tokenizer)
    while second.run_once(50):
        pass
    replies = _replies(redis_client, names)
    latest = {}
    for r in replies:  # what a gateway does: keep the first of each seq
        latest.setdefault(r.seq, r)
    assert "".join(latest[s].text_delta for s in sorted(latest)) == text
    assert [r.seq for r in replies[:len(sent_before)]] == [r.seq for r in sent_before]
    assert replies[-1].finish_reason == FinishReason.LENGTH
    assert redis_client.xpending(names.detok_in(0), "detok")["pending"] == 0
    assert second.stats()["num_requests"] == 0
    assert not any(isinstance(m, Abort) for m in replies)


def test_an_entry_shared_by_two_requests_is_acked_when_both_have_finished(redis_url, redis_client, prefix,
                                                                          hf_tokenizer):
    names = StreamNames(prefix)
    reply = names.gateway_out("g")
    a = _deltas(hf_tokenizer, "one two three", "a", reply_to=reply)
    b = _deltas(hf_tokenizer, "four five six seven eight nine ten", "b", reply_to=reply)
    assert len(a) < len(b)
    producer, service = Producer(redis_client, batch=True), _service(redis_url, prefix, hf_tokenizer)
    stream = names.detok_in(0)
    for step in range(len(b)):  # each engine step: one entry with a delta of each running request
        producer.send_many([(stream, d[step]) for d in (a, b) if step < len(d)])
        while service.run_once(50):
            pass
        finished_a = step >= len(a) - 1
        # a's entries stay pending while b, which shares them, runs; all go when b finishes
        assert redis_client.xpending(stream, "detok")["pending"] == (step + 1 if step < len(b) - 1 else 0)
        assert ("a" in service.processor.requests) == (not finished_a)
    assert redis_client.xpending(stream, "detok")["pending"] == 0 and service.processor.holders == {}
    texts = {"a": "", "b": ""}
    for r in _replies(redis_client, names):
        texts[r.request_id] += r.text_delta
    assert texts == {"a": "one two three", "b": "four five six seven eight nine ten"}


def test_service_fails_a_request_whose_delta_breaks_the_tokenizer(redis_url, redis_client, prefix, hf_tokenizer):
    names = StreamNames(prefix)
    reply = names.gateway_out("g")
    good = TokenDelta(request_id="ok", seq=0, new_token_ids=tuple(_ids(hf_tokenizer, "Hello")), finish_reason=2)
    first = TokenDelta(request_id="bad", seq=0, new_token_ids=tuple(_ids(hf_tokenizer, "Hello")))
    broken = TokenDelta(request_id="bad", seq=1, new_token_ids=(-1,))
    admissions = [Admission(request_id=rid, reply_to=reply) for rid in ("bad", "ok")]
    Producer(redis_client).send_many((names.detok_in(0), d) for d in (*admissions, first, broken, good))
    service = _service(redis_url, prefix, hf_tokenizer)
    while service.run_once(50):
        pass
    replies = _replies(redis_client, names)
    errors = [r for r in replies if r.error is not None]
    assert [(e.request_id, e.error.code) for e in errors] == [("bad", 500)]
    assert "".join(r.text_delta for r in replies if r.request_id == "ok") == "Hello"
    aborts = _messages(redis_client, names.engine_ctl)
    assert [a.request_ids for a in aborts] == [("bad",)]
    assert redis_client.xpending(names.detok_in(0), "detok")["pending"] == 0
    assert service.processor.requests == {}


def test_requests_whose_engine_went_silent_expire(hf_tokenizer):
    processor = DetokProcessor(hf_tokenizer, StreamNames("x"))
    first = _deltas(hf_tokenizer, "Hello world", finish=False)[0]
    processor.process("1-0", first)
    assert processor.take_ackable() == []  # held by its unfinished request
    assert processor.expire(max_idle_s=60) == []
    out = processor.expire(max_idle_s=-1)
    assert [(m.request_id, m.error.code) for _, m in out] == [("r1", 503)] and processor.take_ackable() == ["1-0"]
    assert processor.requests == {}


def test_requests_of_a_dead_engine_fail_with_503(hf_tokenizer):
    processor = DetokProcessor(hf_tokenizer, StreamNames("x"))
    for rid, engine in (("a", "engine-0"), ("b", "engine-1")):
        first = dataclasses.replace(_deltas(hf_tokenizer, "Hello world", finish=False)[0], request_id=rid,
                                    engine_id=engine)
        processor.process(f"{rid}-0", first)
    assert processor.fail_engines(set()) == []
    out = processor.fail_engines({"engine-0"})
    assert [(m.request_id, m.error.code, m.finish_reason) for _, m in out] == [("a", 503, FinishReason.ERROR)]
    assert set(processor.requests) == {"b"} and processor.take_ackable() == ["a-0"]  # b still holds b-0


def test_an_announced_request_of_a_dead_engine_fails_before_its_first_token(hf_tokenizer):
    processor = DetokProcessor(hf_tokenizer, StreamNames("x"))
    announce = Admission(request_id="a", engine_id="engine-0", reply_to=REPLY)
    assert processor.process("a-0", announce) == []  # no text yet, but the shard knows the request
    assert set(processor.requests) == {"a"} and processor.take_ackable() == []
    out = processor.fail_engines({"engine-0"})
    assert [(m.request_id, m.error.code, m.finish_reason) for _, m in out] == [("a", 503, FinishReason.ERROR)]
    assert processor.requests == {} and processor.take_ackable() == ["a-0"]


def test_a_redelivered_admission_changes_no_output(hf_tokenizer):
    text = "Hello world, 中文 and 🙂"
    messages = _deltas(hf_tokenizer, text)
    plain = _run(DetokProcessor(hf_tokenizer, StreamNames("x")), messages)
    again = _run(DetokProcessor(hf_tokenizer, StreamNames("x")), [messages[0], messages[0], *messages[1:]])
    assert again[0] == plain[0] and "".join(o.text_delta for o in plain[0]) == text


def test_deltas_of_a_request_never_admitted_are_dropped(hf_tokenizer):
    processor = DetokProcessor(hf_tokenizer, StreamNames("x"))
    outputs, _, acked = _run(processor, _deltas(hf_tokenizer, "Hello world", admit=False))
    assert outputs == [] and processor.requests == {} and acked


def test_a_stopping_detok_answers_what_it_read_with_its_last_replies(redis_url, redis_client, prefix, hf_tokenizer):
    """A busy turn takes the next entry in the same round trip as its replies (Outbox.flush_and_read
    with block_ms); a stop right after still answers and acks it: nothing read is left pending."""
    names = StreamNames(prefix)
    reply = names.gateway_out("g")
    admission, *deltas = _deltas(hf_tokenizer, "one two", reply_to=reply, n_per=64)  # one delta: the final one
    producer = Producer(redis_client)
    producer.send(names.detok_in(0), admission)
    producer.send(names.detok_in(0), deltas[0])
    config = DetokConfig(bus=BusConfig(redis_url=redis_url, prefix=prefix), shard=0, num_detok_shards=1,
                         service_id="detok-0", block_ms=50, entries_per_read=1)
    service = DetokService(config, DetokProcessor(hf_tokenizer, names))
    assert service.run_once(50) == 1  # the admission, and with its (empty) replies the final delta's entry
    assert service._prefetched is not None and _replies(redis_client, names) == []
    service.stopping.set()
    service.run()
    assert [r.finish_reason for r in _replies(redis_client, names)] == [FinishReason.LENGTH]
    assert redis_client.xpending(names.detok_in(0), "detok")["pending"] == 0
    assert service.processor.requests == {}
