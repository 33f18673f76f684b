"""Sampling on CPU: the Gumbel-max race over counter-based noise.

Each row draws one token from softmax(logits) (logits already divided by the temperature and
masked by top-k/top-p/min_p). Element j of a row takes the 52-bit integer k_j from a hash of
(key, counter, j) alone (SplitMix64's finaliser, below), so d_j = (2 k_j + 1) * 2^-53 is uniform on
(0, 1) and E_j = -log1p(-d_j) an exponential variate; the token is the first j with the largest

    score_j = (logit_j - max logit) - log(E_j)        (in float64)

which is one draw from the row's distribution (the exponential race: argmax p_j / E_j). A seeded
sequence's key is its seed (plus its child index for n > 1) and its counter its output position,
so its token depends on nothing but its logits: not on the batch around it, and not on the engine
that draws it. A failover's resubmission, a preemption's recompute or a P/D hand-off goes on with
the same tokens without replaying draws, and a logit that differs by rounding alone flips a token
only when two scores of the race tie to that precision. Unseeded rows take a fresh random key per
step from torch's global generator.

``race_rows`` is cpu_sampling.cpp's kernel (which skips, by a bound on each element's noise, the
elements that cannot win, and scores only the rest: ~100x faster than torch's exponential noise
for 256 rows of a 49,152-token vocabulary here); ``race_rows_torch`` computes the same race in
torch for when the kernels are off or failed to build (the same tokens, up to a rounding-level
difference between the two libraries' logarithms).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


MIX_1 = _signed(0xBF58476D1CE4E5B9)
MIX_2 = _signed(0x94D049BB133111EB)
GOLDEN = _signed(0x9E3779B97F4A7C15)
COUNTER_SALT = _signed(0xD6E8FEB86659FD93)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical right shift of int64 bit patterns (torch shifts signed values arithmetically)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors (products wrap around, as uint64 arithmetic does)."""
    x = x ^ _shr(x, 30)
    x = x * MIX_1
    x = x ^ _shr(x, 27)
    x = x * MIX_2
    return x ^ _shr(x, 31)


def race_rows_torch(logits: torch.Tensor, keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """The race in torch: every element scored exactly (NaN counts as masked, as in the kernel)."""
    x = logits.float()
    x = torch.where(torch.isnan(x), float("-inf"), x)
    top, top_at = x.max(dim=1, keepdim=True)
    shifted = x - top
    shifted = torch.where(torch.isnan(shifted), float("-inf"), shifted)  # inf - inf: as masked
    shifted.scatter_(1, top_at, 0.0)
    base = mix64(keys + mix64(counters ^ COUNTER_SALT))
    j = torch.arange(1, x.shape[1] + 1, dtype=torch.int64, device=x.device)
    odd = (_shr(mix64(base.unsqueeze(1) + j * GOLDEN), 12) << 1) | 1
    d = odd.double() * 2.0 ** -53
    score = shifted.double() - torch.log(-torch.log1p(-d))
    score = torch.where(shifted == float("-inf"), float("-inf"), score)
    return score.argmax(dim=1)


def race_rows(logits: torch.Tensor, keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One token per row of CPU logits (float32 or bfloat16), by the kernel when it is built."""
    from engine_svc.attention.cpu_ops import race_op

    op = race_op() if logits.is_cpu and logits.dim() == 2 and logits.shape[1] > 0 else None
    if op is not None:
        return op(logits.float().contiguous(), keys, counters)
    return race_rows_torch(logits, keys, counters)


def row_keys(seeds: Sequence[int | None], counters: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The (key, counter) of each row: a seeded row's seed and output position; an unseeded row a
    random key from torch's global generator (its counter then does not matter)."""
    keys = torch.randint(-(1 << 63), (1 << 63) - 1, (len(seeds),), dtype=torch.int64)
    fixed = [i for i, seed in enumerate(seeds) if seed is not None]
    if fixed:
        keys[fixed] = torch.tensor([_signed(seeds[i]) for i in fixed], dtype=torch.int64)
    return keys, torch.tensor(list(counters), dtype=torch.int64)


__all__ = ["mix64", "race_rows", "race_rows_torch", "row_keys"]
