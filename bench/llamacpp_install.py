"""llama.cpp's server (PyPI `llama-cpp-python[server]`, built from source) in its own virtual
environment, installed on demand for bench/sweep.py; it is never a dependency of pagedserve.

    python bench/llamacpp_install.py [--peer-dir .peers/llamacpp] [--version 0.3.36]

Steps, each printed: `python3 -m venv`, `pip install llama-cpp-python[server]==V` (an sdist: pip
compiles llama.cpp with CMake for this CPU; CMAKE_BUILD_PARALLEL_LEVEL sets the jobs, default 2,
and the build runs under `nice -n 19` so it disturbs the rest of the machine least), then
`python -c "import llama_cpp.server"` must work. A stamp file naming the version makes a second
call a no-op.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PeerVenv  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
PEER_DIR = REPO_ROOT / ".peers" / "llamacpp"
LLAMACPP_VERSION = "0.3.36"  # newest on PyPI (`pip index versions llama-cpp-python`) when written


def ensure_llamacpp(peer_dir: Path = PEER_DIR, version: str = LLAMACPP_VERSION, jobs: int = 2) -> Path:
    """Build llama-cpp-python[server]==`version` into `peer_dir` unless its stamp says so; its bin/."""
    venv = PeerVenv(peer_dir, "llamacpp-install")
    if venv.has(version):
        return venv.bin
    venv.create()
    env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs)}
    venv.step(f"building llama-cpp-python[server]=={version} from source ({jobs} jobs, nice 19; minutes)",
              ["nice", "-n", "19", *venv.pip, "install", "--no-binary", "llama-cpp-python",
               f"llama-cpp-python[server]=={version}"], env=env)
    venv.step("checking `import llama_cpp.server`",
              [str(venv.python), "-c",
               "import llama_cpp, llama_cpp.server.app; print('llama_cpp', llama_cpp.__version__)"])
    return venv.mark_installed("llama-cpp-python", version)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer-dir", type=Path, default=PEER_DIR)
    p.add_argument("--version", default=LLAMACPP_VERSION)
    p.add_argument("--jobs", type=int, default=2, help="parallel compile jobs (CMAKE_BUILD_PARALLEL_LEVEL)")
    args = p.parse_args(argv)
    print(ensure_llamacpp(args.peer_dir, args.version, args.jobs))


if __name__ == "__main__":
    main()
