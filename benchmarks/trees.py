"""Tree models served by the fil backend against their library alone, in one run.

Prints rows/s and ratios (a script, never a test). For each model and batch size, in
alternating rounds on the same core:

- ``alone``: the library's own public call back to back in this process
  (``Booster.inplace_predict`` for XGBoost, ``lightgbm.Booster.predict``), one thread;
- ``backend``: Slipstream's fil backend ``run()`` in this process (what a served batch
  runs: the library's prediction and FIL's output);
- ``served``: ``slipstream serve`` answering ``slipstream bench --protocol http-binary``
  (Triton's binary tensor extension), one request in flight (``--concurrency 1``), and
  for batch 1 also 8 in flight, which the dynamic batcher merges.

The server and the in-process measurements run on core 0 (the server is idle while this
process measures), the load generator on core 1. ``served/alone`` is served rows/s over
alone rows/s at the same batch size: at batch 1 and one request in flight it is bounded by
the HTTP round trip, which the library alone never pays. Medians over ``--rounds``, and
the range: this host's 2 cores are shared with other work, so single figures move by
10-30% between runs.

Models (trained here on random rows; nothing downloaded): XGBoost ``binary:logistic``,
``--trees`` trees of depth 6, and LightGBM ``binary``, ``--trees`` trees of 63 leaves,
on 32 features, served from a Triton FIL config.pbtxt with ``predict_proba: true``.

``--candidates`` measures instead the other ways to run the same forests, in this
process on core 0 with one thread, where their packages are installed: Treelite's GTIL,
a tl2cgen-compiled library (gcc), and ONNX Runtime's TreeEnsemble through onnxmltools;
each one's rows/s at batch 1 and 256 beside the library's, and how far its answers are
from the library's. None of them is a Slipstream dependency.

Usage (from the repository root):
    .venv/bin/python benchmarks/trees.py                         # ~5 min on 2 cores
    .venv/bin/python benchmarks/trees.py --rounds 5 --seconds 4 --json trees.json
    .venv/bin/uv pip install --no-deps --target /tmp/tree-candidates treelite tl2cgen \
        onnxmltools
    PYTHONPATH=/tmp/tree-candidates .venv/bin/python benchmarks/trees.py --candidates
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from slipstream.runtime.fil import FilBackend  # noqa: E402
from tests.tree_models import fil_config  # noqa: E402
from tests.utils import free_ports  # noqa: E402

VENV_BIN = Path(sys.executable).parent
FEATURES = 32
SERVER_CORE = 0
CLIENT_CORE = 1
# (batch size, requests in flight) of each served level.
LEVELS = ((1, 1), (1, 8), (256, 1))


@dataclass
class Row:
    model: str
    batch_size: int
    in_flight: int
    alone_rows_per_s: list[float] = field(default_factory=list)
    backend_rows_per_s: list[float] = field(default_factory=list)
    served_rows_per_s: list[float] = field(default_factory=list)
    # The server's own time per request (Triton's statistics: from the request read to
    # its response written), which leaves the client and the loopback out.
    server_us: list[float] = field(default_factory=list)

    def ratios(self, numerator: list[float]) -> list[float]:
        return [n / a for n, a in zip(numerator, self.alone_rows_per_s, strict=True)]


def train(repo: Path, trees: int) -> dict[str, Callable[[np.ndarray], Any]]:
    """The two models, saved as Triton FIL repository entries; each one's library call."""
    import lightgbm
    import xgboost

    rng = np.random.default_rng(0)
    x = rng.standard_normal((5000, FEATURES)).astype(np.float32)
    y = (x[:, :4].sum(axis=1) + 0.3 * rng.standard_normal(5000) > 0).astype(np.int32)
    params = {"objective": "binary:logistic", "max_depth": 6, "nthread": 2}
    booster = xgboost.train(params, xgboost.DMatrix(x, y), trees)
    lgb = lightgbm.train(
        {"objective": "binary", "num_leaves": 63, "verbose": -1, "num_threads": 2},
        lightgbm.Dataset(x, y),
        trees,
    )
    for name, model, model_type, filename in (
        ("xgboost", booster, "xgboost_json", "xgboost.json"),
        ("lightgbm", lgb, "lightgbm", "model.txt"),
    ):
        (repo / name / "1").mkdir(parents=True, exist_ok=True)
        model.save_model(str(repo / name / "1" / filename))
        config = fil_config(model_type, FEATURES, 2, {"predict_proba": "true"})
        (repo / name / "config.pbtxt").write_text(config)
    # The library alone, as a user calls it, on one thread (the server's, pinned here).
    booster.set_param({"nthread": 1})
    return {
        "xgboost": lambda rows: booster.inplace_predict(rows),
        "lightgbm": lambda rows: lgb.predict(rows, num_threads=1),
    }


def rows_per_s(call: Callable[[np.ndarray], Any], rows: np.ndarray, seconds: float) -> float:
    """Rows a second from ``call(rows)`` back to back on core 0: batch / median call."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {SERVER_CORE})
    try:
        for _ in range(20):
            call(rows)
        times: list[float] = []
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            call(rows)
            times.append(time.perf_counter() - started)
    finally:
        os.sched_setaffinity(0, before)
    return len(rows) / statistics.median(times)


def served_rows_per_s(
    port: int, model: str, rows: np.ndarray, in_flight: int, seconds: float, work: Path
) -> tuple[float, float]:
    """Rows a second that ``slipstream bench`` (HTTP, binary tensors) gets answered, and
    the server's own microseconds per request meanwhile."""
    data = work / f"{model}-{len(rows)}.npz"
    np.savez(data, input__0=rows)
    out = work / "bench.json"
    command = [
        "taskset", "-c", str(CLIENT_CORE), str(VENV_BIN / "slipstream"), "bench",
        f"http://127.0.0.1:{port}", "-m", model, "--protocol", "http-binary",
        "--concurrency", str(in_flight), "--input-data", str(data), "--workers", "1",
        "--warmup-s", "1", "--duration", str(seconds), "--json", str(out),
    ]  # fmt: skip
    before = _success(port, model)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    after = _success(port, model)
    if done.returncode != 0:
        raise RuntimeError(f"slipstream bench failed: {done.stderr[-600:]}")
    level = json.loads(out.read_text())["levels"][0]
    if level["errors"]:
        raise RuntimeError(f"slipstream bench saw errors: {level['error_examples']}")
    server_us = (after[1] - before[1]) / max(1, after[0] - before[0]) / 1000
    return float(level["throughput_req_per_s"]) * len(rows), server_us


def _success(port: int, model: str) -> tuple[int, int]:
    """The model's successful requests and their nanoseconds so far (V2 statistics)."""
    url = f"http://127.0.0.1:{port}/v2/models/{model}/stats"
    with urllib.request.urlopen(url, timeout=10) as reply:
        success = json.load(reply)["model_stats"][0]["inference_stats"]["success"]
    return int(success["count"]), int(success["ns"])


@contextmanager
def server(repo: Path, work: Path) -> Iterator[int]:
    http_port, grpc_port = free_ports(2)
    command = [
        "taskset", "-c", str(SERVER_CORE), str(VENV_BIN / "slipstream"), "serve",
        "--model-repository", str(repo), "--host", "127.0.0.1", "--http-port",
        str(http_port), "--grpc-port", str(grpc_port), "--log-level", "warning",
    ]  # fmt: skip
    with (work / "server.log").open("wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                url = f"http://127.0.0.1:{http_port}/v2/health/ready"
                with urllib.request.urlopen(url, timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError((work / "server.log").read_text()[-2000:])
            time.sleep(0.2)
        yield http_port
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def measure(args: argparse.Namespace, work: Path) -> list[Row]:
    repo = work / "models"
    alone = train(repo, args.trees)
    rng = np.random.default_rng(1)
    batches = {size: rng.standard_normal((size, FEATURES)).astype(np.float32) for size in (1, 256)}
    table = [Row(model, size, flight) for model in alone for size, flight in LEVELS]
    parameters = {"cpu_nthread": "1", "predict_proba": "true"}
    backends = {
        model: FilBackend.load(next((repo / model / "1").iterdir()), parameters, 1)
        for model in alone
    }
    with server(repo, work) as port:
        for round_number in range(args.rounds):
            # Alternating order: a slow stretch of the machine hits each figure in turn.
            forward = round_number % 2 == 0
            for row in table if forward else table[::-1]:
                rows = batches[row.batch_size]
                backend = backends[row.model]
                steps = [
                    (row.alone_rows_per_s, lambda r=rows, m=row.model: rows_per_s(
                        alone[m], r, args.seconds)),
                    (row.backend_rows_per_s, lambda r=rows, b=backend: rows_per_s(
                        lambda x: b.run({"input__0": x}, ["output__0"]), r, args.seconds)),
                    (row.served_rows_per_s, lambda r=rows, w=row: served(
                        w, port, r, args.seconds, work)),
                ]  # fmt: skip
                for figures, step in steps if forward else steps[::-1]:
                    figures.append(step())
            print(f"round {round_number + 1}/{args.rounds} done", flush=True)
    return table


def served(row: Row, port: int, rows: np.ndarray, seconds: float, work: Path) -> float:
    rate, server_us = served_rows_per_s(port, row.model, rows, row.in_flight, seconds, work)
    row.server_us.append(server_us)
    return rate


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):8.2f} ({min(values):.2f}-{max(values):.2f})"


def report(table: list[Row]) -> None:
    print(f"\n{'model':9} {'batch':>5} {'flight':>6} {'alone rows/s':>13} "
          f"{'backend rows/s':>15} {'served rows/s':>14}   {'served/alone':>21}   "
          f"{'backend/alone':>21}   {'alone us/call':>13} {'server us/req':>13}")  # fmt: skip
    for row in table:
        alone = statistics.median(row.alone_rows_per_s)
        print(
            f"{row.model:9} {row.batch_size:5d} {row.in_flight:6d} {alone:13,.0f} "
            f"{statistics.median(row.backend_rows_per_s):15,.0f} "
            f"{statistics.median(row.served_rows_per_s):14,.0f}   "
            f"{spread(row.ratios(row.served_rows_per_s)):>21}   "
            f"{spread(row.ratios(row.backend_rows_per_s)):>21}   "
            f"{1e6 * row.batch_size / alone:13,.0f} {statistics.median(row.server_us):13,.0f}"
        )
    print(
        "\nratios: median (min-max) over rounds; alone = the library's own call, one thread; "
        "server us/req: the server's own time per request (its statistics), median"
    )


def candidates(args: argparse.Namespace, work: Path) -> None:
    """The other predictors of the same two forests against the library alone."""
    repo = work / "models"
    alone = train(repo, args.trees)
    files = {"xgboost": repo / "xgboost/1/xgboost.json", "lightgbm": repo / "lightgbm/1/model.txt"}
    rng = np.random.default_rng(1)
    batches = {size: rng.standard_normal((size, FEATURES)).astype(np.float32) for size in (1, 256)}
    makers = {"treelite GTIL": _gtil, "tl2cgen (gcc)": _tl2cgen, "onnxruntime": _onnxruntime}
    print(f"\n{'model':9} {'predictor':15} {'rows/s @1':>10} {'rows/s @256':>12} "
          f"{'max |diff|':>11}  note")  # fmt: skip
    for model, path in files.items():
        reference = np.asarray(alone[model](batches[256]), dtype=np.float32)
        found: dict[str, tuple[Callable[[np.ndarray], Any], str]] = {"library": (alone[model], "")}
        for label, make in makers.items():
            try:
                found[label] = make(model, path, work)
            except ImportError as exc:
                print(f"{model:9} {label:15} not installed ({exc.name})")
        for label, (call, note) in found.items():
            one = rows_per_s(call, batches[1], args.seconds)
            many = rows_per_s(call, batches[256], args.seconds)
            # The positive class's probability, whatever shape the predictor gives.
            answers = np.asarray(call(batches[256]), dtype=np.float32).reshape(256, -1)[:, -1]
            diff = float(np.abs(answers - reference).max())
            print(f"{model:9} {label:15} {one:10,.0f} {many:12,.0f} {diff:11.2e}  {note}")


def _gtil(model: str, path: Path, work: Path) -> tuple[Callable[[np.ndarray], Any], str]:
    import treelite

    forest = _treelite_model(model, path)
    return lambda rows: treelite.gtil.predict(forest, rows, nthread=1), ""


def _tl2cgen(model: str, path: Path, work: Path) -> tuple[Callable[[np.ndarray], Any], str]:
    import tl2cgen

    library = work / f"{model}.so"
    started = time.perf_counter()
    tl2cgen.export_lib(_treelite_model(model, path), toolchain="gcc", libpath=str(library),
                       params={"parallel_comp": os.cpu_count() or 1}, nthread=1)  # fmt: skip
    compiled_s = time.perf_counter() - started
    predictor = tl2cgen.Predictor(str(library), nthread=1)
    note = f"compiled in {compiled_s:.1f} s"
    return lambda rows: predictor.predict(tl2cgen.DMatrix(rows)), note


def _treelite_model(model: str, path: Path) -> Any:
    import treelite

    if model == "lightgbm":
        return treelite.frontend.load_lightgbm_model(str(path))
    return treelite.frontend.load_xgboost_model(str(path))


def _onnxruntime(model: str, path: Path, work: Path) -> tuple[Callable[[np.ndarray], Any], str]:
    import lightgbm
    import onnxmltools
    import onnxruntime
    import xgboost
    from onnxmltools.convert.common.data_types import FloatTensorType

    types = [("input", FloatTensorType([None, FEATURES]))]
    started = time.perf_counter()
    if model == "lightgbm":
        booster = lightgbm.Booster(model_file=str(path))
        onnx_model = onnxmltools.convert_lightgbm(booster, initial_types=types, zipmap=False)
    else:
        booster = xgboost.Booster(model_file=str(path))
        onnx_model = onnxmltools.convert_xgboost(booster, initial_types=types)
    converted_s = time.perf_counter() - started
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    session = onnxruntime.InferenceSession(onnx_model.SerializeToString(), options)
    output = session.get_outputs()[-1].name  # the probabilities
    note = f"converted in {converted_s:.1f} s"
    return lambda rows: session.run([output], {"input": rows})[0], note


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    parser.add_argument("--trees", type=int, default=200)
    parser.add_argument("--json", type=Path, help="write the figures as JSON")
    parser.add_argument(
        "--candidates", action="store_true", help="measure the other predictors instead"
    )
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f} (2 cores here; figures taken "
          "beside other work are noisy)")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="slipstream-trees-") as tmp:
        if args.candidates:
            candidates(args, Path(tmp))
            return
        table = measure(args, Path(tmp))
    report(table)
    if args.json:
        args.json.write_text(json.dumps([asdict(row) for row in table], indent=2))


if __name__ == "__main__":
    main()
