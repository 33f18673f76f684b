"""Attention backends over the paged KV pool: `torch` (reference, CPU and CUDA) and `cupy` (CUDA kernels)."""

from __future__ import annotations

import logging

import torch

from engine_svc.attention.base import AttentionBackend, AttentionMetadata
from engine_svc.attention.torch_backend import TorchAttentionBackend

logger = logging.getLogger("pagedserve.attention")

BACKEND_NAMES = ("auto", "torch", "cupy")


def get_backend(name: str, device, *, dtype: torch.dtype | None = None, head_dim: int | None = None,
                block_size: int | None = None) -> AttentionBackend:
    """`auto` = cupy on CUDA when cupy imports (and its kernels support the given dtype, head_dim
    and block_size, when given), else torch. The cupy module is imported only here, lazily."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {BACKEND_NAMES}, got {name!r}")
    is_cuda = torch.device(device).type == "cuda"
    if name == "cupy" and not is_cuda:
        raise ValueError("attention_backend 'cupy' needs device cuda")
    if name == "torch" or not is_cuda:
        logger.info("attention backend: torch")
        return TorchAttentionBackend()
    try:
        from engine_svc.attention import cupy_backend

        shape_known = None not in (dtype, head_dim, block_size)
        if shape_known and not cupy_backend.supports(dtype, head_dim, block_size):
            raise ValueError(f"cupy kernels do not support dtype {dtype}, head_dim {head_dim}, block_size {block_size}")
        backend = cupy_backend.CupyAttentionBackend()
    except (ImportError, ValueError) as exc:
        if name == "cupy":
            raise ValueError(f"attention_backend 'cupy' is not available: {exc}") from exc
        logger.info("attention backend: torch (cupy unavailable: %s)", exc)
        return TorchAttentionBackend()
    logger.info("attention backend: cupy")
    return backend


__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "get_backend"]
