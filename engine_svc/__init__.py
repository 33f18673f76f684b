"""The engine: paged KV cache, continuous batching, Llama-family models (imports no Redis)."""

from engine_svc.config import EngineConfig
from engine_svc.engine import CompletionOutput, RequestResult, LLMEngine

__all__ = ["CompletionOutput", "EngineConfig", "RequestResult", "LLMEngine"]
