"""INT8 candidates of `slipstream optimize` on MiniLM: speed and accuracy against FP32.

Prints ratios (a script, never a test). For each INT8 candidate setting of the
optimizer (dynamic per-channel / per-tensor, op types, static with each calibration
method) it builds the model through the Python API (`optimize_model`) and prints:

- throughput at batch 8, seq 128, one intra-op thread on one pinned core, as a ratio to
  the FP32 model measured in the same round (`profile_model(threads=1)`); the median
  over `--rounds` rounds and the range, as this machine's speed drifts;
- cosine similarity of each sentence's embedding to the FP32 one over the 300 sentences
  of `benchmarks/data/sentences.txt` (mean, min, and min over the sentences static
  calibration did not see);
- whether the issue's target is met: >= 2.0x throughput, mean cosine >= 0.99, min >= 0.98.

The last line names the candidate the accuracy gate should pick: the fastest one that
meets the accuracy target.

Usage (from the repository root):
    .venv/bin/python benchmarks/optimize.py                    # everything, ~5 min
    .venv/bin/python benchmarks/optimize.py --only dyn-matmul-pc,static-minmax --rounds 1
    .venv/bin/python benchmarks/optimize.py --json benchmarks/results/optimize.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from slipstream.bench.profile import profile_model
from slipstream.optimize import OptimizeRequest, PassSettings, optimize_model

import models

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"  # git-ignored
SENTENCES = BENCH_DIR / "data" / "sentences.txt"
SEQ_LEN = 128
BATCH_SIZE = 8
# The first rows of the sentences calibrate int8-static; the rest were never seen by it.
# A multiple of PassSettings.calibration_batch_size (16): ORT 1.x entropy and percentile
# calibrators fail on a last, shorter batch ("inhomogeneous shape").
CALIBRATION_ROWS = 96
# Rows the optimizer's own gate runs (opened wide, see build_candidate); the script
# compares all the sentences itself, so the gate's run is kept short.
GATE_ROWS = 16
TARGET_SPEEDUP = 2.0
TARGET_MEAN_COSINE = 0.99
TARGET_MIN_COSINE = 0.98


@dataclass(frozen=True)
class Candidate:
    """One optimizer setting under test."""

    label: str  # short name, also the model's directory in the scratch repository
    passes: tuple[str, ...]  # as for `slipstream optimize --passes`
    settings: PassSettings  # as for --op-types, --per-channel, --calibration-method
    about: str  # one line for the table


def _settings(**changes: Any) -> PassSettings:
    return PassSettings(**changes)


MATMUL_GATHER = ("MatMul", "Gather")
CANDIDATES = (
    Candidate(
        "dyn-matmul-pc",
        ("graph", "int8-dynamic"),
        _settings(int8_op_types=("MatMul",), per_channel=True),
        "dynamic, MatMul, per-channel (optimizer default)",
    ),
    Candidate(
        "dyn-matmul-pt",
        ("graph", "int8-dynamic"),
        _settings(int8_op_types=("MatMul",), per_channel=False),
        "dynamic, MatMul, per-tensor",
    ),
    Candidate(
        "dyn-matgat-pc",
        ("graph", "int8-dynamic"),
        _settings(int8_op_types=MATMUL_GATHER, per_channel=True),
        "dynamic, MatMul+Gather, per-channel",
    ),
    Candidate(
        "dyn-all-pt",
        ("graph", "int8-dynamic"),
        # An empty list makes ORT quantize every op it has an integer kernel for: the
        # naive `quantize_dynamic(model, out)` call.
        _settings(int8_op_types=(), per_channel=False),
        "dynamic, all ops, per-tensor (ORT defaults)",
    ),
    Candidate(
        "static-minmax",
        ("graph", "int8-static"),
        _settings(calibration_method="minmax"),
        "static QDQ, MatMul, minmax",
    ),
    Candidate(
        "static-entropy",
        ("graph", "int8-static"),
        _settings(calibration_method="entropy"),
        "static QDQ, MatMul, entropy",
    ),
    Candidate(
        "static-percentile",
        ("graph", "int8-static"),
        _settings(calibration_method="percentile"),
        "static QDQ, MatMul, percentile",
    ),
)


@dataclass(frozen=True)
class Settings:
    """Everything one run needs, from the command line."""

    candidates: tuple[Candidate, ...]  # the ones selected with --only
    rounds: int  # speed rounds; every model is timed once per round
    seconds: float  # timed seconds per model per round
    core: int  # the core the speed runs are pinned to
    repo: Path  # model repository holding minilm (built if missing)
    work_dir: Path  # validation files and the optimizer's scratch repository
    json_out: Path | None  # where to write all figures, if anywhere


@dataclass
class Row:
    """One candidate's figures, a line of the results table."""

    label: str
    about: str
    build_s: float = 0.0  # wall time of optimize_model (passes + its own gate run)
    mean_cosine: float | None = None
    min_cosine: float | None = None
    min_cosine_unseen: float | None = None  # rows not used for calibration
    ratios: list[float] = field(default_factory=list)  # throughput / FP32's, per round
    error: str | None = None

    @property
    def ratio(self) -> float | None:
        return statistics.median(self.ratios) if self.ratios else None

    def accurate(self) -> bool:
        return (
            self.mean_cosine is not None
            and self.min_cosine is not None
            and self.mean_cosine >= TARGET_MEAN_COSINE
            and self.min_cosine >= TARGET_MIN_COSINE
        )

    def meets_target(self) -> bool:
        return self.accurate() and self.ratio is not None and self.ratio >= TARGET_SPEEDUP


def tokenize(tokenizer_path: Path, sentences: list[str]) -> dict[str, np.ndarray]:
    """input_ids and attention_mask [N, SEQ_LEN], padded or truncated to SEQ_LEN."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    # Fixed length, so the speed figure is at seq 128 whatever the sentences' lengths.
    tokenizer.enable_padding(length=SEQ_LEN, pad_id=0, pad_token="[PAD]")
    tokenizer.enable_truncation(max_length=SEQ_LEN)
    encodings = tokenizer.encode_batch(sentences)
    return {
        "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
        "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
    }


def embed(path: Path, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """The model's first output for every row [N, 384]."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rows = len(inputs["input_ids"])
    parts = [
        session.run(None, {name: array[start : start + 32] for name, array in inputs.items()})[0]
        for start in range(0, rows, 32)
    ]
    return np.concatenate(parts).astype(np.float64)


def cosines(reference: np.ndarray, other: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(reference, axis=1) * np.linalg.norm(other, axis=1)
    return np.sum(reference * other, axis=1) / norms


def build_candidate(
    settings: Settings, candidate: Candidate, source: Path, data: dict[str, Path]
) -> Path:
    """Run the optimizer's Python API for one candidate; the model file it wrote."""
    request = OptimizeRequest(
        model=source,
        repository=settings.work_dir / "repo",
        name=candidate.label,
        passes=list(candidate.passes),
        validation=data["gate"],
        calibration=data["calibration"] if "int8-static" in candidate.passes else None,
        # This script judges the target itself over all 300 sentences; the gate is opened
        # wide so every candidate's model is written and can be timed.
        metric="cosine",
        max_drop=1.0,
        settings=candidate.settings,
        measure_speed=False,
    )
    result = optimize_model(request)
    if result.version_dir is None:
        raise RuntimeError(f"nothing written: {result.gate.summary}")
    return result.version_dir / "model.onnx"


def measure_accuracy(
    settings: Settings, source: Path, inputs: dict[str, np.ndarray], data: dict[str, Path]
) -> tuple[list[Row], dict[str, Path]]:
    reference = embed(source, inputs)
    rows, paths = [], {}
    for candidate in settings.candidates:
        row = Row(candidate.label, candidate.about)
        rows.append(row)
        started = time.perf_counter()
        try:
            path = build_candidate(settings, candidate, source, data)
        except Exception as exc:  # a failed candidate is reported; the others go on
            row.error = f"{type(exc).__name__}: {exc}"[:200]
            print(f"!! {candidate.label}: {row.error}", flush=True)
            continue
        row.build_s = time.perf_counter() - started
        similarity = cosines(reference, embed(path, inputs))
        row.mean_cosine = float(similarity.mean())
        row.min_cosine = float(similarity.min())
        row.min_cosine_unseen = float(similarity[CALIBRATION_ROWS:].min())
        paths[candidate.label] = path
        print(
            f"built {row.label:<18} in {row.build_s:5.1f} s: cosine mean {row.mean_cosine:.4f}"
            f" min {row.min_cosine:.4f}",
            flush=True,
        )
    return rows, paths


def throughput(path: Path, inputs: dict[str, np.ndarray], seconds: float) -> float:
    """Inferences/s at BATCH_SIZE with one intra-op thread (the caller pins the core)."""
    result = profile_model(
        path,
        batch_sizes=[BATCH_SIZE],
        shapes={"input_ids": [SEQ_LEN], "attention_mask": [SEQ_LEN]},
        threads=1,
        seconds=seconds,
        input_data={name: array[:BATCH_SIZE] for name, array in inputs.items()},
        op_profile=False,
    )
    return result.batches[0].throughput_infer_per_s or 0.0


def measure_speed(
    settings: Settings,
    source: Path,
    paths: dict[str, Path],
    inputs: dict[str, np.ndarray],
    rows: list[Row],
) -> list[float]:
    """Fill each row's per-round ratios; return FP32's inferences/s per round."""
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {settings.core})
    fp32_per_round = []
    try:
        for round_index in range(settings.rounds):
            labels = list(paths)
            # Alternate the order so a slow stretch of the machine does not always hit
            # the same candidates.
            if round_index % 2:
                labels.reverse()
            fp32 = throughput(source, inputs, settings.seconds)
            measured = {
                label: throughput(paths[label], inputs, settings.seconds) for label in labels
            }
            fp32 = (fp32 + throughput(source, inputs, settings.seconds)) / 2
            fp32_per_round.append(fp32)
            for row in rows:
                if row.label in measured:
                    row.ratios.append(measured[row.label] / fp32)
            print(f"round {round_index + 1}/{settings.rounds}: FP32 {fp32:.1f} infer/s", flush=True)
    finally:
        os.sched_setaffinity(0, previous)
    return fp32_per_round


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_report(rows: list[Row], fp32_per_round: list[float]) -> None:
    print()
    spread = ""
    if fp32_per_round:
        low, high = min(fp32_per_round), max(fp32_per_round)
        spread = f" (rounds: {low:.1f}..{high:.1f})"
        print(f"FP32 at batch {BATCH_SIZE}, seq {SEQ_LEN}, 1 thread: ", end="")
        print(f"{statistics.median(fp32_per_round):.1f} infer/s{spread}")
    header = (
        f"{'candidate':<18} {'x FP32':>7} {'range':>11} {'mean cos':>9} {'min cos':>8} "
        f"{'min unseen':>10}  target  settings"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        if row.error is not None:
            print(f"{row.label:<18} FAILED: {row.error}")
            continue
        span = f"{min(row.ratios):.2f}-{max(row.ratios):.2f}" if row.ratios else "-"
        verdict = "MET" if row.meets_target() else "missed"
        print(
            f"{row.label:<18} {_fmt(row.ratio, '7.2f')} {span:>11} "
            f"{_fmt(row.mean_cosine, '9.4f')} {_fmt(row.min_cosine, '8.4f')} "
            f"{_fmt(row.min_cosine_unseen, '10.4f')}  {verdict:<6}  {row.about}"
        )
    print(
        f"target: >= {TARGET_SPEEDUP}x FP32 throughput, mean cosine >= {TARGET_MEAN_COSINE}, "
        f"min >= {TARGET_MIN_COSINE}; 'min unseen' leaves out the {CALIBRATION_ROWS} "
        "calibration sentences"
    )
    accurate = [row for row in rows if row.accurate() and row.ratio is not None]
    if accurate:
        best = max(accurate, key=lambda row: row.ratio or 0.0)
        print(f"gate pick (fastest that keeps the accuracy target): {best.label} ({best.about})")
    else:
        print("gate pick: none of the candidates keeps the accuracy target")


def write_json(path: Path, rows: list[Row], fp32_per_round: list[float]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "batch_size": BATCH_SIZE,
        "seq_len": SEQ_LEN,
        "fp32_infer_per_s_per_round": fp32_per_round,
        "candidates": [
            {**asdict(row), "ratio": row.ratio, "meets_target": row.meets_target()} for row in rows
        ],
        "loadavg": os.getloadavg(),
    }
    path.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {path}")


def run_minilm(settings: Settings) -> tuple[list[Row], list[float]]:
    found = models.build_repository(settings.repo, ["minilm"])
    if "minilm" not in found:
        return [], []
    source = found["minilm"]
    sentences = [line.strip() for line in SENTENCES.read_text().splitlines() if line.strip()]
    inputs = tokenize(settings.repo / "minilm" / "tokenizer" / "tokenizer.json", sentences)
    # A fresh scratch repository, so versions do not pile up across runs.
    shutil.rmtree(settings.work_dir, ignore_errors=True)
    settings.work_dir.mkdir(parents=True)
    data = {
        "validation": settings.work_dir / "sentences.npz",
        "calibration": settings.work_dir / "calibration.npz",
        "gate": settings.work_dir / "gate.npz",
    }
    np.savez(data["validation"], **inputs)
    slices = {"calibration": slice(0, CALIBRATION_ROWS), "gate": slice(-GATE_ROWS, None)}
    for key, rows in slices.items():
        np.savez(data[key], **{name: array[rows] for name, array in inputs.items()})
    print(f"{len(sentences)} sentences at seq {SEQ_LEN} -> {data['validation']}", flush=True)
    rows, paths = measure_accuracy(settings, source, inputs, data)
    fp32_per_round = measure_speed(settings, source, paths, inputs, rows)
    return rows, fp32_per_round


def parse_args(argv: list[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    labels = [candidate.label for candidate in CANDIDATES]
    parser.add_argument("--only", help=f"comma-separated candidates: {', '.join(labels)}")
    parser.add_argument("--rounds", type=int, default=3, help="speed rounds (default 3)")
    parser.add_argument(
        "--seconds", type=float, default=2.0, help="timed seconds per model per round (2)"
    )
    parser.add_argument("--core", type=int, default=0, help="core the speed runs use (0)")
    parser.add_argument("--repo", type=Path, default=RESULTS_DIR / "models")
    parser.add_argument("--json", type=Path, dest="json_out")
    args = parser.parse_args(argv)
    chosen = CANDIDATES
    if args.only:
        wanted = {label.strip() for label in args.only.split(",") if label.strip()}
        unknown = sorted(wanted - set(labels))
        if unknown:
            parser.error(f"--only: unknown {', '.join(unknown)}; expected some of {labels}")
        chosen = tuple(c for c in CANDIDATES if c.label in wanted)
    return Settings(
        candidates=chosen,
        rounds=max(1, args.rounds),
        seconds=args.seconds,
        core=args.core,
        repo=args.repo,
        work_dir=RESULTS_DIR / "work" / "optimize",
        json_out=args.json_out,
    )


def main(argv: list[str] | None = None) -> int:
    settings = parse_args(argv)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    rows, fp32_per_round = run_minilm(settings)
    if not rows:
        return 1
    # TODO(digits): a `digits` section (classifier, top1 gate) goes here beside run_minilm.
    print_report(rows, fp32_per_round)
    if settings.json_out is not None:
        write_json(settings.json_out, rows, fp32_per_round)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
