"""Failover's pure parts: an engine resumes a request from its prompt plus the outputs a dead engine
delivered and goes on exactly as the uninterrupted run did; the detokenizer hands a dead engine's
requests back to their gateway (Resume) instead of failing them, and takes them up again when the
new engine admits them, without duplicating or losing text."""

from __future__ import annotations

import asyncio

import pytest

from detok_svc.processor import RESUME_TIMEOUT_S, SEQ_EPOCH, DetokProcessor
from engine_svc import EngineConfig, LLMEngine
from shared.protocol import (Abort, Admission, DetokParams, FinishReason, ProtocolError, RequestOutput, Resume,
                             SamplingParams, StreamNames, TokenDelta)
from tests.invariants import assert_engine_idle

# ----------------------------------------------------------------------------------------- engine


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return LLMEngine(EngineConfig(enforce_eager=True, model=str(tiny_llama_dir), dtype="float32",
                                  kv_cache_memory=16 << 20, max_num_seqs=8))


def run_one(engine, request_id, prompt, params, resumed=(), resumed_seq=0) -> list[TokenDelta]:
    engine.add_request(request_id, prompt, params, resumed_token_ids=resumed, resumed_seq=resumed_seq)
    deltas = []
    while engine.has_work():
        deltas += engine.step()
    assert_engine_idle(engine)
    return deltas


PROMPTS = [[5, 17, 99, 3, 42, 7], list(range(10, 60))]
SAMPLINGS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    "seeded": SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True),
    "seeded-penalties": SamplingParams(temperature=0.8, top_k=50, seed=7, max_tokens=24, min_tokens=20,
                                       frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.2),
}


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_resumed_request_continues_as_the_uninterrupted_run(engine, name):
    params = SAMPLINGS[name]
    for p, prompt in enumerate(PROMPTS):
        whole = run_one(engine, f"{name}-{p}", prompt, params)
        tokens = [t for d in whole for t in d.new_token_ids]
        assert len(tokens) == 24 and whole[-1].finish_reason == FinishReason.LENGTH
        for cut in (1, 9, 23):
            seq = 100 + cut  # the detokenizer's next seq: the new engine's deltas go on from it
            rest = run_one(engine, f"{name}-{p}-{cut}", prompt, params, tokens[:cut], seq)
            assert tokens[:cut] + [t for d in rest for t in d.new_token_ids] == tokens, (name, p, cut)
            assert [d.seq for d in rest] == list(range(seq, seq + len(rest)))
            assert rest[-1].finish_reason == FinishReason.LENGTH
            assert all(d.num_prompt_tokens == len(prompt) for d in rest)  # usage keeps the original prompt
            assert all(d.num_cached_tokens <= len(prompt) for d in rest)


def test_resume_is_refused_when_it_cannot_be_exact(engine):
    prompt = PROMPTS[0]
    cases = [
        (SamplingParams(n=2, max_tokens=8), (3,), 1),  # n > 1: the choices went different ways
        (SamplingParams(n=1, use_beam_search=True, max_tokens=8), (3,), 1),
        (SamplingParams(max_tokens=2), (3, 4), 2),  # it already had all its tokens
        (SamplingParams(max_tokens=8), (3, engine.vocab_size), 2),
        (SamplingParams(max_tokens=8), (3,), -1),
    ]
    for params, resumed, seq in cases:
        with pytest.raises(ProtocolError):
            engine.add_request("refused", prompt, params, resumed_token_ids=resumed, resumed_seq=seq)
    assert_engine_idle(engine)


# ----------------------------------------------------------------------------------------- detok


NAMES = StreamNames("t")
GATEWAY = "t:gateway:g:out"


def admission(rid="r", engine_id="e0", n=1, **detok):
    return Admission(request_id=rid, num_choices=n, engine_id=engine_id, reply_to=GATEWAY,
                     detok=DetokParams(**detok))


def delta(seq, ids, rid="r", finish=None, index=0, n=1):
    return TokenDelta(request_id=rid, seq=seq, index=index, new_token_ids=tuple(ids), finish_reason=finish,
                      num_prompt_tokens=5, num_choices=n)


class Shard:
    """A DetokProcessor fed one entry per message, as the service does."""

    def __init__(self, processor):
        self.processor = processor
        self.num_entries = 0
        self.acked: list[str] = []

    def feed(self, *msgs):
        out = []
        for msg in msgs:
            self.num_entries += 1
            out += self.processor.process(f"{self.num_entries}-0", msg)
        self.acked += self.processor.take_ackable()
        return out


@pytest.fixture
def shard(detok_tokenizer):
    return Shard(DetokProcessor(detok_tokenizer, NAMES))


@pytest.fixture(scope="module")
def detok_tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def text_of(outs):
    return "".join(m.text_delta for _, m in outs if isinstance(m, RequestOutput))


def test_a_dead_engines_request_is_resumed_and_goes_on_without_duplicate_text(shard, detok_tokenizer):
    ids = detok_tokenizer.encode(" one two three four five six seven")
    first = shard.feed(admission(), delta(0, ids[:2]), delta(1, ids[2:4]))
    out = shard.processor.fail_engines({"e0"}, can_resume=True)
    assert out == [(GATEWAY, Resume(request_id="r", token_ids=tuple(ids[:4]), next_seq=SEQ_EPOCH, engine_id="e0"))]
    assert shard.processor.fail_engines({"e0"}, can_resume=True) == []  # once per death, not at every check
    # a late delta of the dead engine (written before it died) is dropped: the survivor regenerates it
    assert shard.feed(delta(2, ids[4:5])) == []
    rest = shard.feed(admission(engine_id="e1"), delta(SEQ_EPOCH, ids[4:6]),
                      delta(3, ids[6:7]),  # the "dead" engine was only frozen: its deltas stay out
                      delta(SEQ_EPOCH + 1, ids[6:], finish=FinishReason.LENGTH))
    assert text_of(first) + text_of(rest) == detok_tokenizer.decode(ids)
    final = rest[-1][1]
    assert final.finish_reason == FinishReason.LENGTH and final.usage.completion_tokens == len(ids)
    assert [m.seq for _, m in first + rest] == [0, 1, SEQ_EPOCH, SEQ_EPOCH + 1]
    assert not shard.processor.requests and not shard.processor.holders
    assert sorted(shard.acked, key=lambda e: int(e.split("-")[0])) == [f"{k}-0" for k in range(1, 9)]


def test_a_request_resumed_twice_and_one_with_nothing_delivered(shard, detok_tokenizer):
    ids = detok_tokenizer.encode(" alpha beta gamma delta")
    shard.feed(admission(), delta(0, ids[:1]), admission("q", n=3))  # q: three choices, nothing yet
    out = dict((m.request_id, m) for _, m in shard.processor.fail_engines({"e0"}, can_resume=True))
    assert out["r"] == Resume(request_id="r", token_ids=tuple(ids[:1]), next_seq=SEQ_EPOCH, engine_id="e0")
    assert out["q"] == Resume(request_id="q", token_ids=(), next_seq=0, engine_id="e0")  # a plain restart
    shard.feed(admission(engine_id="e1"), delta(SEQ_EPOCH, ids[1:2]), admission("q", engine_id="e1", n=3))
    out = shard.processor.fail_engines({"e0", "e1"}, can_resume=True)
    assert sorted(m.request_id for _, m in out) == ["q", "r"]
    again = next(m for _, m in out if m.request_id == "r")
    assert again.token_ids == tuple(ids[:2]) and again.next_seq == 2 * SEQ_EPOCH
    rest = shard.feed(admission(engine_id="e2"), delta(2 * SEQ_EPOCH, ids[2:], finish=FinishReason.STOP),
                      admission("q", engine_id="e2", n=3),
                      *[delta(0, ids[:1], rid="q", index=i, n=3, finish=FinishReason.LENGTH) for i in range(3)])
    assert [m.finish_reason for _, m in rest] == [FinishReason.STOP] + [FinishReason.LENGTH] * 3
    assert not shard.processor.requests and not shard.processor.holders


def test_what_cannot_be_resumed_fails_with_a_503(shard, detok_tokenizer):
    ids = detok_tokenizer.encode(" x y z")
    shard.feed(admission(n=2), delta(0, ids[:1], index=1, n=2))  # n = 2, one choice under way
    (reply_to, out), = shard.processor.fail_engines({"e0"}, can_resume=True)
    assert reply_to == GATEWAY and out.error.code == 503 and "n > 1" in out.error.message
    shard.feed(admission("s"), delta(0, ids[:1], rid="s"))  # resumable, but no engine is left to take it
    (reply_to, out), = shard.processor.fail_engines({"e0"})
    assert reply_to == GATEWAY and out.request_id == "s" and out.error.code == 503
    assert not shard.processor.requests and not shard.processor.holders


def test_a_resume_nobody_takes_up_is_given_up_and_a_late_admission_aborted(shard, detok_tokenizer, monkeypatch):
    ids = detok_tokenizer.encode(" a b c")
    shard.feed(admission(), delta(0, ids[:1]))
    assert isinstance(shard.processor.fail_engines({"e0"}, can_resume=True)[0][1], Resume)
    assert shard.processor.expire(600.0) == []  # still within the resume timeout
    later = shard.processor.requests["r"].resumed_at + RESUME_TIMEOUT_S + 1
    monkeypatch.setattr("detok_svc.processor.time.monotonic", lambda: later)
    (reply_to, out), = shard.processor.expire(600.0)  # the client left, or the resubmission was refused
    assert out.error.code == 503 and "resumed" in out.error.message
    assert not shard.processor.requests and not shard.processor.holders
    # an engine that admits it after all (the resume raced the finish) is told to stop at once
    assert shard.feed(admission(engine_id="e1")) == [(NAMES.engine_ctl, Abort(request_ids=("r",), reason="finished"))]
    assert not shard.processor.requests and not shard.processor.holders


def test_a_resumed_structured_output_request_goes_on_inside_its_grammar(engine):
    from shared.structured import StructuredOutputs

    params = SamplingParams(temperature=1.0, seed=5, max_tokens=40,
                            structured_outputs=StructuredOutputs(regex=r"(yes|no)(, (red|green|blue)){2,8}\."))
    whole = run_one(engine, "grammar", PROMPTS[0], params)
    tokens = [t for d in whole for t in d.new_token_ids]
    assert whole[-1].finish_reason == FinishReason.STOP and len(tokens) > 6
    for cut in (1, len(tokens) // 2, len(tokens) - 1):  # the new engine's matcher accepts the outputs first
        rest = run_one(engine, f"grammar-{cut}", PROMPTS[0], params, tokens[:cut], cut)
        assert tokens[:cut] + [t for d in rest for t in d.new_token_ids] == tokens, cut


# ----------------------------------------------------------------------------------------- gateway


class Bus:
    """The gateway's side of the bus as a Submission sees it, recording what goes out."""

    def __init__(self):
        from gateway.collector import Collector

        self.collector = Collector(reader=None)
        self.submitted: list = []
        self.aborted: list = []

    async def submit(self, requests) -> None:
        self.submitted += requests

    def abort(self, request_ids, reason) -> None:
        self.aborted.append((tuple(request_ids), reason))


def test_the_gateway_resubmits_on_resume_and_the_stream_goes_on():
    from gateway.submission import Submission
    from shared.protocol import GenerateRequest

    async def scenario():
        bus = Bus()
        request = GenerateRequest(request_id="r", reply_to=GATEWAY, prompt="Count:",
                                  sampling=SamplingParams(max_tokens=8))
        submission = Submission(bus, [request])
        await submission.start()
        bus.collector.deliver(RequestOutput(request_id="r", seq=0, text_delta="one", token_ids=(5,)))
        first = await submission.receive()
        bus.collector.deliver(Resume(request_id="r", token_ids=(5,), next_seq=SEQ_EPOCH, engine_id="e0"))
        await asyncio.sleep(0)  # the resubmission task runs
        bus.collector.deliver(RequestOutput(request_id="r", seq=SEQ_EPOCH, text_delta=" two", token_ids=(6,),
                                            finish_reason=FinishReason.LENGTH))
        rest = await submission.receive()
        submission.close()
        return bus, first + rest, submission

    bus, applied, submission = asyncio.run(scenario())
    assert [r.resumed_token_ids for r in bus.submitted] == [(), (5,)]
    assert [r.resumed_seq for r in bus.submitted] == [0, SEQ_EPOCH]
    assert bus.submitted[1].prompt == "Count:" and bus.submitted[1].request_id == "r"
    assert submission.choices[0].text == "one two" and submission.choices[0].is_finished
    assert not bus.aborted and not bus.collector.inboxes  # finished: nothing to abort, nothing held


def test_a_resume_for_a_client_that_left_is_dropped():
    from gateway.submission import Submission
    from shared.protocol import GenerateRequest

    async def scenario():
        bus = Bus()
        submission = Submission(bus, [GenerateRequest(request_id="r", reply_to=GATEWAY, prompt="x")])
        await submission.start()
        submission.cancel()
        submission.resume(Resume(request_id="r", token_ids=(5,), next_seq=SEQ_EPOCH))  # raced the departure
        submission.close()
        bus.collector.deliver(Resume(request_id="r", token_ids=(5,), next_seq=SEQ_EPOCH))  # after it
        await asyncio.sleep(0)
        return bus

    bus = asyncio.run(scenario())
    assert len(bus.submitted) == 1 and bus.aborted == [(("r",), "client disconnected")]
    assert bus.collector.num_dropped == 1
