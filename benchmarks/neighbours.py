"""Thread settings of a CPU engine beside 0, 1, ... busy processes (one per core at
most): the shared loop of ``llm_threads.py`` and ``torch_threads.py``."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.cpu_neighbours import busy_processes


def against_neighbours(
    cores: int,
    settings: list[str],
    measure: Callable[[str], tuple[float, int]],
    rounds: int,
    unit: str,
    label: str = "",
) -> dict[str, dict[str, Any]]:
    """For 0 to ``cores`` busy processes, ``measure(setting)`` -> (rate, threads at the
    end) for each setting, rounds alternating them; prints each setting's median, its
    spread and its ratio to the best setting named ``fixed ...``; returns the figures."""
    results: dict[str, dict[str, Any]] = {}
    for busy in range(cores + 1):
        rates: dict[str, list[float]] = {name: [] for name in settings}
        threads: dict[str, int] = {}
        with busy_processes(busy):
            time.sleep(0.5)
            for _ in range(rounds):
                for name in settings:
                    rate, threads[name] = measure(name)
                    rates[name].append(rate)
        medians = {name: statistics.median(values) for name, values in rates.items()}
        best = max(medians[name] for name in medians if name.startswith("fixed"))
        key = f"{label}{busy} busy"
        results[key] = {unit.replace("/", "_per_"): rates, "threads_at_end": threads}
        for name, value in medians.items():
            spread = f"{min(rates[name]):,.1f}-{max(rates[name]):,.1f}"
            print(f"{key:17} {name:8} {value:10,.1f} {unit} ({spread})  / best fixed "
                  f"{value / best:.2f}  threads at end {threads[name]}")  # fmt: skip
    return results
