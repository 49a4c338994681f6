"""What the tuner says a variant's accuracy drop is measured against (optimize run twice
makes v3 from v2), how the budget's refusals read, and the mode of the version
``--apply`` writes."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from slipstream.tune.apply import apply_winner
from slipstream.tune.report import html_report, leaderboard_row
from slipstream.tune.results import TrialRecord, TuneResult
from slipstream.tune.settings import Catalogue, HardwareProfile, parse_slo
from slipstream.tune.variants import apply_budget, find_variants, measure_drops
from tests.models import build_add_sub

POINT = {"max_batch_size": 8, "max_queue_delay_us": 0, "instances": 1, "threads": 1}


def _optimized(repo: Path, version: int, source_version: int, mean_cosine: float) -> None:
    """REPO/add_sub/<version> as optimize writes it from <source_version>."""
    build_add_sub(repo, version=version)
    record = {
        "source_model": str(repo / "add_sub" / str(source_version) / "model.onnx"),
        "passes": [{"name": "graph"}],
        "gate": {"metric": "cosine", "after": {"mean_cosine": mean_cosine}},
    }
    (repo / "add_sub" / str(version) / "optimization.json").write_text(json.dumps(record))


@pytest.fixture
def chained(tmp_path: Path) -> Path:
    """v1 original; v2 optimized from v1 (drop 0.002); v3 optimized from v2, whose
    record compares it with v2 (drop 0)."""
    build_add_sub(tmp_path)
    _optimized(tmp_path, 2, 1, 0.998)
    _optimized(tmp_path, 3, 2, 1.0)
    return tmp_path / "add_sub"


def test_a_drop_against_an_optimized_version_says_which(chained: Path) -> None:
    _, variants = find_variants(chained)
    assert [(v.accuracy_drop, v.accuracy_baseline) for v in variants] == [
        (0.0, None),
        (0.002, None),
        (0.0, 2),
    ]
    record = TrialRecord(
        trial=1, config={"variant": variants[2].name, "profile": "p", **POINT}, status="ok",
        accuracy_drop=variants[2].accuracy_drop, accuracy_baseline=variants[2].accuracy_baseline,
    )  # fmt: skip
    assert leaderboard_row(record)[12] == "0.0000 vs v2"
    record.accuracy_baseline = None
    assert leaderboard_row(record)[12] == "0.0000"


def test_the_budget_does_not_take_a_drop_against_v2_for_one_against_the_original(
    chained: Path,
) -> None:
    # v3's record said drop 0, which the tune reported (and budgeted) as v3's drop from
    # the original, where the real one is v2's and more.
    _, variants = find_variants(chained)
    apply_budget(variants, max_drop=0.01)
    assert [v.excluded for v in variants[:2]] == ["", ""]
    assert variants[2].excluded == (
        "accuracy drop against the original unknown (optimization.json gives 0 (cosine) vs "
        "v2, and v2 was optimized itself); give --validation to measure it"
    )


def test_validation_rows_measure_a_chained_version_against_the_original(
    chained: Path, tmp_path: Path
) -> None:
    rng = np.random.default_rng(0)
    rows = {name: rng.standard_normal((20, 16)).astype(np.float32) for name in ("INPUT0", "INPUT1")}
    np.savez(tmp_path / "val.npz", **rows)  # type: ignore[arg-type]
    _, variants = find_variants(chained)
    measure_drops(variants, tmp_path / "val.npz")
    assert [v.accuracy_baseline for v in variants] == [None, None, None]
    apply_budget(variants, max_drop=0.01)
    assert [v.excluded for v in variants] == ["", "", ""]


def test_a_trial_and_the_report_carry_what_the_drop_is_against(
    chained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from slipstream.tune import trials
    from slipstream.tune.server import TrialServerError
    from slipstream.tune.session import TuneOptions, plan_tune

    class NoServer:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def __enter__(self) -> None:
            raise TrialServerError("not started in this test", "")

        def __exit__(self, *args: object) -> None:
            pass

    monkeypatch.setattr(trials, "TrialServer", NoServer)
    options = TuneOptions(
        model_dir=chained, slo=parse_slo("p99_ms=5", None), work_dir=tmp_path / "work",
        catalogue=Catalogue(profiles=[HardwareProfile(name="cpu", cores=1, price_per_hour=0.1)]),
        backends=("onnxruntime",),
    )  # fmt: skip
    plan = plan_tune(options)
    name = plan.variants[2].name
    record = trials.run_trial(plan.context, 1, {"variant": name, "profile": "cpu", **POINT})
    assert record.status == "failed" and record.accuracy_baseline == 2
    result = TuneResult(
        model="add_sub", model_dir=str(chained), slo={"p99_ms": 5.0}, mode="brute",
        space={}, space_size=1, trials=[record], profiles=plan.profiles,
        variants=[{**v.__dict__, "model_file": str(v.model_file)} for v in plan.variants],
    )  # fmt: skip
    assert "<td>0.0000 vs v2</td>" in html_report(result)


def test_a_budget_refusal_prints_no_empty_metric(tmp_path: Path) -> None:
    # An original has no gate metric: its refusal read "accuracy drop 0 () is over ...".
    build_add_sub(tmp_path)
    _, variants = find_variants(tmp_path / "add_sub")
    apply_budget(variants, max_drop=-1.0)
    assert variants[0].excluded == "accuracy drop 0 is over --max-accuracy-drop -1"


def test_the_cli_refuses_a_negative_accuracy_budget(tmp_path: Path) -> None:
    from slipstream.tune.cli import tune

    build_add_sub(tmp_path)
    args = [str(tmp_path / "add_sub"), "--slo", "p99_ms=50", "--max-accuracy-drop", "-1"]
    outcome = CliRunner().invoke(tune, [*args, "--out", str(tmp_path / "out")])
    assert outcome.exit_code == 2
    assert "Invalid value for '--max-accuracy-drop': -1.0 is not in the range x>=0" in (
        outcome.output
    )


def test_the_applied_version_has_the_mode_mkdir_gives(tmp_path: Path, umask: int) -> None:
    # It was tempfile.mkdtemp's 0o700, renamed into place: a server running as another
    # user could not read the new version.
    build_add_sub(tmp_path)
    model_dir = tmp_path / "add_sub"
    config: dict[str, Any] = {"variant": "v1 original", "profile": "p", **POINT}
    result = TuneResult(
        model="add_sub", model_dir=str(model_dir), slo={"p99_ms": 50.0}, mode="brute",
        space={}, space_size=1,
        variants=[{"name": "v1 original", "version": 1, "backend": "",
                   "model_file": str(model_dir / "1" / "model.onnx")}],
        profiles=[{"name": "p", "cpus": [0], "gpu": None, "price_per_hour": 0.1}],
        trials=[TrialRecord(trial=1, config=config, status="ok", throughput_runs=[10.0])],
        winner=1,
    )  # fmt: skip
    version = apply_winner(result, model_dir, {})
    assert version == 2 and (model_dir / "2" / "model.onnx").is_file()
    assert stat.S_IMODE((model_dir / "2").stat().st_mode) == 0o777 & ~umask
