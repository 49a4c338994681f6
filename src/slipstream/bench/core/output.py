"""What both bench modes show: the live progress bar, the terminal console, number
cells and the problems under the tables. The files go through :mod:`slipstream.reports`
(shared with profile)."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, TypeVar

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


_P = TypeVar("_P", bound="LevelProgress")


class LevelProgress:
    """A progress bar per load level, for a mode's live progress listener: use it as a
    context manager and call :meth:`new_level` as each level starts."""

    def __init__(self, console: Console) -> None:
        self._console = console
        self._progress = progress_bar(console)
        self._task: Any = None

    def __enter__(self: _P) -> _P:
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


def errors_cell(errors_by_code: Mapping[str, int]) -> str:
    """Errors by code in one CSV cell: ``http 503=2; timeout=1``."""
    return "; ".join(f"{key}={count}" for key, count in errors_by_code.items())
