"""The files the tools write (bench, profile): a result dataclass as JSON, rows as CSV,
and self-contained HTML pages with their charts embedded as PNGs.

matplotlib is imported only when a figure is made, with the Agg canvas (no display):
figures are ``matplotlib.figure.Figure`` objects, not pyplot's, so none is left open.

Example::

    figure = new_figure(6.4, 4.0)
    figure.subplots().plot([1, 2, 3])
    page = html_page("a title", [html_table(["a", "b"], [["1", "2"]]), images([png(figure)])])
"""

from __future__ import annotations

import base64
import csv
import dataclasses
import html
import io
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# The pages' style sheet: readable tables, first column left-aligned, charts as wide as
# the page.
STYLE = (
    "body{font-family:system-ui,sans-serif;margin:2em;max-width:70em}"
    "table{border-collapse:collapse;margin:1em 0}"
    "td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right}"
    "th{background:#f2f2f2}td:first-child,th:first-child{text-align:left}"
    "tr.best{font-weight:bold;background:#fff6d5}img{max-width:100%;display:block}"
)


def write_json(result: Any, path: Path, *, allow_nan: bool = False) -> None:
    """A result dataclass as indented JSON (NaN refused unless ``allow_nan``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    document = dataclasses.asdict(result)
    path.write_text(json.dumps(document, indent=2, allow_nan=allow_nan) + "\n")


def write_csv_rows(path: Path, fields: Sequence[str], rows: Iterable[Mapping[str, Any]]) -> None:
    """A CSV file of ``fields`` columns, one row per mapping; None is an empty cell."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(fields))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in row.items()})


def new_figure(width_in: float, height_in: float) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(width_in, height_in), layout="constrained")


def png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


def escape(text: str) -> str:
    return html.escape(text, quote=True)


def html_page(title: str, parts: Iterable[str]) -> str:
    """A whole page: the title as heading, then ``parts`` (HTML) in order."""
    head = f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(title)}</title>"
    body = f"<style>{STYLE}</style></head><body><h1>{escape(title)}</h1>"
    return head + body + "".join(parts) + "</body></html>\n"


def html_cells(cells: Sequence[str], tag: str) -> str:
    return "".join(f"<{tag}>{escape(cell)}</{tag}>" for cell in cells)


def html_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    body = "".join(f"<tr>{html_cells(row, 'td')}</tr>" for row in rows)
    return f"<table><tr>{html_cells(header, 'th')}</tr>{body}</table>"


def images(pngs: Iterable[bytes]) -> str:
    """PNG images embedded in the page as data URLs."""
    return "".join(
        f'<img alt="chart" src="data:image/png;base64,{base64.b64encode(data).decode()}">'
        for data in pngs
    )
