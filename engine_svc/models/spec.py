"""ModelSpec: the checked shape of a Llama-family model, read from an HF folder's config.json.

Every field the decoder needs is read here, once, with an error that names the file and the
field when it is missing or malformed, so a bad folder fails at start-up and not mid-request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

# architecture -> traits, as HF's modeling files hard-code them. "bias": "config" reads
# attention_bias (q/k/v/o) and mlp_bias; "attention" only attention_bias; "qkv": q/k/v always biased, o never; "none": no bias.
ARCHITECTURES = {
    "LlamaForCausalLM": dict(bias="config", qk_norm=False),
    "MistralForCausalLM": dict(bias="none", qk_norm=False),
    "Qwen2ForCausalLM": dict(bias="qkv", qk_norm=False),
    "Qwen3ForCausalLM": dict(bias="attention", qk_norm=True),
}
ROPE_TYPES = ("default", "llama3")


class ModelConfigError(ValueError):
    """A model folder that cannot be served: names the file and the field at fault."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """Everything the decoder's shape depends on; validated on construction by `load_spec`."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope_theta: float
    rope_type: str = "default"
    rope_params: dict = field(default_factory=dict)
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None


def load_spec(model_dir: str | Path) -> ModelSpec:
    """Read and check `model_dir/config.json` (+ generation_config.json for the EOS ids)."""
    path = Path(model_dir) / "config.json"
    cfg = _read_json(path, required=True)
    archs = cfg.get("architectures")
    if not isinstance(archs, list) or not archs:
        raise ModelConfigError(f"{path}: field 'architectures' is missing or empty")
    arch = archs[0]
    if arch not in ARCHITECTURES:
        raise ModelConfigError(
            f"{path}: architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    get = _Getter(path, cfg)
    hidden, heads, kv_heads, head_dim = _attention_shape(path, cfg, get)
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ModelConfigError(f"{path}: field 'hidden_act' = {act!r} is not supported (only silu)")
    attention_bias = bool(cfg.get("attention_bias", False))
    traits = ARCHITECTURES[arch]
    rope_theta, rope_type, rope_params = _rope(path, cfg)
    sliding = cfg.get("sliding_window")
    if arch.startswith("Qwen") and not cfg.get("use_sliding_window", False):
        sliding = None
    return ModelSpec(
        architecture=arch,
        vocab_size=get.int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=get.int("intermediate_size"),
        num_layers=get.int("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=get.float("rms_norm_eps", 1e-6),
        max_position_embeddings=get.int("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=traits["bias"] == "qkv" or (traits["bias"] in ("config", "attention") and attention_bias),
        o_bias=traits["bias"] in ("config", "attention") and attention_bias,
        mlp_bias=traits["bias"] == "config" and bool(cfg.get("mlp_bias", False)),
        qk_norm=traits["qk_norm"],
        rope_theta=rope_theta,
        rope_type=rope_type,
        rope_params=rope_params,
        sliding_window=int(sliding) if sliding else None,
        eos_token_ids=_eos_ids(Path(model_dir), cfg),
        torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
    )


def _attention_shape(path: Path, cfg: dict, get: "_Getter") -> tuple[int, int, int, int]:
    hidden, heads = get.int("hidden_size"), get.int("num_attention_heads")
    kv_heads = get.int("num_key_value_heads", heads)
    if heads % kv_heads:
        raise ModelConfigError(f"{path}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    head_dim = get.int("head_dim") if cfg.get("head_dim") is not None else hidden // heads
    return hidden, heads, kv_heads, head_dim


def _rope(path: Path, cfg: dict) -> tuple[float, str, dict]:
    # transformers 5 writes "rope_parameters"; older folders have "rope_theta" + "rope_scaling"
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if not isinstance(params, dict):
        raise ModelConfigError(f"{path}: field 'rope_parameters' must be an object")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ModelConfigError(f"{path}: rope type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise ModelConfigError(f"{path}: field 'rope_theta' must be a positive number, got {theta!r}")
    if rope_type == "llama3":
        for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if not isinstance(params.get(key), (int, float)):
                raise ModelConfigError(f"{path}: llama3 rope scaling needs a number in field {key!r}")
    return float(theta), rope_type, params


def _eos_ids(model_dir: Path, cfg: dict) -> tuple[int, ...]:
    gen = _read_json(model_dir / "generation_config.json", required=False) or {}
    eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ModelConfigError(f"{model_dir}: field 'eos_token_id' must be an int or a list of ints, got {eos!r}")
    return tuple(dict.fromkeys(ids))


def _read_json(path: Path, *, required: bool) -> dict | None:
    if not path.is_file():
        if required:
            raise ModelConfigError(f"{path}: file not found (a model folder needs config.json)")
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path}: expected a JSON object")
    return data


class _Getter:
    """Typed field access that names the file and the field on error."""

    def __init__(self, path: Path, cfg: dict):
        self.path, self.cfg = path, cfg

    def int(self, key: str, default: int | None = None) -> int:
        value = self.cfg.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ModelConfigError(f"{self.path}: field {key!r} must be a positive integer, got {value!r}")
        return value

    def float(self, key: str, default: float) -> float:
        value = self.cfg.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ModelConfigError(f"{self.path}: field {key!r} must be a positive number, got {value!r}")
        return float(value)
