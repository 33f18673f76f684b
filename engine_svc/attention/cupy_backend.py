"""The cupy attention backend: engine_svc/kernels/*.cu compiled with cupy.RawModule, fed torch tensors.

Tensors cross over without copies: each kernel gets raw data pointers (as numpy uint64 scalars,
which cupy packs as 8-byte kernel parameters) after their shapes, dtypes, devices and strides
are checked here, and runs on torch's current CUDA stream.

Everything that is not the launch itself (checks, argument order, grid sizes, the split-K
choice, scratch buffers) happens in `CupyAttentionBackend`; the launch goes through a
`KernelLauncher`, so the tests run this very plumbing against the CPU-emulated kernels
(tests/cuda_emu) on machines without a GPU.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

logger = logging.getLogger("pagedserve.attention")

KERNEL_DIR = Path(__file__).resolve().parents[1] / "kernels"
KERNEL_FILES = ("cache_ops.cu", "paged_decode.cu", "paged_prefill.cu")
DTYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
HEAD_SIZES = (64, 128)
BLOCK_SIZES = (8, 16, 32)
# These mirror attention.cuh (kThreads, kPartition, kHeadChunk, kAttentionSharedBytes).
NUM_THREADS = 128
PARTITION = 512
HEAD_CHUNK = 4
ATTENTION_SHARED_BYTES = HEAD_CHUNK * PARTITION * 4
TILE_QUERIES = 32  # query vectors (row, GQA head) per tiled-prefill block: kTileQueries in paged_prefill.cu
COPY_THREADS = 256
SPLIT_BLOCKS_PER_SM = 4  # split-K only when (seqs x kv heads) blocks would not fill the GPU


@dataclass(frozen=True, slots=True)
class KernelConfig:
    """One compiled instantiation of the kernels: cache dtype name, head size, block size."""

    dtype: str
    head_dim: int
    block_size: int


class KernelLauncher(Protocol):
    """Runs one kernel by name (cupy calling convention: args are numpy scalars)."""

    def multiprocessor_count(self, device: torch.device) -> int: ...

    def launch(self, device: torch.device, config: KernelConfig, name: str, grid: tuple, block: tuple,
               args: tuple, shared_mem: int = 0) -> None: ...


def supports(dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
    return dtype in DTYPE_NAMES and head_dim in HEAD_SIZES and block_size in BLOCK_SIZES


def prefill_grid(num_tokens: int, num_seqs: int, num_heads: int, num_kv_heads: int) -> tuple[int, int, int]:
    """The tiled prefill grid from shapes alone (no device sync): a block serves `rows` rows of one
    sequence x up to TILE_QUERIES heads of a GQA group (wider groups split along z); sequence s owns
    the tiles s + qsl[s] // rows onwards, so num_tokens // rows + num_seqs tiles cover any batch."""
    group = num_heads // num_kv_heads
    heads_per_block = min(group, TILE_QUERIES)
    rows = TILE_QUERIES // heads_per_block
    return num_tokens // rows + num_seqs, num_kv_heads, -(-group // heads_per_block)


def _ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def _source_hash() -> str:
    digest = hashlib.sha256()
    for path in sorted(KERNEL_DIR.glob("*.cu*")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _cuda_include_options() -> list[str]:
    """-I options for cuda_fp16.h / cuda_bf16.h: the toolkit, or the headers of NVIDIA's pip wheels."""
    import cupy

    roots = [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), cupy.cuda.get_cuda_path()]
    dirs = [Path(r) / "include" for r in roots if r]
    try:
        import nvidia  # namespace package of the nvidia-* wheels (cuda runtime headers)

        for base in nvidia.__path__:
            dirs += [p.parent for p in Path(base).glob("*/include/cuda_fp16.h")]
    except ImportError:
        pass
    return [f"-I{d}" for d in dict.fromkeys(dirs) if (d / "cuda_fp16.h").is_file()]


@functools.cache
def _module(compute_capability: tuple[int, int], config: KernelConfig):
    """One RawModule per (device arch, config); cupy picks -arch for the current device itself."""
    import cupy

    code = "\n".join(f'#include "{name}"' for name in KERNEL_FILES)
    options = (
        "-std=c++17",
        f"-I{KERNEL_DIR}",
        *_cuda_include_options(),
        "-DPS_ONE_CONFIG",
        f"-DPS_CONFIG_DTYPE={config.dtype}",
        f"-DPS_CONFIG_HEAD={config.head_dim}",
        f"-DPS_CONFIG_BLOCK={config.block_size}",
        f"-DPS_SOURCE_HASH={_source_hash()}",  # cupy's disk cache keys on code + options, not on includes
    )
    logger.info("compiling attention kernels %s for sm_%d%d", config, *compute_capability)
    return cupy.RawModule(code=code, options=options)


class CupyLauncher:
    """Launches the compiled kernels with cupy on torch's current stream of the tensors' device."""

    def __init__(self) -> None:
        import cupy

        self._cupy = cupy
        self._streams: dict[int, object] = {}

    def multiprocessor_count(self, device: torch.device) -> int:
        return torch.cuda.get_device_properties(device).multi_processor_count

    def launch(self, device, config, name, grid, block, args, shared_mem=0) -> None:
        cupy = self._cupy
        index = device.index if device.index is not None else torch.cuda.current_device()
        kernel = _module(torch.cuda.get_device_capability(index), config).get_function(name)
        stream_ptr = torch.cuda.current_stream(index).cuda_stream
        stream = self._streams.get(stream_ptr)
        if stream is None:
            stream = self._streams[stream_ptr] = cupy.cuda.ExternalStream(stream_ptr, index)
        with cupy.cuda.Device(index), stream:
            kernel(tuple(grid), tuple(block), tuple(args), shared_mem=shared_mem)


def _check(t: torch.Tensor, what: str, *, ndim: int, dtype: torch.dtype | None = None,
           device: torch.device | None = None, contiguous: bool = True) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{what} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{what} must be {dtype}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{what} is on {t.device}, expected {device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous")


def _rows(t: torch.Tensor, what: str, dtype: torch.dtype, num_heads: int, head_dim: int) -> torch.Tensor:
    """A [n, heads, head_dim] operand whose rows may be strided (a view into a fused qkv), heads packed."""
    _check(t, what, ndim=3, contiguous=False)
    if t.shape[1:] != (num_heads, head_dim):
        raise ValueError(f"{what} must be [n, {num_heads}, {head_dim}], got {tuple(t.shape)}")
    if t.dtype != dtype:
        t = t.to(dtype)  # the kernels read one element type for queries, keys and values
    if t.stride(2) != 1 or t.stride(1) != head_dim:
        t = t.contiguous()
    return t


class CupyAttentionBackend:
    """The AttentionBackend on CUDA kernels. Owns only its launcher; keeps no state between calls."""

    name = "cupy"

    def __init__(self, launcher: KernelLauncher | None = None, *, split_k: bool | None = None) -> None:
        self.launcher = launcher if launcher is not None else CupyLauncher()
        self.split_k = split_k  # None: decide per call; True/False: force (tests, benchmarks)

    # ------------------------------------------------------------------ writes
    def reshape_and_cache(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        config, device = self._cache_config(k_cache, v_cache)
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        key = _rows(key, "key", k_cache.dtype, num_kv_heads, head_dim)
        value = _rows(value, "value", k_cache.dtype, num_kv_heads, head_dim)
        _check(slot_mapping, "slot_mapping", ndim=1, dtype=torch.int64, device=device)
        if not key.shape[0] == value.shape[0] == slot_mapping.shape[0]:
            raise ValueError("key, value and slot_mapping disagree on the number of tokens")
        if slot_mapping.numel() == 0:
            return
        args = (_ptr(key), _ptr(value), _ptr(k_cache), _ptr(v_cache), _ptr(slot_mapping),
                np.int64(key.stride(0)), np.int64(value.stride(0)), np.int32(num_kv_heads * head_dim))
        self.launcher.launch(device, config, f"ps_reshape_and_cache_{config.dtype}", (key.shape[0], 1, 1),
                             (NUM_THREADS, 1, 1), args)

    def decode_kernels(self, query, key, value, k_cache, v_cache, meta):
        return None  # each launch checks its operands: there is no cheaper pair to hand out

    def copy_blocks(self, k_caches: list, v_caches: list, block_mapping) -> None:
        mapping = torch.as_tensor(block_mapping, dtype=torch.int64).reshape(-1, 2)
        if mapping.numel() == 0 or not k_caches:
            return
        config, device = self._cache_config(k_caches[0], v_caches[0])
        for cache in (*k_caches, *v_caches):
            _check(cache, "kv cache", ndim=4, dtype=k_caches[0].dtype, device=device)
            if cache.shape != k_caches[0].shape:
                raise ValueError("every layer's cache must have the same shape")
        if len(k_caches) != len(v_caches):
            raise ValueError("k_caches and v_caches differ in length")
        block_bytes = k_caches[0][0].numel() * k_caches[0].element_size()
        mapping = mapping.to(device).contiguous()
        k_ptrs = torch.tensor([c.data_ptr() for c in k_caches], dtype=torch.int64, device=device)
        v_ptrs = torch.tensor([c.data_ptr() for c in v_caches], dtype=torch.int64, device=device)
        args = (_ptr(k_ptrs), _ptr(v_ptrs), _ptr(mapping), np.int64(block_bytes // 4))
        self.launcher.launch(device, config, "ps_copy_blocks", (len(k_caches), mapping.shape[0], 1),
                             (COPY_THREADS, 1, 1), args)

    # ------------------------------------------------------------------ reads
    def _read_inputs(self, query, k_cache, v_cache, block_tables):
        """The pool's config and device, the query in the pool's dtype and its own dtype (the
        output's), after checking the block table."""
        config, device = self._cache_config(k_cache, v_cache)
        _check(block_tables, "block_tables", ndim=2, dtype=torch.int32, device=device)
        return config, device, self._query(query, k_cache), query.dtype

    def paged_decode(self, query, k_cache, v_cache, block_tables, context_lens, scale):
        config, device, query, out_dtype = self._read_inputs(query, k_cache, v_cache, block_tables)
        num_seqs, num_heads, num_kv_heads = query.shape[0], query.shape[1], k_cache.shape[2]
        _check(context_lens, "context_lens", ndim=1, dtype=torch.int32, device=device)
        if block_tables.shape[0] != num_seqs or context_lens.shape[0] != num_seqs:
            raise ValueError("query, block_tables and context_lens disagree on the number of sequences")
        out = torch.empty(query.shape, dtype=query.dtype, device=device)
        if num_seqs == 0:
            return out.to(out_dtype)
        # The block table's width bounds every context: no device sync to learn the longest one.
        num_parts = math.ceil(block_tables.shape[1] * config.block_size / PARTITION)
        split = num_parts > 1 and self._use_split(device, num_seqs * num_kv_heads)
        if not split:
            num_parts = 1
        parts = [None, None, None]
        if split:
            parts = [torch.empty((num_seqs, num_heads, num_parts, config.head_dim), dtype=torch.float32, device=device),
                     torch.empty((num_seqs, num_heads, num_parts), dtype=torch.float32, device=device),
                     torch.empty((num_seqs, num_heads, num_parts), dtype=torch.float32, device=device)]
        suffix = f"{config.dtype}_h{config.head_dim}"
        args = (_ptr(out), *map(_ptr, parts), _ptr(query), _ptr(k_cache), _ptr(v_cache), _ptr(block_tables),
                _ptr(context_lens), np.float32(scale), np.int32(num_heads), np.int32(num_kv_heads),
                np.int32(block_tables.shape[1]), np.int64(query.stride(0)), np.int32(num_parts))
        self.launcher.launch(device, config, f"ps_paged_decode_{suffix}_b{config.block_size}",
                             (num_seqs, num_kv_heads, num_parts), (NUM_THREADS, 1, 1), args, ATTENTION_SHARED_BYTES)
        if split:
            args = (_ptr(out), *map(_ptr, parts), _ptr(context_lens), np.int32(num_heads), np.int32(num_parts))
            self.launcher.launch(device, config, f"ps_paged_decode_reduce_{suffix}", (num_seqs, num_heads, 1),
                                 (config.head_dim, 1, 1), args)
        return out.to(out_dtype)

    def paged_prefill(self, query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale):
        config, device, query, out_dtype = self._read_inputs(query, k_cache, v_cache, block_tables)
        num_tokens, num_heads, num_kv_heads = query.shape[0], query.shape[1], k_cache.shape[2]
        _check(query_start_loc, "query_start_loc", ndim=1, dtype=torch.int32, device=device)
        _check(context_lens, "context_lens", ndim=1, dtype=torch.int32, device=device)
        num_seqs = context_lens.shape[0]
        if block_tables.shape[0] != num_seqs or query_start_loc.shape[0] != num_seqs + 1:
            raise ValueError("block_tables, query_start_loc and context_lens disagree on the number of sequences")
        out = torch.empty(query.shape, dtype=query.dtype, device=device)
        if num_tokens == 0:
            return out.to(out_dtype)
        args = (_ptr(out), _ptr(query), _ptr(k_cache), _ptr(v_cache), _ptr(block_tables), _ptr(query_start_loc),
                _ptr(context_lens), np.float32(scale), np.int32(num_seqs), np.int32(num_heads),
                np.int32(num_kv_heads), np.int32(block_tables.shape[1]), np.int64(query.stride(0)))
        suffix = f"{config.dtype}_h{config.head_dim}_b{config.block_size}"
        self.launcher.launch(device, config, f"ps_paged_prefill_{suffix}",
                             prefill_grid(num_tokens, num_seqs, num_heads, num_kv_heads), (NUM_THREADS, 1, 1), args)
        # sequences with one new token (decode rows of a mixed batch) go through the row kernel
        self.launcher.launch(device, config, f"ps_paged_prefill_single_{suffix}", (num_seqs, num_kv_heads, 1),
                             (NUM_THREADS, 1, 1), args, ATTENTION_SHARED_BYTES)
        return out.to(out_dtype)

    # ------------------------------------------------------------------ helpers
    def _cache_config(self, k_cache, v_cache) -> tuple[KernelConfig, torch.device]:
        _check(k_cache, "k_cache", ndim=4)
        _check(v_cache, "v_cache", ndim=4, dtype=k_cache.dtype, device=k_cache.device)
        if v_cache.shape != k_cache.shape:
            raise ValueError("k_cache and v_cache differ in shape")
        _, block_size, _, head_dim = k_cache.shape
        if not supports(k_cache.dtype, head_dim, block_size):
            raise NotImplementedError(
                f"cupy kernels exist for dtypes {list(DTYPE_NAMES)}, head sizes {HEAD_SIZES}, block sizes "
                f"{BLOCK_SIZES}; got {k_cache.dtype}, head size {head_dim}, block size {block_size}")
        return KernelConfig(DTYPE_NAMES[k_cache.dtype], head_dim, block_size), k_cache.device

    def _query(self, query, k_cache) -> torch.Tensor:
        _check(query, "query", ndim=3, contiguous=False)
        num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
        if num_heads % num_kv_heads:
            raise ValueError(f"query heads ({tuple(query.shape)}) must be a multiple of kv heads ({num_kv_heads})")
        if query.device != k_cache.device:
            raise ValueError(f"query is on {query.device}, the cache on {k_cache.device}")
        return _rows(query, "query", k_cache.dtype, num_heads, k_cache.shape[3])

    def _use_split(self, device, num_blocks: int) -> bool:
        if self.split_k is not None:
            return self.split_k
        return num_blocks < SPLIT_BLOCKS_PER_SM * self.launcher.multiprocessor_count(device)
