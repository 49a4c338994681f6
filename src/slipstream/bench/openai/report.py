"""Showing an OpenAI-mode run: live progress, terminal tables, the JSON and CSV files."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from slipstream.bench.core.levels import LoadLevel
from slipstream.bench.core.output import (
    LevelProgress,
    errors_cell,
    fmt_num,
    load_cell,
    load_header,
    print_problems,
    write_files,
)
from slipstream.bench.core.output import csv_row as core_csv_row
from slipstream.bench.openai.results import (
    LatencySummary,
    OpenAIBenchResult,
    OpenAILevelResult,
    RequestResult,
)
from slipstream.bench.openai.runner import ProgressListener
from slipstream.bench.openai.settings import OpenAIBenchSettings

# The latency metrics of a level, in table and CSV order, with their table names.
METRICS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2E"}
_STATS = [f.name for f in dataclasses.fields(LatencySummary)]
_SKIPPED = {"errors_by_code", "error_examples", "warnings", "request_results", *METRICS}
# Columns of the CSV file, in order: every scalar figure of a level, then each metric's
# statistics flattened (ttft_mean_ms, ttft_p50_ms, ...).
CSV_FIELDS = (
    [f.name for f in dataclasses.fields(OpenAILevelResult) if f.name not in _SKIPPED]
    + [f"{metric}_{stat}" for metric in METRICS for stat in _STATS]
    + ["errors_by_code", "warnings"]
)


class RichProgress(LevelProgress, ProgressListener):
    """A progress bar per level: requests finished, and errors so far."""

    def __init__(self, console: Console) -> None:
        super().__init__(console)
        self._errors = 0

    def level_started(self, level: LoadLevel, total: int) -> None:
        self._errors = 0
        self.new_level(level.label, total, "")

    def request_done(self, request: RequestResult) -> None:
        self._errors += request.error is not None
        self.advance(f"{self._errors} errors" if self._errors else "")

    def level_done(self, result: OpenAILevelResult) -> None:
        self._console.print(
            f"[green]done[/] {result.label}: {result.output_throughput_tok_per_s:,.1f} "
            f"output tok/s, TTFT p99 {fmt_num(result.ttft.p99_ms, 1)} ms, "
            f"{result.errors} errors"
        )


def print_tables(result: OpenAIBenchResult, console: Console) -> None:
    """Throughput and goodput per level, then latencies per level, then warnings."""
    arrivals = f", {result.distribution} arrivals" if result.distribution else ""
    eos = ", ignore_eos" if result.ignore_eos else ""
    slos = ", ".join(f"{k} <= {v:g} ms" for k, v in result.goodput_slos_ms.items())
    title = (
        f"{result.model} over {result.protocol} at {result.url}, "
        f"{result.num_requests} requests per level{arrivals}{eos}"
        + (f"; goodput SLOs: {slos}" if slos else "")
    )
    load = load_header(result)
    main = Table(title=title, title_justify="left")
    columns = [load, "req/s", "output tok/s", "total tok/s"]
    if result.goodput_slos_ms:
        columns.append("goodput req/s")
    columns += ["mean in/out tokens", "peak in flight", "client CPU%", "duration s", "errors"]
    for index, name in enumerate(columns):
        main.add_column(name, justify="left" if index == 0 else "right")
    for level in result.levels:
        row = [
            load_cell(level),
            fmt_num(level.request_throughput_per_s),
            fmt_num(level.output_throughput_tok_per_s, 1),
            fmt_num(level.total_token_throughput_tok_per_s, 1),
        ]
        if result.goodput_slos_ms:
            row.append(f"{fmt_num(level.goodput_req_per_s)} ({level.good_requests} ok)")
        row += [
            _mean_lengths(level),
            str(level.peak_inflight),
            fmt_num(level.client_cpu_pct, 0),
            fmt_num(level.duration_s, 1),
            errors_cell(level),
        ]
        main.add_row(*row)
    console.print(main)
    console.print(_latency_table(result, load))
    print_problems(console, result)


def _latency_table(result: OpenAIBenchResult, load: str) -> Table:
    table = Table(title="Latencies (ms)", title_justify="left")
    for index, name in enumerate([load, "metric", "mean", "p50", "p90", "p99", "max", "count"]):
        table.add_column(name, justify="left" if index < 2 else "right")
    for level in result.levels:
        for number, (metric, name) in enumerate(METRICS.items()):
            summary: LatencySummary = getattr(level, metric)
            table.add_row(
                load_cell(level) if number == 0 else "",
                name,
                *(fmt_num(v) for v in (summary.mean_ms, summary.p50_ms, summary.p90_ms)),
                *(fmt_num(v) for v in (summary.p99_ms, summary.max_ms)),
                str(summary.count),
                end_section=number == len(METRICS) - 1,
            )
    return table


def _mean_lengths(level: OpenAILevelResult) -> str:
    if not level.requests:
        return "-"
    count = level.requests
    return f"{level.prompt_tokens / count:.0f} / {level.output_tokens / count:.0f}"


def level_row(level: OpenAILevelResult) -> dict[str, Any]:
    """A level as one flat CSV row (per-request detail is in the JSON only)."""
    row = core_csv_row(level, CSV_FIELDS)
    for metric in METRICS:
        summary = getattr(level, metric)
        row.update({f"{metric}_{stat}": getattr(summary, stat) for stat in _STATS})
    return row


def write_outputs(
    settings: OpenAIBenchSettings, result: OpenAIBenchResult, written: Callable[[Path], None]
) -> None:
    """The files asked for: --json, --csv; ``written`` is told each path as it is written."""
    write_files(settings, result, CSV_FIELDS, level_row, written)
