"""The `digits` section of `optimize.py`: distill and prune a PyTorch CNN on digits.

scikit-learn's 1,797 digits (8x8, 16 grey levels) are shuffled once (seed 0) and split
into 1,100 training rows (the teacher's, and those distill / prune train on), 300
validation rows (the optimizer's top1 gate) and 397 test rows (the figures below). The
teacher is a CNN trained here; then the same `optimize_model` calls as
`slipstream optimize --passes distill|prune --train train.npz --validation val.npz`:

- `distill` into the `mlp-medium` student preset (64 -> 256 -> 10);
- `prune` 50 % of every layer's channels / neurons (torch-pruning, L1), fine-tuned.

Printed: parameters, ONNX bytes, test accuracy, and throughput against the teacher's
at batch 1 and batch 64 on one pinned core (ONNX Runtime, one intra-op thread, the
models in alternating order, medians over rounds). Targets (issue 4): the student >= 4x
smaller and >= 3x faster within 1 point of the teacher's test accuracy; pruned within
1 point and measurably faster.
"""

from __future__ import annotations

import shutil
import statistics
from pathlib import Path
from typing import Any

import numpy as np
from optimize_timing import interleaved_latencies_ms, ratios_to

from slipstream.optimize import OptimizeRequest, PassSettings, optimize_model

SEED = 0
TRAIN_ROWS, VALIDATION_ROWS = 1100, 300
TEACHER_EPOCHS = 30
BATCH_SIZES = (1, 64)
STUDENT = "mlp-medium"
TARGET_STUDENT_SMALLER, TARGET_STUDENT_FASTER, TARGET_MAX_DROP_POINTS = 4.0, 3.0, 1.0
OPTIMIZED = {
    "distilled": (["distill"], PassSettings(student=STUDENT, epochs=60)),
    "pruned": (["prune"], PassSettings(prune_ratio=0.5, epochs=30)),
}


def split_digits(folder: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(pixels [N, 1, 8, 8] in [0, 1], labels) per split; train.npz and val.npz written."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = (digits.data / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    labels = digits.target.astype(np.int64)
    order = np.random.default_rng(SEED).permutation(len(pixels))
    pixels, labels = pixels[order], labels[order]
    edges = (TRAIN_ROWS, TRAIN_ROWS + VALIDATION_ROWS)
    splits = {
        "train": (pixels[: edges[0]], labels[: edges[0]]),
        "val": (pixels[edges[0] : edges[1]], labels[edges[0] : edges[1]]),
        "test": (pixels[edges[1] :], labels[edges[1] :]),
    }
    for name in ("train", "val"):
        np.savez(folder / f"{name}.npz", pixels=splits[name][0], labels=splits[name][1])
    return splits


def train_teacher(pixels: np.ndarray, labels: np.ndarray, path: Path) -> Any:
    """A small CNN (conv 32, conv 64, pool, 128 hidden; ~151k parameters), saved whole."""
    import torch

    torch.manual_seed(SEED)
    teacher = torch.nn.Sequential(
        torch.nn.Conv2d(1, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(32, 64, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(64 * 4 * 4, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 10),
    )
    optimizer = torch.optim.Adam(teacher.parameters(), lr=1e-3)
    inputs, targets = torch.from_numpy(pixels), torch.from_numpy(labels)
    generator = torch.Generator().manual_seed(SEED)
    for _ in range(TEACHER_EPOCHS):
        order = torch.randperm(len(inputs), generator=generator)
        for start in range(0, len(inputs), 64):
            rows = order[start : start + 64]
            loss = torch.nn.functional.cross_entropy(teacher(inputs[rows]), targets[rows])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    torch.save(teacher.eval(), path)
    return teacher


def test_accuracy(path: Path, pixels: np.ndarray, labels: np.ndarray) -> float:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"pixels": pixels})
    return 100.0 * float(np.mean(np.argmax(logits, axis=1) == labels))


def onnx_parameters(path: Path) -> int:
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(path)).graph
    return int(sum(numpy_helper.to_array(init).size for init in graph.initializer))


def build(folder: Path) -> tuple[dict[str, Path], dict[str, str], tuple[np.ndarray, np.ndarray]]:
    """ONNX files of teacher, distilled and pruned; the optimizer's gate lines; test rows."""
    import torch

    from slipstream.optimize.torch_passes import export_onnx

    splits = split_digits(folder)
    teacher = train_teacher(*splits["train"], folder / "teacher.pt")
    paths = {"teacher": folder / "teacher.onnx"}
    # The export the optimizer uses for its own "before" model.
    export_onnx(
        teacher, torch.from_numpy(splits["val"][0][:2]), paths["teacher"], ("pixels", "logits")
    )
    gates = {}
    for label, (passes, settings) in OPTIMIZED.items():
        result = optimize_model(
            OptimizeRequest(
                model=folder / "teacher.pt",
                repository=folder / "repo",
                name=label,
                passes=passes,
                validation=folder / "val.npz",
                train=folder / "train.npz",
                settings=settings,
                measure_speed=False,
            )
        )
        gates[label] = result.gate.summary
        print(f"{label}: {result.gate.summary}", flush=True)
        if result.version_dir is None:
            raise RuntimeError(f"{label}: nothing written")
        paths[label] = result.version_dir / "model.onnx"
    return paths, gates, splits["test"]


def run(folder: Path, *, rounds: int, seconds: float, core: int) -> dict[str, Any]:
    import torch

    # With onnxruntime loaded, torch's own threads spin against it and small-batch
    # training runs many times slower; one thread avoids it.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        paths, gates, (pixels, labels) = build(folder)
    finally:
        torch.set_num_threads(threads)
    figures: dict[str, Any] = {
        label: {
            "parameters": onnx_parameters(path),
            "onnx_bytes": path.stat().st_size,
            "test_accuracy_percent": test_accuracy(path, pixels, labels),
            "gate": gates.get(label),
            "speedup": {},
        }
        for label, path in paths.items()
    }
    for batch_size in BATCH_SIZES:
        latencies = interleaved_latencies_ms(
            paths,
            {"pixels": pixels[:batch_size]},
            rounds=rounds,
            seconds=seconds,
            core=core,
            denormals_as_zero=False,
        )
        for label in paths:
            figures[label]["speedup"][batch_size] = ratios_to(
                latencies["teacher"], latencies[label]
            )
    print_report(figures, len(labels))
    return figures


def print_report(figures: dict[str, Any], test_rows: int) -> None:
    teacher = figures["teacher"]
    print()
    print(f"digits: test accuracy over {test_rows} held-out rows; speed on one core, ONNX Runtime")
    header = (
        f"{'model':<10} {'params':>8} {'x smaller':>9} {'test acc':>9} {'drop':>6} "
        + " ".join(f"{'x faster b' + str(b):>16}" for b in BATCH_SIZES)
    )
    print(header)
    print("-" * len(header))
    for label, row in figures.items():
        smaller = teacher["onnx_bytes"] / row["onnx_bytes"]
        drop = teacher["test_accuracy_percent"] - row["test_accuracy_percent"]
        speeds = " ".join(
            f"{statistics.median(row['speedup'][b]):7.2f} ({min(row['speedup'][b]):.1f}-"
            f"{max(row['speedup'][b]):.1f})"
            for b in BATCH_SIZES
        )
        print(
            f"{label:<10} {row['parameters']:>8} {smaller:>9.2f} "
            f"{row['test_accuracy_percent']:>8.2f}% {drop:>6.2f} {speeds}"
        )
    distilled, pruned = figures["distilled"], figures["pruned"]
    student_faster = min(statistics.median(distilled["speedup"][b]) for b in BATCH_SIZES)
    checks = {
        f"student >= {TARGET_STUDENT_SMALLER}x smaller": teacher["onnx_bytes"]
        / distilled["onnx_bytes"]
        >= TARGET_STUDENT_SMALLER,
        f"student >= {TARGET_STUDENT_FASTER}x faster (every batch size)": student_faster
        >= TARGET_STUDENT_FASTER,
        f"student within {TARGET_MAX_DROP_POINTS} point": teacher["test_accuracy_percent"]
        - distilled["test_accuracy_percent"]
        <= TARGET_MAX_DROP_POINTS,
        f"pruned within {TARGET_MAX_DROP_POINTS} point": teacher["test_accuracy_percent"]
        - pruned["test_accuracy_percent"]
        <= TARGET_MAX_DROP_POINTS,
        "pruned faster (every batch size, slowest round)": all(
            min(pruned["speedup"][b]) > 1.0 for b in BATCH_SIZES
        ),
    }
    for check, met in checks.items():
        print(f"{'MET' if met else 'missed'}: {check}")
