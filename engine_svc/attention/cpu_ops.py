"""Builds and loads the C++ CPU kernels on first use: cpu_kernels.cpp (paged decode attention),
the KV write, cpu_prefill.cpp (paged prefill attention, bfloat16 and float32), cpu_gemv.cpp (the small-batch linear layer),
cpu_bitmask.cpp (structured outputs' logits mask), cpu_sampling.cpp (sampling: greedy's argmax, the race at temperature > 0)
and cpu_activation.cpp (a bfloat16 MLP's silu(gate) * up);
on a CPU with AMX-BF16, cpu_amx.cpp (the linear layer for up to `calibrate_amx_rows` rows) and cpu_amx_prefill.cpp
(bfloat16 prefill attention) on the tile units, chosen at run time inside the ops (the AVX512-BF16
build compiles them; ``amx_available`` says whether this CPU and kernel grant the tiles).

One shared library is compiled with g++ straight against torch's headers and libraries (no
ninja, no pybind: the ops are registered with TORCH_LIBRARY and called as
torch.ops.pagedserve_cpu.paged_decode / .linear). It is cached under $PAGEDSERVE_CACHE/torch_extensions
(default ~/.cache/pagedserve/torch_extensions), keyed on the sources, the flags, torch's version
and the compiler's, and renamed into place atomically so concurrent processes never load a
half-written file. Any failure logs one warning and `paged_decode_op()` / `linear_op()` answer
None from then on: the callers keep the pure-torch paths. PAGEDSERVE_CPU_KERNELS=0 disables the kernels.

Prebuilt (the Docker image, whose runtime stage has no compiler): ``prebuild(folder)`` compiles one
library per vector-flag set (``VARIANTS``) into a folder; with PAGEDSERVE_CPU_KERNELS_DIR naming
it, the library for this CPU's flags is loaded from there and nothing is compiled.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
import weakref
from pathlib import Path

import torch

from engine_svc import cpu_info

logger = logging.getLogger("pagedserve.attention")

SOURCES = [Path(__file__).with_name(name)
           for name in ("cpu_kernels.cpp", "cpu_prefill.cpp", "cpu_gemv.cpp", "cpu_bitmask.cpp", "cpu_sampling.cpp",
                        "cpu_amx.cpp", "cpu_amx_prefill.cpp", "cpu_activation.cpp")]
HEADERS = [Path(__file__).with_name(name) for name in ("cpu_simd.h", "cpu_amx.h")]  # included by the sources: part of the cache key too
BASE_FLAGS = ["-std=c++17", "-O3", "-fPIC", "-shared", "-fopenmp", "-fno-trapping-math", "-Wno-unused-parameter"]
ENV_SWITCH = "PAGEDSERVE_CPU_KERNELS"
PREBUILT_ENV = "PAGEDSERVE_CPU_KERNELS_DIR"
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
AVX512_BF16 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"})
AVX2_FLAGS = ["-mavx2", "-mfma"]
AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16"]
VARIANTS = ([], AVX2_FLAGS, AVX2_FLAGS + AVX512_FLAGS)  # every answer cpu_flags() can give


def enabled() -> bool:
    """False when PAGEDSERVE_CPU_KERNELS is set to 0/false/off (read at each call, so tests can flip
    it; a TorchAttentionBackend chooses its kernels once per step's metadata tensors, so a flip
    takes effect from its next step, or at once in a new backend)."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


def paged_decode_op():
    """torch.ops.pagedserve_cpu.paged_decode, or None when disabled or the build failed."""
    return _load() if enabled() else None


def decode_kernel_for(query, k_cache, v_cache, block_tables, context_lens):
    """The kernel when it can serve these tensors (CPU, contiguous pool, one float dtype, int32
    metadata), else None: the caller then runs the pure-torch path."""
    if not (query.device.type == k_cache.device.type == v_cache.device.type == "cpu"
            and query.dtype == k_cache.dtype == v_cache.dtype and query.dtype in KERNEL_DTYPES
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and block_tables.dtype == context_lens.dtype == torch.int32
            and block_tables.device.type == context_lens.device.type == "cpu"):
        return None
    return paged_decode_op()


def kv_writer_for(key, value, k_cache, slot_mapping):
    """torch.ops.pagedserve_cpu.write_kv (the step's K/V rows into their slots, one memcpy each)
    when it can serve these tensors (CPU, rows already in the pool's dtype, int64 slots), else None:
    the caller then masks and index_copy_s."""
    if not (key.device.type == k_cache.device.type == slot_mapping.device.type == "cpu"
            and key.dtype == value.dtype == k_cache.dtype and slot_mapping.dtype == torch.int64):
        return None
    return torch.ops.pagedserve_cpu.write_kv if paged_decode_op() is not None else None


def prefill_kernel_for(query, k_cache, v_cache):
    """torch.ops.pagedserve_cpu.paged_prefill when it can serve these tensors (CPU, a bfloat16 or
    float32 pool, a CPU with AVX2 and FMA, head size 64 or 128), else None: the caller then gathers
    the context and runs torch's SDPA."""
    if not (query.device.type == k_cache.device.type == "cpu" and query.dtype == k_cache.dtype == v_cache.dtype
            and query.dtype in (torch.bfloat16, torch.float32) and k_cache.is_contiguous() and v_cache.is_contiguous()):
        return None
    if paged_decode_op() is None or not torch.ops.pagedserve_cpu.paged_prefill_supported(query.shape[-1]):
        return None
    return torch.ops.pagedserve_cpu.paged_prefill


def linear_op():
    """torch.ops.pagedserve_cpu.linear (a GEMV loop for a few rows; beyond them oneDNN's matmul,
    from the weight's packed copy when given its handle), or None."""
    return torch.ops.pagedserve_cpu.linear if paged_decode_op() is not None else None


PACK_ROWS = 256  # the row count oneDNN lays a packed weight out for (any count may use it)


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs (and multiplies) matrices of this dtype here: bfloat16 needs AVX-512
    (BW, VL, DQ) or AVX-NE-CONVERT, which an AVX2-only CPU such as AMD's Zen 3 lacks."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


class PackedWeights:
    """Owns the oneDNN-packed copies of one model's matrices (held in cpu_gemv.cpp, by handle):
    ``handle(name)`` for the linear op, all released with the module that holds them (the weight
    memory doubles while they live)."""

    def __init__(self, owner, matrices: dict[str, torch.Tensor]):
        pack = torch.ops.pagedserve_cpu.pack_linear_weight
        # where oneDNN has no bfloat16, a bfloat16 matrix's copy is packed as float32 and the rows past
        # the small-batch loop are multiplied in float32 (at::linear's bfloat16 there: ~1 GFLOP/s)
        self.handles = {name: pack(weight if onednn_packs(weight.dtype) else weight.float(), PACK_ROWS)
                        for name, weight in matrices.items()}
        weakref.finalize(owner, _release, list(self.handles.values()))

    def handle(self, name: str) -> int:
        return self.handles[name]


AMX_ROWS_TRIED = (16, 32, 48, 64, 96, 128)  # up to cpu_amx.h's kMaxRows
_amx_rows_measured: dict[tuple, int] = {}  # the answer for a set of matrix shapes, measured once a process


def calibrate_amx_rows(matrices: list[tuple[torch.Tensor, int]]) -> int | None:
    """Measure up to how many token rows the AMX tiles beat the rest of the linear op (oneDNN from
    the packed copy) on these (weight, packed handle) pairs, a model's layer matrices, and set the
    op's limit there (torch.ops.pagedserve_cpu.set_amx_rows). Each count of AMX_ROWS_TRIED runs every
    matrix through both paths, alternating, best of three; the first count the tiles lose ends the
    search. The crossover is the machine's: past 128 rows on one Xeon VM, 32 on another. Returns the
    limit set, or None (nothing set) without the tiles or a bfloat16 matrix they take."""
    ops = torch.ops.pagedserve_cpu
    matrices = [(w, h) for w, h in matrices if h is not None and w.dtype == torch.bfloat16 and w.dim() == 2
                and w.is_contiguous() and w.shape[0] % 16 == 0 and w.shape[1] % 32 == 0]
    if linear_op() is None or not ops.amx_available() or not matrices:
        return None
    key = tuple(tuple(w.shape) for w, _ in matrices)
    if key not in _amx_rows_measured:
        _amx_rows_measured[key] = _measure_amx_rows(matrices)
    rows = _amx_rows_measured[key]
    ops.set_amx_rows(rows)
    return rows


def _measure_amx_rows(matrices: list[tuple[torch.Tensor, int]]) -> int:
    ops = torch.ops.pagedserve_cpu
    paths = {"tiles": lambda x, w, h: ops.linear_amx(x, w, None), "oneDNN": lambda x, w, h: ops.linear_vector(x, w, None, h)}
    gen = torch.Generator().manual_seed(0)
    rows, seen = 0, []
    for count in AMX_ROWS_TRIED:
        xs = {k: torch.randn(count, k, generator=gen).bfloat16() for k in {w.shape[1] for w, _ in matrices}}
        best = dict.fromkeys(paths, float("inf"))
        for _ in range(3):
            for name, path in paths.items():
                start = time.perf_counter()
                for w, h in matrices:
                    path(xs[w.shape[1]], w, h)
                best[name] = min(best[name], time.perf_counter() - start)
        seen.append(f"{count}: {best['tiles'] * 1e3:.1f}/{best['oneDNN'] * 1e3:.1f}")
        if best["tiles"] > best["oneDNN"]:
            break
        rows = count
    logger.info("AMX linear for up to %d token rows (ms for %d matrices, tiles/oneDNN, by rows: %s)",
                rows, len(matrices), ", ".join(seen))
    return rows


def _release(handles: list[int]) -> None:
    for handle in handles:
        torch.ops.pagedserve_cpu.release_linear_weight(handle)


def silu_mul_op():
    """torch.ops.pagedserve_cpu.silu_mul (a bfloat16 silu(gate) * up, cpu_activation.cpp), or None where
    the kernels are off or this build lacks AVX512-BF16."""
    if paged_decode_op() is None or not torch.ops.pagedserve_cpu.silu_mul_available():
        return None
    return torch.ops.pagedserve_cpu.silu_mul


def argmax_op():
    """torch.ops.pagedserve_cpu.argmax_rows (each float32 row's argmax, as torch.argmax), or None."""
    return torch.ops.pagedserve_cpu.argmax_rows if paged_decode_op() is not None else None


def race_op():
    """torch.ops.pagedserve_cpu.race_rows (sampling's race over counter-based noise, engine_svc/race.py), or None."""
    return torch.ops.pagedserve_cpu.race_rows if paged_decode_op() is not None else None


def bitmask_op():
    """torch.ops.pagedserve_cpu.apply_token_bitmask (structured outputs' logits mask), or None."""
    return torch.ops.pagedserve_cpu.apply_token_bitmask if paged_decode_op() is not None else None


@functools.cache
def _load():
    try:
        library = prebuilt() or build()
        torch.ops.load_library(str(library))
        # shapes for torch.compile: the ops themselves stay opaque inside a compiled graph
        torch.library.register_fake("pagedserve_cpu::linear")(
            lambda x, weight, bias=None, packed=-1, out_dtype=None: x.new_empty((*x.shape[:-1], weight.shape[0]),
                                                                                dtype=out_dtype or x.dtype))
        torch.library.register_fake("pagedserve_cpu::silu_mul")(
            lambda gate_up: gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2)))
        return torch.ops.pagedserve_cpu.paged_decode
    except Exception as exc:  # noqa: BLE001 - any failure means "use the torch path", never a crash
        logger.warning("CPU attention kernels unavailable, using the pure-torch path: %s", exc)
        return None


def cpu_flags() -> list[str]:
    """The vector extensions this CPU has, never -march=native: the cache may be shared by another
    x86-64 CPU model (the key below includes these flags). AVX-512 with BF16 enables the kernel's
    in-place bfloat16 dot products."""
    flags = cpu_info.cpu_flags()
    out = list(AVX2_FLAGS) if {"avx2", "fma"} <= flags else []
    if out and AVX512_BF16 <= flags:
        out += AVX512_FLAGS
    return out


def cache_dir() -> Path:
    root = os.environ.get("PAGEDSERVE_CACHE") or str(Path.home() / ".cache" / "pagedserve")
    return Path(root) / "torch_extensions"


def prebuilt_name(vector_flags: list[str]) -> str:
    """The file name of the prebuilt library for these flags (torch's version in it: its ABI)."""
    return f"pagedserve_cpu-{torch.__version__}-{'-'.join(f[2:] for f in vector_flags) or 'base'}.so"


def prebuilt() -> Path | None:
    """The library for this CPU from $PAGEDSERVE_CPU_KERNELS_DIR, when that folder has it."""
    folder = os.environ.get(PREBUILT_ENV)
    path = Path(folder) / prebuilt_name(cpu_flags()) if folder else None
    return path if path is not None and path.is_file() else None


def prebuild(folder: str | Path) -> list[Path]:
    """Compile every variant into ``folder`` (the image's build stage): the runtime then needs no compiler."""
    variants = VARIANTS if platform.machine().lower() in ("x86_64", "amd64") else ([],)
    return [build(flags, Path(folder) / prebuilt_name(flags)) for flags in variants]


def build(vector_flags: list[str] | None = None, target: Path | None = None) -> Path:
    """The path of the compiled library, compiling it when not cached (``target``: there instead
    of the cache; ``vector_flags``: these instead of this CPU's)."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++/c++) on PATH")
    command = [compiler, *BASE_FLAGS, *(cpu_flags() if vector_flags is None else vector_flags), *_torch_flags()]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256("\0".join([*command, version, torch.__version__]).encode()
                            + b"".join(source.read_bytes() for source in (*SOURCES, *HEADERS)))
    target = target or cache_dir() / f"pagedserve_cpu_{digest.hexdigest()[:20]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("compiling the CPU attention kernels (once, cached in %s)...", target.parent)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pagedserve-cpu-", dir=target.parent) as tmp:
        out = Path(tmp) / "lib.so"
        proc = subprocess.run([*command, *map(str, SOURCES), "-o", str(out), *_torch_libs()], capture_output=True,
                              text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling the CPU kernels failed:\n{proc.stderr[-4000:]}")
        os.replace(out, target)
    logger.info("compiled the CPU attention kernels in %.0f s", time.monotonic() - start)
    return target


def _torch_flags() -> list[str]:
    from torch.utils.cpp_extension import include_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in include_paths())]


def _torch_libs() -> list[str]:
    lib_dir = Path(torch.__file__).parent / "lib"
    # libgomp comes from torch's lib dir too (same soname), so one OpenMP runtime serves both
    return [f"-L{lib_dir}", f"-Wl,-rpath,{lib_dir}", "-lc10", "-ltorch_cpu", "-ltorch"]


__all__ = ["enabled", "onednn_packs", "paged_decode_op", "decode_kernel_for", "kv_writer_for", "prefill_kernel_for", "linear_op",
           "silu_mul_op", "argmax_op", "bitmask_op", "race_op", "build", "cache_dir",
           "prebuild", "prebuilt"]
