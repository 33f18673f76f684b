"""What every benchmark shares: the machine header, the workload, the models, progress lines,
side-by-side tables with ratios, percentiles, the matmul roofline, and plots under bench/out/.

Benchmarks live here, never in the test suite; each prints the peer's figure and ours from the
same run, with the ratio, the command and the machine.
"""

from __future__ import annotations

import os
import platform
import random
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parent / "out"
REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `python bench/x.py` from anywhere
    sys.path.insert(0, str(REPO_ROOT))


# ---------------------------------------------------------------------------- machine
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_lines() -> list[str]:
    """The command and the machine, printed at the top of every benchmark."""
    import torch
    import transformers

    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    env = " ".join(f"{k}={os.environ.get(k, '(unset)')}" for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY"))
    return [
        f"command: {shlex.join([Path(sys.executable).name, *sys.argv])}",
        f"machine: nproc={len(os.sched_getaffinity(0))} cpu={cpu_model()!r} torch_threads={torch.get_num_threads()} "
        f"load_avg={load} {env}",
        f"software: python {platform.python_version()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, pagedserve {_git_revision()}",
    ]


def _git_revision() -> str:
    """The checkout's commit, with '+dirty' when tracked files differ from it (read-only git)."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True,
                              timeout=10).stdout.strip()

    try:
        rev = git("rev-parse", "--short", "HEAD")
        return (rev + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")) or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def print_header(title: str) -> None:
    print(f"== {title}")
    for line in machine_lines():
        print("   " + line)
    sys.stdout.flush()


# ---------------------------------------------------------------------------- workload
@dataclass(frozen=True, slots=True)
class Workload:
    """Seeded random prompts (token ids) and output lengths; every request ignores EOS."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def max_len(self) -> int:
        return max(len(p) + o for p, o in zip(self.prompts, self.output_lens))

    def describe(self) -> str:
        lens = [len(p) for p in self.prompts]
        return (f"{self.num_requests} requests, prompt {min(lens)}-{max(lens)} tokens (sum {self.num_prompt_tokens}), "
                f"output {min(self.output_lens)}-{max(self.output_lens)} tokens (sum {self.num_output_tokens}), "
                "ignore_eos")


def make_workload(num_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                  vocab_size: int, seed: int = 0, first_token: int = 3) -> Workload:
    """Uniform lengths in the closed ranges; token ids avoid the first special ids."""
    rng = random.Random(seed)
    prompts, outputs = [], []
    for _ in range(num_requests):
        n = rng.randint(*prompt_range)
        prompts.append([rng.randrange(first_token, vocab_size) for _ in range(n)])
        outputs.append(rng.randint(*output_range))
    return Workload(prompts, outputs)


# ---------------------------------------------------------------------------- models
def resolve_bench_model(name: str) -> Path:
    """`default` = SmolLM2-135M-Instruct; `tiny` = a random 2-layer Llama with the default tokenizer
    (built once under $PAGEDSERVE_CACHE/bench/); anything else is an HF folder."""
    from shared.models import cache_root, default_model_dir

    if name == "default":
        return default_model_dir()
    if name == "tiny":
        from tests.fixtures.models import cached_tiny_model

        cache = cache_root() / "bench"
        cache.mkdir(parents=True, exist_ok=True)
        return cached_tiny_model(cache, "tiny-llama", "llama", tokenizer_dir=default_model_dir())
    path = Path(name)
    if not (path / "config.json").is_file():
        raise SystemExit(f"--model {name!r}: expected default, tiny or an HF folder with config.json")
    return path


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def model_shape(model_dir: Path, dtype: str = "float32") -> dict:
    """vocab_size, max_model_len and KV bytes per token in `dtype`, from config.json."""
    import json

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = cfg.get("num_key_value_heads", heads)
    return {"vocab_size": cfg["vocab_size"], "max_model_len": cfg.get("max_position_embeddings", 2048),
            "kv_bytes_per_token": 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * DTYPE_BYTES[dtype]}


# ---------------------------------------------------------------------------- progress and timing
class Progress:
    """One line to stderr at most every `every_s` seconds: label, done/total, rate, ETA."""

    def __init__(self, label: str, total: int, unit: str = "tok", every_s: float = 5.0):
        self.label, self.total, self.unit, self.every_s = label, total, unit, every_s
        self.done = 0
        self.start = self.last = time.perf_counter()

    def update(self, n: int = 1, extra: str = "") -> None:
        self.done += n
        now = time.perf_counter()
        if now - self.last >= self.every_s or self.done >= self.total:
            self.last = now
            elapsed = now - self.start
            rate = self.done / elapsed if elapsed > 0 else 0.0
            eta = (self.total - self.done) / rate if rate > 0 else float("inf")
            print(f"  [{self.label}] {self.done}/{self.total} {self.unit} {elapsed:6.1f}s "
                  f"{rate:8.1f} {self.unit}/s eta {eta:6.0f}s {extra}", file=sys.stderr, flush=True)


def percentile(values, q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of a non-empty sequence; nan when empty."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


# ---------------------------------------------------------------------------- tables
def ratio(ours: float, peer: float) -> str:
    if not peer or peer != peer or ours != ours:
        return "n/a"
    return f"{ours / peer:.2f}x"


MARKDOWN_ENV = "PAGEDSERVE_BENCH_MARKDOWN"  # a file: every table printed is also appended there (make bench)


def print_table(title: str, header: list[str], rows: list[list]) -> None:
    """A plain fixed-width table; floats get 4 significant digits. Also appended as a markdown
    table to the file that $PAGEDSERVE_BENCH_MARKDOWN names, when it names one."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max([len(str(h)), *(len(r[i]) for r in cells)]) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  " + "  ".join(str(h).ljust(w) for h, w in zip(header, widths)))
    print("  " + "  ".join("-" * w for w in widths))
    for row in cells:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)))
    sys.stdout.flush()
    if os.environ.get(MARKDOWN_ENV):
        with open(os.environ[MARKDOWN_ENV], "a") as out:
            out.write(f"\n**{title}**\n\n| " + " | ".join(map(str, header)) + " |\n|" + "---|" * len(header) + "\n")
            out.writelines("| " + " | ".join(c.replace("|", "/") for c in row) + " |\n" for row in cells)


def _fmt(value) -> str:
    if isinstance(value, float):
        if value != value:
            return "n/a"
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:,.0f}"
    return str(value)


def target(ok: bool | None) -> str:
    return "n/a" if ok is None else ("MET" if ok else "MISSED")


# ---------------------------------------------------------------------------- roofline
def matmul_gflops(m: int = 512, k: int = 576, n: int = 1536, seconds: float = 2.0, dtype: str = "float32") -> float:
    """Best sustained GFLOP/s of [m,k]x[k,n] in `dtype` over `seconds` (shape of a model's MLP by
    default), the better of torch's matmul and oneDNN's linear: for float32 torch takes MKL's SGEMM,
    which runs AVX2 code on an AMD CPU at under half of oneDNN's AVX-512 rate (the engine uses both)."""
    import torch

    a, b = torch.randn(m, k).to(getattr(torch, dtype)), torch.randn(k, n).to(getattr(torch, dtype))
    kernels = [lambda: a @ b]
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        weight = b.t().contiguous()
        kernels.append(lambda: torch.ops.mkldnn._linear_pointwise(a, weight, None, "none", [], ""))
    best = 0.0
    for kernel in kernels:
        try:
            for _ in range(3):
                kernel()
        except RuntimeError:  # oneDNN has no bfloat16 inner product on a CPU without AVX-512
            continue
        end = time.perf_counter() + seconds / len(kernels)
        while time.perf_counter() < end:
            reps = 10
            t0 = time.perf_counter()
            for _ in range(reps):
                kernel()
            dt = time.perf_counter() - t0
            best = max(best, 2.0 * m * k * n * reps / dt / 1e9)
    return best


def count_parameters(model_dir: Path) -> int:
    """Parameters from the safetensors headers (tied embeddings counted once)."""
    import json
    import struct

    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(size))
        for name, info in header.items():
            if name != "__metadata__":
                count = 1
                for d in info["shape"]:
                    count *= d
                total += count
    return total


# ---------------------------------------------------------------------------- plots
def save_figure(fig, name: str) -> Path:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / name
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")
    return path


def pyplot():
    """matplotlib with a file-only backend (no display here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ---------------------------------------------------------------------------- peers' virtual environments
class PeerVenv:
    """A peer system's own virtual environment under .peers/ (never a dependency of pagedserve),
    built by steps that are each printed; a stamp file naming the installed version makes a
    second build a no-op."""

    def __init__(self, peer_dir: Path, tag: str):
        self.peer_dir, self.tag = peer_dir, tag
        self.bin = peer_dir / "bin"
        self.python = self.bin / "python"
        self.pip = [str(self.python), "-m", "pip"]
        self._stamp = peer_dir / ".installed-stamp"
        self._start = time.perf_counter()

    def has(self, version: str) -> bool:
        return self._stamp.is_file() and self._stamp.read_text().strip() == version

    def create(self) -> None:
        """The venv (unless its python is there already), with pip upgraded."""
        self._start = time.perf_counter()
        if not self.python.is_file():
            self.step(f"creating the virtual environment {self.peer_dir}",
                      [sys.executable, "-m", "venv", str(self.peer_dir)])
        self.step("upgrading pip", [*self.pip, "install", "-q", "--upgrade", "pip"])

    def step(self, what: str, argv: list[str], env: dict | None = None, quiet: bool = False) -> None:
        """Run one step (``quiet``: its output is kept, and shown only when it fails); exit on failure."""
        import subprocess

        self.say(what)
        t0 = time.perf_counter()
        proc = subprocess.run(argv, env=env, capture_output=quiet, text=True)
        if proc.returncode != 0:
            detail = f"\n{proc.stderr}" if proc.stderr else ""
            raise SystemExit(f"failed ({proc.returncode}): {' '.join(argv)}{detail}"[-4000:])
        self.say(f"  done in {time.perf_counter() - t0:.0f} s")

    def mark_installed(self, name: str, version: str) -> Path:
        """Write the stamp once every step has passed; the venv's bin/."""
        self._stamp.write_text(version + "\n")
        self.say(f"{name} {version} ready in {self.peer_dir} ({time.perf_counter() - self._start:.0f} s)")
        return self.bin

    def say(self, line: str) -> None:
        print(f"[{self.tag}] {line}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- child processes
def stop_group(proc, grace_s: float = 15.0) -> None:
    """SIGTERM the process group ``proc`` leads (started with ``process_group=0``), SIGKILL it
    after ``grace_s``; nothing when it has exited already."""
    import signal
    import subprocess

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
