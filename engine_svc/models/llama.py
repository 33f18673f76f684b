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
from torch import nn

import engine_svc.attention.step  # noqa: F401  (registers torch.ops.pagedserve.paged_attention)
from engine_svc.attention import cpu_ops
from engine_svc.models.spec import ModelSpec
from engine_svc.models.weights import SafetensorsWeights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalise in float32, cast back, then scale."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype) * weight


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: int | None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """F.linear; on a bfloat16 or float32 CPU model (``packed``: the handle of weight's oneDNN-packed
    copy), through cpu_gemv.cpp, which streams the weights faster than oneDNN for the few rows of a
    decode step and hands the rest to oneDNN with the packed copy (float32 too: F.linear would take
    MKL's SGEMM, AVX2-only on this AMD CPU). ``out_dtype`` float32 (that op only): its float32 sums
    are not rounded to a bfloat16 output."""
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.pagedserve_cpu.linear(x, weight, bias, packed, out_dtype)


def silu_and_mul(gate_up: torch.Tensor, is_fused: bool) -> torch.Tensor:
    """silu(gate) * up over the fused gate/up projection [..., 2 x intermediate]; ``is_fused``: through
    cpu_activation.cpp (a bfloat16 CPU model), else torch's ops (which inductor fuses)."""
    if is_fused:
        return torch.ops.pagedserve_cpu.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def use_cpu_silu_mul(dtype: torch.dtype, device) -> bool:
    return torch.device(device).type == "cpu" and dtype == torch.bfloat16 and cpu_ops.silu_mul_op() is not None


def use_cpu_gemv(dtype: torch.dtype, device) -> bool:
    return torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float32) and cpu_ops.linear_op() is not None


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
    x1, x2 = x[..., :half], x[..., half:]
    # x * cos + rotate_half(x) * sin, each half written once: a rotate_half built by torch.cat became
    # copies of its own in inductor's C++, run by one thread
    return torch.cat((x1 * cos[..., :half] - x2 * sin[..., :half], x2 * cos[..., half:] + x1 * sin[..., half:]), dim=-1)


class DecoderLayer(nn.Module):
    """One transformer block's fused weights (buffers, so a compiled forward may freeze and
    prepack them); reads and writes its KV only through the paged attention op."""

    def __init__(self, spec: ModelSpec, weights: SafetensorsWeights, i: int, dtype, device):
        super().__init__()
        p = f"model.layers.{i}."
        h, d, nh, nkv = spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads
        load = lambda name, shape: weights.get(p + name, shape).to(device=device, dtype=dtype)  # noqa: E731
        optional = lambda on, names, shapes: (torch.cat([load(n, s) for n, s in zip(names, shapes)])  # noqa: E731
                                              if on else None)
        self.layer, self.spec = i, spec
        self.q_size, self.kv_size = nh * d, nkv * d
        self.scale = d**-0.5
        self.attention_id = 0  # the PagedAttention this layer calls (set by the runner: bind_attention)
        inter = spec.intermediate_size
        qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        gate_up = ("mlp.gate_proj", "mlp.up_proj")
        tensors = {
            "qkv_w": torch.cat([load(f"{n}.weight", (o, h)) for n, o in zip(qkv, (nh * d, nkv * d, nkv * d))]),
            "qkv_b": optional(spec.qkv_bias, [f"{n}.bias" for n in qkv], [(nh * d,), (nkv * d,), (nkv * d,)]),
            "o_w": load("self_attn.o_proj.weight", (h, nh * d)),
            "o_b": optional(spec.o_bias, ["self_attn.o_proj.bias"], [(h,)]),
            "q_norm": optional(spec.qk_norm, ["self_attn.q_norm.weight"], [(d,)]),
            "k_norm": optional(spec.qk_norm, ["self_attn.k_norm.weight"], [(d,)]),
            "gate_up_w": torch.cat([load(f"{n}.weight", (inter, h)) for n in gate_up]),
            "gate_up_b": optional(spec.mlp_bias, [f"{n}.bias" for n in gate_up], [(inter,), (inter,)]),
            "down_w": load("mlp.down_proj.weight", (h, inter)),
            "down_b": optional(spec.mlp_bias, ["mlp.down_proj.bias"], [(h,)]),
            "input_norm": load("input_layernorm.weight", (h,)),
            "post_norm": load("post_attention_layernorm.weight", (h,)),
        }
        for name, tensor in tensors.items():
            self.register_buffer(name, None if tensor is None else tensor.contiguous(), persistent=False)
        self.is_silu_mul_fused = use_cpu_silu_mul(dtype, device)  # silu(gate) * up in one C++ pass
        # the handles of the matrices' oneDNN-packed copies for the CPU linear op; None: F.linear
        self.packed_qkv = self.packed_o = self.packed_gate_up = self.packed_down = None
        if use_cpu_gemv(dtype, device):
            packed = cpu_ops.PackedWeights(self, {"qkv": self.qkv_w, "o": self.o_w, "gate_up": self.gate_up_w,
                                                  "down": self.down_w})
            self.packed_qkv, self.packed_o = packed.handle("qkv"), packed.handle("o")
            self.packed_gate_up, self.packed_down = packed.handle("gate_up"), packed.handle("down")

    def forward(self, hidden, residual, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        spec, eps = self.spec, self.spec.rms_norm_eps
        residual = hidden if residual is None else residual + hidden
        x = rms_norm(residual, self.input_norm, eps)
        qkv = linear(x, self.qkv_w, self.qkv_b, self.packed_qkv)
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, spec.num_heads, spec.head_dim)
        k = k.view(num_tokens, spec.num_kv_heads, spec.head_dim)
        v = v.view(num_tokens, spec.num_kv_heads, spec.head_dim)
        if self.q_norm is not None:
            q, k = rms_norm(q, self.q_norm, eps), rms_norm(k, self.k_norm, eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        attn = torch.ops.pagedserve.paged_attention(q, k, v, self.attention_id, self.layer)
        residual = residual + linear(attn.view(num_tokens, self.q_size), self.o_w, self.o_b, self.packed_o)
        x = rms_norm(residual, self.post_norm, eps)
        act = silu_and_mul(linear(x, self.gate_up_w, self.gate_up_b, self.packed_gate_up), self.is_silu_mul_fused)
        return linear(act, self.down_w, self.down_b, self.packed_down), residual


class LlamaForCausalLM(nn.Module):
    """The whole decoder: embeddings, layers, final norm and LM head (computed only where asked).

    `forward` takes only the step's token ids and positions: attention reaches the KV pool and
    the step's metadata through the PagedAttention bound with `bind_attention`, so the same
    forward runs eagerly or compiled (engine_svc.compiled).
    """

    def __init__(self, spec: ModelSpec, weights: SafetensorsWeights, *, dtype: torch.dtype, device,
                 max_positions: int):
        super().__init__()
        h = spec.hidden_size
        self.spec, self.dtype, self.device = spec, dtype, torch.device(device)
        self.register_buffer("embed", weights.get("model.embed_tokens.weight", (spec.vocab_size, h)).to(
            device=device, dtype=dtype), persistent=False)
        self.layers = nn.ModuleList(DecoderLayer(spec, weights, i, dtype, device) for i in range(spec.num_layers))
        self.register_buffer("norm", weights.get("model.norm.weight", (h,)).to(device=device, dtype=dtype),
                             persistent=False)
        if spec.tie_word_embeddings:  # as HF: tied means the embedding, whatever lm_head.weight holds
            self.lm_head = self.embed
        else:
            self.lm_head = weights.get("lm_head.weight", (spec.vocab_size, h)).to(device=device, dtype=dtype)
        self.packed_lm_head = (cpu_ops.PackedWeights(self, {"lm_head": self.lm_head}).handle("lm_head")
                               if use_cpu_gemv(dtype, device) else None)
        cos, sin = rope_tables(spec, max_positions, dtype, device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def packed_matrices(self) -> list[tuple[torch.Tensor, int]]:
        """Every layer's (weight, packed handle) pair, for cpu_ops.calibrate_amx_rows; empty when
        the linear op is not used."""
        return [(w, h) for layer in self.layers
                for w, h in ((layer.qkv_w, layer.packed_qkv), (layer.o_w, layer.packed_o),
                             (layer.gate_up_w, layer.packed_gate_up), (layer.down_w, layer.packed_down)) if h is not None]

    def bind_attention(self, attention_id: int) -> None:
        for layer in self.layers:
            layer.attention_id = attention_id

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids/positions [num_tokens] -> final hidden states [num_tokens, hidden] (before the norm)."""
        hidden = F.embedding(input_ids, self.embed)
        cos, sin = self.cos.index_select(0, positions).unsqueeze(1), self.sin.index_select(0, positions).unsqueeze(1)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos, sin)
        return hidden if residual is None else residual + hidden

    @property
    def logits_dtype(self) -> torch.dtype:
        """float32 where the CPU linear op computes the logits: it sums in float32, and a bfloat16 model's
        logits rounded to bfloat16 (3 significant digits) flip near-tied top tokens. On the default model,
        teacher-forced against float32, 1,596 positions (AMD Zen 3): top-1 agreement 99.25% against
        98.12% for bfloat16 logits, mean |dlogprob| of the chosen token 0.013 against 0.019."""
        return torch.float32 if self.packed_lm_head is not None else self.dtype

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] (only the rows that sample) -> logits [n, vocab] in ``logits_dtype`` (a
        bfloat16 model's elsewhere than through the CPU op: the sampler widens them to float32 unless
        plain greedy rows need only their argmax)."""
        return linear(rms_norm(hidden, self.norm, self.spec.rms_norm_eps), self.lm_head, None, self.packed_lm_head,
                      self.logits_dtype)


class MistralForCausalLM(LlamaForCausalLM):
    """Llama without biases (the spec says so); sliding window handled by capping max_model_len."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with q/k/v biases (the spec says so)."""


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama with a per-head RMSNorm on q and k before rope, and an explicit head_dim (the spec says so)."""
