"""`slipstream serve` under tracemalloc, for finding what holds memory in a soak.

    python benchmarks/traced_serve.py SNAPSHOT_DIR serve --model-repository ...

Everything after SNAPSHOT_DIR is `slipstream`'s own command line. Each SIGUSR1 writes
the Python allocations still held, with 12 frames of traceback each, to
SNAPSHOT_DIR/<n>.snapshot (`tracemalloc.Snapshot.load` reads it back; `soak.py
--trace-memory DIR` takes one at the end of warm-up and one at the end, and prints what
grew between them). tracemalloc sees Python's allocations only: growth it does not show
is native (C libraries, the allocator's free lists).
"""

from __future__ import annotations

import signal
import sys
import tracemalloc
from pathlib import Path
from types import FrameType


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    tracemalloc.start(12)
    taken = 0

    def dump(_signum: int, _frame: FrameType | None) -> None:
        nonlocal taken
        taken += 1
        tracemalloc.take_snapshot().dump(str(out / f"{taken}.snapshot"))

    signal.signal(signal.SIGUSR1, dump)
    from slipstream.cli import main as slipstream

    sys.argv = ["slipstream", *sys.argv[2:]]
    slipstream()


if __name__ == "__main__":
    main()
