"""Incremental detokenization: token ids in, text deltas out, never half a character.

The algorithm is vLLM's: decode a short window of tokens that starts at ``prefix_offset``
(context for tokenizers whose text depends on the previous token, e.g. SentencePiece's leading
space) and emit what lies beyond the text of ``ids[prefix_offset:read_offset]``. A window whose
text ends in U+FFFD is an unfinished UTF-8 sequence (byte-level BPE, byte fallback): hold it
back until the next token completes it. ``finish()`` settles the rest so that the concatenated
deltas equal ``tokenizer.decode(all ids)``. No Redis here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from functools import lru_cache

import tokenizers

REPLACEMENT = "\ufffd"
METASPACE = "\u2581"
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def text_decoder(tokenizer) -> Callable[[Sequence[int], bool], str]:
    """``decode(ids, skip_special_tokens)`` for a tokenizer: its Rust backend called directly
    when that is all ``tokenizer.decode`` would do (a fast tokenizer that cleans up no spaces),
    which costs a third of the HF wrapper's per-call overhead; else ``tokenizer.decode``."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if isinstance(backend, tokenizers.Tokenizer) and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


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


class TokenStrings:
    """Renders token ids for logprobs: the token's text (``decode([id])``) and its raw bytes."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = "ByteLevel" in repr(decoder)
        self._unicode_to_byte = {c: b for b, c in _bytes_to_unicode().items()}
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
