"""In-process profile of one model file: the raw runtime's ceiling, per batch size.

No server: the model is loaded through the server's own :class:`Backend` classes, as
the server loads it (:mod:`slipstream.profile.loading`: its config's parameters, then
``configure``; a stateful model's runs are sequences, :mod:`slipstream.profile.sequences`)
and run in a loop at each batch size. Warm-up runs are discarded, then runs are timed until
the time budget is spent; the result holds median and tail latency, throughput (rows
run / time spent running), the best batch size, the memory footprint (where there is a
GPU, its memory too and its utilization per batch size, from NVML) and, for ONNX
Runtime, the top operators from ORT's own profiler. With one intra-op thread (the
default) every figure is per core: the ceiling a server pinned to that core can approach.

Random inputs follow the signature's datatypes. Integer inputs are drawn from [0, 1000)
so token-id lookups stay inside any realistic vocabulary, except names that look like
masks (ones), token-type / segment ids (zeros) and position ids (0, 1, 2, ...).

Example::

    from slipstream.profile.measure import profile_model

    result = profile_model(
        "models/minilm/1/model.onnx",
        batch_sizes=[1, 8, 32],
        shapes={"input_ids": [128], "attention_mask": [128]},
        threads=1,
        seconds=2.0,
    )
    print(result.best_batch_size, result.best_throughput_infer_per_s)
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import json
import logging
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from slipstream.config import ModelConfig
from slipstream.config.sequence import SequenceBatching
from slipstream.datatypes import V2_TO_NUMPY, from_config_datatype, v2_datatype
from slipstream.observability.gpu import Gpus, totals
from slipstream.profile.loading import (
    THREAD_PARAMETERS,
    ProfileError,
    Run,
    load_model,
    thread_parameters,
)
from slipstream.profile.ort_trace import summarize_ort_trace
from slipstream.profile.results import (
    BatchProfile,
    OpProfile,
    OpTime,
    ProfileInput,
    ProfileResult,
    describe_environment,
)
from slipstream.profile.sequences import SequenceInputs, timed_run
from slipstream.runtime import backend_for_file, get_backend
from slipstream.runtime.base import Backend, ModelSignature, TensorSpec
from slipstream.tensors import random_tensor, value_source

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_BATCH_SIZES",
    "BatchProfile",
    "OpProfile",
    "OpTime",
    "ProfileError",
    "ProfileInput",
    "ProfileResult",
    "plan_inputs",
    "profile_model",
    "summarize_ort_trace",
]

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
# The ORT trace grows by a few events per node per run; this bounds its size.
MAX_OP_PROFILE_RUNS = 200
# Timed runs between two RSS samples (a sample costs ~20 us, outside the timed region).
_RSS_SAMPLE_EVERY = 32
# Seconds between two GPU readings at those samples: NVML's utilization covers its last
# sample period (1/6 s to 1 s), and a reading costs a few calls into the driver.
_GPU_SAMPLE_S = 0.1
_MB = 1024 * 1024
# A stateful model's runs per sequence, by default (perf_analyzer's --sequence-length).
DEFAULT_SEQUENCE_LENGTH = 20


@dataclass(frozen=True, slots=True)
class _Timing:
    """How long to run each batch size."""

    seconds: float
    warmup_runs: int
    min_runs: int
    # A stateful model's runs per sequence.
    sequence_length: int = DEFAULT_SEQUENCE_LENGTH


def profile_model(
    path: Path | str,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    shapes: Mapping[str, Sequence[int]] | None = None,
    threads: int = 1,
    seconds: float = 1.0,
    *,
    backend: str | None = None,
    datatypes: Mapping[str, str] | None = None,
    input_data: Mapping[str, np.ndarray] | None = None,
    top_ops: int = 10,
    op_profile: bool = True,
    warmup_runs: int = 2,
    min_runs: int = 3,
    on_batch: Callable[[BatchProfile], None] | None = None,
    open_gpus: Callable[[], Gpus | None] = Gpus.open,
    config: ModelConfig | None = None,
    sequence_length: int = DEFAULT_SEQUENCE_LENGTH,
) -> ProfileResult:
    """Profile ``path`` in-process at each of ``batch_sizes``; see the module docstring.

    ``shapes`` gives the dims after the batch dim for inputs whose dims are variable
    (``{"input_ids": [128]}``); ``datatypes`` the V2 datatype of inputs a signature-less
    model does not declare (default FP32). ``input_data`` (arrays by input name, e.g. a
    loaded ``.npz``) replaces the random inputs; its rows are taken or tiled to each batch
    size. ``on_batch`` is called as each batch size finishes (for progress output).
    ``open_gpus``: this machine's GPUs, whose memory and utilization are sampled beside
    the process's RSS (none: the GPU figures are None). ``config``: the model's config
    (its repository's config.pbtxt / config.yaml): the model is loaded with its
    parameters and configured with it completed, as the server does (a Python model's
    ``initialize``; ``finalize`` at the end); without one, as a bare file.
    ``sequence_length``: a stateful model's runs per sequence (see
    :mod:`slipstream.profile.sequences`).
    Raises :class:`ProfileError` when the inputs cannot be made or every batch size fails.
    """
    path = Path(path)
    timing = _Timing(seconds, warmup_runs, min_runs, sequence_length)
    _check_settings(list(batch_sizes), threads, seconds, timing, top_ops)
    backend_name = backend or backend_for_file(path)
    backend_class = get_backend(backend_name)
    data = None if input_data is None else {k: np.asarray(v) for k, v in input_data.items()}
    inputs = _InputOptions(shapes or {}, datatypes or {}, data)
    memory = _UsageTracker(open_gpus())
    try:
        measured = _measure(
            backend_class, (path, config), threads, batch_sizes, inputs, timing, memory, on_batch
        )
    finally:
        memory.close()
    notes = list(measured.notes)
    if measured.sequences is not None:
        notes.append(
            f"stateful model: each row of a batch is a sequence of {sequence_length} runs "
            "(START on the first, END on the last, its state passed from run to run)"
        )
    best = _best_batch(measured.batches)
    op_result = None
    if op_profile and backend_name == "onnxruntime":
        feed = {name: array[: best.batch_size] for name, array in measured.pool.items()}
        if measured.sequences is not None:  # a sequence's first run: controls and states
            feed = SequenceInputs(measured.sequences, feed, measured.batching).first_run()
        op_result = _ort_op_profile(path, threads, feed, measured.output_names, timing, top_ops)
    elif op_profile:
        notes.append(f"no op profile: it comes from ONNX Runtime's profiler, not {backend_name}")
    return ProfileResult(
        model_path=str(path),
        backend=backend_name,
        threads=threads if backend_name in THREAD_PARAMETERS else None,
        seconds_per_batch=seconds,
        warmup_runs=warmup_runs,
        batching=measured.batching,
        inputs=measured.plans,
        batches=measured.batches,
        best_batch_size=best.batch_size,
        best_throughput_infer_per_s=best.throughput_infer_per_s or 0.0,
        model_size_mb=path.stat().st_size / _MB,
        baseline_rss_mb=memory.baseline_mb,
        load_rss_increase_mb=measured.loaded_rss_mb - memory.baseline_mb,
        peak_rss_mb=memory.peak_mb,
        peak_rss_increase_mb=memory.peak_mb - memory.baseline_mb,
        op_profile=op_result,
        notes=tuple(notes),
        environment=describe_environment(backend_name),
        baseline_gpu_memory_mb=memory.gpu_baseline_mb,
        load_gpu_memory_increase_mb=_minus(measured.loaded_gpu_mb, memory.gpu_baseline_mb),
        peak_gpu_memory_mb=memory.gpu_peak_mb,
        sequence_length=sequence_length if measured.sequences is not None else None,
    )


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


@dataclass(frozen=True, slots=True)
class _InputOptions:
    """What the caller said about the inputs (see profile_model)."""

    shapes: Mapping[str, Sequence[int]]
    datatypes: Mapping[str, str]
    data: Mapping[str, np.ndarray] | None


@dataclass(frozen=True, slots=True)
class _Measured:
    """What the timed runs produced, and what the op profile reuses."""

    plans: tuple[ProfileInput, ...]
    batching: bool
    batches: tuple[BatchProfile, ...]
    # Inputs at the largest batch size (or the fixed shape); batches are slices of it.
    pool: dict[str, np.ndarray]
    output_names: list[str]
    # Process RSS right after loading the model, and the GPUs' memory in use (None
    # without a GPU).
    loaded_rss_mb: float
    loaded_gpu_mb: float | None
    notes: tuple[str, ...]
    # A stateful model's sequence_batching (its runs are sequences); None for others.
    sequences: SequenceBatching | None = None


def _measure(
    backend_class: type[Backend],
    model_files: tuple[Path, ModelConfig | None],
    threads: int,
    batch_sizes: Sequence[int],
    options: _InputOptions,
    timing: _Timing,
    memory: _UsageTracker,
    on_batch: Callable[[BatchProfile], None] | None,
) -> _Measured:
    """Load the model as the server does, time each batch size in turn, then close it
    (a Python model's finalize)."""
    path, config = model_files
    loaded = load_model(backend_class, path, threads, config)
    model = loaded.backend
    loaded_rss_mb = memory.sample(read_gpu=True)
    loaded_gpu_mb = memory.gpu_now_mb
    try:
        plans, batching = plan_inputs(
            loaded.signature, options.shapes, options.datatypes, options.data
        )
        fixed = _fixed_batch_size(plans)
        sizes = sorted(set(batch_sizes)) if batching else sorted({*batch_sizes, fixed})
        pool = _input_pool(plans, batching, max(sizes), options.data)
        measured = _Measured(
            plans, batching, (), pool, loaded.output_names, loaded_rss_mb, loaded_gpu_mb,
            tuple(loaded.notes), loaded.sequences,
        )  # fmt: skip
        batches = []
        sequence_ids = itertools.count(1)
        for size in sizes:
            if not batching and size != fixed:
                reason = f"the model's first dim is fixed at {fixed}"
                batch = BatchProfile(batch_size=size, status="not_applicable", reason=reason)
            else:
                feed = {name: array[:size] for name, array in pool.items()} if batching else pool
                run, finish = timed_run(
                    model, feed, measured, (timing.sequence_length, sequence_ids)
                )
                batch = _time_batch(run, size, timing, memory)
                finish()
            batches.append(batch)
            if on_batch is not None:
                on_batch(batch)
    finally:
        _close(model, path)
    return dataclasses.replace(measured, batches=tuple(batches))


def _close(model: Backend, path: Path) -> None:
    """Close the instance (a Python model's finalize runs here); its failure is the
    profile's, named."""
    try:
        model.close()
    except Exception as exc:
        raise ProfileError(
            f"{path.name}: closing the model failed: {type(exc).__name__}: {exc}"
        ) from exc


def _check_settings(
    batch_sizes: Sequence[int], threads: int, seconds: float, timing: _Timing, top_ops: int
) -> None:
    problems = [
        f"{name}: expected {want}, got {got}"
        for name, ok, want, got in (
            ("batch_sizes", bool(batch_sizes) and min(batch_sizes) >= 1, "sizes >= 1", batch_sizes),
            ("threads", threads >= 1, ">= 1", threads),
            ("seconds", seconds > 0, "> 0", seconds),
            ("warmup_runs", timing.warmup_runs >= 0, ">= 0", timing.warmup_runs),
            ("min_runs", timing.min_runs >= 1, ">= 1", timing.min_runs),
            ("top_ops", top_ops >= 0, ">= 0", top_ops),
            ("sequence_length", timing.sequence_length >= 1, ">= 1", timing.sequence_length),
        )
        if not ok
    ]
    if problems:
        raise ProfileError("; ".join(problems))


# --- inputs -------------------------------------------------------------------------


def plan_inputs(
    signature: ModelSignature,
    shapes: Mapping[str, Sequence[int]],
    datatypes: Mapping[str, str],
    data: Mapping[str, np.ndarray] | None,
) -> tuple[tuple[ProfileInput, ...], bool]:
    """What to feed each input, and whether the model batches (every first dim variable).

    A model that declares no inputs (TorchScript without an embedded signature) takes
    its inputs, in order, from ``data`` or else from ``shapes`` and ``datatypes``.
    """
    specs = signature.inputs or _user_specs(shapes, datatypes, data)
    known = {spec.name for spec in specs}
    for name in (*shapes, *(data or {})):
        if name not in known:
            raise ProfileError(
                f"{name!r} is not an input of the model; its inputs are {sorted(known)}"
            )
    batching = all(spec.shape and spec.shape[0] == -1 for spec in specs)
    plans = tuple(_plan_input(spec, batching, shapes.get(spec.name), data) for spec in specs)
    return plans, batching


def _user_specs(
    shapes: Mapping[str, Sequence[int]],
    datatypes: Mapping[str, str],
    data: Mapping[str, np.ndarray] | None,
) -> tuple[TensorSpec, ...]:
    """Inputs of a model that declares none, in the order the user gave them."""
    if data is not None:
        return tuple(TensorSpec(n, v2_datatype(a.dtype), (-1,) * a.ndim) for n, a in data.items())
    if not shapes:
        raise ProfileError(
            "the model file declares no inputs (TorchScript without an embedded signature): "
            "pass --shape NAME:D1,D2[:DATATYPE] for each forward() argument, in order, or "
            "--input-data FILE.npz"
        )
    return tuple(
        TensorSpec(name, from_config_datatype(datatypes.get(name, "FP32")), (-1,) * (len(dims) + 1))
        for name, dims in shapes.items()
    )


def _plan_input(
    spec: TensorSpec,
    batching: bool,
    given: Sequence[int] | None,
    data: Mapping[str, np.ndarray] | None,
) -> ProfileInput:
    declared = spec.shape[1:] if batching else spec.shape
    if data is not None:
        if spec.name not in data:
            raise ProfileError(f"--input-data has no array {spec.name!r}; it needs every input")
        array = data[spec.name]
        dims = tuple(array.shape[1:]) if batching else tuple(array.shape)
        source = "--input-data rows, taken or tiled to the batch size"
    elif given is not None:
        dims = tuple(int(d) for d in given)
        source = value_source(spec.name, spec.datatype)
    else:
        dims = declared
        source = value_source(spec.name, spec.datatype)
    if len(dims) != len(declared) or any(
        want not in (-1, got) for want, got in zip(declared, dims, strict=False)
    ):
        where = "dims after the batch dim" if batching else "shape"
        raise ProfileError(
            f"input {spec.name!r}: {where} {list(dims)} do not fit the declared "
            f"{list(declared)} (full shape {list(spec.shape)})"
        )
    if any(d < 1 for d in dims):
        example = ",".join("128" if d == -1 else str(d) for d in declared)
        raise ProfileError(
            f"input {spec.name!r} has variable dims {list(declared)} beyond the batch dim; "
            f"pass --shape {spec.name}:{example} (or shapes={{{spec.name!r}: [...]}})"
        )
    shape = (-1, *dims) if batching else dims
    return ProfileInput(name=spec.name, datatype=spec.datatype, shape=shape, source=source)


def _fixed_batch_size(plans: tuple[ProfileInput, ...]) -> int:
    """Rows one run of a fixed-shape model holds: the shared first dim, else 1."""
    firsts = {plan.shape[0] if plan.shape else 1 for plan in plans}
    return firsts.pop() if len(firsts) == 1 and min(firsts) > 0 else 1


def _input_pool(
    plans: tuple[ProfileInput, ...],
    batching: bool,
    rows: int,
    data: Mapping[str, np.ndarray] | None,
) -> dict[str, np.ndarray]:
    """One array per input with ``rows`` rows (or the fixed shape); batches are slices."""
    rng = np.random.default_rng(0)
    pool = {}
    for plan in plans:
        shape = (rows, *plan.shape[1:]) if batching else plan.shape
        dtype = V2_TO_NUMPY[plan.datatype]
        if data is not None:
            if data[plan.name].size == 0:
                raise ProfileError(f"--input-data array {plan.name!r} is empty")
            # np.resize repeats whole rows in order: the rows tiled to the batch size.
            pool[plan.name] = np.ascontiguousarray(np.resize(data[plan.name], shape), dtype=dtype)
        else:
            pool[plan.name] = random_tensor(plan.datatype, shape, rng, name=plan.name)
    return pool


# --- timing and memory --------------------------------------------------------------


class _UsageTracker:
    """Process RSS at load time and its peak, sampled between runs; with ``gpus``, their
    memory in use likewise and their utilization while each batch size runs.

    ONNX Runtime's arena keeps the memory a run allocated, so a sample taken after a
    run includes that run's peak; backends without an arena may peak higher inside a run.
    """

    def __init__(self, gpus: Gpus | None) -> None:
        import psutil  # type: ignore[import-untyped,unused-ignore]

        self._process: Any = psutil.Process()
        self._gpus = gpus
        gc.collect()
        self.baseline_mb = self._rss_mb()
        self.peak_mb = self.baseline_mb
        # The GPUs' memory in use (every process on them), MB; None without a GPU.
        self.gpu_now_mb: float | None = None
        self.gpu_peak_mb: float | None = None
        self._gpu_read_at = 0.0
        # Utilization readings (summed over the GPUs, 1.0 = one busy) since start_batch.
        self._utilizations: list[float] = []
        self._read_gpus()
        self.gpu_baseline_mb = self.gpu_now_mb

    def _rss_mb(self) -> float:
        return float(self._process.memory_info().rss) / _MB

    def sample(self, read_gpu: bool = False) -> float:
        """Current RSS in MB; updates the peaks. The GPUs are read too when ``read_gpu``
        or when _GPU_SAMPLE_S has passed since they last were."""
        rss_mb = self._rss_mb()
        self.peak_mb = max(self.peak_mb, rss_mb)
        if read_gpu or time.monotonic() - self._gpu_read_at >= _GPU_SAMPLE_S:
            self._read_gpus()
        return rss_mb

    def start_batch(self) -> None:
        self._utilizations.clear()

    def batch_gpu_util_pct(self) -> float | None:
        """Mean GPU utilization read since start_batch, percent of one GPU."""
        if not self._utilizations:
            return None
        return 100 * sum(self._utilizations) / len(self._utilizations)

    def close(self) -> None:
        if self._gpus is not None:
            self._gpus.close()

    def _read_gpus(self) -> None:
        gpu = totals(self._gpus.read()) if self._gpus is not None else None
        self._gpu_read_at = time.monotonic()
        if gpu is None:
            return
        self.gpu_now_mb = gpu.memory_used_bytes / _MB
        self.gpu_peak_mb = max(self.gpu_peak_mb or 0.0, self.gpu_now_mb)
        if gpu.utilization is not None:
            self._utilizations.append(gpu.utilization)


def _run_for(
    run_once: Callable[[], object],
    timing: _Timing,
    max_runs: int | None = None,
    between_runs: Callable[[int], None] | None = None,
) -> list[float]:
    """Warm up, then run until ``timing.seconds`` of wall time is spent; run times in s."""
    for _ in range(timing.warmup_runs):
        run_once()
    clock = time.perf_counter
    latencies_s: list[float] = []
    deadline = clock() + timing.seconds
    while (clock() < deadline or len(latencies_s) < timing.min_runs) and (
        max_runs is None or len(latencies_s) < max_runs
    ):
        start = clock()
        run_once()
        latencies_s.append(clock() - start)
        if between_runs is not None:
            between_runs(len(latencies_s))
    return latencies_s


def _time_batch(
    run: Run,
    batch_size: int,
    timing: _Timing,
    memory: _UsageTracker,
) -> BatchProfile:
    def sample_rss(runs: int) -> None:
        if runs % _RSS_SAMPLE_EVERY == 0:
            memory.sample()

    memory.start_batch()
    try:
        latencies_s = _run_for(run, timing, None, sample_rss)
    except Exception as exc:  # a batch size the model or the memory cannot take
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        logger.debug("batch size %d failed", batch_size, exc_info=True)
        reason = f"{type(exc).__name__}: {message}"
        return BatchProfile(batch_size=batch_size, status="failed", reason=reason)
    memory.sample(read_gpu=True)
    latencies_ms = np.asarray(latencies_s) * 1000.0
    p50, p90, p99 = np.percentile(latencies_ms, [50, 90, 99])
    return BatchProfile(
        batch_size=batch_size,
        status="ok",
        runs=len(latencies_s),
        throughput_infer_per_s=batch_size * len(latencies_s) / float(sum(latencies_s)),
        p50_throughput_infer_per_s=batch_size * 1000.0 / float(p50),
        p50_ms=float(p50),
        p90_ms=float(p90),
        p99_ms=float(p99),
        mean_ms=float(latencies_ms.mean()),
        min_ms=float(latencies_ms.min()),
        max_ms=float(latencies_ms.max()),
        gpu_util_pct=memory.batch_gpu_util_pct(),
    )


def _best_batch(batches: Sequence[BatchProfile]) -> BatchProfile:
    measured = [batch for batch in batches if batch.status == "ok"]
    if not measured:
        failures = "; ".join(f"batch {b.batch_size}: {b.reason}" for b in batches)
        raise ProfileError(f"no batch size could run ({failures})")
    return max(measured, key=lambda batch: batch.throughput_infer_per_s or 0.0)


# --- operator profile (ONNX Runtime) ------------------------------------------------


def _ort_op_profile(
    path: Path,
    threads: int,
    inputs: dict[str, np.ndarray],
    output_names: list[str],
    timing: _Timing,
    top_n: int,
) -> OpProfile:
    """Run a second, profiling session (so its overhead stays out of the timed figures)."""

    from slipstream.runtime.onnx import OnnxBackend, create_session, session_options

    batch_size = next(iter(inputs.values())).shape[0] if inputs else 1
    with tempfile.TemporaryDirectory(prefix="slipstream-profile-") as tmp:
        options = session_options(thread_parameters("onnxruntime", threads), 1)
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(tmp) / "ort")
        session = create_session(path, options)
        model = OnnxBackend(session)
        _run_for(lambda: model.run(inputs, output_names), timing, MAX_OP_PROFILE_RUNS)
        trace_path = session.end_profiling()
        events = json.loads(Path(trace_path).read_text())
        model.close()
    return summarize_ort_trace(events, timing.warmup_runs, top_n, batch_size)
