"""runtime/heap.py: start-up objects frozen out of the collector's walk, a retired
model's cycles collected all the same, freed memory handed back at a bounded rate."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import weakref
from collections.abc import Iterator

import pytest

from slipstream.runtime import heap


class Model:
    """Stands for a loaded model whose objects refer to each other (a cycle)."""

    def __init__(self) -> None:
        self.self_reference = self


@pytest.fixture(autouse=True)
def thawed() -> Iterator[None]:
    """Each test starts with nothing frozen; the session's freeze (tests/conftest.py)
    is put back after it."""
    gc.unfreeze()
    yield
    gc.freeze()


def test_settle_freezes_what_exists_so_a_collection_skips_it() -> None:
    model = Model()
    alive = weakref.ref(model)
    assert gc.get_freeze_count() == 0
    heap.settle()
    assert gc.get_freeze_count() > 0
    del model
    gc.collect()
    assert alive() is not None  # frozen: the collector does not look at it


async def retire_frozen_model(reclaims: int) -> weakref.ref[Model]:
    """A model frozen by settle(), then dropped, ``reclaims`` reclaim_soon() calls made
    and their delay waited; a reference that tells whether the model was collected."""
    model = Model()
    alive = weakref.ref(model)
    heap.settle()
    del model
    for _ in range(reclaims):
        heap.reclaim_soon()
    await asyncio.sleep(heap.RECLAIM_DELAY_S + 0.5)
    return alive


async def test_a_retired_models_frozen_cycle_is_reclaimed_and_the_rest_frozen_again() -> None:
    alive = await retire_frozen_model(reclaims=2)  # the second coalesced with the first
    assert alive() is None
    assert gc.get_freeze_count() > 0


async def test_a_reclaim_pending_on_a_closed_loop_does_not_block_the_next() -> None:
    heap.reclaim_soon()  # this test's loop closes before it runs
    assert heap._reclaim_loop is asyncio.get_running_loop()


async def test_reclaim_runs_on_a_new_loop_after_the_old_one_closed() -> None:
    alive = await retire_frozen_model(reclaims=1)
    assert alive() is None


@pytest.mark.skipif(heap._malloc_trim is None, reason="no glibc malloc_trim on this system")
def test_trim_runs_at_most_once_an_interval_unless_forced() -> None:
    assert heap.trim(force=True)
    assert not heap.trim()
    assert heap.trim(force=True)


# A request's life as a front end sees it: a 600 KB body joined, an aligned copy of its
# tensor, a response of the same size, all freed before the next request.
_REQUESTS = """
import resource, sys
import numpy as np
from slipstream.runtime import heap
configured = heap.configure() if sys.argv[1] == "configure" else False
def request():
    body = b"".join([b"h" * 200, bytes(600_000)])
    tensor = np.frombuffer(body, np.uint8, 600_000, 200).copy()
    return (tensor * 2).tobytes()
for _ in range(20):  # warm up: glibc raises its own limit once it sees such frees
    request()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(200):
    request()
print(configured, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 200)
"""


def _faults_per_request(mode: str) -> tuple[bool, float]:
    out = subprocess.run(
        [sys.executable, "-c", _REQUESTS, mode], capture_output=True, text=True, check=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)},
    ).stdout.split()  # fmt: skip
    return out[0] == "True", float(out[1])


@pytest.mark.skipif(heap._mallopt is None, reason="glibc only")
def test_configure_keeps_tensor_sized_buffers_from_faulting_in_anew() -> None:
    configured, faults = _faults_per_request("configure")
    assert configured
    # Each request's buffers come from the heap, already mapped: no page faults.
    assert faults < 5
    # glibc's default maps and unmaps them, and pages them in anew each request (this
    # pattern of frees never raises its adaptive limit): 666 faults a request here.
    assert _faults_per_request("default")[1] > 100
