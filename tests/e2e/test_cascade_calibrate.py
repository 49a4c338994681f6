"""``slipstream cascade calibrate`` as a user runs it: labelled rows in, the threshold, the
accuracy and the first stage's share out, and written into the cascade's config.yaml.

The toy stages disagree on purpose: the small model is right exactly on the rows it is
confident about, the large one (labels shifted by one) exactly on the others, so the
one threshold that reaches accuracy 1.0 is known.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import yaml

from slipstream.config import parse_model_config
from tests.models import CLASSIFIER_CLASSES, build_classifier, write_config
from tests.utils import slipstream_command

CONFIDENT_ROWS, UNSURE_ROWS = 30, 10


def labelled_rows(path: Path) -> float:
    """Write the rows and labels; returns the lowest confident row's top probability."""
    rng = np.random.default_rng(0)
    confident = np.zeros((CONFIDENT_ROWS, CLASSIFIER_CLASSES), np.float32)
    confident[np.arange(CONFIDENT_ROWS), rng.integers(0, CLASSIFIER_CLASSES, CONFIDENT_ROWS)] = (
        rng.uniform(6, 9, CONFIDENT_ROWS)
    )
    unsure = rng.uniform(0, 0.2, (UNSURE_ROWS, CLASSIFIER_CLASSES)).astype(np.float32)
    x = np.concatenate([confident, unsure])
    labels = x.argmax(axis=1) + np.r_[np.zeros(CONFIDENT_ROWS), np.ones(UNSURE_ROWS)]
    np.savez(path, x=x, labels=labels.astype(np.int64))
    top = np.exp(confident.max(axis=1)) / np.exp(confident).sum(axis=1)
    return float(top.min())


def test_calibrate_picks_and_writes_the_threshold(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    build_classifier(repo, "small")
    build_classifier(repo, "large", label_offset=1)
    config = write_config(repo, "cascade", (
        "# the first stage answers what it is sure of\n"
        "cascade:\n"
        "  stages:\n"
        "    - model: small\n"
        "      confidence: {output: probabilities, threshold: 0.5}  # calibrated\n"
        "    - model: large\n"
    ))  # fmt: skip
    lowest_confident = labelled_rows(tmp_path / "val.npz")
    result = subprocess.run(
        [*slipstream_command(), "cascade", "calibrate", "cascade", "--model-repository",
         str(repo), "--data", str(tmp_path / "val.npz"), "--prediction-output", "label",
         "--target-accuracy", "1.0", "--write"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "accuracy 1.0000 (target 1.0000)" in result.stdout
    assert f"first stage answers 75.0% of {CONFIDENT_ROWS + UNSURE_ROWS} rows" in result.stdout
    text = config.read_text()
    assert text.startswith("# the first stage") and "# calibrated" in text  # edited in place
    parsed = parse_model_config(yaml.safe_load(text), "cascade")
    assert parsed.cascade is not None and parsed.cascade.stages[0].confidence is not None
    threshold = parsed.cascade.stages[0].confidence.threshold
    assert abs(threshold - lowest_confident) < 1e-5


def test_calibrate_names_an_unreachable_target(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    build_classifier(repo, "small")
    build_classifier(repo, "large", label_offset=1)
    write_config(repo, "cascade", {"cascade": {"stages": [
        {"model": "small", "confidence": {"output": "probabilities", "threshold": 0.5}},
        {"model": "large"}]}})  # fmt: skip
    labelled_rows(tmp_path / "val.npz")
    # Every row wrong on one stage or the other: 1.0 is out of reach without "label".
    result = subprocess.run(
        [*slipstream_command(), "cascade", "calibrate", "cascade", "--model-repository",
         str(repo), "--data", str(tmp_path / "val.npz"), "--target-accuracy", "1.0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1
    assert "no threshold reaches the target accuracy 1.0000" in result.stderr


def test_calibrate_names_labels_that_do_not_fit_and_flags_out_of_range(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    build_classifier(repo, "small")
    build_classifier(repo, "large", label_offset=1)
    write_config(repo, "cascade", {"cascade": {"stages": [
        {"model": "small", "confidence": {"output": "probabilities", "threshold": 0.5}},
        {"model": "large"}]}})  # fmt: skip
    labelled_rows(tmp_path / "val.npz")
    with np.load(tmp_path / "val.npz") as data:
        np.savez(tmp_path / "short.npz", x=data["x"], labels=data["labels"][:10])
    command = [*slipstream_command(), "cascade", "calibrate", "cascade", "--model-repository",
               str(repo), "--data"]  # fmt: skip
    cases = [
        (["short.npz"], 1, f"'labels' has 10 rows and 'x' {CONFIDENT_ROWS + UNSURE_ROWS}"),
        (["val.npz", "--target-accuracy", "1.5"], 2, "--target-accuracy"),
        (["val.npz", "--max-accuracy-drop", "-1"], 2, "--max-accuracy-drop"),
    ]
    for args, exit_code, message in cases:
        args[0] = str(tmp_path / args[0])
        result = subprocess.run([*command, *args], capture_output=True, text=True, timeout=120)
        assert result.returncode == exit_code and message in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
