"""Busy neighbours on the host: processes spinning a Python loop each, standing for a
front end, a load generator or another tenant (the CPU-thread tests and benchmarks)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """``count`` processes spinning on the host's cores while the block runs."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
