"""Prefill/decode disaggregation in process: a prefill LLMEngine and a decode LLMEngine joined by a
real KV connector (a real redis-server, or files in /dev/shm), driven as the engine services drive
them (the prefill engine's hand-offs become the decode engine's requests). Greedy tokens equal a
unified (``both``) engine's; a spoiled entry (the connector's test hook: deleted, a flipped byte, a
foreign header) is recomputed to the same tokens and counted by reason; n > 1 and beam search stay
on the prefill engine; an abort between the two engines deletes the entry. After every test both
engines hold no block and no request, and no KV entry is left."""

from __future__ import annotations

import os
import random
import re
import tempfile

import pytest
import redis

from engine_svc import EngineConfig, LLMEngine
from engine_svc.kv_transfer import KVTransferConfig, make_connector
from shared.protocol import SamplingParams

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
MAX_TOKENS = 8


def make_engine(model_dir, dtype: str, role: str, client=None, prefix: str = "", kind: str = "redis",
                faults: str | None = None) -> LLMEngine:
    config = EngineConfig(model=str(model_dir), dtype=dtype, enforce_eager=True, kv_cache_memory=48 << 20,
                          max_model_len=512, max_num_batched_tokens=256)
    engine = LLMEngine(config, role=role)
    if role != "both":
        kv = KVTransferConfig(connector=kind, shm_dir=SHM_DIR, fault=faults)
        engine.connector = make_connector(kv, engine.runner.kv_caches, "model", prefix=prefix, client=client)
    return engine


def make_prompts(seed: int = 0, num: int = 16) -> list[list[int]]:
    """Lengths across block boundaries; the second half shares a 40-token prefix (prefix-cache hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 500) for _ in range(40)]
    prompts = [[rng.randrange(1, 500) for _ in range(rng.choice([3, 15, 16, 17, 33, 50]))] for _ in range(num // 2)]
    return prompts + [shared + [rng.randrange(1, 500) for _ in range(k + 1)] for k in range(num - num // 2)]


def unified(engine: LLMEngine, prompts, params, one_by_one: bool = False) -> list[list[list[int]]]:
    if one_by_one:
        return [unified(engine, [prompt], params)[0] for prompt in prompts]
    return [[out.token_ids for out in r.outputs] for r in engine.generate(prompts, params)]


def one_by_one(dtype: str) -> bool:
    """bfloat16 on the CPU rounds a matmul by the batch's shape: the unified engine's own greedy
    tokens differ between a prompt run alone and in a batch (2 of these 16 on the default model),
    and may differ between a prompt prefilled whole and one prefilled after a prefix-cache hit (its
    logprobs do, by ~0.01: a 1-token step's attention is the decode kernel's). So in bfloat16 both
    sides run the prompts one at a time, with the same prefix-cache hits: the same shapes step by step."""
    return dtype == "bfloat16"


class PD:
    """A prefill and a decode engine, stepped as their services would step them."""

    def __init__(self, prefill: LLMEngine, decode: LLMEngine):
        self.prefill, self.decode = prefill, decode
        self.num_handoffs = 0

    def run(self, prompts, params: SamplingParams, tag: str, between=None,
            one_by_one: bool = False) -> list[list[list[int]]]:
        if one_by_one:
            return [self.run([prompt], params, f"{tag}{i}", between)[0] for i, prompt in enumerate(prompts)]
        tokens: dict[str, dict[int, list[int]]] = {}
        seqs: dict[tuple[str, int], list[int]] = {}
        ids = [f"{tag}-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts):
            self.prefill.add_request(rid, prompt, params)
            tokens[rid] = {}
        by_id = dict(zip(ids, prompts))
        while self.prefill.has_work() or self.decode.has_work():
            deltas = self.prefill.step() if self.prefill.has_work() else []
            for h in self.prefill.take_handoffs():
                self.num_handoffs += 1
                if between is not None and between(h) == "abort":
                    self.prefill.drop_kv([h.kv_handle])  # what the prefill service does for an abort it sees
                    tokens.pop(h.request_id)
                    continue
                self.decode.add_request(h.request_id, by_id[h.request_id], params, resumed_token_ids=h.output_token_ids,
                                        resumed_seq=h.next_seq, kv_handle=h.kv_handle, num_kv_tokens=h.num_kv_tokens)
            if self.decode.has_work():
                deltas += self.decode.step()
            for d in deltas:
                if d.request_id in tokens:
                    tokens[d.request_id].setdefault(d.index, []).extend(d.new_token_ids)
                    seqs.setdefault((d.request_id, d.index), []).append(d.seq)
        for (rid, _), numbers in seqs.items():
            if rid in tokens and len(numbers) > 1:
                assert numbers == list(range(len(numbers))), f"{rid}: seqs {numbers}"
        return [[tokens[rid][i] for i in sorted(tokens[rid])] for rid in ids if rid in tokens]


def assert_engines_idle(*engines: LLMEngine) -> None:
    for engine in engines:
        stats = engine.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
        assert stats["num_requests"] == stats["num_running"] == stats["num_waiting"] == 0, stats


def leftovers(kind: str, client: redis.Redis, prefix: str) -> list:
    if kind == "redis":
        return list(client.scan_iter(f"{prefix}:kv:*"))
    return [n for n in os.listdir(SHM_DIR) if n.startswith(f"{prefix}-kv-")]


@pytest.fixture
def kv_client(redis_url):
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.mark.parametrize("dtype,kind", [("float32", "redis"), ("bfloat16", "redis"), ("float32", "shm")])
def test_pd_greedy_equals_unified_tiny(tiny_llama_dir, kv_client, prefix, dtype, kind):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = make_prompts()
    reference = make_engine(tiny_llama_dir, dtype, "both")
    expected = unified(reference, prompts, params, one_by_one(dtype))
    # the same engine again: every full prompt block is now a prefix-cache hit, so each prompt's
    # prefill is shorter -- the shapes of the P/D run's second pass below. float32 answers the same
    # whatever the shapes; bfloat16 need not (one_by_one), so each pass is compared with its own.
    expected_again = unified(reference, prompts, params, one_by_one(dtype))
    if dtype == "float32":
        assert expected_again == expected
    pd = PD(make_engine(tiny_llama_dir, dtype, "prefill", kv_client, prefix, kind),
            make_engine(tiny_llama_dir, dtype, "decode", kv_client, prefix, kind))
    assert pd.run(prompts, params, "a", one_by_one=one_by_one(dtype)) == expected
    hits_before = pd.prefill.stats()["prefix_cache_hits"]
    assert hits_before > 0  # the shared 40-token prefix: two full blocks per later prompt
    # again: now every full prompt block is a hit
    assert pd.run(prompts, params, "b", one_by_one=one_by_one(dtype)) == expected_again
    assert pd.prefill.stats()["prefix_cache_hits"] > hits_before
    stats = pd.decode.connector.stats
    assert (stats.num_loaded, stats.num_fallbacks, pd.prefill.connector.stats.num_saved) == (32, 0, 32)
    assert stats.bytes_loaded == pd.prefill.connector.stats.bytes_saved > 0
    assert_engines_idle(pd.prefill, pd.decode)
    assert leftovers(kind, kv_client, prefix) == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pd_greedy_equals_unified_default_model(default_model_dir, kv_client, prefix, dtype):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = make_prompts(seed=1)
    expected = unified(make_engine(default_model_dir, dtype, "both"), prompts, params, one_by_one(dtype))
    pd = PD(make_engine(default_model_dir, dtype, "prefill", kv_client, prefix),
            make_engine(default_model_dir, dtype, "decode", kv_client, prefix))
    assert pd.run(prompts, params, "a", one_by_one=one_by_one(dtype)) == expected
    assert pd.prefill.stats()["prefix_cache_hits"] > 0
    assert (pd.decode.connector.stats.num_loaded, pd.decode.connector.stats.num_fallbacks) == (16, 0)
    assert_engines_idle(pd.prefill, pd.decode)
    assert leftovers("redis", kv_client, prefix) == []


@pytest.mark.parametrize("kind", ["redis", "shm"])
def test_spoiled_entries_are_recomputed(tiny_llama_dir, kv_client, prefix, kind):
    """The test hook spoils the prefill engine's entries in turn: deleted, a flipped payload byte, a
    header for another block size. Each is refused, counted by reason and recomputed: same tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = make_prompts(seed=2, num=6)
    expected = unified(make_engine(tiny_llama_dir, "float32", "both"), prompts, params)
    pd = PD(make_engine(tiny_llama_dir, "float32", "prefill", kv_client, prefix, kind, faults="delete,flip,foreign"),
            make_engine(tiny_llama_dir, "float32", "decode", kv_client, prefix, kind))
    assert pd.run(prompts, params, "f") == expected
    stats = pd.decode.connector.stats
    assert (stats.num_loaded, stats.num_fallbacks) == (0, 6)
    assert stats.fallback_reasons == {"missing": 2, "corrupt": 2, "mismatch": 2}
    assert pd.decode.stats()["kv_num_fallbacks"] == 6.0
    assert_engines_idle(pd.prefill, pd.decode)
    assert leftovers(kind, kv_client, prefix) == []


def test_seeded_sampling_and_logprobs_go_on_across_the_handoff(tiny_llama_dir, kv_client, prefix):
    """A seeded request's decode engine skips the draw the prefill engine made: same tokens."""
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True,
                            repetition_penalty=1.2, logprobs=2)
    prompts = make_prompts(seed=3, num=4)
    expected = unified(make_engine(tiny_llama_dir, "float32", "both"), prompts, params)
    pd = PD(make_engine(tiny_llama_dir, "float32", "prefill", kv_client, prefix),
            make_engine(tiny_llama_dir, "float32", "decode", kv_client, prefix))
    assert pd.run(prompts, params, "s") == expected
    assert pd.decode.connector.stats.num_loaded == 4
    assert_engines_idle(pd.prefill, pd.decode)


@pytest.mark.parametrize("params", [
    SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True),
    SamplingParams(n=2, use_beam_search=True, temperature=0.0, max_tokens=MAX_TOKENS)],
                         ids=["n3", "beam"])
def test_n_and_beam_search_stay_on_the_prefill_engine(tiny_llama_dir, kv_client, prefix, params):
    prompts = make_prompts(seed=4, num=3)
    expected = unified(make_engine(tiny_llama_dir, "float32", "both"), prompts, params)
    pd = PD(make_engine(tiny_llama_dir, "float32", "prefill", kv_client, prefix),
            make_engine(tiny_llama_dir, "float32", "decode", kv_client, prefix))
    assert pd.run(prompts, params, "n") == expected
    assert pd.num_handoffs == 0 and pd.prefill.connector.stats.num_saved == 0
    assert_engines_idle(pd.prefill, pd.decode)


def test_abort_between_prefill_and_decode_leaves_nothing(tiny_llama_dir, kv_client, prefix):
    """Aborted after the hand-off, before the decode engine has it (the prefill side deletes the
    entry), or while it waits for its load (the decode side does): no entry, block or state left."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = make_prompts(seed=5, num=4)
    pd = PD(make_engine(tiny_llama_dir, "float32", "prefill", kv_client, prefix),
            make_engine(tiny_llama_dir, "float32", "decode", kv_client, prefix))
    seen = []

    def between(handoff):
        seen.append(handoff.request_id)
        assert leftovers("redis", kv_client, prefix)  # saved, not yet loaded
        if len(seen) == 1:
            return "abort"
        if len(seen) == 2:  # admitted by the decode engine, aborted before its load
            pd.decode.add_request(handoff.request_id, prompts[1], params, resumed_token_ids=handoff.output_token_ids,
                                  resumed_seq=handoff.next_seq, kv_handle=handoff.kv_handle,
                                  num_kv_tokens=handoff.num_kv_tokens)
            pd.decode.abort_request(handoff.request_id)
            assert not kv_client.exists(f"{prefix}:kv:{handoff.request_id}")  # deleted by the decode engine
            return "abort"
        return None

    outputs = pd.run(prompts, params, "x", between)
    assert len(outputs) == 2 and all(len(o[0]) == MAX_TOKENS for o in outputs)
    assert pd.decode.connector.stats.num_loaded == 2
    assert_engines_idle(pd.prefill, pd.decode)
    assert leftovers("redis", kv_client, prefix) == []


def test_structured_outputs_go_on_under_their_grammar_across_the_handoff(default_model_dir, kv_client, prefix):
    """The decode engine compiles the request's grammar, feeds it the first token, then loads."""
    from shared.structured import StructuredOutputs

    params = SamplingParams(temperature=0.0, max_tokens=20,
                            structured_outputs=StructuredOutputs(regex=r"\d{4}-\d{2}-\d{2} at \d{2}:\d{2}"))
    both = make_engine(default_model_dir, "float32", "both")
    prompts = [both.tokenizer.encode(p) for p in ("The meeting is on ", "Write a date and a time: ")]
    expected = unified(both, prompts, params)
    pd = PD(make_engine(default_model_dir, "float32", "prefill", kv_client, prefix),
            make_engine(default_model_dir, "float32", "decode", kv_client, prefix))
    assert pd.run(prompts, params, "g") == expected
    assert pd.decode.connector.stats.num_loaded == 2
    texts = [both.tokenizer.decode(o[0], skip_special_tokens=True) for o in expected]
    assert all(re.fullmatch(r"\d{4}-\d{2}-\d{2} at \d{2}:\d{2}", t) for t in texts), texts
    assert_engines_idle(pd.prefill, pd.decode)
