"""Makes the shared helpers importable as ``tests.utils`` and ``tests.models``.

``tests/`` is deliberately not a package (each tier's modules are collected by file),
so the repository root is put on ``sys.path`` once here instead.
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
