"""The torch backend on the CPU beside busy neighbours: fixed thread counts against the
governor.

    .venv/bin/python benchmarks/torch_threads.py [--seconds 4] [--rounds 2] [--batch 8,64]

For 0, 1 and 2 busy processes (each a Python loop spinning on the host's cores, standing
for a front end, a load generator or a neighbour), runs an exported MLP (384 -> 1536 ->
384, GELU, random weights) through Slipstream's torch backend, as the server does: its
own thread calling ``run()`` back to back for ``--seconds``. Settings: every core's
thread (``intra_op_thread_count`` fixed at the core count), one thread (fixed 1) and the
default (no count given), whose governor gives threads up while the kernel's CPU
pressure says the cores are crowded (``slipstream/runtime/cpu_share.py``). Prints rows/s,
the ratio of each setting to the best fixed one beside the same neighbours and the
default's thread count at the end. Rounds alternate the settings; medians.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.neighbours import against_neighbours  # noqa: E402
from slipstream.runtime.base import usable_cpu_count  # noqa: E402
from slipstream.runtime.torch import TorchBackend  # noqa: E402
from tests.torch_models import export_mlp  # noqa: E402


def rows_per_s(backend: TorchBackend, batch: int, seconds: float) -> float:
    """Rows a second from ``run()`` called back to back on a fresh thread (as a model
    instance's dedicated thread calls it)."""
    x = np.random.default_rng(0).standard_normal((batch, 384)).astype(np.float32)
    name = backend.signature().inputs[0].name
    output = backend.signature().outputs[0].name
    result: list[float] = []

    def work() -> None:
        for _ in range(5):
            backend.run({name: x}, [output])
        done, started = 0, time.monotonic()
        while time.monotonic() - started < seconds:
            backend.run({name: x}, [output])
            done += 1
        result.append(done * batch / (time.monotonic() - started))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    return result[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", default="8,64")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cores = usable_cpu_count()
    kinds: dict[str, dict[str, str]] = {
        f"fixed {cores}": {"intra_op_thread_count": str(cores)},
        "fixed 1": {"intra_op_thread_count": "1"},
        "default": {},
    }
    print(f"{cores} cores; {args.seconds:.0f} s a measurement, {args.rounds} rounds")
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = export_mlp(Path(tmp) / "model.pt2")
        for batch in (int(b) for b in args.batch.split(",")):

            def measure(name: str, batch: int = batch) -> tuple[float, int]:
                backend = TorchBackend.load(path, kinds[name], 1)
                try:
                    rate = rows_per_s(backend, batch, args.seconds)
                    return rate, backend.cpu_threads or 0
                finally:
                    backend.close()

            results.update(against_neighbours(cores, list(kinds), measure, args.rounds,
                                              "rows/s", f"batch {batch}, "))  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
