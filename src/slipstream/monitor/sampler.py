"""Drift monitoring of one model version, off the hot path.

The serving path calls :meth:`DriftMonitor.offer` after a response is ready: it keeps a
reference to the request's inputs and outputs in a bounded queue (or counts a drop when
the queue is full) and returns; nothing is copied or tested there. A worker thread takes
the samples, gathers their batch rows per tensor and, each time ``window`` rows of every
tested tensor are in, tests them against the reference (:mod:`slipstream.monitor.drift`).

The reference is the version's ``drift_reference.npz`` when it has one (one array per
tensor name, written by ``slipstream monitor reference``), else the first
``reference_samples`` rows the version serves: the distribution it met going live. A
capture ends when one tensor has that many rows (a tensor few clients ask for, such as an
output most requests leave out, would hold it open forever); the tensors short of them
are left out, with the reason in ``skipped``.

A reference file that cannot be used turns the version's monitoring off, with the reason
in ``disabled``; the version itself loads and serves as without monitoring.
"""

from __future__ import annotations

import functools
import logging
import random
import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from slipstream.config import DriftSettings
from slipstream.monitor.drift import DriftReport, Reference

logger = logging.getLogger(__name__)

REFERENCE_FILE = "drift_reference.npz"


@dataclass
class DriftState:
    """What the monitor knows now; read by /metrics and the drift route."""

    # Where the reference came from: "file", "captured", or "capturing" until it is.
    reference: str = "capturing"
    # Rows gathered towards the reference while capturing (of its best-sampled tensor).
    reference_rows: int = 0
    sampled: int = 0
    dropped: int = 0
    # Windows tested (one per window, however many tensors it tested).
    windows: int = 0
    # Tensor tests run: a window of three tested tensors counts three.
    tensor_tests: int = 0
    # Why monitoring is off for the version (a reference file it cannot use); "" if on.
    disabled: str = ""
    # The last window's report per tensor.
    reports: dict[str, DriftReport] = field(default_factory=dict)
    # Why a tensor is not tested (a shape that changed, a tensor the reference lacks).
    skipped: dict[str, str] = field(default_factory=dict)


class DriftMonitor:
    """Samples one version's requests and tests each window in a thread of its own."""

    def __init__(
        self,
        model: str,
        version: str,
        settings: DriftSettings,
        version_dir: Path | None = None,
    ) -> None:
        self.model = model
        self.version = version
        self._settings = settings
        self.state = DriftState()
        self._queue: deque[dict[str, np.ndarray]] = deque()
        # Whether requests are sampled now: closed from a window's last row until
        # min_interval_s after its test, so a busy model pays for one window per interval
        # (a flag check per request otherwise), not for a test every few milliseconds.
        self._open = True
        self._wake = threading.Condition()
        self._closed = False
        self._random = random.Random(0)
        self._references: dict[str, Reference] = {}
        self._captured: dict[str, list[np.ndarray]] = {}
        self._pending: dict[str, list[np.ndarray]] = {}
        # Rows gathered so far per tensor, into _captured or _pending (whichever fills).
        self._rows: dict[str, int] = {}
        path = version_dir / REFERENCE_FILE if version_dir is not None else None
        if path is not None and path.is_file():
            self._load_reference(path)
        if self.state.disabled:
            self._open = False  # offers cost a flag check and are never sampled
        self._thread = threading.Thread(
            target=self._run, name=f"slipstream-drift-{model}", daemon=True
        )
        self._thread.start()

    # -- the serving path ----------------------------------------------------------------

    def offer(self, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> None:
        """Queue one request's tensors for testing; O(1), never blocks, never raises."""
        if not self._open:
            return
        settings = self._settings
        if settings.sample_rate < 1.0 and self._random.random() >= settings.sample_rate:
            return
        state = self.state
        if len(self._queue) >= settings.queue_size:
            state.dropped += 1
            return
        tensors = {**inputs, **outputs}
        if settings.tensors:
            tensors = {k: v for k, v in tensors.items() if k in settings.tensors}
        self._queue.append(tensors)
        state.sampled += 1
        with self._wake:
            self._wake.notify()

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(10)

    # -- the worker thread ---------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
            self._drain()
            if self.state.reference != "capturing" and self._window_full():
                self._open = False
                self._drain()  # what was queued before the gate closed
                self._guarded(self._test_windows)
                with self._wake:
                    self._wake.wait_for(lambda: self._closed, self._settings.min_interval_s)
                self._pending.clear()  # rows that came in with the last ones: not sampled
                self._rows.clear()
                self._open = True

    def _drain(self) -> None:
        while self._queue:
            sample = self._queue.popleft()
            self._guarded(functools.partial(self._take, sample))

    def _guarded(self, step: Callable[[], None]) -> None:
        try:
            step()
        except Exception:  # a monitor fault must never reach the serving path
            logger.exception("drift monitor of %s:%s failed", self.model, self.version)

    def _take(self, sample: dict[str, np.ndarray]) -> None:
        for name, array in sample.items():
            if name in self.state.skipped:
                continue
            rows = np.asarray(array)
            if rows.ndim == 0:
                self.state.skipped[name] = "a scalar has no batch dimension to sample"
                continue
            if self.state.reference != "capturing" and name not in self._references:
                continue  # nothing to test it against
            target = self._captured if self.state.reference == "capturing" else self._pending
            target.setdefault(name, []).append(rows)
            self._rows[name] = self._rows.get(name, 0) + len(rows)
        if self.state.reference == "capturing":
            self._maybe_finish_capture()

    def _window_full(self) -> bool:
        window = self._settings.window
        return any(rows >= window for rows in self._rows.values())

    def _maybe_finish_capture(self) -> None:
        self.state.reference_rows = max(self._rows.values(), default=0)
        wanted = self._settings.reference_samples
        if self.state.reference_rows < wanted:
            return
        least = min(wanted, self._settings.window)
        for name, parts in self._captured.items():
            rows = self._rows.get(name, 0)
            if rows < least:
                self.state.skipped[name] = (
                    f"{rows} rows when the reference was captured from {wanted} (at least "
                    f"{least} needed): too few requests carried it; ask for it in more "
                    "requests, or write a reference file (slipstream monitor reference)"
                )
                continue
            try:
                self._references[name] = Reference.from_samples(
                    name, np.concatenate(parts), alpha=self._settings.alpha
                )
            except ValueError as exc:  # rows of another shape than the first ones
                self.state.skipped[name] = str(exc)
        self._captured.clear()
        self._rows.clear()
        self.state.reference = "captured"
        logger.info(
            "drift reference of %s:%s captured from %d rows",
            self.model, self.version, self.state.reference_rows,
        )  # fmt: skip

    def _test_windows(self) -> None:
        """Test the first ``window`` rows of every tensor that has them."""
        window = self._settings.window
        # Readers see the window's reports all at once: the dict is replaced, not filled.
        reports = dict(self.state.reports)
        tested = 0
        for name, parts in list(self._pending.items()):
            rows = np.concatenate(parts) if parts else np.empty((0,))
            reference = self._references.get(name)
            if len(rows) < window or reference is None:
                continue
            try:
                report = reference.test(rows[:window])
            except ValueError as exc:
                self.state.skipped[name] = str(exc)
                continue
            reports[name] = report
            tested += 1
            if report.detected:
                logger.warning(
                    "drift in %s:%s %s: %d of %d features (min p %.2g)",
                    self.model, self.version, name, len(report.drifted),
                    len(report.features), report.min_p_value,
                )  # fmt: skip
        if tested:
            self.state.reports = reports
            self.state.windows += 1
            self.state.tensor_tests += tested

    def _load_reference(self, path: Path) -> None:
        """The file's references; an array it cannot use is skipped, a file it cannot
        use at all disables monitoring (never the version's load), each with the reason."""
        self.state.reference = "file"
        try:
            with np.load(path, allow_pickle=False) as data:
                for name in data.files:
                    try:
                        self._references[name] = Reference.from_samples(
                            name, data[name], alpha=self._settings.alpha
                        )
                    except ValueError as exc:  # too few rows, a scalar
                        self.state.skipped[name] = f"{path.name}: {exc}"
        except Exception as exc:  # an unreadable file: zip, npy or pickle errors alike
            self.state.disabled = f"{path}: cannot be read ({exc})"
        if not self._references and not self.state.disabled:
            why = "; ".join(self.state.skipped.values()) or "it holds no arrays"
            self.state.disabled = f"{path}: no usable reference ({why})"
        if self.state.disabled:
            self.state.disabled += "; write it again with slipstream monitor reference"
            logger.warning("drift monitoring of %s:%s is off: %s", self.model, self.version,
                           self.state.disabled)  # fmt: skip
        elif self.state.skipped:
            logger.warning("drift reference of %s:%s: tensors left out: %s", self.model,
                           self.version, self.state.skipped)  # fmt: skip
        self.state.reference_rows = min(
            (len(r.samples) for r in self._references.values()), default=0
        )

    # -- reading -------------------------------------------------------------------------

    def to_json(self) -> dict[str, object]:
        state = self.state
        reports = state.reports  # one window's reports, whatever the worker does meanwhile
        return {
            "model": self.model,
            "version": self.version,
            "reference": state.reference,
            "reference_rows": state.reference_rows,
            "window": self._settings.window,
            "sampled": state.sampled,
            "dropped": state.dropped,
            "windows": state.windows,
            "tensor_tests": state.tensor_tests,
            "disabled": state.disabled or None,
            "detected": any(r.detected for r in reports.values()),
            "tensors": {name: r.to_json() for name, r in sorted(reports.items())},
            "skipped": dict(sorted(state.skipped.items())),
        }
