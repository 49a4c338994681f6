"""``slipstream cascade calibrate``: a cascade's first threshold, picked from labelled data.

The cascade's stages run in this process as the server runs them (a serving core over
the repository, remote stages called at their URL): the first stage on every row, the
rest of the cascade on every row. For each threshold, the rows whose first-stage
confidence reaches it keep the first stage's answer and the others get the rest's; the
threshold chosen is the lowest whose accuracy reaches the target, so the first stage
answers as many rows as it can.

Example::

    slipstream cascade calibrate digits_cascade --model-repository models \\
        --data calibration.npz --max-accuracy-drop 0.005 --write
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import click
import numpy as np
import yaml

from slipstream.config import ConfigError, ServerSettings, parse_model_config
from slipstream.serving.cascade import Cascade, Stage, confidence
from slipstream.tensors import read_tensor_file
from slipstream.types import InferRequest

if TYPE_CHECKING:
    from slipstream.serving.core import ModelServer

logger = logging.getLogger(__name__)

LABELS_NAME = "labels"


class CalibrationError(ValueError):
    """Calibration cannot run or reach its target; the message names the fix."""


@dataclass(frozen=True, slots=True)
class Calibration:
    """The threshold picked and what it gives on the data."""

    threshold: float
    # Accuracy of the cascade with ``threshold`` on the data, and the target it met.
    accuracy: float
    target_accuracy: float
    # Share of rows the first stage answers with ``threshold``.
    first_stage_share: float
    # Accuracy of the first stage alone, and of the rest of the cascade alone.
    first_stage_accuracy: float
    rest_accuracy: float
    rows: int


def pick_threshold(
    confidence: np.ndarray, first_correct: np.ndarray, rest_correct: np.ndarray, target: float
) -> Calibration:
    """The lowest threshold whose accuracy reaches ``target`` (CalibrationError if none).

    >>> c = pick_threshold(np.array([0.9, 0.8, 0.6, 0.5]), np.array([1, 1, 0, 1]),
    ...                    np.array([1, 1, 1, 1]), target=0.9)
    >>> float(c.threshold), c.accuracy, c.first_stage_share
    (0.8, 1.0, 0.5)
    """
    rows = confidence.size
    order = np.argsort(-confidence, kind="stable")
    ranked = confidence[order]
    first = np.concatenate([[0], np.cumsum(first_correct[order])])
    rest = np.concatenate([[0], np.cumsum(rest_correct[order])])
    # k rows answered by the first stage: only where a tie ends (a threshold keeps ties).
    ends = [k for k in range(1, rows + 1) if k == rows or ranked[k] < ranked[k - 1]]
    accuracy = {k: float(first[k] + rest[rows] - rest[k]) / rows for k in [0, *ends]}
    passing = [k for k, value in accuracy.items() if value >= target - 1e-12]
    if not passing:
        raise CalibrationError(
            f"no threshold reaches the target accuracy {target:.4f}: the rest of the cascade "
            f"alone reaches {accuracy[0]:.4f}; lower the target"
        )
    k = max(passing)
    threshold = float(ranked[k - 1]) if k else float(np.nextafter(ranked[0], np.inf))
    return Calibration(
        threshold=threshold,
        accuracy=accuracy[k],
        target_accuracy=target,
        first_stage_share=k / rows,
        first_stage_accuracy=float(np.mean(first_correct)),
        rest_accuracy=accuracy[0],
        rows=rows,
    )


async def calibrate(
    repository: Path,
    name: str,
    data: Path,
    target_accuracy: float | None,
    max_accuracy_drop: float,
    prediction_output: str = "",
    batch_size: int = 32,
) -> Calibration:
    """Run the cascade ``name``'s stages on ``data`` and pick its first threshold."""
    arrays = read_tensor_file(data)[0]
    labels = arrays.pop(LABELS_NAME, None)
    if labels is None:
        raise CalibrationError(f"{data}: no {LABELS_NAME!r} array; save the expected class "
                               f"of each row under that name")  # fmt: skip
    labels = _checked_labels(data, arrays, labels)
    from slipstream.serving.core import ModelServer  # the serving core: only when run

    settings = ServerSettings(model_repository=repository, model_control_mode="explicit",
                              load_models=[name])  # fmt: skip
    server = ModelServer(settings)
    await server.start()
    try:
        cascade = server.cascades.get(name)
        if cascade is None or not isinstance(cascade, Cascade):
            reasons = [e.reason for e in server.cascades.index() if e.name == name]
            raise CalibrationError(f"cascade {name!r} did not load: "
                                   f"{reasons[0] if reasons else 'not a cascade'}")  # fmt: skip
        first = cascade.stages[0]
        rule = first.spec.confidence
        assert rule is not None
        output = prediction_output or rule.output
        found = await _run_rows(server, [first], arrays, [rule.output, output], batch_size)
        rest = await _run_rows(server, cascade.stages[1:], arrays, [output], batch_size, cascade)
    finally:
        await server.stop()
    scores = confidence(rule, found[rule.output])
    first_correct = _predictions(found[output]) == labels
    rest_correct = _predictions(rest[output]) == labels
    rest_accuracy = float(np.mean(rest_correct))
    target = target_accuracy if target_accuracy is not None else rest_accuracy - max_accuracy_drop
    return pick_threshold(scores, first_correct, rest_correct, target)


def _checked_labels(data: Path, arrays: dict[str, np.ndarray], labels: np.ndarray) -> np.ndarray:
    """``labels`` as [rows], one per row of every input (CalibrationError naming the
    array otherwise), checked before any stage is loaded."""
    if not arrays:
        raise CalibrationError(f"{data}: only {LABELS_NAME!r}; save the cascade's inputs "
                               "beside it, named like them")  # fmt: skip
    if labels.ndim == 0 or labels.size != len(labels):  # [rows] or [rows, 1]
        raise CalibrationError(f"{data}: {LABELS_NAME!r} has shape {list(labels.shape)}; "
                               "it takes one expected class per row, shape [rows]")  # fmt: skip
    for name, array in arrays.items():
        rows = array.shape[0] if array.ndim else 0
        if rows != len(labels):
            raise CalibrationError(f"{data}: {LABELS_NAME!r} has {len(labels)} rows and "
                                   f"{name!r} {rows}; save one label per row")  # fmt: skip
    return labels.reshape(-1)


async def _run_rows(
    server: ModelServer,
    stages: list[Stage],
    arrays: dict[str, np.ndarray],
    outputs: list[str],
    batch_size: int,
    cascade: Cascade | None = None,
) -> dict[str, np.ndarray]:
    """``outputs`` for every row: one stage, or the cascade made of ``stages``."""
    wanted = list(dict.fromkeys(outputs))
    rows = next(iter(arrays.values())).shape[0]
    parts: list[dict[str, np.ndarray]] = []
    for start in range(0, rows, batch_size):
        chunk = {name: array[start : start + batch_size] for name, array in arrays.items()}
        request = InferRequest(cascade.name if cascade else "", "", chunk)
        if len(stages) == 1:
            parts.append(await stages[0].run(server.infer, chunk, wanted, request))
        else:
            assert cascade is not None
            rest = _rest_of(cascade, stages)
            parts.append(await rest.run_rows(request, wanted, server.infer))
    return {name: np.concatenate([part[name] for part in parts]) for name in wanted}


def _rest_of(cascade: Cascade, stages: list[Stage]) -> Cascade:
    """The cascade of its stages after the first (three or more stages)."""
    config = cascade.config
    assert config.cascade is not None
    specs = [stage.spec for stage in stages]
    rest_config = config.model_copy(
        update={"cascade": config.cascade.model_copy(update={"stages": specs})}
    )
    return Cascade(cascade.name, rest_config, cascade.metadata, stages, cascade.counts,
                   cascade.metrics)  # fmt: skip


def _predictions(output: np.ndarray) -> np.ndarray:
    """Class per row: the output itself (class ids [B]) or its argmax ([B, classes])."""
    if output.ndim == 1 or (output.ndim == 2 and output.shape[1] == 1):
        return output.reshape(-1)
    classes: np.ndarray = output.reshape(output.shape[0], -1).argmax(axis=1)
    return classes


def write_threshold(config_path: Path, threshold: float) -> bool:
    """Set the first stage's ``confidence.threshold`` in ``config_path``. The line is
    edited in place when the file has one threshold (comments kept); otherwise the YAML
    is written again (comments lost). Returns whether the file was edited in place."""
    text = config_path.read_text()
    value = f"{threshold:.6g}"
    pattern = re.compile(r"(\bthreshold:\s*)([-+0-9.eE]+)")
    if len(pattern.findall(text)) == 1:
        edited = pattern.sub(lambda m: m.group(1) + value, text)
        config = parse_model_config(yaml.safe_load(edited), str(config_path))
        stage = config.cascade.stages[0] if config.cascade else None
        if stage is not None and stage.confidence and stage.confidence.threshold == float(value):
            config_path.write_text(edited)
            return True
    data = yaml.safe_load(text)
    try:
        data["cascade"]["stages"][0]["confidence"]["threshold"] = float(value)
    except (KeyError, IndexError, TypeError):
        raise ConfigError(f"{config_path}: no cascade.stages[0].confidence to set") from None
    parse_model_config(data, str(config_path))
    config_path.write_text(yaml.safe_dump(data, sort_keys=False))
    return False


@click.group()
def cascade() -> None:
    """Cascades: models that escalate unsure rows to a larger model."""


@cascade.command("calibrate")
@click.argument("name")
@click.option("--data", type=click.Path(exists=True, path_type=Path), required=True,
              help="Labelled rows (held out from training): .npz, a directory of .npy "
              "files or V2 JSON requests, arrays named like the cascade's inputs plus "
              "'labels' (the expected class per row).")  # fmt: skip
@click.option("--model-repository", type=click.Path(file_okay=False, path_type=Path),
              default=Path("models"), show_default=True)  # fmt: skip
@click.option("--max-accuracy-drop", type=click.FloatRange(0, 1), default=0.005,
              show_default=True,
              help="Target: the accuracy of the rest of the cascade alone minus this "
              "(0.005: half a point).")  # fmt: skip
@click.option("--target-accuracy", type=click.FloatRange(0, 1), default=None,
              help="Target accuracy (0..1) instead of --max-accuracy-drop.")  # fmt: skip
@click.option("--prediction-output", default="",
              help="Output holding the predicted class (class ids, or scores to argmax); "
              "default: the first stage's confidence output.")  # fmt: skip
@click.option("--batch-size", type=click.IntRange(1), default=32, show_default=True)
@click.option("--write", is_flag=True,
              help="Write the threshold into the cascade's config.yaml.")  # fmt: skip
def calibrate_command(name: str, data: Path, model_repository: Path, max_accuracy_drop: float,
                      target_accuracy: float | None, prediction_output: str, batch_size: int,
                      write: bool) -> None:  # fmt: skip
    """Pick cascade NAME's first threshold from labelled data: the lowest (the first
    stage answering the most rows) whose accuracy reaches the target.

    Example: slipstream cascade calibrate digits_cascade --data val.npz --write
    """
    from slipstream.tensors import TensorFileError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        run = calibrate(model_repository, name, data, target_accuracy, max_accuracy_drop,
                        prediction_output, batch_size)  # fmt: skip
        found = asyncio.run(run)
    except (CalibrationError, ConfigError, TensorFileError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"threshold {found.threshold:.6g}: accuracy {found.accuracy:.4f} "
               f"(target {found.target_accuracy:.4f}), first stage answers "
               f"{found.first_stage_share:.1%} of {found.rows} rows")  # fmt: skip
    click.echo(f"first stage alone {found.first_stage_accuracy:.4f}, the rest alone "
               f"{found.rest_accuracy:.4f}")  # fmt: skip
    if write:
        config = model_repository / name / "config.yaml"
        in_place = write_threshold(config, found.threshold)
        click.echo(f"wrote threshold into {config}" + ("" if in_place else
                   " (rewritten: its comments are gone)"))  # fmt: skip
