"""Makes the shared helpers importable as ``tests.utils`` and ``tests.models``, keeps
bytecode caches, keeps what collection imported out of the garbage collector's way, and
builds the example models once per session.

``tests/`` is deliberately not a package (each tier's modules are collected by file),
so the repository root is put on ``sys.path`` once here instead.
"""

from __future__ import annotations

import compileall
import gc
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
# Bytecode caches written as Python writes them by default, although this environment
# sets PYTHONDONTWRITEBYTECODE: without them every run parsed, assertion-rewrote and
# compiled the ~100 test modules and the ~90 of schemathesis imported from here again
# (collection 14 s -> 10.5 s from the second run on).
sys.dont_write_bytecode = False


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile the package (and the helpers here) to bytecode where it is missing or
    stale, as imports do unless PYTHONDONTWRITEBYTECODE is set (the processes the tests
    start inherit it): every server, worker and tool process compiled the ~200 modules it
    imports again, ~0.1 s a process here."""
    compileall.compile_dir(Path(_ROOT) / "src" / "slipstream", quiet=2)
    compileall.compile_dir(Path(__file__).parent, maxlevels=0, quiet=2)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection made (torch, transformers, scipy, every test module: ~0.5M
    objects that live as long as the session): the collector's full passes, automatic or
    a ``gc.collect()`` in the code under test, then look only at what tests make. A full
    pass took ~0.3 s here; the unit tests spent 11.8 s collecting garbage, now 3.6 s."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each item's share of its node id's recorded time, for pytest-split (`make test`'s
    parts). schemathesis makes one item per API operation under one node id, whose
    recorded time is the sum of them all: the split counted each of those ~50 items at
    the whole module's 27 s, and cut the first half right after them (it ran ~100 s
    longer than the second)."""
    split = config.pluginmanager.get_plugin("pytestsplitplugin")
    if split is None:
        return
    for node_id, count in Counter(item.nodeid for item in items).items():
        if count > 1 and node_id in split.cached_durations:
            split.cached_durations[node_id] /= count


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After each file (its fixtures torn down): collect its garbage, then freeze what it
    left alive, as above. The pass costs what the file made, not the whole session."""
    if nextitem is None or nextitem.path != item.path:
        gc.collect()
        gc.freeze()


@pytest.fixture(scope="session")
def example_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``REPO``: the README's models (digits, minilm, smollm2) as ``make run`` builds
    them, with ``python examples/build_models.py REPO``; built once for the session (the
    minilm export and its check against sentence-transformers take seconds). Tests only
    read it."""
    models = tmp_path_factory.mktemp("example-models") / "models"
    subprocess.run(
        [sys.executable, str(Path(_ROOT) / "examples" / "build_models.py"), str(models),
         "--only", "digits,minilm,smollm2"],
        check=True, capture_output=True, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    return models


@pytest.fixture
def neighbours() -> Iterator[None]:
    """A process spinning on each usable core, for the test's length."""
    from slipstream.runtime.base import usable_cpu_count
    from tests.cpu_neighbours import busy_processes

    with busy_processes(usable_cpu_count()):
        yield


@pytest.fixture(params=[0o022, 0o002], ids=["umask-022", "umask-002"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    """The process umask for one test, each of two usual values (the files a test makes
    must get the modes a user's umask gives)."""
    value: int = request.param
    previous = os.umask(value)
    try:
        yield value
    finally:
        os.umask(previous)
