"""FlashInfer's sampler draws from the same distribution as the torch sampler's filtering
(temperature -> min_p -> top-k -> top-p): chi-square over 100k draws per setting."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from tests.gpu.conftest_helpers import needs_flashinfer

pytestmark = needs_flashinfer

DRAWS = 100_000
VOCAB = 64
SETTINGS = [  # temperature, top_k, top_p, min_p
    (1.0, 0, 1.0, 0.0),
    (0.7, 20, 1.0, 0.0),
    (1.3, 0, 0.8, 0.0),
    (1.0, 10, 0.9, 0.0),
    (0.9, 0, 1.0, 0.05),
]


def _torch_probs(logits: torch.Tensor, temperature, top_k, top_p, min_p) -> torch.Tensor:
    """The torch sampler's filtered distribution (its own filter functions, one request)."""
    from engine_svc import sampler

    params = SimpleNamespace(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, is_greedy=False)
    requests = [SimpleNamespace(params=params, generator=None)]
    x = logits.unsqueeze(0).double() / temperature
    x = sampler._top_k_top_p(sampler._min_p(x, requests), requests)
    return x.softmax(dim=-1)[0]


def _chi2_critical(dof: int, z: float = 4.26) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 4.26: p ~ 1e-5)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "min_p"), SETTINGS)
def test_flashinfer_distribution_matches_torch(temperature, top_k, top_p, min_p):
    from engine_svc.flashinfer_sampler import flashinfer_sample

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(VOCAB, generator=g) * 2
    expected = _torch_probs(logits, temperature, top_k, top_p, min_p)
    gen = torch.Generator(device="cuda").manual_seed(1)
    batch = logits.cuda().unsqueeze(0).expand(DRAWS, VOCAB).contiguous()
    tokens = flashinfer_sample(batch, temperature, top_k, top_p, min_p, gen)
    counts = torch.bincount(tokens.cpu(), minlength=VOCAB).double()
    assert counts[expected == 0].sum() == 0, "sampled a token the filters remove"
    keep = expected > 0
    exp_counts = expected[keep] * DRAWS
    chi2 = float(((counts[keep] - exp_counts) ** 2 / exp_counts).sum())
    dof = int(keep.sum()) - 1
    assert chi2 < _chi2_critical(dof), f"chi2 {chi2:.1f} over {dof} dof"


def test_greedy_rows_take_the_argmax():
    from engine_svc.flashinfer_sampler import flashinfer_sample

    logits = torch.randn(8, VOCAB, device="cuda")
    temps = torch.tensor([0.0, 1.0] * 4, device="cuda")
    tokens = flashinfer_sample(logits, temps, 0, 1.0, 0.0)
    assert torch.equal(tokens[::2], logits.argmax(dim=-1)[::2])
