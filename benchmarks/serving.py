"""Served throughput and latency of Slipstream, against the runtime ceiling and peer servers.

One run measures two figures and prints them as ratios (a script, never a test):

1. compute-bound: MiniLM (seq 128, one sequence per request) at 1, 8 and 64 concurrent
   connections, each as a fraction of in-process ONNX Runtime's best-batch throughput on
   the same single core (measured in this run by `ort_ceiling.py`). Target >= 0.95.
2. overhead-bound: a small MLP, one sample per request. Requests/s at 64 connections
   with V2 JSON and with binary tensors, and p50 latency at 1 connection, for Slipstream,
   a plain FastAPI + ORT endpoint (`peers/fastapi_ort.py`) and Triton via PyTriton with
   its dynamic batcher (`peers/pytriton_server.py`). Targets: ours/Triton (JSON) >= 2.0,
   ours/FastAPI >= 1.5, p50 at 1 connection < 0.3 ms.

Every server is pinned to one core (`taskset -c 0`), the load generator `wrk` to another
(`taskset -c 1`). Each level runs wrk for a warm-up (discarded) then for `--duration`.
Latency percentiles come from wrk's own histogram (1 us resolution), read in its Lua
`done` hook; at 1 connection that is the client-observed round trip over keep-alive.

Usage (from the repository root):
    .venv/bin/python benchmarks/serving.py                     # everything, 10 s a level
    .venv/bin/python benchmarks/serving.py --duration 3 --only overhead --skip-peers
    .venv/bin/python benchmarks/serving.py --repo models --json results.json
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

import models
from loadgen import WRK_INSTALL_HINT, LoadResult, measure_level, write_lua_script, wrk_available
from servers import ServerSpec, ensure_venv, free_port, post, running

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"  # git-ignored
COMPUTE_CONNECTIONS = (1, 8, 64)
OVERHEAD_CONNECTIONS = 64


@dataclass(frozen=True)
class Settings:
    """Everything one run needs, from the command line."""

    duration_s: float  # measured seconds per load level
    warmup_s: float  # discarded seconds before each level
    figures: frozenset[str]  # subset of {"compute", "overhead"}
    skip_peers: bool  # measure Slipstream only
    repo: Path  # model repository (built if missing)
    work_dir: Path  # Lua scripts, request bodies, server logs
    server_core: int | None  # core the server under test is pinned to
    client_core: int | None  # core wrk is pinned to
    ceiling_seconds: float  # timing budget per batch size for the ORT ceiling
    json_out: Path | None  # where to write all figures, if anywhere


@dataclass(frozen=True)
class Case:
    """One load level against one server."""

    label: str  # e.g. "json", "binary"
    body: models.RequestBody  # sent unchanged on every request
    connections: int  # concurrent keep-alive connections
    duration_s: float | None = None  # measured seconds, if not the --duration default


@dataclass(frozen=True)
class Row:
    """One measured (or failed) load level, a line of the results table."""

    figure: str  # "compute" | "overhead"
    server: str  # "slipstream" | "fastapi" | "triton"
    case: Case
    result: LoadResult | None  # None when the level could not run
    error: str | None  # why it could not run

    def as_dict(self) -> dict[str, Any]:
        return {
            "figure": self.figure,
            "server": self.server,
            "case": self.case.label,
            "connections": self.case.connections,
            "result": self.result.as_dict() if self.result else None,
            "error": self.error,
        }


@dataclass(frozen=True)
class Ratio:
    """A headline figure with its target."""

    name: str  # what is divided by what
    value: float | None  # None when an input is missing
    target: str  # e.g. ">= 2.0"
    met: bool | None  # None when value is None


# --------------------------------------------------------------------------- servers


def slipstream_spec(repo: Path) -> ServerSpec:
    port = free_port()
    exe = Path(sys.executable).parent / "slipstream"
    argv = [str(exe) if exe.exists() else "slipstream", "serve", "--model-repository"]
    argv += [str(repo), "--host", "127.0.0.1", "--http-port", str(port), "--grpc-port", "0"]
    return ServerSpec("slipstream", argv, port, "/v2/health/ready")


def single_model_repo(settings: Settings, model: str) -> Path:
    """A repository holding only `model` (a symlink), so Slipstream serves what a peer does."""
    repo = settings.work_dir / "repos" / model
    repo.mkdir(parents=True, exist_ok=True)
    link = repo / model
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(settings.repo / model, target_is_directory=True)
    return repo


def fastapi_spec(python: Path, model: str, path: Path) -> ServerSpec:
    port = free_port()
    script = BENCH_DIR / "peers" / "fastapi_ort.py"
    argv = [str(python), str(script), "--model", str(path), "--name", model]
    return ServerSpec("fastapi", [*argv, "--http-port", str(port)], port, "/v2/health/ready")


def triton_spec(python: Path, model: str, path: Path) -> ServerSpec:
    port = free_port()
    script = BENCH_DIR / "peers" / "pytriton_server.py"
    argv = [str(python), str(script), "--model", str(path), "--name", model]
    argv += ["--http-port", str(port)]
    return ServerSpec("triton", argv, port, f"/v2/models/{model}/ready", startup_timeout_s=180)


def peer_specs(settings: Settings, model: str, path: Path) -> list[ServerSpec]:
    """The peers whose venvs could be made; a peer that cannot is reported and left out."""
    specs: list[ServerSpec] = []
    for venv, make in (("fastapi", fastapi_spec), ("pytriton", triton_spec)):
        python = ensure_venv(venv)
        if python is None:
            print(f"!! peer {venv}: no venv, left out of this run")
            continue
        specs.append(make(python, model, path))
    return specs


# --------------------------------------------------------------------------- measuring


def measure_server(
    settings: Settings, figure: str, spec: ServerSpec, model: str, cases: list[Case]
) -> list[Row]:
    """Start `spec`, check each body gets a 200, run every case, stop it."""
    url = spec.url(f"/v2/models/{model}/infer")
    rows: list[Row] = []
    print(f"-- {figure}: {spec.label} ({model})", flush=True)
    try:
        log_path = settings.work_dir / "logs" / f"{figure}-{spec.label}.log"
        with running(spec, settings.server_core, log_path):
            for case in cases:
                rows.append(_measure_case(settings, figure, spec.label, url, case))
    except RuntimeError as exc:
        print(f"!! {spec.label} did not start: {exc}")
        reason = f"server did not start: {str(exc).splitlines()[0]}"
        done = {id(r.case) for r in rows}
        rows += [Row(figure, spec.label, c, None, reason) for c in cases if id(c) not in done]
    return rows


def _measure_case(settings: Settings, figure: str, server: str, url: str, case: Case) -> Row:
    status, answer = post(url, case.body)
    if status != 200:
        reason = f"sanity request got {status}: {answer[:200].decode(errors='replace')}"
        print(f"   {case.label:>6} c{case.connections:<3} !! {reason}")
        return Row(figure, server, case, None, reason)
    script = write_lua_script(case.body, settings.work_dir, f"{server}-{figure}-{case.label}")
    duration_s = case.duration_s or settings.duration_s
    try:
        result = measure_level(
            url, script, case.connections, duration_s, settings.warmup_s, settings.client_core
        )
    except RuntimeError as exc:  # wrk itself failed: say so, keep going with the next level
        print(f"   {case.label:>6} c{case.connections:<3} !! {exc}")
        return Row(figure, server, case, None, str(exc))
    print(
        f"   {case.label:>6} c{case.connections:<3} {result.ok_per_s:>10,.1f} req/s"
        f" (N/lat {result.closed_loop_per_s:,.1f})  p50 {result.p50_ms:.3f} ms"
        f"  p99 {result.p99_ms:.3f} ms  errors {result.errors}  ({result.duration_s:.0f} s)",
        flush=True,
    )
    return Row(figure, server, case, result, None)


def measure_ceiling(settings: Settings, model: str, path: Path) -> dict[str, float]:
    """In-process ORT samples/s per batch size, in a subprocess on the server's core."""
    cmd = ["taskset", "-c", str(settings.server_core)] if settings.server_core is not None else []
    cmd += [sys.executable, str(BENCH_DIR / "ort_ceiling.py"), "--model", model]
    cmd += ["--path", str(path), "--seconds", str(settings.ceiling_seconds)]
    print(f"-- ceiling: in-process ORT, {model}, 1 thread, batch 1..64", flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(f"!! ceiling failed:\n{done.stderr[-1500:]}")
        return {}
    per_batch: dict[str, float] = orjson.loads(done.stdout.strip().splitlines()[-1])[
        "samples_per_s"
    ]
    print("   " + "  ".join(f"b{b}: {v:,.0f}/s" for b, v in per_batch.items()), flush=True)
    return per_batch


def _result(rows: list[Row], server: str, label: str, connections: int) -> LoadResult | None:
    for row in rows:
        if (row.server, row.case.label, row.case.connections) == (server, label, connections):
            return row.result
    return None


def _ok_per_s(rows: list[Row], server: str, label: str, connections: int) -> float | None:
    result = _result(rows, server, label, connections)
    return result.ok_per_s if result else None


def _ratio(name: str, num: float | None, den: float | None, minimum: float | None) -> Ratio:
    """num / den against `minimum`; `minimum` None makes it an informational figure."""
    target = "-" if minimum is None else f">= {minimum}"
    if num is None or den is None or den == 0:
        return Ratio(name, None, target, None)
    value = num / den
    return Ratio(name, value, target, None if minimum is None else value >= minimum)


# --------------------------------------------------------------------------- figures


def compute_duration_s(settings: Settings, connections: int, best: float | None) -> float:
    """At least `--duration`, and long enough for ~10 full batches at the ceiling rate."""
    if not best:
        return settings.duration_s
    return max(settings.duration_s, round(10 * connections / best))


def run_compute(settings: Settings, paths: dict[str, Path]) -> tuple[list[Row], list[Ratio], Any]:
    """Figure 1: MiniLM served seq/s at 1, 8, 64 connections / ORT best-batch seq/s.

    The ceiling is measured right before each served level, on the same core while the
    (idle) server waits: this machine's speed drifts by 10-30% over minutes, so one
    ceiling taken at the start would compare levels against a different machine.
    Served throughput here is connections / mean latency (Little's law, exact for wrk's
    closed loop): at 64 connections responses come back a batch at a time, so counting
    completions in a window would be off by up to a whole batch.
    """
    if "minilm" not in paths:
        print("!! compute: no minilm model (examples/build_models.py) - figure skipped")
        return [], [], {}
    body = models.json_body(models.sample_inputs("minilm"))
    spec = slipstream_spec(single_model_repo(settings, "minilm"))
    url = spec.url("/v2/models/minilm/infer")
    rows: list[Row] = []
    ratios: list[Ratio] = []
    ceilings: dict[str, Any] = {}
    print(f"-- compute: {spec.label} (minilm), ceiling re-measured before each level")
    log_path = settings.work_dir / "logs" / f"compute-{spec.label}.log"
    with running(spec, settings.server_core, log_path):
        for c in COMPUTE_CONNECTIONS:
            ceiling = measure_ceiling(settings, "minilm", paths["minilm"])
            best = max(ceiling.values()) if ceiling else None
            ceilings[f"c{c}"] = {"samples_per_s": ceiling, "best": best}
            case = Case("json", body, c, compute_duration_s(settings, c, best))
            row = _measure_case(settings, "compute", spec.label, url, case)
            rows.append(row)
            result = row.result
            served = result.closed_loop_per_s if result and result.requests >= 2 * c else None
            ratios.append(_ratio(f"minilm c{c}: served / ORT best batch", served, best, 0.95))
    return rows, ratios, ceilings


def overhead_cases(servers: str) -> list[Case]:
    inputs = models.sample_inputs("mlp")
    json_body = models.json_body(inputs)
    cases = [Case("json", json_body, OVERHEAD_CONNECTIONS), Case("json", json_body, 1)]
    if servers != "fastapi":  # the plain endpoint speaks JSON only
        binary = models.binary_body(inputs, models.output_names("mlp"))
        cases += [Case("binary", binary, OVERHEAD_CONNECTIONS), Case("binary", binary, 1)]
    return cases


def run_overhead(settings: Settings, paths: dict[str, Path]) -> tuple[list[Row], list[Ratio]]:
    """Figure 2: MLP req/s at 64 connections and p50 at 1, ours against the peers."""
    if "mlp" not in paths:
        print("!! overhead: no mlp model (examples/build_models.py) - figure skipped")
        return [], []
    path = paths["mlp"]
    specs = [slipstream_spec(single_model_repo(settings, "mlp"))]
    if not settings.skip_peers:
        specs += peer_specs(settings, "mlp", path)
    rows: list[Row] = []
    for spec in specs:
        rows += measure_server(settings, "overhead", spec, "mlp", overhead_cases(spec.label))
    c = OVERHEAD_CONNECTIONS
    ours_json = _ok_per_s(rows, "slipstream", "json", c)
    ratios = [
        _ratio("mlp json c64: ours / triton", ours_json, _ok_per_s(rows, "triton", "json", c), 2.0),
        _ratio(
            "mlp json c64: ours / fastapi", ours_json, _ok_per_s(rows, "fastapi", "json", c), 1.5
        ),
        _ratio(
            "mlp binary c64: ours / triton",
            _ok_per_s(rows, "slipstream", "binary", c),
            _ok_per_s(rows, "triton", "binary", c),
            None,
        ),
    ]
    ours_c1 = _result(rows, "slipstream", "json", 1)
    p50 = ours_c1.p50_ms if ours_c1 else None
    ratios.append(
        Ratio("mlp json c1: ours p50 ms", p50, "< 0.3", None if p50 is None else p50 < 0.3)
    )
    return rows, ratios


# --------------------------------------------------------------------------- reporting


def print_report(rows: list[Row], ratios: list[Ratio]) -> None:
    """The results table, then the headline ratios against their targets."""
    width = 94
    print("\n" + "=" * width)
    print(
        f"{'figure':<9} {'server':<11} {'body':<7} {'conns':>5} {'req/s':>10} {'N/lat':>10} "
        f"{'p50 ms':>8} {'p99 ms':>8} {'errors':>7}"
    )
    print("-" * width)
    for row in rows:
        head = f"{row.figure:<9} {row.server:<11} {row.case.label:<7} {row.case.connections:>5}"
        if row.result is None:
            print(f"{head}  FAILED: {(row.error or '')[:60]}")
            continue
        r = row.result
        print(
            f"{head} {r.ok_per_s:>10,.1f} {r.closed_loop_per_s:>10,.1f} {r.p50_ms:>8.3f} "
            f"{r.p99_ms:>8.3f} {r.errors:>7}"
        )
    print("-" * width)
    print("req/s: responses counted in the window; N/lat: connections / mean latency")
    print(f"{'headline':<48} {'value':>10} {'target':>10}  status")
    for ratio in ratios:
        value = "n/a" if ratio.value is None else f"{ratio.value:.3f}"
        status = {True: "met", False: "BELOW TARGET", None: "not measured"}[ratio.met]
        if ratio.value is not None and ratio.met is None:
            status = "info"
        print(f"{ratio.name:<48} {value:>10} {ratio.target:>10}  {status}")
    print("=" * width)


def environment() -> dict[str, Any]:
    import onnxruntime

    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_json(
    out: Path,
    settings: Settings,
    env: dict[str, Any],
    ceiling: Any,
    rows: list[Row],
    ratios: list[Ratio],
) -> None:
    """Every figure of the run, with its settings and machine, as one JSON document."""
    payload = {
        "settings": {**vars(settings), "figures": sorted(settings.figures)},
        "environment": env,
        "ceiling_minilm": ceiling,
        "rows": [r.as_dict() for r in rows],
        "headline": [vars(r) for r in ratios],
    }
    out.write_bytes(orjson.dumps(payload, default=str, option=orjson.OPT_INDENT_2))
    print(f"figures written to {out}")


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per load level")
    parser.add_argument("--warmup", type=float, default=2.0, help="warm-up seconds per level")
    parser.add_argument("--only", default="compute,overhead", help="figures to run")
    parser.add_argument("--skip-peers", action="store_true", help="measure Slipstream only")
    parser.add_argument(
        "--repo",
        type=Path,
        default=RESULTS_DIR / "models",
        help="model repository; models missing from it are built",
    )
    parser.add_argument("--json", type=Path, dest="json_out", help="write all figures here")
    parser.add_argument("--server-core", type=int, default=0)
    parser.add_argument("--client-core", type=int, default=1)
    parser.add_argument(
        "--ceiling-seconds",
        type=float,
        default=2.0,
        help="ORT ceiling timing budget per batch size",
    )
    args = parser.parse_args(argv)
    figures = frozenset(f.strip() for f in args.only.split(",") if f.strip())
    if not figures <= {"compute", "overhead"}:
        parser.error(f"--only {args.only!r}: expected a comma list of 'compute', 'overhead'")
    return Settings(
        duration_s=args.duration,
        warmup_s=args.warmup,
        figures=figures,
        skip_peers=args.skip_peers,
        repo=args.repo.resolve(),
        work_dir=RESULTS_DIR / "work",
        server_core=args.server_core,
        client_core=args.client_core,
        ceiling_seconds=args.ceiling_seconds,
        json_out=args.json_out,
    )


def main(argv: list[str] | None = None) -> int:
    settings = parse_args(argv)
    if not wrk_available():
        print(WRK_INSTALL_HINT)
        return 2
    cores = os.sched_getaffinity(0)
    if not {settings.server_core, settings.client_core} <= cores:
        print(f"!! cores {settings.server_core}/{settings.client_core} not all in {sorted(cores)}")
        return 2
    env = environment()
    print(f"load average at start: {env['load_average_at_start']} (want ~0 for real figures)")
    names = (["minilm"] if "compute" in settings.figures else []) + (
        ["mlp"] if "overhead" in settings.figures else []
    )
    paths = models.build_repository(settings.repo, names)
    rows: list[Row] = []
    ratios: list[Ratio] = []
    ceiling: Any = {}
    if "compute" in settings.figures:
        compute_rows, compute_ratios, ceiling = run_compute(settings, paths)
        rows, ratios = rows + compute_rows, ratios + compute_ratios
    if "overhead" in settings.figures:
        overhead_rows, overhead_ratios = run_overhead(settings, paths)
        rows, ratios = rows + overhead_rows, ratios + overhead_ratios
    print_report(rows, ratios)
    if settings.json_out is not None:
        write_json(settings.json_out, settings, env, ceiling, rows, ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main())
