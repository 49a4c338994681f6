"""llama.cpp's own C++ server (`llama-server`), built once from the sources that the
llama-cpp-python sdist vendors (the same llama.cpp release Slipstream's engine runs).

    python benchmarks/peers/llama_server.py   # build (~10 min on 2 cores), print its path

The build lands in `.bench-venvs/llama-server-<version>/` (native CPU flags, Release, no
curl), and later calls find it there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib.metadata import version
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CMAKE_FLAGS = ["-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DCMAKE_BUILD_TYPE=Release"]  # fmt: skip


def ensure_llama_server() -> Path:
    """The `llama-server` binary of the installed llama-cpp-python's llama.cpp, built once."""
    release = version("llama-cpp-python")
    home = REPO_ROOT / ".bench-venvs" / f"llama-server-{release}"
    binary = home / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    print(f"building llama-server from llama-cpp-python {release}'s sources into {home} "
          "(about 10 minutes on 2 cores, once)", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary",
             ":all:", "-d", tmp, f"llama-cpp-python=={release}"],
            check=True,
        )  # fmt: skip
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as archive:
            archive.extractall(tmp, filter="data")
        source = next(Path(tmp).glob("llama_cpp_python-*")) / "vendor" / "llama.cpp"
        shutil.rmtree(home, ignore_errors=True)
        shutil.copytree(source, home)
    jobs = str(len(os.sched_getaffinity(0)))
    subprocess.run(["cmake", "-S", str(home), "-B", str(home / "build"), *CMAKE_FLAGS],
                   check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    subprocess.run(["cmake", "--build", str(home / "build"), "--target", "llama-server",
                    "-j", jobs], check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    return binary


if __name__ == "__main__":
    print(ensure_llama_server())
