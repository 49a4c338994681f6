"""Makes the shared helpers importable as ``tests.utils`` and ``tests.models``, and keeps
what collection imported out of the garbage collector's way.

``tests/`` is deliberately not a package (each tier's modules are collected by file),
so the repository root is put on ``sys.path`` once here instead.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection made (torch, transformers, scipy, every test module: ~0.5M
    objects that live as long as the session): the collector's full passes, automatic or
    a ``gc.collect()`` in the code under test, then look only at what tests make. A full
    pass took ~0.3 s here; the unit tests spent 11.8 s collecting garbage, now 6.2 s."""
    gc.collect()
    gc.freeze()
