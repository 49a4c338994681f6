"""Showing a benchmark: live progress and tables on the terminal, JSON and CSV files.

Charts (``--report out.html`` / ``.png``) are in :mod:`slipstream.bench.v2.charts`, which
imports matplotlib only when asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from slipstream.bench.core.levels import LoadLevel
from slipstream.bench.core.output import (
    Column,
    LevelProgress,
    csv_fields,
    csv_row,
    errors_cell,
    level_table,
    number,
    print_problems,
    write_files,
)
from slipstream.bench.v2.results import BenchResult, LevelResult, WindowTotals
from slipstream.bench.v2.runner import ProgressListener
from slipstream.bench.v2.settings import BenchSettings

# Columns of the CSV file, in order: every scalar figure of a level.
CSV_FIELDS = csv_fields(LevelResult)


# ----------------------------------------------------------------------- live progress


class RichProgress(LevelProgress, ProgressListener):
    """A progress bar per level (windows done) with the last window's figures."""

    def level_started(self, level: LoadLevel, workers: int, max_windows: int) -> None:
        plural = "s" if workers > 1 else ""
        self.new_level(f"{level.label} ({workers} worker{plural})", max_windows, "warming up")

    def window_done(self, level: LoadLevel, window: WindowTotals, stable: bool) -> None:
        p99 = window.latency.percentile_s(99) * 1000
        errors = sum(window.errors.values())
        figures = (
            f"{window.throughput_infer_per_s:,.0f} infer/s  p99 {p99:.2f} ms"
            + (f"  {errors} errors" if errors else "")
            + ("  stable" if stable else "")
        )
        self.advance(figures)

    def level_done(self, result: LevelResult) -> None:
        p99 = "-" if result.p99_ms is None else f"{result.p99_ms:.2f} ms"
        self._console.print(
            f"[green]done[/] {result.label}: {result.throughput_infer_per_s:,.1f} infer/s, "
            f"p99 {p99}, {result.errors} errors, {result.windows_measured} windows"
            + (" (not stable)" if any(w.startswith("not stable") for w in result.warnings) else "")
        )

    def note(self, message: str) -> None:
        self._console.print(f"[yellow]{message}[/]")


# ----------------------------------------------------------------------- terminal tables


_LATENCIES = ("avg", "p50", "p90", "p95", "p99", "max")
_MAIN: list[Column] = [
    ("infer/s", number("throughput_infer_per_s", 1)),
    ("req/s", number("throughput_req_per_s", 1)),
    *[(f"{name} ms", number(f"{name}_ms", 3)) for name in _LATENCIES],
    ("errors", errors_cell),
]
_BREAKDOWN: list[Column] = [
    ("queue", number("server_queue_ms", 3)),
    ("compute in", number("server_compute_input_ms", 3)),
    ("compute infer", number("server_compute_infer_ms", 3)),
    ("compute out", number("server_compute_output_ms", 3)),
    ("overhead", number("server_overhead_ms", 3)),
    ("batch", number("server_avg_batch_size", 1)),
    ("client CPU%", number("client_cpu_pct", 0)),
    ("server CPU%", number("server_cpu_pct", 0)),
    ("server RSS MB", number("server_rss_mb", 0)),
]
# Where the server's machine has a GPU (--server-pid).
_GPU: list[Column] = [
    ("GPU%", number("server_gpu_util_pct", 0)),
    ("GPU mem MB", number("server_gpu_memory_mb", 0)),
]


def print_tables(result: BenchResult, console: Console) -> None:
    """Throughput and latency, then the server breakdown and resources, then warnings."""
    title = (
        f"{result.model} over {result.protocol} at {result.url}, batch size {result.batch_size}"
        + (f", {result.distribution} arrivals" if result.distribution else "")
        + (
            f", sequences of {result.sequence_length} requests ({result.sequence_ids} ids)"
            if result.sequence_length is not None
            else ""
        )
    )
    console.print(level_table(title, result, _MAIN))
    breakdown = _BREAKDOWN
    if any(level.server_gpu_memory_mb is not None for level in result.levels):
        breakdown = [*breakdown, *_GPU]
    if any(level.cost_per_1m_infer is not None for level in result.levels):
        breakdown = [*breakdown, ("$ / 1M infer", number("cost_per_1m_infer", 4))]
    title = "Server breakdown (ms per request) and resources"
    console.print(level_table(title, result, breakdown))
    print_problems(console, result)


# ----------------------------------------------------------------------- files


def write_outputs(
    settings: BenchSettings, result: BenchResult, written: Callable[[Path], None]
) -> None:
    """The files asked for: --json, --csv, --report (charts need matplotlib: ImportError
    without it); ``written`` is told each path as it is written."""
    write_files(settings, result, CSV_FIELDS, lambda level: csv_row(level, CSV_FIELDS), written)
    if settings.report_path is not None:
        from slipstream.bench.v2.charts import write_report

        write_report(result, settings.report_path)
        written(settings.report_path)
