"""What ``slipstream profile`` found, as typed results, and the files it is written to.

The result types are plain dataclasses (with the machine they were measured on, from
:func:`describe_environment`), so ``dataclasses.asdict`` is the JSON report;
the same figures go to CSV (one row per batch size) and to an HTML page or PNG image of
charts (throughput and latency against batch size, the best batch size marked, and the
top operators). matplotlib is imported only when a chart is drawn, with the Agg canvas,
so no display is needed.

Example::

    result = profile_model("models/mlp/1/model.onnx", seconds=0.5)
    write_json(result, Path("mlp.json"))
    write_csv(result, Path("mlp.csv"))
    write_report(result, Path("mlp.html"))  # or mlp.png
"""

from __future__ import annotations

import dataclasses
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from slipstream import reports
from slipstream.reports import escape as _e
from slipstream.reports import html_cells, html_table
from slipstream.runtime.base import usable_cpu_count

if TYPE_CHECKING:
    from matplotlib.axes import Axes

BatchStatus = Literal["ok", "not_applicable", "failed"]
REPORT_SUFFIXES = (".html", ".htm", ".png")
# Columns of the CSV report, one row per batch size.
CSV_COLUMNS = (
    "batch_size",
    "status",
    "runs",
    "throughput_infer_per_s",
    "p50_throughput_infer_per_s",
    "p50_ms",
    "p90_ms",
    "p99_ms",
    "mean_ms",
    "min_ms",
    "max_ms",
    "gpu_util_pct",
    "is_best",
    "reason",
)


@dataclass(frozen=True, slots=True)
class ProfileInput:
    """One model input as the profiler feeds it."""

    name: str
    # V2 datatype: FP32, INT64, ...
    datatype: str
    # Shape of one run's tensor; -1 marks the batch dim when the model batches.
    shape: tuple[int, ...]
    # How the values were made, e.g. "random integers in [0, 1000)" or "data.npz".
    source: str


@dataclass(frozen=True, slots=True)
class BatchProfile:
    """Latency and throughput of the runtime at one batch size."""

    batch_size: int
    # "ok", "not_applicable" (a fixed-batch model) or "failed" (see reason).
    status: BatchStatus
    # Why the batch size was not measured; empty when status is "ok".
    reason: str = ""
    # Timed runs (warm-up runs excluded).
    runs: int = 0
    # Rows run / time spent in timed runs: what back-to-back batches sustain.
    throughput_infer_per_s: float | None = None
    # Batch size / p50 latency: less moved by a noisy neighbour's bursts.
    p50_throughput_infer_per_s: float | None = None
    # Latency of one run (one batch), in milliseconds.
    p50_ms: float | None = None
    p90_ms: float | None = None
    p99_ms: float | None = None
    mean_ms: float | None = None
    min_ms: float | None = None
    max_ms: float | None = None
    # The GPUs' utilization while this batch size ran, percent of one GPU (NVML, read
    # between runs); None without a GPU.
    gpu_util_pct: float | None = None


@dataclass(frozen=True, slots=True)
class OpTime:
    """Kernel time of one operator type or one graph node, from ORT's profiler."""

    # The op type (by-type table) or the node name (by-node table).
    name: str
    # ONNX op type as ORT ran it (after graph optimisation, e.g. FusedMatMul).
    op_type: str
    # Kernel time over all profiled runs, and averaged per run.
    total_ms: float
    ms_per_run: float
    # Kernel invocations over all profiled runs.
    calls: int
    # Fraction of all kernel time, 0..1.
    share: float


@dataclass(frozen=True, slots=True)
class OpProfile:
    """Where one run's time goes, from ONNX Runtime's profiler (enable_profiling)."""

    # Batch size the profiled runs used (the best batch size).
    batch_size: int
    # Profiled runs (warm-up runs excluded).
    runs: int
    # Mean wall time of one run as ORT timed it (profiling adds some overhead).
    run_mean_ms: float
    # Mean summed kernel time of one run; the rest is ORT's per-run overhead.
    kernel_mean_ms: float
    # Top operator types and top nodes by total kernel time, largest first.
    top_ops: tuple[OpTime, ...]
    top_nodes: tuple[OpTime, ...]


@dataclass(frozen=True, slots=True)
class ProfileResult:
    """Everything one profile measured; ``dataclasses.asdict`` gives the JSON report."""

    model_path: str
    backend: str
    # Intra-op threads the runtime used; 1 makes every figure per core. None: the
    # backend has no thread setting (sklearn), so numpy / BLAS chose.
    threads: int | None
    # Timing budget per batch size, and warm-up runs discarded before it.
    seconds_per_batch: float
    warmup_runs: int
    # False for a model with a fixed first dim: only its own batch size runs.
    batching: bool
    inputs: tuple[ProfileInput, ...]
    # One entry per batch size, ascending.
    batches: tuple[BatchProfile, ...]
    # Batch size with the highest throughput, and that throughput.
    best_batch_size: int
    best_throughput_infer_per_s: float
    # Size of the model file.
    model_size_mb: float
    # Process RSS before loading, its increase from loading, the peak during runs
    # (sampled between runs) and that peak's increase over the baseline.
    baseline_rss_mb: float
    load_rss_increase_mb: float
    peak_rss_mb: float
    peak_rss_increase_mb: float
    # Top operators at the best batch size; None without an ORT profile.
    op_profile: OpProfile | None
    # Caveats a reader needs (threads not applied, op profile unavailable, ...).
    notes: tuple[str, ...] = ()
    # Versions, CPU model and cores the figures were measured on.
    environment: dict[str, str] = field(default_factory=dict)
    # The GPUs' memory in use (NVML: every process on them, not only this one) before
    # loading, its increase from loading and its peak during runs; None without a GPU.
    baseline_gpu_memory_mb: float | None = None
    load_gpu_memory_increase_mb: float | None = None
    peak_gpu_memory_mb: float | None = None
    # A stateful model's (sequence_batching): the runs per sequence, each row of a batch
    # its own sequence; None for the others.
    sequence_length: int | None = None


def result_to_dict(result: ProfileResult) -> dict[str, Any]:
    """The JSON report: every field of the result, under its own name."""
    return dataclasses.asdict(result)


def write_json(result: ProfileResult, path: Path) -> None:
    reports.write_json(result, path, allow_nan=True)


def write_csv(result: ProfileResult, path: Path) -> None:
    rows = [
        {name: getattr(batch, name) for name in CSV_COLUMNS if name != "is_best"}
        | {"is_best": batch.batch_size == result.best_batch_size}
        for batch in result.batches
    ]
    reports.write_csv_rows(path, CSV_COLUMNS, rows)


def write_report(result: ProfileResult, path: Path) -> None:
    """Charts as a self-contained HTML page (PNGs embedded) or as one PNG image."""
    suffix = path.suffix.lower()
    if suffix not in REPORT_SUFFIXES:
        raise ValueError(f"{path.name}: a report is .html or .png, got {suffix or 'no suffix'}")
    if suffix == ".png":
        figure = reports.new_figure(width_in=15.0, height_in=4.2)
        axes = figure.subplots(1, 3 if result.op_profile else 2)
        _plot_throughput(result, axes[0])
        _plot_latency(result, axes[1])
        if result.op_profile:
            _plot_top_ops(result, axes[2])
        figure.suptitle(_title(result))
        path.write_bytes(reports.png(figure))
        return
    charts = [_chart(result, _plot_throughput), _chart(result, _plot_latency)]
    if result.op_profile and result.op_profile.top_ops:
        charts.append(_chart(result, _plot_top_ops))
    path.write_text(_html_page(result, charts))


def describe_environment(backend_name: str) -> dict[str, str]:
    """Versions, CPU model and usable cores, to tell which machine a profile ran on."""
    import importlib.metadata

    environment = {
        "python": platform.python_version(),
        "numpy": importlib.metadata.version("numpy"),
        "cpu": _cpu_model(),
        "usable_cores": str(usable_cpu_count()),
    }
    if hasattr(os, "sched_getaffinity"):
        environment["cpu_affinity"] = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    package = {"onnxruntime": "onnxruntime", "torch": "torch", "sklearn": "scikit-learn"}
    if backend_name in package:
        environment[backend_name] = importlib.metadata.version(package[backend_name])
    return environment


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            models = [line.split(":", 1)[1] for line in cpuinfo if line.startswith("model name")]
    except OSError:
        models = []
    return models[0].strip() if models else platform.machine()


# --- charts -------------------------------------------------------------------------


def _chart(result: ProfileResult, plot: Any) -> bytes:
    figure = reports.new_figure(width_in=6.4, height_in=4.0)
    plot(result, figure.subplots())
    return reports.png(figure)


def _measured(result: ProfileResult) -> list[BatchProfile]:
    return [batch for batch in result.batches if batch.status == "ok"]


def _batch_axis(axes: Axes, sizes: list[int]) -> None:
    axes.set_xscale("log", base=2)
    axes.set_xticks(sizes, [str(size) for size in sizes])
    axes.set_xlabel("batch size")
    axes.grid(True, alpha=0.3)


def _plot_throughput(result: ProfileResult, axes: Axes) -> None:
    batches = _measured(result)
    sizes = [b.batch_size for b in batches]
    axes.plot(sizes, [b.throughput_infer_per_s or 0.0 for b in batches], marker="o")
    best = result.best_throughput_infer_per_s
    axes.plot([result.best_batch_size], [best], marker="*", markersize=16, color="tab:red")
    at_right = result.best_batch_size == max(sizes)
    axes.annotate(
        f"best: batch {result.best_batch_size}\n{best:,.0f} infer/s",
        (result.best_batch_size, best),
        textcoords="offset points",
        xytext=(-10 if at_right else 0, -34),
        ha="right" if at_right else "center",
    )
    axes.set_ylim(bottom=0, top=best * 1.12)
    _batch_axis(axes, sizes)
    axes.set_ylabel("throughput (inferences/s)")
    axes.set_title(f"Throughput ({_threads_text(result.threads)})")


def _plot_latency(result: ProfileResult, axes: Axes) -> None:
    batches = _measured(result)
    sizes = [b.batch_size for b in batches]
    for name in ("p50_ms", "p90_ms", "p99_ms"):
        axes.plot(sizes, [getattr(b, name) for b in batches], marker="o", label=name[:3])
    _batch_axis(axes, sizes)
    p50s = [b.p50_ms or 0.0 for b in batches]
    if min(p50s) > 0 and max(p50s) / min(p50s) > 20:  # a wide range reads better on a log axis
        axes.set_yscale("log")
    axes.set_ylabel("latency of one run (ms)")
    axes.set_title("Latency per batch")
    axes.legend()


def _plot_top_ops(result: ProfileResult, axes: Axes) -> None:
    assert result.op_profile is not None
    ops = list(reversed(result.op_profile.top_ops))
    axes.barh([op.name for op in ops], [op.ms_per_run for op in ops], color="tab:green")
    axes.set_xlabel("kernel time per run (ms)")
    axes.set_title(f"Top operators at batch {result.op_profile.batch_size}")


# --- HTML ---------------------------------------------------------------------------


def _html_page(result: ProfileResult, charts: list[bytes]) -> str:
    parts = [
        f"<p>{_e(summary_line(result))}</p><p>{_e(memory_line(result))}</p>",
        html_table(
            ["input", "datatype", "shape", "values"],
            [[i.name, i.datatype, str(list(i.shape)), i.source] for i in result.inputs],
        ),
        _html_batches(result),
        reports.images(charts),
    ]
    if result.op_profile:
        parts.append(f"<h2>{_e(op_profile_line(result.op_profile))}</h2>")
        runs = max(1, result.op_profile.runs)
        parts.append(_html_ops(result.op_profile.top_ops, runs, by_node=False))
        parts.append(_html_ops(result.op_profile.top_nodes, runs, by_node=True))
    parts.extend(f"<p>Note: {_e(note)}</p>" for note in result.notes)
    parts.append(html_table(["environment", ""], [[k, v] for k, v in result.environment.items()]))
    return reports.html_page(_title(result), parts)


def _html_batches(result: ProfileResult) -> str:
    gpu = has_gpu(result)
    header = ["batch", "runs", "p50 ms", "p90 ms", "p99 ms", "infer/s", "infer/s@p50",
              *(["GPU%"] if gpu else []), ""]  # fmt: skip
    rows = []
    for batch in result.batches:
        best = batch.batch_size == result.best_batch_size
        cells = [*batch_cells(batch, gpu), "best" if best else batch.reason]
        rows.append(("<tr class='best'>" if best else "<tr>") + html_cells(cells, "td"))
    return f"<table><tr>{html_cells(header, 'th')}</tr>{''.join(r + '</tr>' for r in rows)}</table>"


def _html_ops(ops: tuple[OpTime, ...], runs: int, by_node: bool) -> str:
    header = ["node", "op type"] if by_node else ["op type"]
    rows = []
    for op in ops:
        names = [op.name, op.op_type] if by_node else [op.name]
        rows.append([*names, f"{op.ms_per_run:.3f}", f"{op.share:.1%}", f"{op.calls / runs:g}"])
    return html_table([*header, "ms/run", "share", "calls/run"], rows)


# --- text shared by the terminal, HTML and chart titles -----------------------------


def _threads_text(threads: int | None) -> str:
    if threads is None:
        return "the backend's own threads"
    if threads == 1:
        return "1 intra-op thread: figures are per core"
    return f"{threads} intra-op threads"


def _title(result: ProfileResult) -> str:
    # The last three parts name a repository model: "minilm/1/model.onnx".
    shown = "/".join(Path(result.model_path).parts[-3:])
    return f"slipstream profile: {shown} ({result.backend})"


def summary_line(result: ProfileResult) -> str:
    """Backend, threads and timing budget, in one sentence."""
    version = result.environment.get(result.backend, "")
    return (
        f"{result.backend} {version}".strip()
        + f", {_threads_text(result.threads)}; {result.seconds_per_batch:g} s per batch size "
        f"after {result.warmup_runs} warm-up runs; best batch size {result.best_batch_size} "
        f"at {result.best_throughput_infer_per_s:,.1f} inferences/s"
    )


def memory_line(result: ProfileResult) -> str:
    line = (
        f"Memory: model file {result.model_size_mb:.3g} MB; loading added "
        f"{result.load_rss_increase_mb:.1f} MB RSS; peak RSS during runs "
        f"{result.peak_rss_mb:.1f} MB ({result.peak_rss_increase_mb:+.1f} MB over the "
        f"{result.baseline_rss_mb:.1f} MB before loading)"
    )
    if result.baseline_gpu_memory_mb is not None:
        line += (
            f"; GPU memory in use (every process) {result.baseline_gpu_memory_mb:.0f} MB "
            f"before loading, {result.load_gpu_memory_increase_mb or 0.0:+.0f} MB from "
            f"loading, peak {result.peak_gpu_memory_mb or 0.0:.0f} MB during runs"
        )
    return line


def op_profile_line(profile: OpProfile) -> str:
    return (
        f"Top operators at batch {profile.batch_size} (ONNX Runtime profiler, "
        f"{profile.runs} runs): kernels {profile.kernel_mean_ms:.3f} ms of "
        f"{profile.run_mean_ms:.3f} ms per run"
    )


def has_gpu(result: ProfileResult) -> bool:
    """Whether the batches carry a GPU utilization (a column of their own)."""
    return any(batch.gpu_util_pct is not None for batch in result.batches)


def batch_cells(batch: BatchProfile, gpu: bool = False) -> list[str]:
    """batch, runs, p50, p90, p99 and both throughputs as table cells (and with ``gpu``,
    the GPU utilization); dashes when not run."""
    if gpu:
        util = batch.gpu_util_pct
        return [*batch_cells(batch), "-" if util is None else f"{util:.0f}"]
    if batch.status != "ok":
        return [str(batch.batch_size), batch.status.replace("_", " "), *["-"] * 5]
    return [
        str(batch.batch_size),
        str(batch.runs),
        f"{batch.p50_ms:.3f}",
        f"{batch.p90_ms:.3f}",
        f"{batch.p99_ms:.3f}",
        f"{batch.throughput_infer_per_s:,.1f}",
        f"{batch.p50_throughput_infer_per_s:,.1f}",
    ]
