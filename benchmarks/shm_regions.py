"""What a system shared-memory request costs the server in region handling (issue #25).

A request whose input and output live in client regions (``perf_analyzer
--shared-memory system``) skips the tensor bytes on the wire but pays for the regions in
Python: the parameters, the bounds, the object's size checked against a client that
shrank it, the input's view, the output copied in. At MiniLM sizes (kilobytes) that is
what decides whether shared memory beats binary HTTP, and end to end this host's noise
(+-5%) hides changes of a microsecond or two. This measures the handling alone, in one
process: ``SystemSharedMemory.read_inputs``, ``output_targets`` and ``write_outputs`` for
an ``mlp``-shaped request (one FP32 [1, 256] input, one FP32 [1, 10] output, each in a
region of its own, as perf_analyzer places them), best of ``--repeat`` runs.

    .venv/bin/python benchmarks/shm_regions.py
    git archive HEAD~1 src | tar -x -C /tmp/before
    .venv/bin/python benchmarks/shm_regions.py --src /tmp/before/src,src

With ``--src A,B`` each tree runs in a process of its own (its ``src`` first on
PYTHONPATH), alternating, and the ratio B / A of their best figures is printed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(number: int, repeat: int) -> float:
    """Microseconds of region handling per request, best of ``repeat``."""
    import numpy as np

    from slipstream.serving.shared_memory import SystemSharedMemory
    from slipstream.types import (
        InferRequest,
        InferResponse,
        RequestedOutput,
        SharedMemoryInput,
        SharedMemoryRef,
    )

    keys = (f"/bench_shm_in_{os.getpid()}", f"/bench_shm_out_{os.getpid()}")
    for key in keys:
        descriptor = os.open("/dev/shm" + key, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(descriptor, 4096)
        os.close(descriptor)
    regions = SystemSharedMemory(allowed=True)
    try:
        regions.register("in", keys[0], 0, 1024)
        regions.register("out", keys[1], 0, 40)
        output = np.ones((1, 10), np.float32)

        def one() -> None:
            request = InferRequest(
                "mlp", "", {},
                shared_memory_inputs={"input": SharedMemoryInput(
                    "FP32", [1, 256], SharedMemoryRef("in", 0, 1024))},
                outputs=[RequestedOutput("output", shared_memory=SharedMemoryRef("out", 0, 40))],
            )  # fmt: skip
            regions.read_inputs(request)
            targets = regions.output_targets(request)
            regions.write_outputs(targets, InferResponse("mlp", "1", {"output": output}))

        return min(timeit.repeat(one, number=number, repeat=repeat)) / number * 1e6
    finally:
        regions.close()
        for key in keys:
            os.unlink("/dev/shm" + key)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", default="", help="A,B: two src trees to compare")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--number", type=int, default=50_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one or not args.src:
        print(f"{measure(args.number, args.repeat):.2f}")
        return
    trees = args.src.split(",")
    best: dict[str, list[float]] = {tree: [] for tree in trees}
    for _ in range(args.rounds):
        for tree in trees:
            done = subprocess.run(
                [sys.executable, __file__, "--one", "--number", str(args.number),
                 "--repeat", str(args.repeat)],
                env={**os.environ, "PYTHONPATH": str(Path(tree).resolve())},
                capture_output=True, text=True, check=True, cwd=ROOT,
            )  # fmt: skip
            best[tree].append(float(done.stdout))
            print(f"{tree}: {best[tree][-1]:.2f} us per request")
    first, second = (min(best[tree]) for tree in trees[:2])
    print(f"region handling per request: {first:.2f} -> {second:.2f} us "
          f"({second / first:.2f}; best of {args.rounds} rounds each)")  # fmt: skip


if __name__ == "__main__":
    main()
