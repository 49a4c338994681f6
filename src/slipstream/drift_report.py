"""``slipstream monitor report``: a served model's last drift window as an HTML page.

Reads ``GET /v2/models/{m}[/versions/{v}]/drift`` and draws, for each drifted feature
(or every feature with ``all_features``), the reference's and the window's shares per
bin (the reference's deciles, or its categories), beside the table of tests.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any

from slipstream.reports import escape, html_page, html_table, images, new_figure, png

# Charts per tensor at most: a wide tensor can drift in all of its 64 features.
MAX_CHARTS = 24


def drift_page(doc: Mapping[str, Any], all_features: bool = False) -> str:
    """The page for one drift report (the route's JSON)."""
    title = f"Drift of {doc['model']} version {doc['version']}"
    parts = [
        f"<p>Reference: {escape(str(doc['reference']))} ({doc['reference_rows']} rows); "
        f"windows of {doc['window']} rows, {doc['windows']} tested; "
        f"sampled {doc['sampled']}, dropped {doc['dropped']}. "
        f"<b>{'Drift detected' if doc['detected'] else 'No drift'}</b> in the last window.</p>"
    ]
    if doc.get("disabled"):
        parts.append(f"<p><b>Drift monitoring is off:</b> {escape(str(doc['disabled']))}</p>")
    for name, report in doc["tensors"].items():
        features = report["features"]
        shown = features if all_features else [f for f in features if f["drifted"]]
        parts.append(f"<h2>{escape(name)}: {'drifted' if report['detected'] else 'no drift'}"
                     f" (p below {report['p_threshold']:.2g})</h2>")  # fmt: skip
        rows = [
            [f["feature"], f["kind"], _number(f["statistic"], ".3f"),
             _number(f["p_value"], ".3g"), _number(f["psi"], ".3f"),
             "yes" if f["drifted"] else "", f.get("note", "")]
            for f in sorted(features, key=_p_value_order)
        ]  # fmt: skip
        header = ["feature", "test", "statistic", "p-value", "PSI", "drift", "note"]
        parts.append(html_table(header, rows))
        parts.append(images(_chart(name, f) for f in shown[:MAX_CHARTS]))
        if len(shown) > MAX_CHARTS:
            parts.append(f"<p>{len(shown) - MAX_CHARTS} more features not drawn.</p>")
    if doc.get("skipped"):
        skipped = [[name, reason] for name, reason in doc["skipped"].items()]
        parts.append("<h2>Not tested</h2>" + html_table(["tensor", "why"], skipped))
    return html_page(title, parts)


def _number(value: float | None, spec: str) -> str:
    """A statistic as the table shows it: "untested" for none (a NaN in the JSON)."""
    return "untested" if value is None or not math.isfinite(value) else format(value, spec)


def _p_value_order(feature: Mapping[str, Any]) -> float:
    """Smallest p-value first; a feature without one (untested) first of all: it is the
    one to look at."""
    p_value = feature["p_value"]
    return -1.0 if p_value is None or not math.isfinite(p_value) else float(p_value)


def _chart(tensor: str, feature: Mapping[str, Any]) -> bytes:
    reference, window = feature["reference_shares"], feature["window_shares"]
    bins = feature["bins"]
    if feature["kind"] == "categorical":
        labels = [f"{b:g}" for b in bins] + ["other"]
    else:
        edges = ["-inf", *(f"{b:.3g}" for b in bins), "inf"]
        labels = [f"{lo}..{hi}" for lo, hi in itertools.pairwise(edges)] + ["NaN"]
    figure = new_figure(6.4, 2.6)
    axes = figure.subplots()
    positions = range(len(reference))
    axes.bar([p - 0.2 for p in positions], reference, width=0.4, label="reference")
    axes.bar([p + 0.2 for p in positions], window, width=0.4, label="last window")
    axes.set_xticks(list(positions), labels[: len(reference)], rotation=30, fontsize=7)
    axes.set_ylabel("share")
    axes.set_title(f"{tensor} feature {feature['feature']}: "
                   f"p={_number(feature['p_value'], '.2g')}, "
                   f"PSI {_number(feature['psi'], '.2f')}", fontsize=9)  # fmt: skip
    axes.legend(fontsize=7)
    return png(figure)
