"""The live display of ``slipstream tune``: trial n of m and the best so far."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from slipstream.tune.results import TrialRecord
from slipstream.tune.session import TuneListener


class RichTuneProgress(TuneListener):
    def __init__(self, console: Console) -> None:
        self._console = console
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self._task = self._progress.add_task("tune", total=None)

    def __enter__(self) -> RichTuneProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def started(self, space_size: int, max_trials: int) -> None:
        self._progress.update(self._task, total=max_trials, description=f"space {space_size}")

    def trial_started(self, trial: int, config: dict[str, Any]) -> None:
        self._progress.update(self._task, description=f"trial {trial}: {_text(config)}")

    def remeasuring(self, trial: int, config: dict[str, Any]) -> None:
        # The bar stays full (the trials are done); its line names what runs now.
        self._console.print(f"re-measuring trial {trial}")
        description = f"re-measuring trial {trial}: {_text(config)}"
        self._progress.update(self._task, description=description)

    def trial_done(self, record: TrialRecord, best: TrialRecord | None) -> None:
        self._progress.advance(self._task)
        level = record.level
        figures = (
            f"{level.throughput_infer_per_s:.1f} infer/s, p99 {level.p99_ms or 0:.1f} ms"
            if level
            else record.error
        )
        best_text = (
            f"best so far: trial {best.trial} at {best.throughput or 0:.1f} infer/s"
            if best
            else "no configuration within the SLO yet"
        )
        self._console.print(
            f"trial {record.trial} {record.status} ({figures}, {record.wall_s:.0f} s); {best_text}"
        )

    def note(self, message: str) -> None:
        self._console.print(message)


def _text(config: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in config.items())
