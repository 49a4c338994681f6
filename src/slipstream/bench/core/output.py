"""What both bench modes show and write: the live progress bar, the terminal console,
number cells, the problems under the tables, and the JSON file."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn


def progress_bar(console: Console) -> Progress:
    """The bench progress bar: spinner, level, bar, done/total, the level's figures."""
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(bar_width=20),
        MofNCompleteColumn(),
        TextColumn("{task.fields[figures]}"),
        console=console,
        transient=True,
    )


def terminal_console(stderr: bool = False) -> Console:
    """A console as wide as the terminal, or 200 columns when output is not one (a file,
    a pipe, CI logs): the tables stay one line per level."""
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else 200)


def fmt_num(value: float | None, digits: int = 2) -> str:
    """A table cell: thousands separated, ``-`` for a figure that is missing.

    >>> fmt_num(12345.678), fmt_num(None), fmt_num(0.5, 0)
    ('12,345.68', '-', '0')
    """
    return "-" if value is None else f"{value:,.{digits}f}"


def print_problems(console: Console, result: Any) -> None:
    """Each level's error examples and warnings, then the run's warnings (a result of
    either mode)."""
    for level in result.levels:
        for key, example in level.error_examples.items():
            console.print(f"[red]{level.label}: {key}[/]: {example[:300]}")
        for warning in level.warnings:
            console.print(f"[yellow]warning[/] {level.label}: {warning}")
    for warning in result.warnings:
        console.print(f"[yellow]warning[/] {warning}")


def write_json(result: Any, path: Path) -> None:
    """A mode's result (a dataclass) as JSON; NaN is refused (empty figures are null)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    document = dataclasses.asdict(result)
    path.write_text(json.dumps(document, indent=2, allow_nan=False) + "\n")
