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
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from slipstream.runtime.base import usable_cpu_count  # noqa: E402
from slipstream.runtime.torch import TorchBackend  # noqa: E402


def export_mlp(path: Path) -> Path:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(384, 1536), torch.nn.GELU(), torch.nn.Linear(1536, 384)
    ).eval()
    batch = torch.export.Dim("batch", min=1, max=1024)
    program = torch.export.export(model, (torch.zeros(2, 384),), dynamic_shapes=({0: batch},))
    torch.export.save(program, str(path))
    return path


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
    results: dict[str, dict[str, Any]] = {}
    print(f"{cores} cores; {args.seconds:.0f} s a measurement, {args.rounds} rounds")
    with tempfile.TemporaryDirectory() as tmp:
        path = export_mlp(Path(tmp) / "model.pt2")
        for batch in (int(b) for b in args.batch.split(",")):
            for busy in range(cores + 1):
                hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                        for _ in range(busy)]  # fmt: skip
                try:
                    time.sleep(0.5)
                    rates: dict[str, list[float]] = {name: [] for name in kinds}
                    threads: dict[str, int] = {}
                    for _ in range(args.rounds):
                        for name, parameters in kinds.items():
                            backend = TorchBackend.load(path, parameters, 1)
                            rates[name].append(rows_per_s(backend, batch, args.seconds))
                            threads[name] = backend.intra_op_threads
                            backend.close()
                finally:
                    for hog in hogs:
                        hog.kill()
                        hog.wait()
                medians = {name: statistics.median(values) for name, values in rates.items()}
                best = max(medians[name] for name in medians if name.startswith("fixed"))
                label = f"batch {batch}, {busy} busy"
                results[label] = {"rows_per_s": rates, "threads_at_end": threads}
                for name, value in medians.items():
                    spread = f"{min(rates[name]):,.0f}-{max(rates[name]):,.0f}"
                    print(f"{label:17} {name:8} {value:9,.0f} rows/s ({spread})  / best fixed "
                          f"{value / best:.2f}  threads at end {threads[name]}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
