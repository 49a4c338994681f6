"""`slipstream optimize` against its targets: MiniLM int8 and digits distill / prune.

Prints ratios (a script, never a test). Two sections (`--sections`, default both):

`minilm`: for each int8 candidate setting of the optimizer (the gate-steered search;
plain dynamic per-channel / per-tensor, op types; static with each calibration method)
it builds the model through the Python API (`optimize_model`) and prints:

- throughput at batch 8, seq 128, one intra-op thread on one pinned core, as a ratio to
  the FP32 model timed in the same round, in alternating order; the median over
  `--rounds` rounds and the range. Twice: with the session options `slipstream serve`
  uses today, and with ONNX Runtime's denormals-as-zero on (both models alike; see
  `optimize_timing.py`);
- cosine similarity of each sentence's embedding to the FP32 one over the 300 sentences
  of `benchmarks/data/sentences.txt` (mean, min, and min over the 200 sentences that
  calibration and the search never saw);
- whether the issue's target is met: >= 2.0x throughput, mean cosine >= 0.99, min >= 0.98.

`digits` (see `optimize_digits.py`): a PyTorch CNN teacher, the distilled student and
the 50 %-pruned, fine-tuned CNN, with sizes, test accuracy and one-core speed ratios.

Usage (from the repository root):
    .venv/bin/python benchmarks/optimize.py                    # everything, ~15 min
    .venv/bin/python benchmarks/optimize.py --only dyn-search,dyn-matmul-pc --rounds 3
    .venv/bin/python benchmarks/optimize.py --sections digits
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
import optimize_digits
from optimize_timing import interleaved_latencies_ms, ratios_to

from slipstream.optimize import OptimizeRequest, PassSettings, optimize_model

import models

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"  # git-ignored
SENTENCES = BENCH_DIR / "data" / "sentences.txt"
SEQ_LEN = 128
BATCH_SIZE = 8
# Every third sentence calibrates (int8-static, the search's judge): 100 rows spread
# over every kind of sentence in the file, which is grouped by kind (the one-word
# replies sit together near line 185). The other 200 are "unseen".
CALIBRATION_STRIDE = 3
# Rows the optimizer's own gate runs for the ungated candidates (opened wide, see
# build_candidate); the script compares all the sentences itself.
GATE_ROWS = 16
TARGET_SPEEDUP = 2.0
TARGET_MEAN_COSINE = 0.99
TARGET_MIN_COSINE = 0.98


@dataclass(frozen=True)
class SpeedMode:
    """One way of timing every model."""

    label: str  # column heading
    denormals_as_zero: bool  # ORT's session.set_denormal_as_zero, for every model
    # "sentences": the first 8 sentences, padded to 128 tokens (mostly padding: masked);
    # "full": 8 rows of 128 real tokens cut from the sentences run together (no mask).
    rows: str


SPEED_MODES = (
    SpeedMode("served", False, "sentences"),  # the session options slipstream uses today
    SpeedMode("daz", True, "sentences"),
    SpeedMode("full-128", False, "full"),
)


@dataclass(frozen=True)
class Candidate:
    """One optimizer setting under test."""

    label: str  # short name, also the model's directory in the scratch repository
    passes: tuple[str, ...]  # as for `slipstream optimize --passes`
    settings: PassSettings  # as for --op-types, --per-channel, --int8-search, ...
    about: str  # one line for the table
    # True: the optimizer's own gate (cosine, default limits) judges the 200 unseen
    # sentences and the search steers by it; False: the gate is opened wide.
    gated: bool = False


def _plain(**changes: Any) -> PassSettings:
    return PassSettings(int8_search=False, **changes)


CANDIDATES = (
    Candidate(
        "dyn-search",
        ("graph", "int8-dynamic"),
        PassSettings(),
        "dynamic, MatMul, per-channel, gate-steered search (optimizer default)",
        gated=True,
    ),
    Candidate(
        "dyn-search-exclude",
        ("graph", "int8-dynamic"),
        PassSettings(smoothing_alphas=()),
        "the search without smoothing: sensitive nodes kept in FP32",
        gated=True,
    ),
    Candidate(
        "dyn-matmul-pc",
        ("graph", "int8-dynamic"),
        _plain(int8_op_types=("MatMul",), per_channel=True),
        "dynamic, MatMul, per-channel, no search",
    ),
    Candidate(
        "dyn-matmul-pt",
        ("graph", "int8-dynamic"),
        _plain(int8_op_types=("MatMul",), per_channel=False),
        "dynamic, MatMul, per-tensor, no search",
    ),
    Candidate(
        "dyn-matgat-pc",
        ("graph", "int8-dynamic"),
        _plain(int8_op_types=("MatMul", "Gather"), per_channel=True),
        "dynamic, MatMul+Gather, per-channel, no search",
    ),
    Candidate(
        "dyn-all-pt",
        ("graph", "int8-dynamic"),
        # An empty list makes ORT quantize every op it has an integer kernel for: the
        # naive `quantize_dynamic(model, out)` call.
        _plain(int8_op_types=(), per_channel=False),
        "dynamic, all ops, per-tensor (ORT defaults)",
    ),
    Candidate(
        "static-minmax",
        ("graph", "int8-static"),
        _plain(calibration_method="minmax"),
        "static QDQ, MatMul, minmax",
    ),
    Candidate(
        "static-entropy",
        ("graph", "int8-static"),
        _plain(calibration_method="entropy"),
        "static QDQ, MatMul, entropy",
    ),
    Candidate(
        "static-percentile",
        ("graph", "int8-static"),
        _plain(calibration_method="percentile"),
        "static QDQ, MatMul, percentile",
    ),
)


@dataclass(frozen=True)
class Settings:
    """Everything one run needs, from the command line."""

    sections: tuple[str, ...]  # minilm, digits
    candidates: tuple[Candidate, ...]  # the ones selected with --only
    rounds: int  # speed rounds; every model is timed once per round and mode
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
    build_s: float = 0.0  # wall time of optimize_model (passes, search, its own gate)
    mean_cosine: float | None = None
    min_cosine: float | None = None
    min_cosine_unseen: float | None = None  # rows calibration and the search never saw
    chosen: str = ""  # what the search kept (smoothing alpha, nodes in FP32)
    # Speed mode -> throughput / FP32's, per round.
    ratios: dict[str, list[float]] = field(default_factory=dict)
    error: str | None = None

    def ratio(self, mode: str) -> float | None:
        values = self.ratios.get(mode)
        return statistics.median(values) if values else None

    def accurate(self) -> bool:
        return (
            self.mean_cosine is not None
            and self.min_cosine is not None
            and self.mean_cosine >= TARGET_MEAN_COSINE
            and self.min_cosine >= TARGET_MIN_COSINE
        )

    def meets_target(self, mode: str) -> bool:
        ratio = self.ratio(mode)
        return self.accurate() and ratio is not None and ratio >= TARGET_SPEEDUP


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
    """The model's first output for every row [N, 384], in batches of BATCH_SIZE (the
    dynamic int8 scales are per batch, so the batch size is the one timed)."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rows = len(inputs["input_ids"])
    parts = [
        session.run(
            None, {name: array[start : start + BATCH_SIZE] for name, array in inputs.items()}
        )[0]
        for start in range(0, rows, BATCH_SIZE)
    ]
    return np.concatenate(parts).astype(np.float64)


def cosines(reference: np.ndarray, other: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(reference, axis=1) * np.linalg.norm(other, axis=1)
    return np.sum(reference * other, axis=1) / norms


def build_candidate(
    settings: Settings, candidate: Candidate, source: Path, data: dict[str, Path]
) -> tuple[Path, str]:
    """Run the optimizer's Python API for one candidate; the model file it wrote and what
    the search kept."""
    uses_calibration = candidate.gated or "int8-static" in candidate.passes
    request = OptimizeRequest(
        model=source,
        repository=settings.work_dir / "repo",
        name=candidate.label,
        passes=list(candidate.passes),
        validation=data["unseen"] if candidate.gated else data["gate"],
        calibration=data["calibration"] if uses_calibration else None,
        metric="cosine",
        # Ungated: the script judges the target itself over all 300 sentences; the gate
        # is opened wide so every candidate's model is written and can be timed.
        max_drop=None if candidate.gated else 1.0,
        settings=candidate.settings,
        measure_speed=False,
    )
    result = optimize_model(request)
    if result.version_dir is None:
        raise RuntimeError(f"nothing written: {result.gate.summary}")
    int8 = result.passes[-1].settings
    chosen = ""
    if "search" in int8:
        alpha = int8["smoothing_alpha"]
        chosen = (
            f"kept: smoothing alpha {alpha if alpha is not None else 'none'}, "
            f"{len(int8['excluded_nodes'])} nodes in FP32; gate on 200 unseen: "
            f"{'passed' if result.gate.passed else 'FAILED'}"
        )
    return result.version_dir / "model.onnx", chosen


def measure_accuracy(
    settings: Settings, source: Path, inputs: dict[str, np.ndarray], data: dict[str, Path]
) -> tuple[list[Row], dict[str, Path]]:
    reference = embed(source, inputs)
    unseen = np.arange(len(reference)) % CALIBRATION_STRIDE != 0
    rows, paths = [], {}
    for candidate in settings.candidates:
        row = Row(candidate.label, candidate.about)
        rows.append(row)
        started = time.perf_counter()
        try:
            path, row.chosen = build_candidate(settings, candidate, source, data)
        except Exception as exc:  # a failed candidate is reported; the others go on
            row.error = f"{type(exc).__name__}: {exc}"[:200]
            print(f"!! {candidate.label}: {row.error}", flush=True)
            continue
        row.build_s = time.perf_counter() - started
        similarity = cosines(reference, embed(path, inputs))
        row.mean_cosine = float(similarity.mean())
        row.min_cosine = float(similarity.min())
        row.min_cosine_unseen = float(similarity[unseen].min())
        paths[candidate.label] = path
        print(
            f"built {row.label:<18} in {row.build_s:5.1f} s: cosine mean {row.mean_cosine:.4f}"
            f" min {row.min_cosine:.4f} {row.chosen}",
            flush=True,
        )
    return rows, paths


def full_length_rows(tokenizer_path: Path, sentences: list[str]) -> dict[str, np.ndarray]:
    """BATCH_SIZE rows of SEQ_LEN real tokens ([CLS] ... [SEP], no padding), cut from the
    sentences run together: the unmasked case, where no softmax input is masked."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    tokenizer.no_truncation()  # the file's settings cut at 128 tokens
    tokenizer.no_padding()
    ids = tokenizer.encode(" ".join(sentences), add_special_tokens=False).ids
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    body = SEQ_LEN - 2
    rows = [[cls, *ids[i * body : (i + 1) * body], sep] for i in range(BATCH_SIZE)]
    input_ids = np.array(rows, dtype=np.int64)
    return {"input_ids": input_ids, "attention_mask": np.ones_like(input_ids)}


def measure_speed(
    settings: Settings,
    source: Path,
    paths: dict[str, Path],
    feeds: dict[str, dict[str, np.ndarray]],
    rows: list[Row],
) -> dict[str, list[float]]:
    """Fill each row's per-round ratios per speed mode; return FP32's ms per mode."""
    fp32_ms = {}
    for mode in SPEED_MODES:
        latencies = interleaved_latencies_ms(
            {"fp32": source, **paths},
            feeds[mode.rows],
            rounds=settings.rounds,
            seconds=settings.seconds,
            core=settings.core,
            denormals_as_zero=mode.denormals_as_zero,
        )
        fp32_ms[mode.label] = latencies["fp32"]
        for row in rows:
            if row.label in latencies:
                row.ratios[mode.label] = ratios_to(latencies["fp32"], latencies[row.label])
        median = statistics.median(latencies["fp32"])
        print(f"speed ({mode.label}): FP32 median {median:.1f} ms", flush=True)
    return fp32_ms


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_report(rows: list[Row], fp32_ms: dict[str, list[float]]) -> None:
    print()
    for mode, per_round in fp32_ms.items():
        print(
            f"FP32 at batch {BATCH_SIZE}, seq {SEQ_LEN}, 1 thread ({mode}): "
            f"{1000 * BATCH_SIZE / statistics.median(per_round):.1f} infer/s "
            f"(rounds: {min(per_round):.0f}..{max(per_round):.0f} ms)"
        )
    speed_heads = " ".join(f"{'x ' + mode.label:>10} {'range':>10}" for mode in SPEED_MODES)
    header = (
        f"{'candidate':<19} {speed_heads} {'mean cos':>9} {'min cos':>8} {'min unseen':>10}  "
        f"{'target':<20} settings"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        if row.error is not None:
            print(f"{row.label:<19} FAILED: {row.error}")
            continue
        speeds = " ".join(
            f"{_fmt(row.ratio(mode.label), '10.2f')} {_span(row.ratios.get(mode.label)):>10}"
            for mode in SPEED_MODES
        )
        verdict = "/".join(
            "MET" if row.meets_target(mode.label) else "missed" for mode in SPEED_MODES
        )
        print(
            f"{row.label:<19} {speeds} {_fmt(row.mean_cosine, '9.4f')} "
            f"{_fmt(row.min_cosine, '8.4f')} {_fmt(row.min_cosine_unseen, '10.4f')}  "
            f"{verdict:<20} {row.about}"
        )
        if row.chosen:
            print(f"{'':<19} {row.chosen}")
    print(
        f"target: >= {TARGET_SPEEDUP}x FP32 throughput, mean cosine >= {TARGET_MEAN_COSINE}, "
        f"min >= {TARGET_MIN_COSINE}; 'target' reads per speed column. served: the session "
        "options slipstream serves with today, on the first 8 sentences padded to 128 tokens; "
        "daz: the same with denormals-as-zero on for both models; full-128: as served, on 8 "
        "rows of 128 real tokens (no padding). 'min unseen' leaves out the calibration "
        "sentences"
    )
    for mode in SPEED_MODES:
        accurate = [row for row in rows if row.accurate() and row.ratio(mode.label) is not None]
        if accurate:
            best = max(accurate, key=lambda row: row.ratio(mode.label) or 0.0)
            print(f"fastest that keeps the accuracy target ({mode.label}): {best.label} "
                  f"x{best.ratio(mode.label):.2f}")  # fmt: skip


def _span(values: list[float] | None) -> str:
    return f"{min(values):.2f}-{max(values):.2f}" if values else "-"


def run_minilm(settings: Settings) -> dict[str, Any] | None:
    found = models.build_repository(settings.repo, ["minilm"])
    if "minilm" not in found:
        return None
    source = found["minilm"]
    sentences = [line.strip() for line in SENTENCES.read_text().splitlines() if line.strip()]
    tokenizer = settings.repo / "minilm" / "tokenizer" / "tokenizer.json"
    inputs = tokenize(tokenizer, sentences)
    # A fresh scratch repository, so versions do not pile up across runs.
    shutil.rmtree(settings.work_dir, ignore_errors=True)
    settings.work_dir.mkdir(parents=True)
    calibration = np.arange(len(sentences)) % CALIBRATION_STRIDE == 0
    selections = {
        "sentences": np.ones(len(sentences), dtype=bool),
        "calibration": calibration,
        "unseen": ~calibration,
        "gate": np.arange(len(sentences)) >= len(sentences) - GATE_ROWS,
    }
    data = {key: settings.work_dir / f"{key}.npz" for key in selections}
    for key, chosen in selections.items():
        np.savez(data[key], **{name: array[chosen] for name, array in inputs.items()})
    print(f"{len(sentences)} sentences at seq {SEQ_LEN} -> {data['sentences']}", flush=True)
    rows, paths = measure_accuracy(settings, source, inputs, data)
    feeds = {
        "sentences": {name: array[:BATCH_SIZE] for name, array in inputs.items()},
        "full": full_length_rows(tokenizer, sentences),
    }
    fp32_ms = measure_speed(settings, source, paths, feeds, rows)
    print_report(rows, fp32_ms)
    return {
        "batch_size": BATCH_SIZE,
        "seq_len": SEQ_LEN,
        "fp32_ms_per_round": fp32_ms,
        "candidates": [
            {
                **asdict(row),
                "ratio": {mode.label: row.ratio(mode.label) for mode in SPEED_MODES},
                "meets_target": {mode.label: row.meets_target(mode.label) for mode in SPEED_MODES},
            }
            for row in rows
        ],
    }


def parse_args(argv: list[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    labels = [candidate.label for candidate in CANDIDATES]
    parser.add_argument("--sections", default="minilm,digits", help="minilm, digits or both")
    parser.add_argument("--only", help=f"comma-separated minilm candidates: {', '.join(labels)}")
    parser.add_argument("--rounds", type=int, default=5, help="speed rounds (default 5)")
    parser.add_argument(
        "--seconds", type=float, default=1.5, help="timed seconds per model per round (1.5)"
    )
    parser.add_argument("--core", type=int, default=0, help="core the speed runs use (0)")
    parser.add_argument("--repo", type=Path, default=RESULTS_DIR / "models")
    parser.add_argument("--json", type=Path, dest="json_out")
    args = parser.parse_args(argv)
    sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
    if not sections or set(sections) - {"minilm", "digits"}:
        parser.error(f"--sections: {args.sections!r}; expected minilm, digits or both")
    chosen = CANDIDATES
    if args.only:
        wanted = {label.strip() for label in args.only.split(",") if label.strip()}
        unknown = sorted(wanted - set(labels))
        if unknown:
            parser.error(f"--only: unknown {', '.join(unknown)}; expected some of {labels}")
        chosen = tuple(c for c in CANDIDATES if c.label in wanted)
    return Settings(
        sections=sections,
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
    document: dict[str, Any] = {}
    if "minilm" in settings.sections:
        minilm = run_minilm(settings)
        if minilm is None:
            return 1
        document["minilm"] = minilm
    if "digits" in settings.sections:
        document["digits"] = optimize_digits.run(
            settings.work_dir.parent / "optimize-digits",
            rounds=settings.rounds,
            seconds=settings.seconds,
            core=settings.core,
        )
    if settings.json_out is not None:
        settings.json_out.parent.mkdir(parents=True, exist_ok=True)
        document["loadavg"] = os.getloadavg()
        settings.json_out.write_text(json.dumps(document, indent=2) + "\n")
        print(f"wrote {settings.json_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
