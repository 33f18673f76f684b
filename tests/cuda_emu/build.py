"""Builds the emulated kernels (engine_svc/kernels/*.cu + tests/cuda_emu) into one shared library.

The library is cached under $PAGEDSERVE_CACHE/cuda_emu (default ~/.cache/pagedserve/cuda_emu),
keyed on the hash of every source, the flags and the compiler version, so a test session builds
it at most once. Sources compile in parallel; the result is renamed into place atomically, so
concurrent sessions cannot see a half-written library.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

EMU_DIR = Path(__file__).resolve().parent
KERNEL_DIR = EMU_DIR.parents[1] / "engine_svc" / "kernels"
CXX_FLAGS = ["-std=c++20", "-O2", "-fPIC", "-pthread", "-fno-strict-aliasing", "-U_FORTIFY_SOURCE"]


def cuda_include_dir() -> Path | None:
    """The CUDA toolkit's include dir (for cuda_fp16.h / cuda_bf16.h in host mode), if installed."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parents[1]))
    for root in filter(None, candidates):
        inc = Path(root) / "include"
        if (inc / "cuda_fp16.h").is_file() and (inc / "cuda_bf16.h").is_file():
            return inc
    return None


def _sources() -> list[Path]:
    return sorted(KERNEL_DIR.glob("*.cu")) + sorted(EMU_DIR.glob("*.cu")) + [EMU_DIR / "cuda_emu.cpp"]


def _hashed_files() -> list[Path]:
    files = list(KERNEL_DIR.glob("*.cu*")) + list(EMU_DIR.glob("*.[ch]*")) + list(EMU_DIR.glob("*.cu"))
    return sorted(set(files) | set((EMU_DIR / "fallback").glob("*.h")))


def cache_dir() -> Path:
    root = os.environ.get("PAGEDSERVE_CACHE") or str(Path.home() / ".cache" / "pagedserve")
    return Path(root) / "cuda_emu"


def _compile_command(src: Path, obj: Path, include: Path) -> list[str]:
    cmd = ["g++", *CXX_FLAGS, "-I", str(EMU_DIR), "-I", str(KERNEL_DIR), "-I", str(include)]
    if src.suffix == ".cu":
        cmd += ["-x", "c++", "-include", str(EMU_DIR / "cuda_emu.h")]
    return [*cmd, "-c", str(src), "-o", str(obj)]


def build(*, fallback_fp16: bool = False) -> Path:
    """Path of the emulation library, built if not cached. fallback_fp16 ignores the toolkit's headers."""
    include = None if fallback_fp16 else cuda_include_dir()
    include = include or EMU_DIR / "fallback"
    version = subprocess.run(["g++", "--version"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256(f"{CXX_FLAGS}|{include}|{version}".encode())
    for path in _hashed_files():
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    out = cache_dir() / f"libpsemu-{digest.hexdigest()[:20]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="psemu-", dir=out.parent) as tmp:
        objs = [Path(tmp) / f"{i}-{src.stem}.o" for i, src in enumerate(_sources())]
        with ThreadPoolExecutor(max_workers=max(1, min(len(objs), os.cpu_count() or 1))) as pool:
            results = list(pool.map(lambda so: _run(_compile_command(so[0], so[1], include)), zip(_sources(), objs)))
        errors = [r for r in results if r]
        if errors:
            raise RuntimeError("building the CUDA emulation failed:\n" + "\n".join(errors))
        lib = Path(tmp) / "lib.so"
        err = _run(["g++", "-shared", "-pthread", "-o", str(lib), *map(str, objs)])
        if err:
            raise RuntimeError("linking the CUDA emulation failed:\n" + err)
        os.replace(lib, out)
    return out


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return "" if proc.returncode == 0 else f"$ {' '.join(cmd)}\n{proc.stderr[-8000:]}"
