"""The CUDA kernels under ThreadSanitizer, through the emulator's thread mode (tests/cuda_emu).

The "tsan" flavour runs every CUDA thread as an OS thread and compiles the kernels with
-fsanitize=thread; TSan sees only the happens-before edges CUDA promises (__syncthreads,
__syncwarp, the end of a block), so a missing barrier is reported as a data race. python is not
instrumented, so the cases (tests/cuda_emu/tsan_cases.py) run in one child process with libtsan
preloaded; each must match the reference with no TSan report, and the neighbour-read kernels
prove that an unordered shared-memory read is reported.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cuda_emu import tsan_cases
from tests.cuda_emu.build import build, tsan_runtime

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found: CUDA emulation skipped")

REPO = Path(__file__).resolve().parents[2]
# Every racing pair is reported, not only the first per stack or address: the negative cases share both.
TSAN_OPTIONS = "exitcode=0 suppress_equal_stacks=0 suppress_equal_addresses=0"
REPORT = "WARNING: ThreadSanitizer"


@pytest.fixture(scope="module")
def tsan_results() -> dict[str, tuple[str | None, str]]:
    """case -> (its error or None, what TSan wrote to stderr while it ran), from one child process."""
    runtime = tsan_runtime()
    if runtime is None:
        pytest.skip("libtsan not found (g++ -print-file-name=libtsan.so): ThreadSanitizer checks skipped")
    library = build(flavour="tsan")
    preload = " ".join(filter(None, [str(runtime), os.environ.get("LD_PRELOAD")]))
    env = {**os.environ, "LD_PRELOAD": preload, "TSAN_OPTIONS": TSAN_OPTIONS, "OMP_NUM_THREADS": "1"}
    proc = _run_child([sys.executable, "-m", "tests.cuda_emu.tsan_cases", str(library), *tsan_cases.CASES], env)
    assert proc.returncode == 0, f"the TSan child failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    errors = {r["case"]: r["error"] for r in map(json.loads, proc.stdout.splitlines())}
    sections = {}
    for chunk in proc.stderr.split(tsan_cases.MARKER)[1:]:
        name, _, text = chunk.partition("\n")
        sections[name] = text
    assert set(errors) == set(tsan_cases.CASES), f"cases that did not run: {set(tsan_cases.CASES) - set(errors)}"
    return {name: (errors[name], sections.get(name, "")) for name in tsan_cases.CASES}


def _run_child(cmd: list[str], env: dict) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    # gcc's TSan runtime cannot place its shadow memory under the larger mmap randomization of
    # recent kernels ("unexpected memory mapping"); without address randomization it can.
    if proc.returncode != 0 and "unexpected memory mapping" in proc.stderr and shutil.which("setarch"):
        proc = subprocess.run(["setarch", platform.machine(), "-R", *cmd], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=300)
    return proc


def _assert_clean(name: str, tsan_results) -> None:
    error, stderr = tsan_results[name]
    assert error is None, error
    assert REPORT not in stderr, f"{stderr.count(REPORT)} TSan report(s) in {name}; the first:\n" + \
        stderr[stderr.index(REPORT):][:6000]


@pytest.mark.parametrize("name", tsan_cases.KERNEL_CASES)
def test_kernel_has_no_race_and_matches_reference(tsan_results, name):
    _assert_clean(name, tsan_results)


@pytest.mark.parametrize("name", tsan_cases.EMULATOR_CASES)
def test_thread_mode_keeps_the_emulator_semantics(tsan_results, name):
    """Poisoned shared memory, shuffles, barriers and unmatched-barrier errors, as in the fiber mode."""
    _assert_clean(name, tsan_results)


@pytest.mark.parametrize(("name", "is_racy"), [(n, racy) for n, (_, _, racy) in tsan_cases.NEIGHBOUR_READS.items()])
def test_tsan_reports_exactly_the_unordered_shared_reads(tsan_results, name, is_racy):
    """A shared-memory read of another thread's write is a race unless a barrier spanning both orders it."""
    error, stderr = tsan_results[f"neighbour_read_{name}"]
    assert error is None, error
    if is_racy:
        assert "WARNING: ThreadSanitizer: data race" in stderr and "emu_neighbour_read" in stderr
    else:
        assert REPORT not in stderr, stderr[:6000]


def test_thread_mode_runs_without_tsan():
    """The thread runtime also builds and runs uninstrumented, in this process (no libtsan needed)."""
    from tests.cuda_emu.launcher import EmuLauncher

    launcher = EmuLauncher(build(flavour="threads"))
    for name in [*tsan_cases.EMULATOR_CASES, "decode_split_f16"]:
        tsan_cases.CASES[name](launcher)
