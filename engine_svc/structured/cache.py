"""The engine's compiled grammars: compiled off the engine thread, keyed by constraint, LRU-bounded."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar as xgr

from shared.grammar import build_grammar, clean_message
from engine_svc.structured.matcher import Matcher
from shared.codec import ProtocolError
from shared.structured import PARAM_PREFIX, StructuredOutputs


class GrammarCache:
    """Owns the xgrammar GrammarCompiler of one tokenizer and the futures of its compiled grammars,
    keyed by ``StructuredOutputs.key()``; it holds at most ``max_entries`` finished entries (least
    recently used go first) and never evicts one still compiling.

    An engine step never waits: ``submit`` queues a compile on a worker thread (xgrammar releases
    the GIL while compiling) and returns at once; ``poll`` answers None until it is done. A failed
    compile is kept like a success, as a ProtocolError, so it fails only the requests that ask
    for that constraint, and fails the next one at once.
    """

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, *, max_entries: int = 256, num_threads: int = 1):
        if max_entries < 1 or num_threads < 1:
            raise ValueError("max_entries and num_threads must be at least 1")
        # xgrammar's own cache is off: this one bounds the count, and holds errors too
        self._compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=num_threads, cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="grammar")
        self._entries: OrderedDict[str, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()  # submit/poll may come from the engine and a worker thread
        self.max_entries = max_entries
        self.vocab_size = tokenizer_info.vocab_size
        self.num_hits = 0
        self.num_misses = 0
        self.num_evictions = 0
        self.num_errors = 0

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int, *, stop_token_ids: Sequence[int] | None = None,
                       max_entries: int = 256, num_threads: int = 1) -> GrammarCache:
        """From a Hugging Face tokenizer: see make_tokenizer_info."""
        return cls(make_tokenizer_info(tokenizer, vocab_size, stop_token_ids),
                   max_entries=max_entries, num_threads=num_threads)

    def submit(self, constraint: StructuredOutputs) -> Future[xgr.CompiledGrammar]:
        """Start compiling `constraint` unless it is cached or compiling; its future either way."""
        key = constraint.key()
        with self._lock:
            future = self._entries.get(key)
            if future is not None:
                self.num_hits += 1
                self._entries.move_to_end(key)
                return future
            self.num_misses += 1
            future = self._pool.submit(self._compile, constraint)
            self._entries[key] = future
            self._evict()
        return future

    def poll(self, key: str) -> xgr.CompiledGrammar | None:
        """The compiled grammar, None while compiling; raises ProtocolError if the compile failed
        and KeyError if `key` was never submitted (or was evicted: submit again)."""
        with self._lock:
            future = self._entries[key]
            if not future.done():
                return None
            self._entries.move_to_end(key)
        return future.result()

    def matcher(self, key: str) -> Matcher | None:
        """A fresh Matcher at the start of the constraint of `key`, None while it compiles."""
        compiled = self.poll(key)
        return None if compiled is None else Matcher.start(compiled)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def close(self) -> None:
        """Stop the workers; compiles in flight finish, queued ones are cancelled."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _compile(self, constraint: StructuredOutputs) -> xgr.CompiledGrammar:
        try:
            return self._compiler.compile_grammar(build_grammar(constraint))
        except ProtocolError:
            self._count_error()
            raise
        except (RuntimeError, ValueError) as exc:
            self._count_error()
            param = f"{PARAM_PREFIX}.{constraint.kind}"
            raise ProtocolError(f"{param}: {clean_message(exc)}", param) from None

    def _count_error(self) -> None:
        with self._lock:
            self.num_errors += 1

    def _evict(self) -> None:
        excess = len(self._entries) - self.max_entries
        for key in [k for k, f in self._entries.items() if f.done()][:max(excess, 0)]:
            del self._entries[key]
            self.num_evictions += 1


def make_tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: Sequence[int] | None = None) -> xgr.TokenizerInfo:
    """xgrammar's view of a Hugging Face tokenizer. `vocab_size` is the model's (its lm_head
    width), which may exceed the tokenizer's: no mask ever allows the padding ids. Stop tokens
    default to the tokenizer's EOS; the engine should pass every id that ends a sequence.

    Added special tokens (``<|im_start|>``, ``<file_sep>``...) get an empty text, which xgrammar
    treats as never allowed except as a stop token: from_huggingface alone keeps their literal
    text, so a grammar string could contain ``<|im_start|>``, which the detokenizer then skips.
    """
    stop = list(stop_token_ids) if stop_token_ids else None
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop)
    special_ids = {i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items() if token.special}
    if not special_ids:
        return info
    vocab = [""] * vocab_size
    for text, token_id in tokenizer.get_vocab().items():
        if token_id < vocab_size and token_id not in special_ids:
            vocab[token_id] = text
    return xgr.TokenizerInfo.from_vocab_and_metadata(vocab, info.dump_metadata())
