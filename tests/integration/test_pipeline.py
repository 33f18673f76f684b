"""tokenizer -> engine -> detok on a real redis-server with a tiny model (no gateway).

The services run in threads of this process, each with its own Redis connections. Output
must equal the in-process LLMEngine's greedy output, and every test ends idle: no pending
entries, no request state, every KV block free (as the heartbeats report it too).
"""

from __future__ import annotations

import threading
import time

import pytest

from detok_svc.processor import DetokProcessor
from detok_svc.service import DetokService
from engine_svc import EngineConfig, LLMEngine
from engine_svc.service import EngineService
from shared.config import BusConfig, DetokConfig, EngineServiceConfig, TokenizerConfig
from shared.protocol import (Abort, Admission, ChatMessage, DetokParams, EngineRequest, FinishReason, GenerateRequest,
                             SamplingParams, StreamNames, detok_shard)
from shared.heartbeat import read_heartbeats
from shared.models import load_tokenizer
from shared.streams import Producer, StreamReader, connect
from tokenizer_svc.prompts import PromptEncoder
from tokenizer_svc.service import TokenizerService

MAX_MODEL_LEN = 256
NUM_SHARDS = 2


def _engine_config(model_dir) -> EngineConfig:
    return EngineConfig(enforce_eager=True, model=str(model_dir), device="cpu", dtype="float32", kv_cache_memory=4 << 20,
                        max_model_len=MAX_MODEL_LEN, max_num_seqs=8, attention_backend="torch")


@pytest.fixture(scope="module")
def reference_engine(tiny_llama_dir):
    return LLMEngine(_engine_config(tiny_llama_dir))


class Pipeline:
    """The three services in threads on one prefix, plus a gateway-side reader of the reply stream."""

    def __init__(self, redis_url: str, prefix: str, model_dir, tokenizer):
        bus = BusConfig(redis_url=redis_url, prefix=prefix)
        self.names = StreamNames(prefix)
        self.client = connect(redis_url)
        self.tokenizer = TokenizerService(
            TokenizerConfig(bus=bus, service_id="tok-0", block_ms=50, heartbeat_s=0.05),
            PromptEncoder(tokenizer, MAX_MODEL_LEN, self.names), client=connect(redis_url))
        self.engine = EngineService(
            EngineServiceConfig(bus=bus, num_detok_shards=NUM_SHARDS, service_id="engine-0", idle_block_ms=50,
                                heartbeat_s=0.05),
            LLMEngine(_engine_config(model_dir)), client=connect(redis_url))
        self.detoks = [DetokService(DetokConfig(bus=bus, shard=k, num_detok_shards=NUM_SHARDS,
                                                service_id=f"detok-{k}", block_ms=50, heartbeat_s=0.05),
                                    DetokProcessor(tokenizer, self.names), client=connect(redis_url))
                       for k in range(NUM_SHARDS)]
        self.reply_to = self.names.gateway_out("g0")
        self.replies = StreamReader(self.client, self.reply_to, start="0-0")
        self.services = [self.tokenizer, self.engine, *self.detoks]
        self.threads = [threading.Thread(target=s.run, daemon=True) for s in self.services]

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        for s in self.services:
            s.stop()
        for t in self.threads:
            t.join(10)

    def submit(self, requests: list[GenerateRequest]) -> None:
        Producer(self.client).send_many((self.names.tokenizer_in, r) for r in requests)

    def collect(self, request_ids, timeout_s: float = 120.0, until=None) -> dict:
        """request_id -> {index: [RequestOutput...]} until every choice of every request finished."""
        outputs: dict[str, dict[int, list]] = {rid: {} for rid in request_ids}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for env in self.replies.read(count=512, block_ms=100):
                out = env.msg
                outputs[out.request_id].setdefault(out.index, []).append(out)
                if until is not None:
                    until(out)
            if all(_done(o) for o in outputs.values()):
                return outputs
        raise TimeoutError(f"unfinished: {[r for r, o in outputs.items() if not _done(o)]}")

    def assert_idle(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            problems = self.idle_problems()
            if not problems or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert problems == []

    def idle_problems(self) -> list[str]:
        problems = []
        stats = self.engine.engine.stats()
        if stats["num_free_blocks"] != stats["num_total_blocks"] or stats["num_requests"]:
            problems.append(f"engine: {stats}")
        for d in self.detoks:
            if d.processor.requests:
                problems.append(f"detok {d.config.shard}: {list(d.processor.requests)}")
        for stream, group in [(self.names.tokenizer_in, "tokenizer"), (self.names.engine_in, "engine")] + \
                [(self.names.detok_in(k), "detok") for k in range(NUM_SHARDS)]:
            pending = self.client.xpending(stream, group)["pending"]
            if pending:
                problems.append(f"{stream}/{group}: {pending} pending")
        beat = read_heartbeats(self.client, self.names.heartbeat).get("engine-0")
        if beat is None or beat.stats["num_free_blocks"] != beat.stats["num_total_blocks"] or \
                beat.stats["num_requests"]:
            problems.append(f"engine heartbeat: {beat}")
        return problems


def _done(choices: dict) -> bool:
    if any(o.error is not None for outs in choices.values() for o in outs):
        return True
    if not choices:
        return False
    num = next(iter(choices.values()))[0].num_choices
    return len(choices) == num and all(outs[-1].finish_reason is not None for outs in choices.values())


def _text(outs) -> str:
    return "".join(o.text_delta for o in outs)


def _ids(outs) -> list[int]:
    return [t for o in outs for t in o.token_ids]


@pytest.fixture
def pipeline(redis_url, prefix, tiny_llama_dir):
    with Pipeline(redis_url, prefix, tiny_llama_dir, load_tokenizer(str(tiny_llama_dir))) as p:
        yield p


PROMPTS = ["Hello world", "The capital of France is", "Once upon a time, 中文 and 🙂", "1, 2, 3,"]


def test_greedy_output_equals_the_in_process_engine(pipeline, reference_engine):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = reference_engine.generate(PROMPTS, params)
    requests = [GenerateRequest(request_id=f"r{i}", reply_to=pipeline.reply_to, prompt=p, sampling=params)
                for i, p in enumerate(PROMPTS)]
    pipeline.submit(requests)
    got = pipeline.collect([r.request_id for r in requests])
    for i, ref in enumerate(expected):
        (outs,) = got[f"r{i}"].values()
        assert _ids(outs) == ref.outputs[0].token_ids
        assert _text(outs) == ref.outputs[0].text
        final = outs[-1]
        assert final.finish_reason == FinishReason.LENGTH
        assert final.usage.prompt_tokens == len(ref.prompt_token_ids) and final.usage.completion_tokens == 12
    pipeline.assert_idle()


def test_chat_n2_logprobs_and_a_stop_string(pipeline, reference_engine):
    tok = reference_engine.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    (ref,) = reference_engine.generate(["The capital of France is"], params)
    ids = ref.outputs[0].token_ids
    cut = len(tok.decode(ids[:5], skip_special_tokens=True))
    stop = ref.outputs[0].text[cut - 2:cut + 3]  # spans the 5th/6th tokens
    messages = (ChatMessage(role="user", content="What is the capital of France?"),)
    requests = [
        GenerateRequest(request_id="stop", reply_to=pipeline.reply_to, prompt="The capital of France is",
                        sampling=SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=(stop,))),
        GenerateRequest(request_id="chat", reply_to=pipeline.reply_to, messages=messages,
                        sampling=SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=6, logprobs=2)),
    ]
    pipeline.submit(requests)
    got = pipeline.collect(["stop", "chat"])
    (stop_outs,) = got["stop"].values()
    assert _text(stop_outs) == ref.outputs[0].text[:ref.outputs[0].text.index(stop)]
    assert stop_outs[-1].finish_reason == FinishReason.STOP and stop_outs[-1].stop_reason == stop
    assert sorted(got["chat"]) == [0, 1]
    for outs in got["chat"].values():
        logprobs = [lp for o in outs for lp in o.logprobs]
        assert [lp.token_id for lp in logprobs] == _ids(outs) and len(logprobs) <= 6
        assert all(len(lp.top_tokens) == 2 for lp in logprobs)
    finals = [outs[-1] for outs in got["chat"].values()]
    assert sum(f.usage is not None for f in finals) == 1
    pipeline.assert_idle()  # the stop string aborted the engine's request: its blocks are free


def test_errors_and_an_abort_leave_nothing_behind(pipeline):
    long = GenerateRequest(request_id="long", reply_to=pipeline.reply_to, prompt="Hello",
                           sampling=SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    too_long = GenerateRequest(request_id="too-long", reply_to=pipeline.reply_to, prompt="Hello " * 300)
    bad = GenerateRequest(request_id="bad", reply_to=pipeline.reply_to, prompt_token_ids=(1, 2),
                          sampling=SamplingParams(max_tokens=MAX_MODEL_LEN))
    pipeline.submit([long, too_long, bad])
    sent_abort = []

    def abort_after_first_token(out):
        if out.request_id == "long" and not sent_abort:
            Producer(pipeline.client).send(pipeline.names.engine_ctl, Abort(request_ids=("long",)))
            sent_abort.append(True)

    got = pipeline.collect(["long", "too-long", "bad"], until=abort_after_first_token)
    (outs,) = got["long"].values()
    assert outs[-1].finish_reason == FinishReason.ABORT and len(_ids(outs)) < 200
    for rid in ("too-long", "bad"):
        (outs,) = got[rid].values()
        assert outs[-1].error.code == 400 and outs[-1].finish_reason == FinishReason.ERROR
    pipeline.assert_idle()


def test_redelivered_engine_request_is_admitted_once(pipeline, reference_engine):
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    request = GenerateRequest(request_id="dup", reply_to=pipeline.reply_to, prompt="Hello world", sampling=params)
    pipeline.submit([request, request])  # at-least-once: the same request twice
    got = pipeline.collect(["dup"])
    (outs,) = got["dup"].values()
    (ref,) = reference_engine.generate(["Hello world"], params)
    assert _ids(outs) == ref.outputs[0].token_ids
    time.sleep(0.3)
    assert [e for e in pipeline.replies.read(count=100) if e.msg.request_id == "dup"] == []
    pipeline.assert_idle()


def test_abort_of_an_n3_request_finishes_every_choice(pipeline):
    request = GenerateRequest(request_id="n3", reply_to=pipeline.reply_to, prompt="Hello",
                              sampling=SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=200, ignore_eos=True))
    pipeline.submit([request])
    deadline = time.monotonic() + 30
    while not pipeline.engine.engine.has_request("n3"):  # admitted (an earlier abort would drop it unadmitted)
        assert time.monotonic() < deadline
        time.sleep(0.005)
    Producer(pipeline.client).send(pipeline.names.engine_ctl, Abort(request_ids=("n3",)))
    got = pipeline.collect(["n3"])
    assert sorted(got["n3"]) == [0, 1, 2]
    assert all(outs[-1].finish_reason == FinishReason.ABORT for outs in got["n3"].values())
    pipeline.assert_idle()


def test_an_abort_that_overtakes_its_request_closes_it_unadmitted(pipeline):
    Producer(pipeline.client).send(pipeline.names.engine_ctl, Abort(request_ids=("early",)))
    deadline = time.monotonic() + 30
    while "early" not in pipeline.engine.aborted:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    pipeline.submit([GenerateRequest(request_id="early", reply_to=pipeline.reply_to, prompt="Hello",
                                     sampling=SamplingParams(max_tokens=50))])
    got = pipeline.collect(["early"])
    (outs,) = got["early"].values()
    assert [o.finish_reason for o in outs] == [FinishReason.ABORT] and outs[0].token_ids == ()
    pipeline.assert_idle()


def test_admission_announces_the_request_and_its_engine(redis_url, prefix, tiny_llama_dir):
    bus = BusConfig(redis_url=redis_url, prefix=prefix)
    engine = LLMEngine(_engine_config(tiny_llama_dir))
    service = EngineService(EngineServiceConfig(bus=bus, num_detok_shards=NUM_SHARDS, service_id="engine-7"),
                            engine, client=connect(redis_url))
    request = EngineRequest(request_id="ann", reply_to="g:out", prompt_token_ids=(1, 2, 3),
                            sampling=SamplingParams(n=2, max_tokens=4), detok=DetokParams(stop=("x",)))
    ((stream, admission),) = service.admit(request)
    assert stream == StreamNames(prefix).detok_in(detok_shard("ann", NUM_SHARDS))
    assert admission == Admission(request_id="ann", num_choices=2, engine_id="engine-7", reply_to="g:out",
                                  detok=request.detok)
    assert service.admit(request) == []  # a re-delivery announces nothing again
    engine.abort_request(["ann"])
    engine.step()
    assert engine.stats()["num_requests"] == 0


def test_a_starting_engine_applies_recent_aborts(redis_url, prefix, tiny_llama_dir):
    """An Abort sent before this engine started (its request never admitted anywhere: an engine
    claiming a dead one's entries would otherwise run it for a client that left) is applied."""
    bus = BusConfig(redis_url=redis_url, prefix=prefix)
    names = StreamNames(prefix)
    Producer(connect(redis_url)).send(names.engine_ctl, Abort(request_ids=("gone",)))
    service = EngineService(EngineServiceConfig(bus=bus, service_id="engine-late"),
                            LLMEngine(_engine_config(tiny_llama_dir)), client=connect(redis_url))
    service.apply_aborts(service.from_ctl.read(count=1024))
    assert "gone" in service.aborted
    request = EngineRequest(request_id="gone", reply_to="g:out", prompt_token_ids=(1, 2, 3))
    ((_, out),) = service.admit(request)
    assert out.finish_reason == FinishReason.ABORT and service.engine.stats()["num_requests"] == 0
    fresh = EngineService(EngineServiceConfig(bus=bus, service_id="engine-new", ctl_lookback_s=0.0),
                          service.engine, client=connect(redis_url))
    time.sleep(0.01)
    assert fresh.from_ctl.read(count=1024) == []  # no lookback: only what comes after the start
