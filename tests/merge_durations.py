"""Merge the test times each half of the suite recorded into the suite's durations file.

``python tests/merge_durations.py DURATIONS HALF...``: each HALF began as a copy of
DURATIONS and holds, changed, the times of the tests its half ran; those replace the old
ones (`make durations`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def merge(old: dict[str, float], halves: list[dict[str, float]]) -> dict[str, float]:
    merged = dict(old)
    for half in halves:
        merged.update({test: took for test, took in half.items() if old.get(test) != took})
    return merged


def main(argv: list[str]) -> None:
    target, *paths = (Path(arg) for arg in argv)
    old = json.loads(target.read_text())
    merged = merge(old, [json.loads(path.read_text()) for path in paths])
    changed = sum(1 for test, took in merged.items() if old.get(test) != took)
    target.write_text(json.dumps(merged, sort_keys=True, indent=4) + "\n")
    print(f"{target}: {changed} of {len(merged)} test times recorded again")


if __name__ == "__main__":
    main(sys.argv[1:])
