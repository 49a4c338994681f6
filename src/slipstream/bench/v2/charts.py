"""Charts of a benchmark (matplotlib, Agg): an HTML page with the PNGs embedded, or one PNG.

Three charts: latency against throughput (one point per load level), the latency
percentiles of each level, and where a request's time went (the server's queue and
compute phases, and the overhead on top) as stacked bars.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from slipstream.bench.v2.results import BenchResult, LevelResult
from slipstream.reports import escape, html_page, html_table, images, new_figure, png

_PERCENTILES = [("p50", "p50_ms"), ("p90", "p90_ms"), ("p95", "p95_ms"), ("p99", "p99_ms")]
_BREAKDOWN = [
    ("queue", "server_queue_ms"),
    ("compute input", "server_compute_input_ms"),
    ("compute infer", "server_compute_infer_ms"),
    ("compute output", "server_compute_output_ms"),
    ("overhead", "server_overhead_ms"),
]
_TABLE_FIELDS = [
    ("load", "label"),
    ("infer/s", "throughput_infer_per_s"),
    ("req/s", "throughput_req_per_s"),
    ("avg ms", "avg_ms"),
    ("p50 ms", "p50_ms"),
    ("p90 ms", "p90_ms"),
    ("p95 ms", "p95_ms"),
    ("p99 ms", "p99_ms"),
    ("max ms", "max_ms"),
    ("errors", "errors"),
]


def write_report(result: BenchResult, path: Path) -> None:
    """``.html``: a page with a table and the three charts; ``.png``: the charts only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".png":
        figure = new_figure(18, 5)
        for axis, draw in zip(figure.subplots(1, 3), _DRAWERS, strict=True):
            draw(axis, result.levels)
        figure.suptitle(_title(result))
        path.write_bytes(png(figure))
        return
    charts = []
    for draw in _DRAWERS:
        figure = new_figure(8, 5)
        draw(figure.subplots(), result.levels)
        charts.append(png(figure))
    warnings = [f"{level.label}: {w}" for level in result.levels for w in level.warnings]
    warnings += result.warnings
    rows = [[_cell(getattr(level, name)) for _, name in _TABLE_FIELDS] for level in result.levels]
    parts = [html_table([header for header, _ in _TABLE_FIELDS], rows)]
    if warnings:
        parts.append("<h2>Warnings</h2><ul>" + "".join(f"<li>{escape(w)}</li>" for w in warnings))
        parts.append("</ul>")
    parts.append(images(charts))
    path.write_text(html_page(_title(result), parts))


def _cell(value: object) -> str:
    return f"{value:,.3f}" if isinstance(value, float) else str(value)


def _title(result: BenchResult) -> str:
    return f"slipstream bench: {result.model} over {result.protocol} at {result.url}"


# ---------------------------------------------------------------------------- charts


def _latency_vs_throughput(axis: Any, levels: list[LevelResult]) -> None:
    throughput = [level.throughput_infer_per_s for level in levels]
    for name, attribute in _PERCENTILES:
        values = [getattr(level, attribute) for level in levels]
        points = [(x, y) for x, y in zip(throughput, values, strict=True) if y is not None]
        if points:
            axis.plot(*zip(*points, strict=True), marker="o", label=name)
    for level in levels:
        if level.p99_ms is not None:
            axis.annotate(
                level.label,
                (level.throughput_infer_per_s, level.p99_ms),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=8,
            )
    axis.set_xlabel("throughput (inferences/s)")
    axis.set_ylabel("latency (ms)")
    axis.set_title("Latency vs throughput")
    axis.grid(True, alpha=0.3)
    axis.legend()


def _percentiles_per_level(axis: Any, levels: list[LevelResult]) -> None:
    names = [("avg", "avg_ms"), *_PERCENTILES, ("max", "max_ms")]
    width = 0.8 / len(names)
    for offset, (name, attribute) in enumerate(names):
        values = [getattr(level, attribute) or 0.0 for level in levels]
        positions = [i + (offset - (len(names) - 1) / 2) * width for i in range(len(levels))]
        axis.bar(positions, values, width=width, label=name)
    axis.set_xticks(range(len(levels)), [level.label for level in levels])
    axis.set_ylabel("latency (ms)")
    axis.set_title("Latency percentiles per load level")
    # Levels often span orders of magnitude: a log scale keeps the low ones visible.
    highest = max((level.max_ms or 0.0 for level in levels), default=0.0)
    lowest = min((level.p50_ms for level in levels if level.p50_ms), default=0.0)
    if lowest > 0 and highest > 20 * lowest:
        axis.set_yscale("log")
    axis.grid(True, axis="y", alpha=0.3)
    axis.legend(fontsize=8)


def _server_breakdown(axis: Any, levels: list[LevelResult]) -> None:
    positions = range(len(levels))
    if all(level.server_queue_ms is None for level in levels):
        axis.bar(positions, [level.avg_ms or 0.0 for level in levels], label="client mean")
        axis.set_title("Mean latency (the server offers no statistics)")
    else:
        bottoms = [0.0] * len(levels)
        for name, attribute in _BREAKDOWN:
            values = [max(0.0, getattr(level, attribute) or 0.0) for level in levels]
            axis.bar(positions, values, bottom=bottoms, label=name)
            bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
        axis.set_title("Where a request's time went (mean)")
    axis.set_xticks(list(positions), [level.label for level in levels])
    axis.set_ylabel("ms per request")
    axis.grid(True, axis="y", alpha=0.3)
    axis.legend(fontsize=8)


_DRAWERS: list[Callable[[Any, list[LevelResult]], None]] = [
    _latency_vs_throughput,
    _percentiles_per_level,
    _server_breakdown,
]
