"""Showing a benchmark: live progress and tables on the terminal, JSON and CSV files.

Charts (``--report out.html`` / ``.png``) are in :mod:`slipstream.bench.v2.charts`, which
imports matplotlib only when asked for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from slipstream.bench.core.levels import LoadLevel
from slipstream.bench.core.output import (
    LevelProgress,
    csv_row,
    errors_cell,
    fmt_num,
    load_cell,
    load_header,
    print_problems,
    write_files,
)
from slipstream.bench.v2.results import BenchResult, LevelResult, WindowTotals
from slipstream.bench.v2.runner import ProgressListener
from slipstream.bench.v2.settings import BenchSettings

# Columns of the CSV file, in order: every scalar figure of a level.
CSV_FIELDS = [
    f.name
    for f in dataclasses.fields(LevelResult)
    if f.name not in ("errors_by_code", "error_examples", "warnings")
] + ["errors_by_code", "warnings"]


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


def print_tables(result: BenchResult, console: Console) -> None:
    """Throughput and latency, then the server breakdown and resources, then warnings."""
    title = (
        f"{result.model} over {result.protocol} at {result.url}, batch size {result.batch_size}"
        + (f", {result.distribution} arrivals" if result.distribution else "")
    )
    main = Table(title=title, title_justify="left")
    main.add_column(load_header(result))
    for name in ("infer/s", "req/s", "avg ms", "p50 ms", "p90 ms", "p95 ms", "p99 ms", "max ms"):
        main.add_column(name, justify="right")
    main.add_column("errors", justify="right")
    for level in result.levels:
        main.add_row(
            load_cell(level),
            fmt_num(level.throughput_infer_per_s, 1),
            fmt_num(level.throughput_req_per_s, 1),
            *(fmt_num(v, 3) for v in _latencies(level)),
            errors_cell(level),
        )
    console.print(main)
    console.print(_breakdown_table(result))
    print_problems(console, result)


def _latencies(level: LevelResult) -> list[float | None]:
    return [level.avg_ms, level.p50_ms, level.p90_ms, level.p95_ms, level.p99_ms, level.max_ms]


def _breakdown_table(result: BenchResult) -> Table:
    table = Table(title="Server breakdown (ms per request) and resources", title_justify="left")
    columns = [load_header(result), "queue", "compute in", "compute infer", "compute out"]
    columns += ["overhead", "batch", "client CPU%", "server CPU%", "server RSS MB"]
    if any(level.cost_per_1m_infer is not None for level in result.levels):
        columns.append("$ / 1M infer")
    for index, name in enumerate(columns):
        table.add_column(name, justify="left" if index == 0 else "right")
    for level in result.levels:
        row = [
            load_cell(level),
            fmt_num(level.server_queue_ms, 3),
            fmt_num(level.server_compute_input_ms, 3),
            fmt_num(level.server_compute_infer_ms, 3),
            fmt_num(level.server_compute_output_ms, 3),
            fmt_num(level.server_overhead_ms, 3),
            fmt_num(level.server_avg_batch_size, 1),
            fmt_num(level.client_cpu_pct, 0),
            fmt_num(level.server_cpu_pct, 0),
            fmt_num(level.server_rss_mb, 0),
        ]
        if len(columns) > len(row):
            row.append(fmt_num(level.cost_per_1m_infer, 4))
        table.add_row(*row)
    return table


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
