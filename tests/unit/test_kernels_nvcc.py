"""nvcc compiles the kernels for the GPUs pagedserve targets (sm_80 A100, sm_90 H100/H200).

By default each translation unit is what cupy_backend hands NVRTC (every .cu of the kernels,
one configuration) for one configuration per dtype, both architectures, in parallel;
PAGEDSERVE_NVCC_FULL=1 compiles every instantiation of every file instead. A passing compile is
remembered under the cache dir by source hash, so a rerun without kernel changes is instant.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engine_svc.attention.cupy_backend import KERNEL_DIR, KERNEL_FILES
from tests.cuda_emu.build import cache_dir

ARCHS = ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90"]
CONFIGS = [("f32", 64, 8), ("f16", 128, 16), ("bf16", 128, 32)]


def _nvcc() -> str | None:
    return shutil.which("nvcc") or next(
        (p for p in ("/usr/local/cuda/bin/nvcc", "/usr/local/bin/nvcc") if os.access(p, os.X_OK)), None)


pytestmark = pytest.mark.skipif(_nvcc() is None, reason="nvcc not found: CUDA compile check skipped")


def _kernel_names(dtype: str, head: int, block: int) -> list[str]:
    """The names cupy_backend looks up for one configuration."""
    return [f"ps_reshape_and_cache_{dtype}", "ps_copy_blocks", f"ps_paged_decode_{dtype}_h{head}_b{block}",
            f"ps_paged_decode_reduce_{dtype}_h{head}", f"ps_paged_prefill_{dtype}_h{head}_b{block}",
            f"ps_paged_prefill_single_{dtype}_h{head}_b{block}"]


def _compile(nvcc: str, src: Path, defines: list[str], tmp: Path) -> str:
    obj = tmp / (src.stem + "-" + "-".join(d.split("=")[-1] for d in defines) + ".o")
    cmd = [nvcc, "-std=c++17", *ARCHS, f"-I{KERNEL_DIR}", *defines, "-c", str(src), "-o", str(obj)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return f"$ {' '.join(cmd)}\n{proc.stderr[-6000:]}"
    symbols = subprocess.run(["nm", str(obj)], capture_output=True, text=True).stdout
    if "-DPS_ONE_CONFIG" in defines:
        dtype, head, block = (d.split("=")[1] for d in defines[1:4])
        missing = [n for n in _kernel_names(dtype, int(head), int(block)) if n not in symbols]
        if missing:
            return f"{src.name} {defines}: missing kernels {missing}"
    return ""


def _jobs(tmp: Path) -> list[tuple[Path, list[str]]]:
    if os.environ.get("PAGEDSERVE_NVCC_FULL") == "1":
        return [(KERNEL_DIR / name, []) for name in KERNEL_FILES]
    unit = tmp / "kernels.cu"  # the translation unit cupy_backend compiles
    unit.write_text("".join(f'#include "{name}"\n' for name in KERNEL_FILES))
    return [(unit, ["-DPS_ONE_CONFIG", f"-DPS_CONFIG_DTYPE={d}", f"-DPS_CONFIG_HEAD={h}", f"-DPS_CONFIG_BLOCK={b}"])
            for d, h, b in CONFIGS]


def test_kernels_compile_for_sm80_and_sm90(tmp_path):
    nvcc = _nvcc()
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256(f"{version}{ARCHS}{CONFIGS}{os.environ.get('PAGEDSERVE_NVCC_FULL')}".encode())
    for path in sorted(KERNEL_DIR.glob("*.cu*")):
        digest.update(path.read_bytes())
    stamp = cache_dir().parent / "nvcc" / f"ok-{digest.hexdigest()[:20]}"
    if stamp.exists():
        return
    jobs = _jobs(tmp_path)
    with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        errors = [e for e in pool.map(lambda job: _compile(nvcc, job[0], job[1], tmp_path), jobs) if e]
    assert not errors, "\n\n".join(errors)
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.touch()
