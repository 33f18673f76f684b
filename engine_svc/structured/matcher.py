"""One constrained sequence's grammar state, and the batch bitmask that carries it to the logits."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr


class Matcher:
    """Owns the grammar state of one constrained sequence: the tokens it accepted so far decide
    which tokens the next row of the bitmask allows. ``num_tokens`` counts accepted tokens, so a
    rollback can never reach before the start.
    """

    __slots__ = ("_matcher", "num_tokens")

    def __init__(self, matcher: xgr.GrammarMatcher, num_tokens: int = 0):
        self._matcher = matcher
        self.num_tokens = num_tokens

    @classmethod
    def start(cls, compiled: xgr.CompiledGrammar) -> Matcher:
        """A matcher at the start of `compiled` (stop tokens: those of the cache's tokenizer info)."""
        return cls(xgr.GrammarMatcher(compiled))

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar forbids it or is finished."""
        accepted = self._matcher.accept_token(token_id)
        self.num_tokens += accepted
        return accepted

    def accept_many(self, token_ids: Sequence[int]) -> int:
        """Accept tokens in order until one is refused; how many were accepted (e.g. re-prefill)."""
        for i, token_id in enumerate(token_ids):
            if not self.accept(token_id):
                return i
        return len(token_ids)

    def is_terminated(self) -> bool:
        """True once a stop token was accepted after a complete match: the sequence is done."""
        return self._matcher.is_terminated()

    def is_completed(self) -> bool:
        """True when the text so far is a complete match (a stop token would be allowed next)."""
        return self._matcher.is_completed()

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` accepted tokens (rejected speculative tokens, a retried step)."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_tokens} accepted tokens")
        if num_tokens:
            self._matcher.rollback(num_tokens)
            self.num_tokens -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens into `bitmask[row]` (a CPU int32 tensor from
        allocate_bitmask); False when every token is allowed and the row need not be applied."""
        return self._matcher.fill_next_token_bitmask(bitmask, row)

    def fork(self) -> Matcher:
        """An independent copy at the same state, for n > 1 choices and beam children."""
        return Matcher(self._matcher.fork(), self.num_tokens)

    def jump_forward_tokens(self) -> list[int]:
        """Tokens the grammar forces next (may be empty); accept() them to skip decoding steps."""
        return self._matcher.find_jump_forward_tokens()


def allocate_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """A CPU int32 bitmask of shape (batch_size, ceil(vocab_size / 32)), every token allowed."""
    return xgr.allocate_token_bitmask(batch_size, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set to -inf, in place, the logits of tokens that `bitmask[row]` forbids, for each of `rows`
    only (logits row i goes with bitmask row i); other rows are not touched. CPU logits use
    our C++ kernel (attention/cpu_bitmask.cpp), or xgrammar's when ours is not built; others a
    torch fallback on their device,
    so no Triton is needed. Logits wider than the bitmask covers (a padded lm_head) are forbidden
    in those rows too: no grammar allows an id the tokenizer does not have."""
    if not rows:
        return
    indices = list(rows)
    vocab_size = min(logits.shape[-1], bitmask.shape[-1] * 32)
    if logits.shape[-1] > vocab_size:
        logits[indices, vocab_size:] = float("-inf")
    if logits.device.type == "cpu":
        from engine_svc.attention.cpu_ops import bitmask_op

        op = bitmask_op()
        if op is not None and logits.is_contiguous():  # 2-10x faster than xgrammar's CPU kernel here
            op(logits, bitmask, torch.tensor(indices, dtype=torch.int64))
            return
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=indices, backend="cpu")
        return
    bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=indices,
                                    backend="torch_native")
