"""What both bench modes show: the live progress bar, the terminal console, number
cells and the problems under the tables. The files go through :mod:`slipstream.reports`
(shared with profile)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn
from rich.table import Table

from slipstream.bench.core.settings import LoadSettings
from slipstream.reports import write_csv_rows, write_json


class LevelProgress:
    """A progress bar per load level, for a mode's live progress listener: use it as a
    context manager and call :meth:`new_level` as each level starts."""

    def __init__(self, console: Console) -> None:
        self._console = console
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(bar_width=20),
            MofNCompleteColumn(),
            TextColumn("{task.fields[figures]}"),  # the level's latest figures
            console=console,
            transient=True,
        )
        self._task: Any = None

    def __enter__(self) -> Self:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def new_level(self, description: str, total: int, figures: str) -> None:
        """Replace the last level's bar by one for the next level."""
        if self._task is not None:
            self._progress.remove_task(self._task)
        self._task = self._progress.add_task(description, total=total, figures=figures)

    def advance(self, figures: str) -> None:
        self._progress.update(self._task, advance=1, figures=figures)


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


# A table column: its heading, and a level's cell in it.
Column = tuple[str, Callable[[Any], str]]


def number(field: str, digits: int = 2) -> Callable[[Any], str]:
    """A column's cells: a level's ``field`` through :func:`fmt_num`."""
    return lambda level: fmt_num(getattr(level, field), digits)


def level_table(title: str, result: Any, columns: Sequence[Column]) -> Table:
    """A table of one row per level of ``result`` (either mode's): the level's load,
    then a cell per column, right-aligned."""
    table = Table(title=title, title_justify="left")
    table.add_column(load_header(result))
    for name, _ in columns:
        table.add_column(name, justify="right")
    for level in result.levels:
        table.add_row(load_cell(level), *(cell(level) for _, cell in columns))
    return table


def load_header(result: Any) -> str:
    """The load column's heading: a sweep is of one kind (LoadSettings._check_load)."""
    return "concurrency" if result.distribution is None else "req/s asked"


def load_cell(level: Any) -> str:
    """A level's load: its concurrency, or the request rate asked for."""
    if level.concurrency is not None:
        return str(level.concurrency)
    return f"{level.request_rate:g}"


def errors_cell(level: Any) -> str:
    """A level's errors in a table cell: ``0``, or ``http 503: 2, timeout: 1``."""
    if not level.errors:
        return "0"
    return ", ".join(f"{key}: {count}" for key, count in level.errors_by_code.items())


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


def csv_fields(level_type: Any, skipped: Iterable[str] = (), flat: Iterable[str] = ()) -> list[str]:
    """A mode's CSV columns, in order: every scalar field of its level result but
    ``skipped``, then the ``flat`` columns the mode adds, then :func:`csv_row`'s cells."""
    skip = {"errors_by_code", "error_examples", "warnings", *skipped}
    scalars = [f.name for f in dataclasses.fields(level_type) if f.name not in skip]
    return [*scalars, *flat, "errors_by_code", "warnings"]


def csv_row(level: Any, fields: Sequence[str]) -> dict[str, Any]:
    """A level's fields that it has as attributes, with its errors by code (``http
    503=2; timeout=1``) and its warnings each in one cell."""
    row = {name: getattr(level, name) for name in fields if hasattr(level, name)}
    row["errors_by_code"] = "; ".join(f"{k}={n}" for k, n in level.errors_by_code.items())
    row["warnings"] = " | ".join(level.warnings)
    return row


def write_files(
    settings: LoadSettings,
    result: Any,
    csv_fields: Sequence[str],
    row: Callable[[Any], Mapping[str, Any]],
    written: Callable[[Path], None],
) -> None:
    """--json (the whole result) and --csv (``row`` of each level), as asked for;
    ``written`` is told each path as it is written."""
    if settings.json_path is not None:
        write_json(result, settings.json_path)
        written(settings.json_path)
    if settings.csv_path is not None:
        write_csv_rows(settings.csv_path, csv_fields, [row(level) for level in result.levels])
        written(settings.csv_path)
