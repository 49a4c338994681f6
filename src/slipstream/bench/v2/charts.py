"""Charts of a benchmark (matplotlib, Agg): an HTML page with the PNGs embedded, or one PNG.

Three charts: latency against throughput (one point per load level), the latency
percentiles of each level, and where a request's time went (the server's queue and
compute phases, and the overhead on top) as stacked bars.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slipstream.bench.v2.results import BenchResult, LevelResult

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


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_report(result: BenchResult, path: Path) -> None:
    """``.html``: a page with a table and the three charts; ``.png``: the charts only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".png":
        path.write_bytes(_combined_png(result))
    else:
        path.write_text(_html(result))


def _combined_png(result: BenchResult) -> bytes:
    plt = _pyplot()
    figure, axes = plt.subplots(1, 3, figsize=(18, 5))
    for axis, draw in zip(axes, _DRAWERS, strict=True):
        draw(axis, result.levels)
    figure.suptitle(_title(result))
    figure.tight_layout()
    return _png(figure)


def _html(result: BenchResult) -> str:
    plt = _pyplot()
    images = []
    for draw in _DRAWERS:
        figure, axis = plt.subplots(figsize=(8, 5))
        draw(axis, result.levels)
        figure.tight_layout()
        encoded = base64.b64encode(_png(figure)).decode("ascii")
        images.append(f'<img alt="chart" src="data:image/png;base64,{encoded}">')
    warnings = [f"{level.label}: {w}" for level in result.levels for w in level.warnings]
    warnings += result.warnings
    warning_items = "".join(f"<li>{html.escape(w)}</li>" for w in warnings)
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(_title(result))}</title>"
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}"
        "img{max-width:100%;display:block;margin:1em 0}</style></head><body>"
        f"<h1>{html.escape(_title(result))}</h1>"
        f"{_html_table(result.levels)}"
        + (f"<h2>Warnings</h2><ul>{warning_items}</ul>" if warnings else "")
        + "".join(images)
        + "</body></html>\n"
    )


def _html_table(levels: list[LevelResult]) -> str:
    head = "".join(f"<th>{name}</th>" for name, _ in _TABLE_FIELDS)
    rows = []
    for level in levels:
        cells = []
        for _, attribute in _TABLE_FIELDS:
            value = getattr(level, attribute)
            text = f"{value:,.3f}" if isinstance(value, float) else str(value)
            cells.append(f"<td>{html.escape(text)}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def _title(result: BenchResult) -> str:
    return f"slipstream bench: {result.model} over {result.protocol} at {result.url}"


def _png(figure: Any) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    _pyplot().close(figure)
    return buffer.getvalue()


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
