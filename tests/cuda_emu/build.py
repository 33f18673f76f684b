"""Builds the emulated kernels (engine_svc/kernels/*.cu + tests/cuda_emu) into one shared library.

Two runtimes, chosen at build time (see the package docstring): the default "fibers" flavour,
and "tsan", the thread-per-CUDA-thread runtime (-DPS_EMU_THREADS) with the kernels compiled by
-fsanitize=thread ("threads" is the same runtime without the sanitizer). The runtime itself is
never instrumented: its own synchronization must stay invisible to ThreadSanitizer.

A library is cached under $PAGEDSERVE_CACHE/cuda_emu (default ~/.cache/pagedserve/cuda_emu),
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
from dataclasses import dataclass
from pathlib import Path

EMU_DIR = Path(__file__).resolve().parent
KERNEL_DIR = EMU_DIR.parents[1] / "engine_svc" / "kernels"
CXX_FLAGS = ["-std=c++20", "-O2", "-fPIC", "-pthread", "-fno-strict-aliasing", "-U_FORTIFY_SOURCE"]
RUNTIME_SOURCES = ["cuda_emu_api.cpp", "cuda_emu.cpp", "cuda_emu_threads.cpp"]


@dataclass(frozen=True)
class Flavour:
    """Owns the extra flags of one library flavour: for all sources, for the .cu kernels only, for the link."""

    name: str
    flags: tuple[str, ...] = ()
    kernel_flags: tuple[str, ...] = ()
    link_flags: tuple[str, ...] = ()


# Thread mode: kernel statics (__shared__) in their own sections for shared_section.ld, and hidden,
# so they never bind to another loaded emulation library's symbols of the same name.
_THREADS = Flavour("threads", ("-DPS_EMU_THREADS",), ("-fdata-sections", "-fvisibility=hidden"),
                   (f"-Wl,-T,{EMU_DIR / 'shared_section.ld'}",))
FLAVOURS = {
    "fibers": Flavour("fibers"),
    "threads": _THREADS,
    "tsan": Flavour("tsan", (*_THREADS.flags, "-O1", "-g"), (*_THREADS.kernel_flags, "-fsanitize=thread"),
                    (*_THREADS.link_flags, "-fsanitize=thread")),
}


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


def tsan_runtime() -> Path | None:
    """g++'s ThreadSanitizer runtime (to LD_PRELOAD into a process that loads the tsan flavour), if any."""
    if shutil.which("g++") is None:
        return None
    proc = subprocess.run(["g++", "-print-file-name=libtsan.so"], capture_output=True, text=True)
    path = Path(proc.stdout.strip())
    return path.resolve() if proc.returncode == 0 and path.is_absolute() and path.exists() else None


def _kernel_sources() -> list[Path]:
    return sorted(KERNEL_DIR.glob("*.cu")) + sorted(EMU_DIR.glob("*.cu"))


def _hashed_files() -> list[Path]:
    files = list(KERNEL_DIR.glob("*.cu*")) + list(EMU_DIR.glob("*.[ch]*")) + list(EMU_DIR.glob("*.ld"))
    return sorted(set(files) | set((EMU_DIR / "fallback").glob("*.h")))


def cache_dir() -> Path:
    root = os.environ.get("PAGEDSERVE_CACHE") or str(Path.home() / ".cache" / "pagedserve")
    return Path(root) / "cuda_emu"


def _compile_command(src: Path, obj: Path, include: Path, flavour: Flavour) -> list[str]:
    cmd = ["g++", *CXX_FLAGS, *flavour.flags, "-I", str(EMU_DIR), "-I", str(KERNEL_DIR), "-I", str(include)]
    if src.suffix == ".cu":
        cmd += [*flavour.kernel_flags, "-x", "c++", "-include", str(EMU_DIR / "cuda_emu.h")]
    return [*cmd, "-c", str(src), "-o", str(obj)]


def build(*, fallback_fp16: bool = False, flavour: str = "fibers") -> Path:
    """Path of the emulation library, built if not cached. fallback_fp16 ignores the toolkit's headers."""
    how = FLAVOURS[flavour]
    include = None if fallback_fp16 else cuda_include_dir()
    include = include or EMU_DIR / "fallback"
    version = subprocess.run(["g++", "--version"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256(f"{CXX_FLAGS}|{how}|{include}|{version}".encode())
    for path in _hashed_files():
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    name = "libpsemu" if flavour == "fibers" else f"libpsemu-{flavour}"
    out = cache_dir() / f"{name}-{digest.hexdigest()[:20]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="psemu-", dir=out.parent) as tmp:
        jobs = [(src, Path(tmp) / f"cu-{i}-{src.stem}.o") for i, src in enumerate(_kernel_sources())]
        jobs += [(EMU_DIR / src, Path(tmp) / f"rt-{Path(src).stem}.o") for src in RUNTIME_SOURCES]
        with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
            results = list(pool.map(lambda job: _run(_compile_command(*job, include, how)), jobs))
        errors = [r for r in results if r]
        if errors:
            raise RuntimeError("building the CUDA emulation failed:\n" + "\n".join(errors))
        lib = Path(tmp) / "lib.so"
        err = _run(["g++", "-shared", "-pthread", *how.link_flags, "-o", str(lib), *(str(obj) for _, obj in jobs)])
        if err:
            raise RuntimeError("linking the CUDA emulation failed:\n" + err)
        os.replace(lib, out)
    return out


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return "" if proc.returncode == 0 else f"$ {' '.join(cmd)}\n{proc.stderr[-8000:]}"
