"""The byte-level fast detokenizer: its deltas join to exactly the Rust decode, never hold half a
character, and it is chosen only for tokenizers whose decode it reproduces."""

from __future__ import annotations

import random

import pytest

from detok_svc.incremental import (ByteLevelDetokenizer, IncrementalDetokenizer, _bytes_to_unicode,
                                   detokenizer_factory)
from tests.integration.tokenizers import build_bytelevel, build_llama_style

TEXTS = ["Hello world, the capital of France is Paris.", "中文字符 和 日本語 テキスト 🙂🚀 café",
         "def f(x):\n    return {'a': [x, 2.5e-3]}  # naïve\n\n\tdone", "Ünïcödé  \u00a0 spaces\r\n and ∑∫ 𝔘"]
# Added tokens whose bytes (read through GPT-2's table) run into their neighbours' bytes: "aÃ"
# ends in a lead byte, "©b" starts with a continuation byte, "đem" reads as "\x11em".
EXTRA_ADDED = ["é中", "Ġhi", "đem", "aÃ", "©b"]
EXTRA_SPECIAL = ["<sp>", "<Ã>", "Ġthe"]


@pytest.fixture(scope="module")
def default_tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def _wrap(backend, **kwargs):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False, **kwargs)


def _with_extra_added(tokenizer):
    """The default tokenizer plus added tokens, special and not, some of them sharing a vocab id."""
    from tokenizers import AddedToken, Tokenizer

    backend = Tokenizer.from_str(tokenizer._tokenizer.to_str())
    backend.add_tokens([AddedToken(t, special=False) for t in EXTRA_ADDED])
    backend.add_special_tokens([AddedToken(t, special=True) for t in EXTRA_SPECIAL])
    return _wrap(backend)


@pytest.fixture(scope="module", params=["default", "extra-added", "tiny-bytelevel"])
def bytelevel_tokenizer(request, default_tokenizer, tmp_path_factory):
    from transformers import AutoTokenizer

    if request.param == "default":
        return default_tokenizer
    if request.param == "extra-added":
        return _with_extra_added(default_tokenizer)
    return AutoTokenizer.from_pretrained(build_bytelevel(tmp_path_factory.mktemp("tok-bytelevel")))


def _byte_ids(tokenizer) -> dict[int, int]:
    """byte -> the id of the token that is that one byte, where the vocab has one."""
    table = _bytes_to_unicode()
    ids = {b: tokenizer._tokenizer.token_to_id(table[b]) for b in range(256)}
    return {b: i for b, i in ids.items() if i is not None}


def _random_ids(tokenizer, rng: random.Random) -> list[int]:
    """Any id of the vocab (added and special ones too, and a few decode drops), with multi-byte
    characters spelt one byte per token, whole or cut, and stray single bytes."""
    byte_ids = _byte_ids(tokenizer)
    chars = [[byte_ids[b] for b in c.encode()] for c in "é中🙂語" if all(b in byte_ids for b in c.encode())]
    num_added = max(tokenizer._tokenizer.get_added_tokens_decoder()) + 1
    ids: list[int] = []
    for _ in range(rng.randrange(1, 40)):
        roll = rng.random()
        if roll < 0.25:
            char = rng.choice(chars)
            ids += char if rng.random() < 0.7 else char[:rng.randrange(1, len(char) + 1)]
        elif roll < 0.35:
            ids.append(rng.choice(list(byte_ids.values())))
        elif roll < 0.5:
            ids.append(rng.randrange(num_added))
        elif roll < 0.52:
            ids.append(rng.choice([len(tokenizer), len(tokenizer) + 7, 2**32 - 1]))  # decode drops these
        else:
            ids.append(rng.randrange(len(tokenizer)))
    return ids


def _stream(detok, ids: list[int], rng: random.Random, reference=None) -> list[str]:
    """Push ids 1..4 at a time (engines may send several); with ``reference`` (the full decode),
    check after each push that the text so far is its prefix and that of what the ids so far decode
    to, only an unfinished character is held back (one U+FFFD there; two for the first two bytes of
    a UTF-16 surrogate, ED A0..BF, which CPython's decoder waits on before rejecting)."""
    deltas, i = [], 0
    while i < len(ids):
        k = rng.randrange(1, 5)
        deltas.append(detok.push(ids[i:i + k]))
        i += k
        if reference is not None:
            emitted, so_far = "".join(deltas), reference(ids[:i])
            assert reference(ids).startswith(emitted)
            assert so_far.startswith(emitted) and so_far[len(emitted):] in ("", "\ufffd", "\ufffd" * 2), so_far
    return deltas + [detok.finish()]


def test_fast_path_is_chosen_for_byte_level(bytelevel_tokenizer):
    new = detokenizer_factory(bytelevel_tokenizer)
    assert isinstance(new(True), ByteLevelDetokenizer) and isinstance(new(False), ByteLevelDetokenizer)


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_join_to_decode_and_stream_whole_characters(bytelevel_tokenizer, skip):
    new = detokenizer_factory(bytelevel_tokenizer)
    backend = bytelevel_tokenizer._tokenizer
    reference = lambda ids: backend.decode(ids, skip_special_tokens=skip)  # noqa: E731
    rng = random.Random(1234 + skip)
    for _ in range(40):
        ids = _random_ids(bytelevel_tokenizer, rng)
        detok = new(skip)
        deltas = _stream(detok, ids, rng, reference)
        full = reference(ids)
        assert "".join(deltas) == full == detok.text == bytelevel_tokenizer.decode(ids, skip_special_tokens=skip)
        for delta in deltas:
            delta.encode("utf-8")  # real text: raises on a lone surrogate


@pytest.mark.parametrize("text", TEXTS)
def test_real_text_round_trips(default_tokenizer, text):
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    detok = detokenizer_factory(default_tokenizer)(True)
    deltas = [detok.push([t]) for t in ids] + [detok.finish()]
    assert "".join(deltas) == text == detok.text
    assert all("\ufffd" not in d for d in deltas)
    assert sum(1 for d in deltas if d) > len(ids) // 2  # it streamed, not one lump at the end


def test_chat_template_with_special_tokens(default_tokenizer):
    messages = [{"role": "user", "content": "Bonjour, ça va ? 🙂"}, {"role": "assistant", "content": "中文 ok"}]
    text = default_tokenizer.apply_chat_template(messages, tokenize=False)
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    new = detokenizer_factory(default_tokenizer)
    for skip in (True, False):
        detok = new(skip)
        out = "".join(detok.push([t]) for t in ids) + detok.finish()
        assert out == default_tokenizer.decode(ids, skip_special_tokens=skip)
        assert ("<|im_start|>" in out) is (not skip)
    assert out == text


def test_ids_decode_cannot_take_raise_as_decode_does(default_tokenizer):
    detok = detokenizer_factory(default_tokenizer)(True)
    for bad in (-1, 2**32):
        with pytest.raises(OverflowError):
            default_tokenizer._tokenizer.decode([bad])
        with pytest.raises(OverflowError):
            detok.push([bad])


def test_a_token_added_after_the_tables_is_refused(default_tokenizer):
    tokenizer = _with_extra_added(default_tokenizer)
    detok = detokenizer_factory(tokenizer)(True)
    tokenizer.add_tokens(["<late>"])
    with pytest.raises(ValueError):
        detok.push([tokenizer.convert_tokens_to_ids("<late>")])
    assert detok.push([len(tokenizer) + 5]) == ""  # an id decode drops is still dropped


def test_added_tokens_join_the_byte_run(default_tokenizer):
    """What tokenizers does (and the fast path relies on, checking it when it builds its tables):
    added tokens, special or not, are read through the ByteLevel table together with their
    neighbours, so an unfinished character runs into them; a skipped special token is dropped from
    the run without cutting it."""
    tokenizer = _with_extra_added(default_tokenizer)
    backend, byte_ids = tokenizer._tokenizer, _byte_ids(tokenizer)
    lead, cont = byte_ids[0xC3], byte_ids[0xA9]
    assert backend.decode([lead, backend.token_to_id("©b")]) == "éb"
    assert backend.decode([backend.token_to_id("aÃ"), cont]) == "aé"
    assert backend.decode([backend.token_to_id("đem")]) == "\x11em"
    sp = backend.token_to_id("<sp>")
    assert backend.decode([lead, sp, cont], skip_special_tokens=True) == "é"
    assert backend.decode([lead, sp, cont], skip_special_tokens=False) == "\ufffd<sp>\ufffd"


def test_other_decoders_fall_back(default_tokenizer, default_model_dir):
    from tokenizers import Tokenizer, decoders
    from transformers import AutoTokenizer

    sequence = Tokenizer.from_str(default_tokenizer._tokenizer.to_str())
    sequence.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Strip(" ", 1, 0)])
    cleans_up = AutoTokenizer.from_pretrained(default_model_dir, clean_up_tokenization_spaces=True)
    for tokenizer in (_wrap(sequence), cleans_up):
        assert type(detokenizer_factory(tokenizer)(True)) is IncrementalDetokenizer


def test_sentencepiece_byte_fallback_takes_the_general_path(tmp_path_factory):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_llama_style(tmp_path_factory.mktemp("tok-llama")))
    new = detokenizer_factory(tokenizer)
    assert type(new(True)) is IncrementalDetokenizer
    # ByteFallback turns a broken run of byte tokens into one U+FFFD per byte, which no incremental
    # decoder agrees with: byte tokens come as whole characters (as in test_detok.py).
    byte_ids = {tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)}
    pool = [i for i in range(len(tokenizer)) if i not in byte_ids]
    chars = [[tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in c.encode()] for c in "é中🙂語"]
    rng = random.Random(7)
    for skip in (True, False):
        for _ in range(20):
            ids = [i for _ in range(rng.randrange(1, 30))
                   for i in (rng.choice(chars) if rng.random() < 0.2 else [rng.choice(pool)])]
            detok = new(skip)
            assert "".join(_stream(detok, ids, rng)) == tokenizer.decode(ids, skip_special_tokens=skip) == detok.text
