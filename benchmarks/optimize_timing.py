"""One-core A/B timing for `optimize.py`: models timed in alternating order, medians.

Sessions get the options `slipstream serve` gives an ONNX model with one intra-op
thread (`slipstream.runtime.onnx.session_options`), optionally plus ONNX Runtime's
`session.set_denormal_as_zero`: with it off, as served today, MLAS's exp on the masked
positions of a transformer's attention softmax returns denormal floats, and each of
MiniLM's softmaxes at batch 8 x 128 tokens takes ~8 ms instead of ~0.8 ms, in FP32 and
int8 alike. Both settings are reported, as that fixed cost dilutes every speed-up.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import time
from collections.abc import Mapping
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime as ort

from slipstream.runtime.onnx import session_options

WARMUP_RUNS = 3


def one_core_session(path: Path, denormals_as_zero: bool) -> ort.InferenceSession:
    options = session_options({"intra_op_thread_count": "1"}, instance_count=1)
    if denormals_as_zero:
        options.add_session_config_entry("session.set_denormal_as_zero", "1")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def median_latency_ms(
    session: ort.InferenceSession, feed: Mapping[str, np.ndarray], seconds: float
) -> float:
    for _ in range(WARMUP_RUNS):
        session.run(None, dict(feed))
    latencies = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(latencies) < 3:
        started = time.perf_counter()
        session.run(None, dict(feed))
        latencies.append(time.perf_counter() - started)
    return 1000.0 * statistics.median(latencies)


def interleaved_latencies_ms(
    paths: Mapping[str, Path],
    feed: Mapping[str, np.ndarray],
    *,
    rounds: int,
    seconds: float,
    core: int,
    denormals_as_zero: bool,
) -> dict[str, list[float]]:
    """Each model's median latency per round; the order reverses every other round so a
    slow stretch of the machine does not always hit the same models.

    Runs in a fresh process: ORT applies denormals-as-zero to the calling thread (where
    one intra-op thread runs everything) only from the first session a process creates,
    so the two settings cannot share a process, nor this one, which has made sessions.
    """
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
        job = pool.submit(
            _latencies_here, dict(paths), dict(feed), rounds, seconds, core, denormals_as_zero
        )
        return job.result()


def _latencies_here(
    paths: dict[str, Path],
    feed: dict[str, np.ndarray],
    rounds: int,
    seconds: float,
    core: int,
    denormals_as_zero: bool,
) -> dict[str, list[float]]:
    os.sched_setaffinity(0, {core})
    sessions = {label: one_core_session(path, denormals_as_zero) for label, path in paths.items()}
    measured: dict[str, list[float]] = {label: [] for label in paths}
    for round_index in range(rounds):
        labels = list(paths) if round_index % 2 == 0 else list(reversed(paths))
        for label in labels:
            measured[label].append(median_latency_ms(sessions[label], feed, seconds))
    return measured


def ratios_to(base: list[float], other: list[float]) -> list[float]:
    """Speed-up per round: the base model's latency over the other's (same batch)."""
    return [b / o for b, o in zip(base, other, strict=True)]
