"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM) on plain torch ops.

The differences between the family members are data, not code: biases, q/k RMSNorm and rope
scaling come from the ModelSpec. Weights are fused at load time (q/k/v into one matrix,
gate/up into one) so a layer costs four matmuls, and the forward takes one flat batch of
tokens from every sequence of the step (no padding, no per-token Python).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine_svc.attention.base import AttentionBackend, AttentionMetadata
from engine_svc.models.spec import ModelSpec
from engine_svc.models.weights import SafetensorsWeights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalise in float32, cast back, then scale."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype) * weight


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """Inverse frequencies exactly as transformers computes them (types default and llama3)."""
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if spec.rope_type != "llama3":
        return inv_freq
    p = spec.rope_params
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(spec: ModelSpec, max_positions: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_positions, head_dim], computed in float32 like HF, then cast."""
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * rope_inv_freq(spec)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, 1, D]; rotate-half convention (HF's, after GGUF un-permuting)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DecoderLayer:
    """One transformer block's fused weights; reads and writes its KV only through the backend."""

    def __init__(self, spec: ModelSpec, weights: SafetensorsWeights, i: int, dtype, device):
        p = f"model.layers.{i}."
        h, d, nh, nkv = spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads
        load = lambda name, shape: weights.get(p + name, shape).to(device=device, dtype=dtype)  # noqa: E731
        self.spec = spec
        self.q_size, self.kv_size = nh * d, nkv * d
        self.qkv_w = torch.cat([load("self_attn.q_proj.weight", (nh * d, h)), load("self_attn.k_proj.weight", (nkv * d, h)),
                                load("self_attn.v_proj.weight", (nkv * d, h))]).contiguous()
        self.qkv_b = None
        if spec.qkv_bias:
            self.qkv_b = torch.cat([load("self_attn.q_proj.bias", (nh * d,)), load("self_attn.k_proj.bias", (nkv * d,)),
                                    load("self_attn.v_proj.bias", (nkv * d,))])
        self.o_w = load("self_attn.o_proj.weight", (h, nh * d))
        self.o_b = load("self_attn.o_proj.bias", (h,)) if spec.o_bias else None
        self.q_norm = load("self_attn.q_norm.weight", (d,)) if spec.qk_norm else None
        self.k_norm = load("self_attn.k_norm.weight", (d,)) if spec.qk_norm else None
        inter = spec.intermediate_size
        self.gate_up_w = torch.cat([load("mlp.gate_proj.weight", (inter, h)), load("mlp.up_proj.weight", (inter, h))])
        self.gate_up_b = None
        if spec.mlp_bias:
            self.gate_up_b = torch.cat([load("mlp.gate_proj.bias", (inter,)), load("mlp.up_proj.bias", (inter,))])
        self.down_w = load("mlp.down_proj.weight", (h, inter))
        self.down_b = load("mlp.down_proj.bias", (h,)) if spec.mlp_bias else None
        self.input_norm = load("input_layernorm.weight", (h,))
        self.post_norm = load("post_attention_layernorm.weight", (h,))
        self.scale = d**-0.5

    def forward(self, hidden, residual, cos, sin, k_cache, v_cache, meta: AttentionMetadata,
                backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        spec, eps = self.spec, self.spec.rms_norm_eps
        residual = hidden if residual is None else residual + hidden
        x = rms_norm(residual, self.input_norm, eps)
        qkv = F.linear(x, self.qkv_w, self.qkv_b)
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, spec.num_heads, spec.head_dim)
        k = k.view(num_tokens, spec.num_kv_heads, spec.head_dim)
        v = v.view(num_tokens, spec.num_kv_heads, spec.head_dim)
        if self.q_norm is not None:
            q, k = rms_norm(q, self.q_norm, eps), rms_norm(k, self.k_norm, eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        backend.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.is_decode:
            attn = backend.paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, self.scale)
        else:
            attn = backend.paged_prefill(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                         meta.context_lens, self.scale)
        residual = residual + F.linear(attn.reshape(num_tokens, self.q_size), self.o_w, self.o_b)
        x = rms_norm(residual, self.post_norm, eps)
        gate, up = F.linear(x, self.gate_up_w, self.gate_up_b).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_w, self.down_b), residual


class LlamaForCausalLM:
    """The whole decoder: embeddings, layers, final norm and LM head (computed only where asked)."""

    def __init__(self, spec: ModelSpec, weights: SafetensorsWeights, *, dtype: torch.dtype, device,
                 max_positions: int):
        h = spec.hidden_size
        self.spec, self.dtype, self.device = spec, dtype, torch.device(device)
        self.embed = weights.get("model.embed_tokens.weight", (spec.vocab_size, h)).to(device=device, dtype=dtype)
        self.layers = [DecoderLayer(spec, weights, i, dtype, device) for i in range(spec.num_layers)]
        self.norm = weights.get("model.norm.weight", (h,)).to(device=device, dtype=dtype)
        if spec.tie_word_embeddings:  # as HF: tied means the embedding, whatever lm_head.weight holds
            self.lm_head = self.embed
        else:
            self.lm_head = weights.get("lm_head.weight", (spec.vocab_size, h)).to(device=device, dtype=dtype)
        self.cos, self.sin = rope_tables(spec, max_positions, dtype, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        """input_ids/positions [num_tokens] -> final hidden states [num_tokens, hidden] (before the norm)."""
        hidden = F.embedding(input_ids, self.embed)
        cos, sin = self.cos.index_select(0, positions).unsqueeze(1), self.sin.index_select(0, positions).unsqueeze(1)
        residual = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            hidden, residual = layer.forward(hidden, residual, cos, sin, k_cache, v_cache, meta, backend)
        return hidden if residual is None else residual + hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] (only the rows that sample) -> float32 logits [n, vocab]."""
        return F.linear(rms_norm(hidden, self.norm, self.spec.rms_norm_eps), self.lm_head).float()


class MistralForCausalLM(LlamaForCausalLM):
    """Llama without biases (the spec says so); sliding window handled by capping max_model_len."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with q/k/v biases (the spec says so)."""


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama with a per-head RMSNorm on q and k before rope, and an explicit head_dim (the spec says so)."""
