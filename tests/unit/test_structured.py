"""Structured outputs against the real xgrammar and the default model's tokenizer: constraints on the
wire, grammars compiled off-thread and cached, matchers driven token by token to termination."""

from __future__ import annotations

import json
import random
import re
import threading

import pytest
import torch

from shared.codec import ProtocolError, from_plain, to_plain
from shared.structured import MAX_CHOICES, MAX_CONSTRAINT_CHARS, StructuredOutputs
from tests.fixtures.schemas import SCHEMAS

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from engine_svc.structured import (  # noqa: E402  (after the skips)
    GrammarCache, Matcher, allocate_bitmask, apply_bitmask, make_tokenizer_info,
)
from shared.grammar import choice_ebnf, validate_constraint  # noqa: E402

VOCAB_SIZE = 49152  # the default model's config.json
SHIFTS = torch.arange(32, dtype=torch.int32)


# --------------------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from shared.models import ModelNotFoundError, default_model_dir

    try:
        folder = default_model_dir()
    except ModelNotFoundError as exc:
        pytest.skip(f"default model absent: {exc}")
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def cache(tokenizer):
    cache = GrammarCache.from_tokenizer(tokenizer, VOCAB_SIZE, max_entries=64)
    yield cache
    cache.close()


def allowed_ids(bitmask: torch.Tensor, row: int) -> list[int]:
    bits = (bitmask[row].unsqueeze(-1) >> SHIFTS) & 1
    return bits.flatten()[:VOCAB_SIZE].nonzero().flatten().tolist()


def drive(matcher: Matcher, rng: random.Random | None = None, max_steps: int = 400,
          closers: tuple[int, ...] = ()) -> list[int]:
    """Generate until the matcher terminates: the lowest allowed id each step, or a random one
    (then, one step in three, the first allowed of `closers`, so unbounded grammars end)."""
    bitmask = allocate_bitmask(1, VOCAB_SIZE)
    token_ids = []
    for _ in range(max_steps):
        matcher.fill_bitmask(bitmask, 0)
        allowed = allowed_ids(bitmask, 0)
        closing = [t for t in closers if t in allowed] if rng is not None and rng.random() < 1 / 3 else []
        token_id = closing[0] if closing else allowed[0] if rng is None else rng.choice(allowed)
        assert matcher.accept(token_id)
        token_ids.append(token_id)
        if matcher.is_terminated():
            return token_ids
    raise AssertionError(f"no termination after {max_steps} tokens")


def generate(cache: GrammarCache, tokenizer, constraint: StructuredOutputs, rng: random.Random | None = None,
             closers: str = "") -> str:
    cache.submit(constraint).result(timeout=30)
    closer_ids = (tokenizer.eos_token_id, *(tokenizer.convert_tokens_to_ids(c) for c in closers))
    token_ids = drive(cache.matcher(constraint.key()), rng, closers=closer_ids)
    assert token_ids[-1] == tokenizer.eos_token_id  # the only stop token
    return tokenizer.decode(token_ids[:-1])


# --------------------------------------------------------------------------- StructuredOutputs


def test_wire_round_trip_and_key():
    schema = json.dumps(SCHEMAS["person"])
    cases = [StructuredOutputs(json=schema), StructuredOutputs(json=schema, disable_any_whitespace=True),
             StructuredOutputs(json_object=True), StructuredOutputs(regex=r"\d+"),
             StructuredOutputs(choice=("yes", "no")), StructuredOutputs(grammar='root ::= "a"')]
    for c in cases:
        wire = c.validate().to_wire()
        assert StructuredOutputs.from_wire(wire) == c
        assert from_plain(StructuredOutputs, to_plain(c), "so") == c  # the bus codec can carry it too
    keys = [c.key() for c in cases]
    assert len(set(keys)) == len(cases) and all(re.fullmatch(r"[0-9a-f]{64}", k) for k in keys)
    assert StructuredOutputs(json=schema).key() == keys[0]  # stable
    # whitespace freedom means nothing outside JSON
    assert StructuredOutputs(regex=r"\d+", disable_any_whitespace=True).key() == keys[3]
    assert StructuredOutputs(choice=("no", "yes")).key() != keys[4]
    assert cases[4].to_wire() == {"choice": ["yes", "no"]}


@pytest.mark.parametrize("kwargs, param", [
    ({}, "structured_outputs"),
    ({"regex": "a", "choice": ("a",)}, "structured_outputs"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"json": "[1, 2]"}, "structured_outputs.json"),
    ({"json": "x" * (MAX_CONSTRAINT_CHARS + 1)}, "structured_outputs.json"),
    ({"regex": ""}, "structured_outputs.regex"),
    ({"grammar": "  "}, "structured_outputs.grammar"),
    ({"choice": ()}, "structured_outputs.choice"),
    ({"choice": ("a", "")}, "structured_outputs.choice"),
    ({"choice": ("a",) * (MAX_CHOICES + 1)}, "structured_outputs.choice"),
    ({"choice": ("a" * (MAX_CONSTRAINT_CHARS // 2), "b" * (MAX_CONSTRAINT_CHARS // 2 + 1))},
     "structured_outputs.choice"),
])
def test_validate_names_the_parameter(kwargs, param):
    with pytest.raises(ProtocolError) as info:
        StructuredOutputs(**kwargs).validate()
    assert info.value.param == param and info.value.code == 400


@pytest.mark.parametrize("body", [
    [], {"json": 1}, {"regex": "a", "extra": 1}, {"choice": "ab"}, {"choice": [1]}, {"json_object": 1},
    {"regex": "a", "disable_any_whitespace": "yes"},
])
def test_from_wire_refuses_bad_bodies(body):
    with pytest.raises(ProtocolError):
        StructuredOutputs.from_wire(body)


@pytest.mark.parametrize("constraint, param", [
    (StructuredOutputs(json='{"type": "objectx"}'), "structured_outputs.json"),
    (StructuredOutputs(json='{"$ref": "#/$defs/missing"}'), "structured_outputs.json"),
    (StructuredOutputs(regex="(ab"), "structured_outputs.regex"),
    (StructuredOutputs(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
    (StructuredOutputs(grammar='start ::= "a"'), "structured_outputs.grammar"),  # no root rule
])
def test_validate_constraint_refuses_what_xgrammar_cannot_parse(constraint, param):
    with pytest.raises(ProtocolError) as info:
        validate_constraint(constraint)
    assert info.value.param == param
    assert "/project/" not in info.value.message and not info.value.message.startswith(f"{param}: [")


def test_validate_constraint_accepts_every_fixture_schema():
    for schema in SCHEMAS.values():
        validate_constraint(StructuredOutputs(json=json.dumps(schema)))
    validate_constraint(StructuredOutputs(choice=('a "quoted" one', "back\\slash", "new\nline", "é中")))


# --------------------------------------------------------------------------- generation obeys the constraint


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_lowest_id_walk_validates(cache, tokenizer, name):
    schema = SCHEMAS[name]
    for disable_any_whitespace in (False, True):
        text = generate(cache, tokenizer, StructuredOutputs(json=json.dumps(schema),
                                                            disable_any_whitespace=disable_any_whitespace))
        jsonschema.validate(json.loads(text), schema)
        assert "<|" not in text  # special tokens are never grammar text


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_random_walk_validates(cache, tokenizer, name):
    schema = SCHEMAS[name]
    constraint = StructuredOutputs(json=json.dumps(schema), disable_any_whitespace=True)  # else whitespace runs on
    for seed in range(3):
        text = generate(cache, tokenizer, constraint, random.Random(seed))
        # strict=False: xgrammar 0.2.9 lets a length-bounded string hold raw control characters
        # (its rule is [^"\\\r\n]), which JSON forbids and Python's strict parser refuses
        jsonschema.validate(json.loads(text, strict=False), schema)


def test_disable_any_whitespace_gives_compact_json(cache, tokenizer):
    constraint = StructuredOutputs(json=json.dumps(SCHEMAS["person"]), disable_any_whitespace=True)
    text = generate(cache, tokenizer, constraint, random.Random(1))
    outside_strings = re.sub(r'"(\\.|[^"\\])*"', '""', text)
    assert not re.search(r"\s", outside_strings)  # vLLM's separators: "," and ":" alone


def test_json_object_gives_an_object(cache, tokenizer):
    for constraint in (StructuredOutputs(json_object=True),
                       StructuredOutputs(json_object=True, disable_any_whitespace=True)):
        for seed in range(3):
            text = generate(cache, tokenizer, constraint, random.Random(seed), closers='"}]')
            value = json.loads(text, strict=False)
            assert isinstance(value, dict)


def test_regex_choice_and_grammar_are_obeyed(cache, tokenizer):
    pattern = r"[A-Z]{2}-\d{3}(x|yz)?"
    for seed in range(5):
        assert re.fullmatch(pattern, generate(cache, tokenizer, StructuredOutputs(regex=pattern), random.Random(seed)))
    choices = ('say "hi"', "back\\slash", "two\nlines", "é中", "[x]", "say")
    seen = {generate(cache, tokenizer, StructuredOutputs(choice=choices), random.Random(seed)) for seed in range(40)}
    assert seen <= set(choices) and len(seen) >= 3
    ebnf = 'root ::= "(" num (("+" | "*") num)* ")"\nnum ::= [1-9] [0-9]?'
    for seed in range(5):
        text = generate(cache, tokenizer, StructuredOutputs(grammar=ebnf), random.Random(seed))
        assert re.fullmatch(r"\([1-9][0-9]?([+*][1-9][0-9]?)*\)", text)


def test_choice_ebnf_escapes():
    assert choice_ebnf(('a"b', "c\\d", "e\nf")) == r'root ::= "a\"b" | "c\\d" | "e\nf"'


def test_special_tokens_are_never_allowed_but_eos_ends(tokenizer):
    info = make_tokenizer_info(tokenizer, VOCAB_SIZE)
    assert info.stop_token_ids == [tokenizer.eos_token_id]
    specials = sorted(i for i, t in tokenizer.added_tokens_decoder.items() if t.special and i != tokenizer.eos_token_id)
    assert info.special_token_ids == specials
    cache = GrammarCache(info)
    constraint = StructuredOutputs(regex=r"[^0-9]{0,3}")
    matcher = Matcher.start(cache.submit(constraint).result(timeout=30))
    bitmask = allocate_bitmask(1, VOCAB_SIZE)
    matcher.fill_bitmask(bitmask, 0)
    allowed = set(allowed_ids(bitmask, 0))
    assert tokenizer.eos_token_id in allowed and not allowed & set(specials)
    cache.close()


def test_padded_vocab_is_never_allowed(tokenizer):
    cache = GrammarCache.from_tokenizer(tokenizer, VOCAB_SIZE + 64)
    matcher = Matcher.start(cache.submit(StructuredOutputs(regex=r"[^0-9]*")).result(timeout=30))
    bitmask = allocate_bitmask(1, VOCAB_SIZE + 64)
    assert matcher.fill_bitmask(bitmask, 0)
    bits = ((bitmask[0].unsqueeze(-1) >> SHIFTS) & 1).flatten()
    assert bits[VOCAB_SIZE:].sum().item() == 0 and bits[:VOCAB_SIZE].sum().item() > 30000
    cache.close()


# --------------------------------------------------------------------------- matcher state


def test_rollback_then_reaccept_gives_the_same_state(cache, tokenizer):
    constraint = StructuredOutputs(json=json.dumps(SCHEMAS["nested_object"]), disable_any_whitespace=True)
    compiled = cache.submit(constraint).result(timeout=30)
    reference = drive(Matcher.start(compiled), random.Random(3))
    matcher = Matcher.start(compiled)
    assert matcher.accept_many(reference[:20]) == 20
    masks = allocate_bitmask(2, VOCAB_SIZE)
    matcher.fill_bitmask(masks, 0)
    matcher.rollback(7)
    assert matcher.num_tokens == 13
    matcher.fill_bitmask(masks, 1)
    assert not torch.equal(masks[0], masks[1])  # it really went back
    assert matcher.accept_many(reference[13:20]) == 7
    matcher.fill_bitmask(masks, 1)
    assert torch.equal(masks[0], masks[1])
    assert matcher.accept_many(reference[20:]) == len(reference) - 20 and matcher.is_terminated()
    with pytest.raises(ValueError):
        matcher.rollback(len(reference) + 1)
    assert matcher.accept(reference[0]) is False and matcher.num_tokens == len(reference)  # finished


def test_fork_is_independent(cache, tokenizer):
    constraint = StructuredOutputs(choice=("alpha", "beta"))
    parent = Matcher.start(cache.submit(constraint).result(timeout=30))
    child = parent.fork()
    alpha, beta = tokenizer.encode("alpha"), tokenizer.encode("beta")
    assert parent.accept_many(alpha) == len(alpha)
    assert child.num_tokens == 0 and child.accept_many(beta) == len(beta)
    assert parent.accept(tokenizer.eos_token_id) and parent.is_terminated()
    assert not child.is_terminated() and child.is_completed()
    grandchild = child.fork()
    assert child.accept(tokenizer.eos_token_id) and not grandchild.is_terminated()
    assert grandchild.num_tokens == len(beta)


def test_a_refused_token_leaves_the_state(cache, tokenizer):
    matcher = Matcher.start(cache.submit(StructuredOutputs(regex=r"\d\d")).result(timeout=30))
    assert not matcher.accept(tokenizer.encode("x")[0]) and matcher.num_tokens == 0
    assert not matcher.accept(tokenizer.eos_token_id)  # not complete yet
    assert matcher.accept_many(tokenizer.encode("4") + tokenizer.encode("2") + [tokenizer.eos_token_id]) == 3


# --------------------------------------------------------------------------- the cache


def test_cache_hits_evicts_lru_and_keeps_errors(tokenizer):
    cache = GrammarCache.from_tokenizer(tokenizer, VOCAB_SIZE, max_entries=2)
    a, b, c, d = (StructuredOutputs(regex=r) for r in ("a+", "b+", "c+", "d+"))
    fa = cache.submit(a)
    assert cache.submit(a) is fa
    fa.result(timeout=30)
    cache.submit(b).result(timeout=30)
    assert cache.poll(a.key()) is not None  # touches a: b is now the oldest
    cache.submit(c).result(timeout=30)
    cache.submit(d)  # eviction happens on insert, of finished entries only
    assert a.key() not in cache and b.key() not in cache and c.key() in cache and len(cache) == 2
    with pytest.raises(KeyError):
        cache.poll(b.key())
    bad = StructuredOutputs(regex="(unclosed")
    failed = cache.submit(bad)
    with pytest.raises(ProtocolError) as info:
        failed.result(timeout=30)
    assert info.value.param == "structured_outputs.regex"
    with pytest.raises(ProtocolError):
        cache.poll(bad.key())
    assert cache.submit(bad) is failed  # the next request with it fails at once
    cache.submit(d).result(timeout=30)
    assert cache.matcher(d.key()) is not None  # other requests are fine
    assert c.key() not in cache  # the failure took its place like any entry
    assert (cache.num_hits, cache.num_misses, cache.num_evictions, cache.num_errors) == (3, 5, 3, 1)
    cache.close()


def test_submit_never_waits_for_a_compile(tokenizer):
    gate = threading.Event()
    cache = GrammarCache.from_tokenizer(tokenizer, VOCAB_SIZE, max_entries=1)
    cache._pool.submit(gate.wait)  # occupy the only worker: every compile stays queued
    pending = [StructuredOutputs(regex=f"x{i}") for i in range(3)]
    for constraint in pending:
        cache.submit(constraint)
    assert all(cache.poll(c.key()) is None for c in pending)
    assert len(cache) == 3 and cache.num_evictions == 0  # nothing unfinished is evicted
    gate.set()
    cache.submit(pending[0]).result(timeout=30)
    cache.close()


# --------------------------------------------------------------------------- bitmask on logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_bitmask_touches_only_constrained_rows(cache, tokenizer, dtype):
    constraint = StructuredOutputs(choice=("yes", "no"))
    compiled = cache.submit(constraint).result(timeout=30)
    bitmask = allocate_bitmask(4, VOCAB_SIZE)
    for row in (1, 3):
        assert Matcher.start(compiled).fill_bitmask(bitmask, row)
    logits = torch.randn(4, VOCAB_SIZE, generator=torch.Generator().manual_seed(0)).to(dtype)
    before = logits.clone()
    apply_bitmask(logits, bitmask, [1, 3])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = allowed_ids(bitmask, 1)
    assert {tokenizer.decode([i]) for i in allowed} <= {"y", "ye", "yes", "n", "no"}
    for row in (1, 3):
        finite = torch.isfinite(logits[row]).nonzero().flatten().tolist()
        assert finite == allowed
        assert torch.equal(logits[row, allowed], before[row, allowed])
    apply_bitmask(logits, bitmask, [])  # no constrained rows: nothing to do
    assert torch.equal(logits[0], before[0])


def test_apply_bitmask_forbids_a_padded_logits_tail(cache):
    compiled = cache.submit(StructuredOutputs(regex="[a-z]")).result(timeout=30)
    bitmask = allocate_bitmask(2, VOCAB_SIZE)
    Matcher.start(compiled).fill_bitmask(bitmask, 0)
    logits = torch.zeros(2, VOCAB_SIZE + 32)
    apply_bitmask(logits, bitmask, [0])
    assert torch.isinf(logits[0, VOCAB_SIZE:]).all() and torch.equal(logits[1], torch.zeros(VOCAB_SIZE + 32))


def test_the_package_loads_xgrammar_only_when_asked():
    import subprocess
    import sys

    code = ("import sys, engine_svc.structured as s; assert 'xgrammar' not in sys.modules; "
            "s.Matcher; assert 'xgrammar' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
