"""Triton's C++ load generator, `perf_analyzer`, in a venv of its own.

    python benchmarks/peers/perf_analyzer.py   # install once (~1 min), print its path

The `tritonclient` 2.41.0 wheel is the last that ships the binary (under
`tritonclient-2.41.0.data/data/bin/`). It links `libb64.so.0d` (Debian's `libb64-0d`,
from `make install`'s DEBIAN_PACKAGES) and `libcudart.so.12` even on a CPU host, taken
here from PyPI's `nvidia-cuda-runtime-cu12`. Both live in `.bench-venvs/perf-analyzer-2.41.0/`,
never in the project's lock.
"""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
RELEASE = "2.41.0"
HOME = REPO_ROOT / ".bench-venvs" / f"perf-analyzer-{RELEASE}"
REQUIREMENTS = [f"tritonclient=={RELEASE}", "nvidia-cuda-runtime-cu12"]


def ensure_perf_analyzer(install: bool = True) -> tuple[Path, dict[str, str]] | None:
    """The binary and the environment to run it with; None when it is not installed and
    ``install`` is False, or when libb64 is missing (install it with `make install`)."""
    binary = HOME / "bin" / "perf_analyzer"
    if not binary.exists():
        if not install:
            return None
        print(f"installing perf_analyzer (tritonclient {RELEASE}) into {HOME}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(HOME)], check=True)
        subprocess.run([str(HOME / "bin" / "pip"), "install", "--quiet", *REQUIREMENTS], check=True)
    if ctypes.util.find_library("b64") is None:
        print("perf_analyzer needs libb64-0d: run `make install` (DEBIAN_PACKAGES)")
        return None
    cudart = next(HOME.glob("lib/python*/site-packages/nvidia/cuda_runtime/lib"), None)
    env = dict(os.environ)
    if cudart is not None:
        env["LD_LIBRARY_PATH"] = f"{cudart}:{env.get('LD_LIBRARY_PATH', '')}"
    return binary, env


if __name__ == "__main__":
    found = ensure_perf_analyzer()
    print(found[0] if found else "perf_analyzer is not available")
