"""The built-in ``/dashboard``: one page of live charts of this server's ``/metrics``.

Files served as they are: the page, its script, and uPlot (MIT, vendored from npm's
``uplot@1.6.32`` by ``make vendor``; its licence beside it). Nothing is fetched from
another host.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

_TYPES = {
    "index.html": b"text/html; charset=utf-8",
    "dashboard.js": b"text/javascript; charset=utf-8",
    "uplot.min.js": b"text/javascript; charset=utf-8",
    "uplot.min.css": b"text/css; charset=utf-8",
    "uplot.LICENSE": b"text/plain; charset=utf-8",
}
FILES = tuple(_TYPES)


@cache
def asset(name: str) -> tuple[bytes, bytes] | None:
    """(body, content type) of one of the dashboard's files; None for any other name."""
    content_type = _TYPES.get(name)
    if content_type is None:
        return None
    return resources.files(__name__).joinpath(name).read_bytes(), content_type
