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
    Column,
    LevelProgress,
    csv_fields,
    errors_cell,
    fmt_num,
    level_table,
    load_cell,
    load_header,
    number,
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
# Columns of the CSV file: every scalar figure of a level, then each metric's
# statistics flattened (ttft_mean_ms, ttft_p50_ms, ...).
_FLAT = [f"{metric}_{stat}" for metric in METRICS for stat in _STATS]
CSV_FIELDS = csv_fields(OpenAILevelResult, {"request_results", *METRICS}, _FLAT)


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
    columns: list[Column] = [
        ("req/s", number("request_throughput_per_s")),
        ("output tok/s", number("output_throughput_tok_per_s", 1)),
        ("total tok/s", number("total_token_throughput_tok_per_s", 1)),
    ]
    if result.goodput_slos_ms:
        columns.append(("goodput req/s", _goodput))
    columns += [
        ("mean in/out tokens", _mean_lengths),
        ("peak in flight", lambda level: str(level.peak_inflight)),
        ("client CPU%", number("client_cpu_pct", 0)),
        ("duration s", number("duration_s", 1)),
        ("errors", errors_cell),
    ]
    console.print(level_table(title, result, columns))
    console.print(_latency_table(result))
    print_problems(console, result)


def _latency_table(result: OpenAIBenchResult) -> Table:
    table = Table(title="Latencies (ms)", title_justify="left")
    headings = [load_header(result), "metric", "mean", "p50", "p90", "p99", "max", "count"]
    for index, name in enumerate(headings):
        table.add_column(name, justify="left" if index < 2 else "right")
    for level in result.levels:
        for row, (metric, name) in enumerate(METRICS.items()):
            summary: LatencySummary = getattr(level, metric)
            table.add_row(
                load_cell(level) if row == 0 else "",
                name,
                *(fmt_num(getattr(summary, stat)) for stat in _STATS[1:]),
                str(summary.count),
                end_section=row == len(METRICS) - 1,
            )
    return table


def _goodput(level: OpenAILevelResult) -> str:
    return f"{fmt_num(level.goodput_req_per_s)} ({level.good_requests} ok)"


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
