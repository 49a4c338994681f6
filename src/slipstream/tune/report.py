"""The tune's outputs: tune.json, the HTML report (leaderboard, Pareto front of cost vs
p99 as a chart, excluded variants, skipped profiles, failed trials with their log
tails) and the terminal's leaderboard.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slipstream.reports import escape, html_page, html_table, images, new_figure, png
from slipstream.tune.results import TrialRecord, TuneResult, cost_axis

if TYPE_CHECKING:
    from rich.console import Console

LEADERBOARD_HEADER = [
    "#", "variant", "profile", "batch", "delay us", "inst", "threads", "conc",
    "infer/s at SLO", "spread %", "p50 ms", "p99 ms", "accuracy drop", "$/1M infer",
]  # fmt: skip


def tune_document(result: TuneResult) -> dict[str, Any]:
    """tune.json: the result, each trial with its median throughput, spread and cost. A
    level infinitely far from the SLO (failed requests, no figures) has ``slo_ratio``
    null: JSON has no infinity."""
    document = dataclasses.asdict(result)
    for entry, record in zip(document["trials"], result.trials, strict=True):
        entry["throughput_infer_per_s"] = record.throughput
        entry["spread_pct"] = record.spread_pct
        entry["p50_ms"], entry["p99_ms"] = record.p50_ms, record.p99_ms
        entry["cost_per_1m_infer"] = record.cost_per_1m_infer
        for level in entry["levels"]:
            if not math.isfinite(level["slo_ratio"]):
                level["slo_ratio"] = None
    return document


def write_json(result: TuneResult, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(tune_document(result), indent=2, default=str, allow_nan=False)
    path.write_text(text + "\n")


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def leaderboard_row(record: TrialRecord) -> list[str]:
    config, level = record.config, record.level
    return [
        str(record.trial),
        str(config["variant"]),
        str(config["profile"]),
        str(config["max_batch_size"]),
        str(config["max_queue_delay_us"]),
        str(config["instances"]),
        str(config["threads"]),
        str(level.concurrency) if level else "-",
        _fmt(record.throughput, 1),
        _fmt(record.spread_pct, 1),
        _fmt(record.p50_ms),
        _fmt(record.p99_ms),
        _drop(record.accuracy_drop, record.accuracy_baseline),
        _fmt(record.cost_per_1m_infer, 4),
    ]


def _drop(drop: float | None, baseline: int | None) -> str:
    """An accuracy drop, and the version it is against unless the original (tune.variants)."""
    return _fmt(drop, 4) + ("" if baseline is None else f" vs v{baseline}")


def verdict(result: TuneResult) -> str:
    """One line: the winner, or that no configuration met the SLO and the closest."""
    slo = slo_text(result.slo)
    if result.winner is not None:
        record = result.record(result.winner)
        cost = record.cost_per_1m_infer
        return (
            f"best within SLO ({slo}): trial {record.trial}, {_fmt(record.throughput, 1)} "
            f"infer/s, p99 {_fmt(record.p99_ms)} ms"
            + (f", {cost:.4f} per 1M inferences" if cost else "")
        )
    if result.closest is not None:
        record = result.record(result.closest)
        level = record.level
        assert level is not None  # closest() picks only trials with a level
        return (
            f"SLO NOT MET ({slo}) by any configuration measured; closest: trial {record.trial} "
            f"({_config_text(record)}) at concurrency {level.concurrency}: p50 "
            f"{_fmt(level.p50_ms)} ms, p99 {_fmt(level.p99_ms)} ms, "
            f"{_fmt(level.throughput_infer_per_s, 1)} infer/s"
        )
    return f"SLO NOT MET ({slo}): no trial produced a measurement (see the failed trials)"


def slo_text(slo: dict[str, Any]) -> str:
    parts = [f"{k}<={v:g}" for k, v in slo.items() if k.endswith("_ms")]
    if slo.get("min_throughput") is not None:
        parts.append(f"throughput>={slo['min_throughput']:g}/s")
    return ", ".join(parts)


def _config_text(record: TrialRecord) -> str:
    return ", ".join(f"{k}={v}" for k, v in record.config.items())


def print_leaderboard(result: TuneResult, console: Console, rows: int = 10) -> None:
    from rich.table import Table

    table = Table(title=f"slipstream tune {result.model}: {result.mode}, "
                  f"{len(result.trials)} trials of {result.space_size}")  # fmt: skip
    for name in LEADERBOARD_HEADER:
        table.add_column(name, justify="left" if name in ("variant", "profile") else "right")
    for trial in result.leaderboard[:rows]:
        table.add_row(*leaderboard_row(result.record(trial)))
    console.print(table)
    for variant in result.variants:
        if variant["excluded"]:
            console.print(f"excluded {variant['name']}: {variant['excluded']}")
    for profile in result.profiles:
        if profile["skipped"]:
            console.print(f"skipped profile {profile['name']}: {profile['skipped']}")
    for record in result.trials:
        if record.status == "failed":
            console.print(f"trial {record.trial} failed: {record.error}")
    console.print(verdict(result))


def html_report(result: TuneResult) -> str:
    """The whole report as one self-contained page."""
    parts = [f"<p><b>{escape(verdict(result))}</b></p>"]
    if result.interrupted:
        parts.append("<p>Interrupted: the report covers the trials measured before Ctrl-C.</p>")
    parts.append(
        f"<p>Mode {escape(result.mode)}: {len(result.trials)} trials over a space of "
        f"{result.space_size} configurations, {result.wall_s:.0f} s. "
        + " ".join(escape(note) for note in result.notes)
        + "</p>"
    )
    board = [result.record(t) for t in result.leaderboard]
    parts.append("<h2>Leaderboard (within the SLO)</h2>")
    parts.append(html_table(LEADERBOARD_HEADER, [leaderboard_row(r) for r in board]))
    parts.append("<h2>Pareto front: cost vs p99</h2>")
    parts.append(images([_pareto_png(result)]))
    front = [result.record(t) for t in result.pareto]
    parts.append(html_table(LEADERBOARD_HEADER, [leaderboard_row(r) for r in front]))
    parts.append("<h2>Model variants</h2>")
    parts.append(
        html_table(
            ["variant", "accuracy drop", "metric", "from", "excluded"],
            [
                [v["name"], _drop(v["accuracy_drop"], v.get("accuracy_baseline")),
                 v["accuracy_metric"] or "-",
                 v["accuracy_source"], v["excluded"] or "-"]
                for v in result.variants
            ],
        )
    )  # fmt: skip
    parts.append("<h2>Hardware profiles</h2>")
    parts.append(
        html_table(
            ["profile", "cores", "gpu", "price per hour", "skipped"],
            [
                [p["name"], str(p.get("cpus") or p.get("cores")), str(p["gpu"] or "-"),
                 f"{p['price_per_hour']:g}", p["skipped"] or "-"]
                for p in result.profiles
            ],
        )
    )  # fmt: skip
    parts.append("<h2>Every trial</h2>")
    parts.append(html_table(["#", "status", "config", "score", "error"], [
        [str(r.trial), r.status, _config_text(r), _fmt(r.score, 3), r.error or "-"]
        for r in result.trials
    ]))  # fmt: skip
    for record in result.trials:
        if record.log_tail:
            parts.append(f"<h3>Trial {record.trial}: server log tail</h3>")
            parts.append(f"<pre>{escape(record.log_tail)}</pre>")
    return html_page(f"slipstream tune: {result.model}", parts)


def _pareto_png(result: TuneResult) -> bytes:
    figure = new_figure(7.0, 4.2)
    axes = figure.subplots()
    board = [result.record(t) for t in result.leaderboard]
    priced = any(r.cost_per_1m_infer is not None for r in board)
    front = [result.record(t) for t in result.pareto]
    for records, style, label in ((board, "o", "within SLO"), (front, "-s", "Pareto front")):
        xs = [cost_axis(r) for r in records if r.p99_ms is not None]
        ys = [r.p99_ms for r in records if r.p99_ms is not None]
        axes.plot(xs, ys, style, label=label, alpha=0.5 if style == "o" else 1.0)
    for bound_name, bound in result.slo.items():
        if bound_name.endswith("_ms") and bound is not None and bound_name == "p99_ms":
            axes.axhline(bound, color="red", linestyle="--", label="p99 SLO")
    axes.set_xlabel("cost per 1M inferences" if priced else "1 / (infer/s)")
    axes.set_ylabel("p99 latency (ms)")
    if board:
        axes.legend()
    else:
        axes.text(0.5, 0.5, "no configuration met the SLO", ha="center", transform=axes.transAxes)
    return png(figure)


def write_outputs(result: TuneResult, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, html_path = out_dir / "tune.json", out_dir / "tune.html"
    write_json(result, json_path)
    html_path.write_text(html_report(result))
    return [json_path, html_path]
