"""Scale to zero as a state machine: requests, idle time, and model files that break and
mend, in random order, against the real serving core.

Hypothesis drives a :class:`ModelServer` of two real ONNX models (one pinned) and its
:class:`IdleWatcher` with a test clock, and after every step checks it against a model of
what must be true:

* a model is asleep exactly when it went a whole idle delay without a request since it
  last loaded, and was not pinned; a pinned model never sleeps;
* a request to a loaded model is answered with its right outputs; to an asleep one, it
  loads the model once and is answered, or, when the files are broken, gets a 503 naming
  the load failure; inside the back-off after a failed load, a 503 without a new load;
* the loads counted are exactly the loads the model expects (one per wake-up attempt), so
  no request ever loads a model twice or loads a model that was awake.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from slipstream.config import ServerSettings
from slipstream.errors import Unavailable
from slipstream.serving.core import ModelServer
from slipstream.types import InferRequest
from tests.models import ADD_SUB_WIDTH, build_add_sub, write_config

IDLE_S = 10.0
MODELS = ("napper", "pinned")


class IdleMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="idle-states-"))
        repo = self.root / "repo"
        for name in MODELS:
            build_add_sub(repo, name)
        write_config(repo, "pinned", {"pin": True})
        self.model_file = repo / "napper" / "1" / "model.onnx"
        self.good = self.model_file.read_bytes()
        self.loop = asyncio.new_event_loop()
        self.server = ModelServer(
            ServerSettings(model_repository=repo, idle_unload_seconds=IDLE_S, load_wait_s=30)
        )
        self.loop.run_until_complete(self.server.models.load_all())
        self.watcher = self.server._idle  # the server's own watcher, driven by the test clock
        # The model: when the watcher first saw each model's current activity (None: not
        # since its last request or load), and whether it sleeps.
        self.seen_at: dict[str, float | None] = dict.fromkeys(MODELS, None)
        self.asleep = dict.fromkeys(MODELS, False)
        self.broken = False
        self.loads = 1  # napper's loads, ready or failed
        self.failed_until = 0.0  # real time: a failed wake-up's back-off
        self.now = 0.0
        self._check()

    def _check(self) -> None:
        """One watcher check at the test clock, and what the model says it does."""
        self.loop.run_until_complete(self.watcher.check(self.now))
        for model in MODELS:
            if model == "pinned" or self.asleep[model]:
                continue
            seen = self.seen_at[model]
            if seen is None:
                self.seen_at[model] = self.now
            elif self.now - seen >= IDLE_S:
                self.asleep[model], self.seen_at[model] = True, None

    def teardown(self) -> None:
        self.loop.run_until_complete(self.server.stop())
        self.loop.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def _counted_loads(self) -> float:
        loads = self.server.models.lifecycle.loads
        return loads["napper", "ready"] + loads["napper", "failed"]

    @rule(model=st.sampled_from(MODELS), value=st.integers(0, 50))
    def request(self, model: str, value: int) -> None:
        data = np.full((1, ADD_SUB_WIDTH), float(value), np.float32)
        request = InferRequest(model, "", inputs={"INPUT0": data, "INPUT1": data})
        in_backoff = self.asleep[model] and time.monotonic() < self.failed_until
        try:
            response = self.loop.run_until_complete(self.server.infer(request))
        except Unavailable as exc:
            assert model == "napper" and self.asleep[model], exc.message
            assert self.broken or in_backoff, exc.message
            if not in_backoff:  # a wake-up was tried, and failed
                assert "failed to load" in exc.message, exc.message
                self.loads += 1
                self.failed_until = time.monotonic() + 1.0
            return
        assert not in_backoff, "answered inside the back-off of a failed load"
        np.testing.assert_array_equal(response.outputs["OUTPUT0"], data * 2)
        if self.asleep[model]:
            assert not self.broken, "a broken model answered after waking"
            self.loads += 1
            self.asleep[model] = False
        self.seen_at[model] = None  # its idle time counts from the next check on

    @rule(seconds=st.sampled_from([1.0, 4.0, IDLE_S, 2 * IDLE_S]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds
        self._check()

    @precondition(lambda self: not self.broken)
    @rule()
    def break_files(self) -> None:
        self.model_file.write_bytes(b"not an onnx file")
        self.broken = True

    @precondition(lambda self: self.broken)
    @rule()
    def mend_files(self) -> None:
        self.model_file.write_bytes(self.good)
        self.broken = False

    @invariant()
    def matches_the_model(self) -> None:
        index = {e.name: (e.state, e.reason) for e in self.server.index_now()}
        for model in MODELS:
            loaded = bool(self.server.models.loaded_versions(model))
            assert loaded != self.asleep[model], (model, index[model], self.asleep)
            if self.asleep[model]:
                assert index[model][0] == "UNAVAILABLE"
        assert not self.asleep["pinned"]
        assert self._counted_loads() == self.loads


TestIdleStates = IdleMachine.TestCase
TestIdleStates.settings = settings(
    max_examples=60,
    stateful_step_count=16,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
