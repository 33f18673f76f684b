"""FlashInfer's sorting-free sampling kernels behind one function, for the sampler on CUDA.

The pipeline is the torch sampler's: temperature -> min_p -> top-k -> top-p -> one draw.
Temperature and min_p are elementwise (done here in torch, no sort); top-k and top-p run in
FlashInfer's rejection-sampling kernel (`top_k_top_p_sampling_from_probs`, top-k applied first).

Seeding differs from the torch sampler: FlashInfer draws a whole batch from ONE torch.Generator
(Philox seed/offset taken from it per call), so a request's tokens depend on its batch mates.
Per-request seeds (SamplingParams.seed) therefore need the torch path; the caller should send
seeded rows there. Greedy rows (temperature <= 0) are answered with argmax here.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _flashinfer_sampling():
    if not torch.cuda.is_available():
        return None
    try:
        import flashinfer.sampling as sampling
    except Exception:  # ImportError, or a build that fails to load its kernels
        return None
    return sampling


def is_available() -> bool:
    """True on CUDA with flashinfer importable."""
    return _flashinfer_sampling() is not None


def _per_row(value, batch: int, dtype: torch.dtype, device) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=dtype, device=device)
    return t.expand(batch).contiguous() if t.dim() == 0 else t


def flashinfer_sample(probs_or_logits: torch.Tensor, temperature, top_k, top_p, min_p,
                      generator: torch.Generator | None = None, *, is_logits: bool = True) -> torch.Tensor:
    """One token id (int64) per row of `probs_or_logits` [batch, vocab] (on CUDA).

    temperature / top_k / top_p / min_p: a scalar or a per-row tensor; top_k <= 0 or >= vocab,
    top_p >= 1 and min_p <= 0 disable that filter. With is_logits=False the rows are
    probabilities and temperature is ignored.
    """
    sampling = _flashinfer_sampling()
    if sampling is None:
        raise RuntimeError("flashinfer sampling needs CUDA and the flashinfer package")
    x = probs_or_logits.float()
    batch, vocab = x.shape
    device = x.device
    temps = _per_row(temperature, batch, torch.float32, device)
    greedy = temps <= 0
    if is_logits:
        probs = torch.softmax(x / torch.where(greedy, 1.0, temps).unsqueeze(1), dim=-1)
    else:
        probs = x / x.sum(dim=-1, keepdim=True)
    min_ps = _per_row(min_p, batch, torch.float32, device)
    if bool((min_ps > 0).any()):
        threshold = probs.max(dim=-1, keepdim=True).values * min_ps.clamp(min=0).unsqueeze(1)
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    ks = _per_row(top_k, batch, torch.int32, device)
    ks = torch.where((ks <= 0) | (ks > vocab), vocab, ks).to(torch.int32)
    ps = _per_row(top_p, batch, torch.float32, device).clamp(max=1.0)
    sampled = sampling.top_k_top_p_sampling_from_probs(probs.contiguous(), ks, ps, filter_apply_order="top_k_first",
                                                       deterministic=True, generator=generator)
    sampled = sampled.long()
    if bool(greedy.any()):
        sampled = torch.where(greedy, x.argmax(dim=-1), sampled)
    return sampled
