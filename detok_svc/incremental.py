"""Incremental detokenization: token ids in, text deltas out, never half a character.

The algorithm is vLLM's: decode a short window of tokens that starts at ``prefix_offset``
(context for tokenizers whose text depends on the previous token, e.g. SentencePiece's leading
space) and emit what lies beyond the text of ``ids[prefix_offset:read_offset]``. A window whose
text ends in U+FFFD is an unfinished UTF-8 sequence (byte-level BPE, byte fallback): hold it
back until the next token completes it. ``finish()`` settles the rest so that the concatenated
deltas equal ``tokenizer.decode(all ids)``. No Redis here.

Byte-level BPE (GPT-2 style) gets a fast path with the same output and no decode call per token:
each id's bytes are looked up once per tokenizer and fed to an incremental UTF-8 decoder.
``detokenizer_factory`` picks the path for a tokenizer.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Callable, Sequence
from functools import cache, lru_cache

import tokenizers
import tokenizers.decoders

REPLACEMENT = "\ufffd"
METASPACE = "\u2581"
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def text_decoder(tokenizer) -> Callable[[Sequence[int], bool], str]:
    """``decode(ids, skip_special_tokens)`` for a tokenizer: its Rust backend called directly
    when that is all ``tokenizer.decode`` would do (a fast tokenizer that cleans up no spaces),
    which costs a third of the HF wrapper's per-call overhead; else ``tokenizer.decode``."""
    backend = _rust_backend(tokenizer)
    if backend is not None:
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


def _rust_backend(tokenizer) -> tokenizers.Tokenizer | None:
    """The Rust tokenizer whose decode is exactly ``tokenizer.decode``, if there is one."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if isinstance(backend, tokenizers.Tokenizer) and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return backend
    return None


def detokenizer_factory(tokenizer) -> Callable[[bool], IncrementalDetokenizer | ByteLevelDetokenizer]:
    """``new(skip_special_tokens)`` makes one sequence's detokenizer: the byte-level fast path where
    the tokenizer's decode is plain GPT-2 byte-level (checked against decode itself), else vLLM's."""
    tables = ByteLevelTables.build(tokenizer)
    if tables is not None:
        return lambda skip: ByteLevelDetokenizer(tables.pieces[skip], tables.check_id)
    decode = text_decoder(tokenizer)
    return lambda skip: IncrementalDetokenizer(tokenizer, skip_special_tokens=skip, decode=decode)


class IncrementalDetokenizer:
    """Owns one sequence's output token ids and how much of their text has been emitted."""

    def __init__(self, tokenizer, *, skip_special_tokens: bool = True,
                 decode: Callable[[Sequence[int], bool], str] | None = None):
        self.decode = decode or text_decoder(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # everything emitted so far

    def _decode(self, ids: Sequence[int]) -> str:
        return self.decode(ids, self.skip_special_tokens) if ids else ""

    def push(self, new_token_ids: Sequence[int]) -> str:
        """Add tokens; return the text they complete (possibly "")."""
        self.token_ids.extend(new_token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        window_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(window_text) <= len(prefix_text) or window_text.endswith(REPLACEMENT):
            return ""  # nothing new, or an unfinished multi-byte character: wait for more
        delta = window_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def finish(self) -> str:
        """The last delta: whatever decode(all ids) holds beyond what was emitted (held-back bytes too)."""
        full = self._decode(self.token_ids)
        if full.startswith(self.text):
            delta = full[len(self.text):]
        else:  # a tokenizer whose window text disagrees with the full decode: emit the window's rest
            prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
            delta = self._decode(self.token_ids[self.prefix_offset:])[len(prefix_text):]
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.text += delta
        return delta


class ByteLevelTables:
    """Owns, per token id and ``skip_special_tokens`` value, the bytes decode reads for that id: as
    ``str`` where they are whole characters, else ``bytes``; ``b""`` for a skipped special token or
    an id decode drops. Decode of a byte-level tokenizer is then the lossy UTF-8 decoding of the
    joined bytes, added tokens included (tokenizers 0.23 runs them through the ByteLevel decoder
    with their neighbours); ``build`` checks that against decode itself and declines where it
    fails. An id added to the tokenizer afterwards is refused (ValueError)."""

    def __init__(self, pieces: dict[bool, list[str | bytes]], check_id: Callable[[int], object]):
        self.pieces = pieces
        self.check_id = check_id  # decode([id]): raises where decode would, "" where it drops the id

    @classmethod
    def build(cls, tokenizer) -> ByteLevelTables | None:
        backend = _rust_backend(tokenizer)
        if backend is None or not isinstance(backend.decoder, tokenizers.decoders.ByteLevel):
            return None
        added = backend.get_added_tokens_decoder()
        raw = _model_bytes(backend, added)
        if raw is None:
            return None
        probes = {r: i for i, r in enumerate(raw) if r in (b"\xc3", b"\xa9", b"\x8f") and i not in added}
        for token_id, token in added.items():
            raw[token_id] = _token_bytes(token.content)
        if len(probes) < 3 or not all(_joins_the_run(backend, raw, probes, i, t.special) for i, t in added.items()):
            return None
        kept = [_piece(r) for r in raw]
        skipped = [b"" if i in added and added[i].special else piece for i, piece in enumerate(kept)]
        return cls({False: kept, True: skipped}, lambda token_id: backend.decode([token_id], skip_special_tokens=False))


def _model_bytes(backend: tokenizers.Tokenizer, added: dict) -> list[bytes] | None:
    """Each model token's bytes, b"" for ids decode drops; None unless decoding the whole vocab in
    one call agrees with them, which is what makes the tables trustworthy."""
    vocab = backend.get_vocab(with_added_tokens=False)
    raw = [b""] * (max([*vocab.values(), *added, -1]) + 1)
    for token, token_id in vocab.items():
        raw[token_id] = _token_bytes(token)
    model_ids = [i for i in vocab.values() if i not in added]
    expected = b"".join(raw[i] for i in model_ids).decode("utf-8", errors="replace")
    return raw if backend.decode(model_ids, skip_special_tokens=False) == expected else None


def _token_bytes(token: str) -> bytes:
    """What the ByteLevel decoder reads a token as: GPT-2's table, or its UTF-8 where a character
    lies outside the table."""
    try:
        return bytes(map(_unicode_to_byte().__getitem__, token))
    except KeyError:
        return token.encode()


def _piece(raw: bytes) -> str | bytes:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw


def _joins_the_run(backend: tokenizers.Tokenizer, raw: list[bytes], probes: dict[bytes, int], token_id: int,
                   is_special: bool) -> bool:
    """Does decode read an added token as its bytes, joined with its neighbours' (the first half of
    "é" before it, a continuation byte after it), and does skip_special_tokens drop a special one
    from the run? Two continuation bytes, as no one of them can follow every lead byte."""
    if backend.decode([token_id], skip_special_tokens=False) != raw[token_id].decode("utf-8", errors="replace"):
        return False
    for cont in (b"\xa9", b"\x8f"):
        ids = [probes[b"\xc3"], token_id, probes[cont]]
        kept = (b"\xc3" + raw[token_id] + cont).decode("utf-8", errors="replace")
        dropped = (b"\xc3" + cont).decode("utf-8", errors="replace") if is_special else kept
        if [backend.decode(ids, skip_special_tokens=skip) for skip in (False, True)] != [kept, dropped]:
            return False
    return True


class ByteLevelDetokenizer:
    """Owns one sequence's undecoded bytes (an unfinished UTF-8 character) and the deltas emitted;
    the deltas always join to exactly ``decode(all ids)`` up to those bytes, which ``finish()``
    settles."""

    __slots__ = ("_pieces", "_check_id", "_pending", "_deltas")

    def __init__(self, pieces: list[str | bytes], check_id: Callable[[int], object]):
        self._pieces = pieces
        self._check_id = check_id
        self._pending = b""
        self._deltas: list[str] = []

    @property
    def text(self) -> str:
        """Everything emitted so far (joined on demand, so a push costs the same at any length)."""
        return "".join(self._deltas)

    def push(self, new_token_ids: Sequence[int]) -> str:
        """Add tokens; return the text they complete (possibly "")."""
        pieces, num_ids = self._pieces, len(self._pieces)
        delta = ""
        for token_id in new_token_ids:
            piece = pieces[token_id] if 0 <= token_id < num_ids else self._outside(token_id)
            if piece.__class__ is str and not self._pending:
                delta += piece  # whole characters and nothing pending: the common case
            else:
                delta += self._add(piece)
        if delta:
            self._deltas.append(delta)
        return delta

    def finish(self) -> str:
        """The last delta: the pending bytes, settled as decode settles them (U+FFFD)."""
        delta = codecs.utf_8_decode(self._pending, "replace", True)[0]
        self._pending = b""
        if delta:
            self._deltas.append(delta)
        return delta

    def _add(self, piece: str | bytes) -> str:
        data = self._pending + (piece if isinstance(piece, bytes) else piece.encode())
        text, num_used = codecs.utf_8_decode(data, "replace", False)
        self._pending = data[num_used:]
        return text

    def _outside(self, token_id: int) -> bytes:
        """An id past the tables: decode raises for it (negative, >= 2**32) or drops it."""
        if self._check_id(token_id):
            raise ValueError(f"token id {token_id} was added to the tokenizer after its tables were built")
        return b""


class TokenStrings:
    """Renders token ids for logprobs: the token's text (``decode([id])``) and its raw bytes."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = "ByteLevel" in repr(decoder)
        self._unicode_to_byte = _unicode_to_byte()
        self.text = lru_cache(maxsize=1 << 16)(self._text)
        self.bytes = lru_cache(maxsize=1 << 16)(self._bytes)

    def _text(self, token_id: int) -> str:
        """The token's own text, leading space included (so the tokens of a text join into it)."""
        raw = self._raw_bytes(token_id)
        if raw is not None:
            return raw.decode("utf-8", errors="replace")
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _bytes(self, token_id: int) -> tuple[int, ...]:
        raw = self._raw_bytes(token_id)
        return tuple(raw if raw is not None else self._text(token_id).encode("utf-8"))

    def _raw_bytes(self, token_id: int) -> bytes | None:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return None
        match = _BYTE_TOKEN.match(piece)
        if match:  # SentencePiece byte fallback
            return bytes((int(match.group(1), 16),))
        if self.byte_level:
            if all(c in self._unicode_to_byte for c in piece):
                return bytes(self._unicode_to_byte[c] for c in piece)
            return None
        if piece.startswith(METASPACE):  # SentencePiece: "▁word" is " word"
            return piece.replace(METASPACE, " ").encode("utf-8")
        return None


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable character table (what ByteLevel BPE vocabularies are written in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@cache
def _unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in _bytes_to_unicode().items()}
