"""EngineConfig: every engine knob in one frozen dataclass, with vLLM's names. No I/O here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """What the engine is asked to be; building one never touches the disk or the network."""

    model: str | None = None  # HF folder; None means the default model (shared.models)
    tokenizer: str | None = None  # defaults to `model`
    served_model_name: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: bfloat16 on CUDA and native-bf16 CPUs)
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0
    # KV cache
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; the CPU default is DEFAULT_CPU_KV_BYTES
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    # scheduling
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    enable_chunked_prefill: bool = True
    max_num_queued_reqs: int = 4096
    max_logprobs: int = 20
    attention_backend: str = "auto"  # auto | torch | cupy
    enforce_eager: bool = False  # True: no torch.compile of the forward (engine_svc.compiled)
    engine_id: str = "engine-0"


DEFAULT_CPU_KV_BYTES = 1 << 30
