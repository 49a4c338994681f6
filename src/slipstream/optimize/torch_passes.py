"""The PyTorch passes of ``slipstream optimize``: ``prune`` and ``distill``.

Both read a PyTorch model, change it in PyTorch, and export the result to ONNX (dynamic
batch dim) so the ONNX passes, the accuracy gate and the repository writing that follow
are the same as for any other model. The original model is exported too: the gate
compares the result with it, and its ONNX size is the "before" size.

The model file is a whole module saved with ``torch.save(module, "model.pt")``; it is
read with ``torch.load(path, weights_only=False)``, which unpickles it, so its classes
must be importable and the file must come from someone you trust. A state dict holds no
architecture and TorchScript cannot be restructured, so both are refused. The model takes
one tensor (batch dim first) and returns one tensor of class scores ``[batch, classes]``.

- ``prune``: structured pruning with torch-pruning (``pip install 'slipstream[optimize]'``):
  the ``prune_ratio`` share of each layer's output channels / neurons with the smallest L1
  norm is removed, and the layers that read them are rebuilt smaller, so the dense model
  really shrinks. The classifier layer keeps its outputs. With ``--train`` the pruned model
  is then fine-tuned on those rows (cross-entropy).
- ``distill``: a smaller student (a preset, a ``package.module:factory`` or a ``.pt``
  whole module) learns from the teacher on ``--train`` rows with
  ``alpha * T^2 * KL(student_T || teacher_T) + (1 - alpha) * cross_entropy(student, labels)``,
  ``T`` the temperature that softens both distributions.
"""

from __future__ import annotations

import importlib
import logging
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from slipstream.optimize.data import Dataset
from slipstream.optimize.passes import PassError, PassRecord, PassSettings

logger = logging.getLogger(__name__)

__all__ = [
    "STUDENT_PRESETS",
    "TORCH_SUFFIXES",
    "TorchPassOutput",
    "run_torch_pass",
]

TORCH_SUFFIXES = frozenset({".pt", ".pth"})
ProgressCallback = Callable[[str, int, int], None]


@dataclass(frozen=True, slots=True)
class TorchPassOutput:
    """What a PyTorch pass wrote."""

    # The original model exported to ONNX: the gate's reference and the "before" size.
    reference: Path
    # The pruned model or the student, exported to ONNX.
    optimized: Path
    record: PassRecord
    # Library versions used (torch, torch-pruning), for optimization.json.
    tool_versions: dict[str, str]


def run_torch_pass(
    name: str,
    source: Path,
    work: Path,
    settings: PassSettings,
    names: tuple[str, str],
    sample: np.ndarray,
    train: Dataset | None,
    on_progress: ProgressCallback | None = None,
) -> TorchPassOutput:
    """Run ``prune`` or ``distill`` on the PyTorch model ``source``.

    ``names`` are the ONNX (input, output) names, ``sample`` a few input rows used to
    trace the model, ``train`` the rows for fine-tuning / distillation.
    """
    import torch

    started = time.perf_counter()
    torch.manual_seed(settings.seed)
    model = load_torch_model(source)
    example = torch.from_numpy(np.ascontiguousarray(sample))
    reference = work / "original.onnx"
    export_onnx(model, example, reference, names)
    versions = {"torch": str(torch.__version__)}
    if name == "prune":
        optimized, recorded, notes = _prune(model, example, train, settings, on_progress)
        import torch_pruning

        versions["torch-pruning"] = str(getattr(torch_pruning, "__version__", "unknown"))
    elif name == "distill":
        optimized, recorded, notes = _distill(model, example, train, settings, on_progress)
    else:
        raise PassError(f"--passes: {name} is not a PyTorch pass")
    target = work / f"{name}.onnx"
    export_onnx(optimized, example, target, names)
    record = PassRecord(name, recorded, time.perf_counter() - started, notes)
    return TorchPassOutput(reference, target, record, versions)


def load_torch_model(path: Path) -> Any:
    """A whole module saved with ``torch.save(module, path)``, in eval mode."""
    import torch

    try:
        loaded = torch.load(path, weights_only=False, map_location="cpu")
    except Exception as exc:  # pickle raises anything the saved classes raise
        raise PassError(
            f"--model: {path} cannot be loaded with torch.load ({exc}); save the whole "
            "module with torch.save(module, path) and keep its classes importable"
        ) from None
    if isinstance(loaded, torch.jit.ScriptModule) or not isinstance(loaded, torch.nn.Module):
        kind = (
            "a TorchScript module"
            if isinstance(loaded, torch.jit.ScriptModule)
            else (f"a {type(loaded).__name__}")
        )
        raise PassError(
            f"--model: {path} holds {kind}; prune and distill need a whole nn.Module "
            "saved with torch.save(module, path) (not a state dict or TorchScript)"
        )
    return loaded.float().eval()


def export_onnx(model: Any, example: Any, target: Path, names: tuple[str, str]) -> None:
    """Export with a dynamic batch dim, the input and output named as the data expects."""
    import torch

    input_name, output_name = names
    model.eval()
    with warnings.catch_warnings(), torch.no_grad():
        # torch >= 2.9 flags the TorchScript-based exporter as deprecated; it still works
        # and, unlike the dynamo exporter, needs no onnxscript.
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            model,
            (example,),
            str(target),
            input_names=[input_name],
            output_names=[output_name],
            dynamic_axes={input_name: {0: "batch"}, output_name: {0: "batch"}},
            opset_version=17,
            dynamo=False,
        )


def count_parameters(model: Any) -> int:
    return int(sum(parameter.numel() for parameter in model.parameters()))


def _prune(
    model: Any,
    example: Any,
    train: Dataset | None,
    settings: PassSettings,
    on_progress: ProgressCallback | None,
) -> tuple[Any, dict[str, Any], list[str]]:
    import torch

    try:
        import torch_pruning as tp
    except ImportError:
        raise PassError("prune needs torch-pruning: pip install 'slipstream[optimize]'") from None
    ratio = settings.prune_ratio
    if not 0 < ratio < 1:
        raise PassError(f"--prune-ratio: {ratio} is out of range; expected 0 < ratio < 1")
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear | torch.nn.Conv2d)]
    if not layers:
        raise PassError("--passes prune: the model has no Linear or Conv2d layer to prune")
    before = count_parameters(model)
    pruner = tp.pruner.MetaPruner(
        model,
        example,
        importance=tp.importance.MagnitudeImportance(p=1),
        pruning_ratio=ratio,
        # The classifier's outputs are the classes: they stay.
        ignored_layers=[layers[-1]],
    )
    pruner.step()
    after = count_parameters(model)
    notes = [f"parameters {before} -> {after} ({after / before:.1%})"]
    if train is None:
        notes.append("not fine-tuned: pass --train DATA to recover accuracy after pruning")
    else:
        loss = _fit(model, None, train, settings, on_progress, "fine-tuning")
        notes.append(f"fine-tuned {settings.epochs} epochs on {train.num_rows} rows")
        notes.append(f"final training loss {loss:.4f}")
    recorded = {
        "library": "torch-pruning",
        "importance": "L1 magnitude",
        "prune_ratio": ratio,
        "fine_tune_epochs": settings.epochs if train is not None else 0,
        "learning_rate": settings.learning_rate,
        "parameters_before": before,
        "parameters_after": after,
    }
    return model, recorded, notes


def _distill(
    teacher: Any,
    example: Any,
    train: Dataset | None,
    settings: PassSettings,
    on_progress: ProgressCallback | None,
) -> tuple[Any, dict[str, Any], list[str]]:
    import torch

    if train is None:
        raise PassError("distill needs training rows: pass --train DATA (with labels)")
    if settings.temperature <= 0:
        raise PassError(f"--temperature: {settings.temperature} must be above 0")
    if not 0 <= settings.alpha <= 1:
        raise PassError(f"--alpha: {settings.alpha} is out of range; expected 0 <= alpha <= 1")
    with torch.no_grad():
        num_classes = int(teacher(example).shape[-1])
    student = build_student(settings.student, tuple(example.shape[1:]), num_classes)
    teacher_parameters, student_parameters = count_parameters(teacher), count_parameters(student)
    loss = _fit(student, teacher, train, settings, on_progress, "distilling")
    notes = [
        f"student {settings.student}: {student_parameters} parameters, "
        f"{student_parameters / teacher_parameters:.1%} of the teacher's {teacher_parameters}",
        f"trained {settings.epochs} epochs on {train.num_rows} rows; final loss {loss:.4f}",
    ]
    recorded = {
        "student": settings.student,
        "temperature": settings.temperature,
        "alpha": settings.alpha,
        "epochs": settings.epochs,
        "learning_rate": settings.learning_rate,
        "parameters_teacher": teacher_parameters,
        "parameters_student": student_parameters,
    }
    return student, recorded, notes


def _mlp(input_shape: Sequence[int], num_classes: int, hidden: int) -> Any:
    import torch

    features = int(np.prod(input_shape))
    return torch.nn.Sequential(
        torch.nn.Flatten(),
        torch.nn.Linear(features, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, num_classes),
    )


def _cnn(input_shape: Sequence[int], num_classes: int) -> Any:
    import torch

    if len(input_shape) != 3:
        raise PassError(
            f"--student cnn-small: needs image inputs [batch, C, H, W]; got "
            f"[batch, {', '.join(map(str, input_shape))}]"
        )
    channels, height, width = input_shape
    return torch.nn.Sequential(
        torch.nn.Conv2d(channels, 8, kernel_size=3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * (height // 2) * (width // 2), num_classes),
    )


# Name -> factory(input_shape without the batch dim, number of classes).
STUDENT_PRESETS: dict[str, Callable[[Sequence[int], int], Any]] = {
    "mlp-tiny": lambda shape, classes: _mlp(shape, classes, 32),
    "mlp-small": lambda shape, classes: _mlp(shape, classes, 64),
    "mlp-medium": lambda shape, classes: _mlp(shape, classes, 256),
    "cnn-small": _cnn,
}


def build_student(spec: str, input_shape: Sequence[int], num_classes: int) -> Any:
    """A preset name, ``package.module:factory`` (called with (input_shape, num_classes))
    or a ``.pt`` whole module to start from."""
    import torch

    if spec in STUDENT_PRESETS:
        return STUDENT_PRESETS[spec](input_shape, num_classes)
    if Path(spec).suffix.lower() in TORCH_SUFFIXES:
        return load_torch_model(Path(spec)).train()
    module_name, _, attribute = spec.partition(":")
    if not attribute:
        raise PassError(
            f"--student: {spec!r} is not a preset ({', '.join(STUDENT_PRESETS)}), a "
            "package.module:factory or a .pt file"
        )
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise PassError(f"--student: cannot import {spec!r} ({exc})") from None
    student = factory(tuple(input_shape), num_classes)
    if not isinstance(student, torch.nn.Module):
        raise PassError(
            f"--student: {spec} returned a {type(student).__name__}, expected an nn.Module"
        )
    return student


def _fit(
    model: Any,
    teacher: Any | None,
    train: Dataset,
    settings: PassSettings,
    on_progress: ProgressCallback | None,
    task: str,
) -> float:
    """Train ``model`` on ``train``: cross-entropy, plus distillation when a teacher is given.

    Returns the last epoch's mean loss."""
    import torch
    import torch.nn.functional as functional

    if train.labels is None:
        raise PassError(f"--train: {train.source} has no 'labels' array; training needs them")
    inputs = torch.from_numpy(np.ascontiguousarray(next(iter(train.inputs.values()))))
    labels = torch.from_numpy(train.labels)
    soft_targets = None
    if teacher is not None:
        # The teacher is frozen and sees the same rows every epoch: run it once.
        with torch.no_grad():
            soft_targets = functional.log_softmax(teacher(inputs) / settings.temperature, 1)
    temperature, alpha = settings.temperature, settings.alpha
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.learning_rate)
    generator = torch.Generator().manual_seed(settings.seed)
    batch_size = settings.train_batch_size
    mean_loss = float("nan")
    for epoch in range(settings.epochs):
        model.train()
        order = torch.randperm(len(inputs), generator=generator)
        total = 0.0
        for start in range(0, len(inputs), batch_size):
            rows = order[start : start + batch_size]
            logits = model(inputs[rows])  # [B, classes]
            loss = functional.cross_entropy(logits, labels[rows])
            if soft_targets is not None:
                soft = functional.kl_div(
                    functional.log_softmax(logits / temperature, 1),
                    soft_targets[rows],
                    reduction="batchmean",
                    log_target=True,
                )
                # T^2 keeps the soft term's gradients on the label term's scale.
                loss = alpha * temperature**2 * soft + (1 - alpha) * loss
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            total += loss.item() * len(rows)
        mean_loss = total / len(inputs)
        logger.debug("%s epoch %d: loss %.4f", task, epoch + 1, mean_loss)
        if on_progress is not None:
            on_progress(f"{task} (epochs)", epoch + 1, settings.epochs)
    model.eval()
    return mean_loss
