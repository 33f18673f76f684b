"""Shared skip markers of the GPU tests (marker `gpu`: skipped without CUDA)."""

import importlib.util

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
HAS_CUPY = importlib.util.find_spec("cupy") is not None
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None

needs_cuda = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]
needs_cupy = [*needs_cuda, pytest.mark.skipif(not HAS_CUPY, reason="needs cupy (pip install .[gpu])")]
needs_flashinfer = [*needs_cuda, pytest.mark.skipif(not HAS_FLASHINFER, reason="needs flashinfer (pip install .[gpu])")]
