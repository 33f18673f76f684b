"""Llama-family models on torch, loaded from an HF folder (config.json + safetensors)."""

from __future__ import annotations

from pathlib import Path

import torch

from engine_svc.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from engine_svc.models.spec import ARCHITECTURES, ModelConfigError, ModelSpec, load_spec
from engine_svc.models.weights import SafetensorsWeights

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}
assert set(MODEL_REGISTRY) == set(ARCHITECTURES)


def load_model(model_dir: str | Path, *, dtype: torch.dtype, device, max_positions: int | None = None,
               spec: ModelSpec | None = None) -> LlamaForCausalLM:
    """Read config + weights from `model_dir`; raises ModelConfigError naming the bad file or field."""
    spec = spec or load_spec(model_dir)
    cls = MODEL_REGISTRY[spec.architecture]
    weights = SafetensorsWeights(model_dir)
    with torch.no_grad():
        return cls(spec, weights, dtype=dtype, device=device, max_positions=max_positions or spec.max_position_embeddings)


__all__ = ["MODEL_REGISTRY", "ModelConfigError", "ModelSpec", "load_model", "load_spec"]
