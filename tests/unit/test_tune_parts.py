"""The tuner's inputs and outputs without a server: the SLO and catalogue parsers and
their errors, variants read from optimize's records, the config a trial serves, the
leaderboard, the Pareto front and the report files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slipstream.tune.report import html_report, verdict, write_outputs
from slipstream.tune.results import LevelFigures, TrialRecord, TuneResult, leaderboard, pareto_front
from slipstream.tune.settings import (
    HardwareProfile,
    TuneInputError,
    int_list,
    load_catalogue,
    parse_slo,
)
from slipstream.tune.trials import model_config
from slipstream.tune.variants import Variant, apply_budget, find_variants, gate_drop
from tests.models import build_add_sub, write_config

EXAMPLE_CATALOGUE = Path(__file__).resolve().parents[2] / "examples" / "tune" / "catalogue.yaml"


def test_slo_takes_bench_figures_in_ms() -> None:
    slo = parse_slo("p50_ms=10, p99_ms=50", min_throughput=200)
    assert slo.latency_ms == {"p50_ms": 10.0, "p99_ms": 50.0} and slo.min_throughput == 200
    assert slo.describe() == "p50_ms<=10, p99_ms<=50, throughput>=200/s"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("p99=50", "expected FIGURE=MS with FIGURE one of avg_ms, p50_ms"),
        ("p99_ms", "expected FIGURE=MS"),
        ("p99_ms=fast", "must be a positive number of ms"),
        ("p99_ms=-1", "must be a positive number of ms"),
    ],
)
def test_a_bad_slo_names_the_fix(text: str, message: str) -> None:
    with pytest.raises(TuneInputError, match=message):
        parse_slo(text, None)


def test_the_example_catalogue_loads_and_says_its_prices_are_examples() -> None:
    catalogue = load_catalogue(EXAMPLE_CATALOGUE)
    assert "EXAMPLE" in catalogue.source and "2026-11-24" in catalogue.source
    assert all(p.price_per_hour > 0 for p in catalogue.profiles)
    assert any(p.gpu for p in catalogue.profiles)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("profiles: [{name: a, cores: 1}]", r"profiles\.0\.price_per_hour: Field required"),
        ("profiles: [{name: a, cores: 1, cpus: [0], price_per_hour: 1}]", "exactly one of cores"),
        ("profiles: [{name: a, price_per_hour: 1}]", "exactly one of cores"),
        ("profiles: [{name: a, cores: 0, price_per_hour: 1}]", r"profiles\.0\.cores"),
        ("profiles: [{name: a, cores: 1, price_per_hour: 1, ram: 4}]", "ram: Extra inputs"),
        (
            "profiles: [{name: a, cores: 1, price_per_hour: 1},"
            " {name: a, cores: 2, price_per_hour: 2}]",
            "repeated: a",
        ),
        ("profiles: [", "not valid YAML"),
        ("- a", "expected a mapping with a 'profiles:' list"),
    ],
)
def test_a_bad_catalogue_names_the_entry_and_the_key(
    tmp_path: Path, body: str, message: str
) -> None:
    path = tmp_path / "catalogue.yaml"
    path.write_text(body)
    with pytest.raises(TuneInputError, match=message):
        load_catalogue(path)
    with pytest.raises(TuneInputError, match="No such file"):
        load_catalogue(tmp_path / "missing.yaml")


def test_profiles_pin_to_cores_this_machine_has() -> None:
    assert HardwareProfile(name="a", cores=2, price_per_hour=1).cpu_set([0, 1, 2]) == [0, 1]
    assert HardwareProfile(name="a", cores=4, price_per_hour=1).cpu_set([0, 1]) is None
    assert HardwareProfile(name="a", cpus=[2], price_per_hour=1).cpu_set([0, 1, 2]) == [2]
    assert HardwareProfile(name="a", cpus=[5], price_per_hour=1).cpu_set([0, 1]) is None


def test_int_lists() -> None:
    assert int_list("8,1, 4,4", "--batch-sizes", minimum=1) == (1, 4, 8)
    with pytest.raises(TuneInputError, match="--batch-sizes '0,4': expected integers >= 1"):
        int_list("0,4", "--batch-sizes", minimum=1)


def test_gate_drops_in_each_metrics_unit() -> None:
    assert gate_drop({"metric": "agreement", "after": {"agreement_percent": 98.5}}) == (
        "agreement",
        1.5,
    )
    assert gate_drop({"metric": "cosine", "after": {"mean_cosine": 0.995}}) == ("cosine", 0.005)
    assert gate_drop({"metric": "mae", "after": {"mae": 0.02}}) == ("mae", 0.02)
    assert gate_drop({"metric": "top1", "after": {}}) == ("top1", None)


def _optimized(repo: Path, version: int, passes: list[str], gate: dict[str, object]) -> None:
    build_add_sub(repo, version=version)
    record = {"passes": [{"name": name} for name in passes], "gate": gate}
    (repo / "add_sub" / str(version) / "optimization.json").write_text(json.dumps(record))


def test_variants_come_from_versions_and_the_budget_excludes_with_a_reason(
    tmp_path: Path,
) -> None:
    build_add_sub(tmp_path)
    _optimized(tmp_path, 2, ["int8-dynamic"], {"metric": "cosine", "after": {"mean_cosine": 0.9}})
    _optimized(tmp_path, 3, ["fp16"], {"metric": "cosine", "after": {"mean_cosine": 0.999}})
    _optimized(tmp_path, 4, ["graph"], {})
    _, variants = find_variants(tmp_path / "add_sub")
    assert [v.name for v in variants] == ["v1 original", "v2 int8-dynamic", "v3 fp16", "v4 graph"]
    apply_budget(variants, max_drop=0.01)
    assert variants[0].excluded == variants[2].excluded == ""
    assert variants[1].excluded == "accuracy drop 0.1 (cosine) is over --max-accuracy-drop 0.01"
    assert (
        "accuracy drop unknown" in variants[3].excluded and "--validation" in variants[3].excluded
    )
    with pytest.raises(TuneInputError, match="no version directory"):
        find_variants(write_config(tmp_path, "empty", {}).parent)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"ensemble": {"steps": [{"model": "add_sub", "input_map": {"INPUT0": "A"},
                                  "output_map": {"OUTPUT0": "Z"}}]},
          "input": [{"name": "A", "data_type": "FP32", "dims": [16]}],
          "output": [{"name": "Z", "data_type": "FP32", "dims": [16]}]},
         "an ensemble is not tuned as a whole; tune the models its steps run"),
        ({"sequence_batching": {}}, "a stateful model is not tuned as a whole"),
    ],
)  # fmt: skip
def test_models_made_of_others_or_of_sequences_are_not_tuned(
    tmp_path: Path, config: dict[str, object], expected: str
) -> None:
    build_add_sub(tmp_path, "composed")
    write_config(tmp_path, "composed", config)
    with pytest.raises(TuneInputError, match=expected):
        find_variants(tmp_path / "composed")


def test_the_trial_config_keeps_the_models_other_settings() -> None:
    base = {
        "max_batch_size": 64,
        "tokenizer": "tokenizer/tokenizer.json",
        "dynamic_batching": {"preferred_batch_size": [4, 16], "max_queue_size": 10},
    }
    point = {"max_batch_size": 8, "max_queue_delay_us": 500, "instances": 2, "threads": 1}
    config = model_config(base, point)
    assert config["tokenizer"] == "tokenizer/tokenizer.json"
    assert config["dynamic_batching"] == {
        "preferred_batch_size": [4],
        "max_queue_size": 10,
        "max_queue_delay_microseconds": 500,
    }
    assert config["instance_group"] == [{"count": 2, "kind": "KIND_CPU"}]
    assert config["parameters"] == {"intra_op_thread_count": "1"}
    assert base["max_batch_size"] == 64  # the base is not changed


def _record(
    trial: int, throughput: float, p99: float, price: float, status: str = "ok"
) -> TrialRecord:
    level = LevelFigures(4, throughput, p99 / 2, p99, p99 / 2, 0, None, 2.0, p99 / 50)
    config = {
        "variant": "v1 original", "profile": f"p{price:g}", "max_batch_size": 8,
        "max_queue_delay_us": 0, "instances": 1, "threads": 1,
    }  # fmt: skip
    return TrialRecord(
        trial=trial, config=config, status=status, levels=[level], chosen_level=0,  # type: ignore[arg-type]
        score=throughput / price if status == "ok" else -p99 / 50,
        throughput_runs=[throughput] if status == "ok" else [], price_per_hour=price,
        run_levels=[level] if status == "ok" else [], accuracy_drop=0.0,
    )  # fmt: skip


def test_leaderboard_ranks_by_cost_and_the_front_drops_dominated_configs() -> None:
    records = [
        _record(1, 100.0, 40.0, 0.1),  # cost 0.278 / 1M
        _record(2, 300.0, 20.0, 0.2),  # cost 0.185: cheaper and faster than 1
        _record(3, 150.0, 10.0, 0.2),  # cost 0.370, but the lowest p99
        _record(4, 0.0, 80.0, 0.1, status="slo_unmet"),
    ]
    records[1].throughput_runs = [300.0, 280.0, 310.0]
    assert records[1].spread_pct == pytest.approx(100 * 30 / 300)
    # bench's formula: price / (infer/s * 3600) * 1e6, at the median of the runs.
    assert records[1].cost_per_1m_infer == pytest.approx(0.2 / (300 * 3600) * 1e6)
    assert [r.trial for r in leaderboard(records)] == [2, 1, 3]
    assert [r.trial for r in pareto_front(records)] == [2, 3]


def _result(records: list[TrialRecord], winner: int | None, closest: int | None) -> TuneResult:
    return TuneResult(
        model="add_sub", model_dir="m", slo={"p99_ms": 50.0, "min_throughput": None},
        mode="brute", space={"max_batch_size": [8]}, space_size=4,
        variants=[{"name": "v2 int8", "accuracy_drop": 2.0, "accuracy_metric": "top1",
                   "accuracy_source": "optimization.json", "excluded": "over budget"}],
        profiles=[{"name": "p0.1", "cpus": [0], "gpu": None, "price_per_hour": 0.1,
                   "skipped": ""}],
        trials=records, leaderboard=[r.trial for r in leaderboard(records)],
        pareto=[r.trial for r in pareto_front(records)], winner=winner, closest=closest,
    )  # fmt: skip


def test_the_report_files(tmp_path: Path) -> None:
    failed = TrialRecord(trial=3, config={}, status="failed", error="server exited with code 1",
                         log_tail="Traceback: <boom>")  # fmt: skip
    result = _result([_record(1, 100.0, 40.0, 0.1), _record(2, 300.0, 20.0, 0.2), failed], 2, None)
    json_path, html_path = write_outputs(result, tmp_path)
    document = json.loads(json_path.read_text())
    assert document["winner"] == 2 and document["leaderboard"] == [2, 1]
    assert document["trials"][1]["cost_per_1m_infer"] == pytest.approx(0.185, abs=1e-3)
    assert document["trials"][2]["log_tail"] == "Traceback: <boom>"
    page = html_path.read_text()
    assert 'src="data:image/png;base64,' in page and "Pareto front" in page
    assert "Traceback: &lt;boom&gt;" in page and "over budget" in page
    assert verdict(result).startswith("best within SLO (p99_ms<=50): trial 2, 300.0 infer/s")


def test_the_verdict_shows_the_closest_when_nothing_met_the_slo() -> None:
    unmet = _record(1, 50.0, 90.0, 0.1, status="slo_unmet")
    text = verdict(_result([unmet], None, 1))
    assert text.startswith("SLO NOT MET (p99_ms<=50)") and "closest: trial 1" in text
    assert "p99 90.00 ms" in text
    page = html_report(_result([], None, None))
    assert "no trial produced a measurement" in page


def test_ctrl_c_keeps_what_was_measured_and_writes_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from click.testing import CliRunner

    from slipstream.tune import session
    from slipstream.tune.cli import EXIT_INTERRUPTED, tune

    build_add_sub(tmp_path)
    calls: list[dict[str, object]] = []

    def fake_trial(context: object, trial: int, config: dict[str, object]) -> TrialRecord:
        calls.append(config)
        if len(calls) == 3:
            raise KeyboardInterrupt
        record = _record(trial, 100.0 * trial, 10.0, 0.1)
        record.config = dict(config)
        return record

    monkeypatch.setattr(session, "run_trial", fake_trial)
    out = tmp_path / "out"
    result = CliRunner().invoke(
        tune,
        [str(tmp_path / "add_sub"), "--slo", "p99_ms=50", "--mode", "brute", "--out", str(out)],
    )
    assert result.exit_code == EXIT_INTERRUPTED, result.output
    document = json.loads((out / "tune.json").read_text())
    assert document["interrupted"] is True and len(document["trials"]) == 2
    assert document["winner"] == 2
    assert "Interrupted" in (out / "tune.html").read_text()


def test_a_winner_whose_remeasurement_misses_the_slo_leaves_the_leaderboard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from slipstream.tune import session
    from slipstream.tune.session import TuneOptions, run_tune
    from slipstream.tune.settings import Catalogue

    build_add_sub(tmp_path)
    # Trial 2 (batch 4) is the faster one measured once; measured again it breaks the
    # SLO (p99 80 ms > 50). Trial 1 (batch 1) meets it both times.
    first = {1: (100.0, 10.0), 2: (300.0, 20.0)}
    again = {1: (110.0, 14.0), 2: (40.0, 80.0)}
    seen: list[int] = []

    def fake_trial(context: object, trial: int, config: dict[str, object]) -> TrialRecord:
        throughput, p99 = (again if trial in seen else first)[trial]
        seen.append(trial)
        record = _record(trial, throughput, p99, 0.1, "ok" if p99 <= 50 else "slo_unmet")
        record.config = dict(config)
        return record

    monkeypatch.setattr(session, "run_trial", fake_trial)
    options = TuneOptions(
        model_dir=tmp_path / "add_sub", slo=parse_slo("p99_ms=50", None),
        catalogue=Catalogue(profiles=[HardwareProfile(name="cpu", cores=1, price_per_hour=0.1)]),
        work_dir=tmp_path / "work", mode="brute", batch_sizes=(1, 4), queue_delays_us=(0,),
        instances=(1,), threads=(1,), backends=("onnxruntime",), remeasure_top=2,
    )  # fmt: skip
    result = run_tune(options)
    assert sorted(seen) == [1, 1, 2, 2]
    missed = result.record(2)
    assert missed.status == "slo_unmet" and missed.score is not None and missed.score < 0
    assert missed.error.startswith("re-measurement 2 did not meet the SLO (closest level")
    assert missed.p99_ms == 80.0 and missed.throughput is None
    assert result.winner == 1 and result.leaderboard == [1] and result.pareto == [1]
    winner = result.record(1)
    # The throughput and the latencies reported are medians over the same two runs.
    assert winner.throughput == 105.0 and winner.spread_pct == pytest.approx(100 * 10 / 105)
    assert (winner.p50_ms, winner.p99_ms) == (6.0, 12.0)
    assert verdict(result).startswith(
        "best within SLO (p99_ms<=50): trial 1, 105.0 infer/s, p99 12.00 ms"
    )


def test_validation_rows_measure_the_drop_instead_of_the_record(tmp_path: Path) -> None:
    import numpy as np

    from slipstream.tune.variants import measure_drops

    build_add_sub(tmp_path)
    # Claimed drop 0.5 in its record; the file is the original's, so measured: 0.
    _optimized(tmp_path, 2, ["graph"], {"metric": "cosine", "after": {"mean_cosine": 0.5}})
    rng = np.random.default_rng(0)
    rows = {name: rng.standard_normal((20, 16)).astype(np.float32) for name in ("INPUT0", "INPUT1")}
    np.savez(tmp_path / "val.npz", **rows)  # type: ignore[arg-type]
    _, variants = find_variants(tmp_path / "add_sub")
    assert variants[1].accuracy_drop == 0.5
    measure_drops(variants, tmp_path / "val.npz")
    assert [(v.accuracy_drop, v.accuracy_metric, v.accuracy_source) for v in variants] == [
        (0.0, "cosine", "--validation"),
        (pytest.approx(0.0, abs=1e-6), "cosine", "--validation"),
    ]
    with pytest.raises(TuneInputError, match="--validation"):
        (tmp_path / "bad.npz").write_bytes(b"no")
        measure_drops(variants, tmp_path / "bad.npz")


def test_a_gpu_profile_is_skipped_for_a_cpu_backend(tmp_path: Path) -> None:
    from slipstream.tune.session import TuneOptions, plan_tune
    from slipstream.tune.settings import Catalogue, usable_cpus

    build_add_sub(tmp_path)
    catalogue = Catalogue(
        profiles=[
            HardwareProfile(name="cpu", cores=1, price_per_hour=0.1),
            HardwareProfile(name="gpu", cores=1, gpu="0", price_per_hour=1.0),
        ]
    )
    options = TuneOptions(
        model_dir=tmp_path / "add_sub", slo=parse_slo("p99_ms=5", None), catalogue=catalogue,
        work_dir=tmp_path / "work", backends=("onnxruntime",),
    )  # fmt: skip
    plan = plan_tune(options)
    assert plan.space.size == 60 and plan.priced
    [cpu, gpu] = plan.profiles
    assert cpu["skipped"] == "" and cpu["cpus"] == usable_cpus()[:1]
    assert gpu["skipped"].startswith("asks for GPU 0; the model's backend onnxruntime runs on")


def test_onnx_variants_are_also_tried_on_openvino(tmp_path: Path) -> None:
    from slipstream.tune.trials import write_trial_repository
    from slipstream.tune.variants import backend_variants

    build_add_sub(tmp_path)
    config, variants = find_variants(tmp_path / "add_sub")
    twins = backend_variants(variants, config, ["onnxruntime", "openvino"])
    assert [(v.name, v.backend) for v in twins] == [
        ("v1 original", ""),
        ("v1 original on openvino", "openvino"),
    ]
    assert backend_variants(variants, config, ["onnxruntime"]) == variants
    with pytest.raises(TuneInputError, match="--backends: unknown backend 'tensorrt'"):
        backend_variants(variants, config, ["tensorrt"])
    point = {"max_batch_size": 8, "max_queue_delay_us": 0, "instances": 1, "threads": 1}
    written = model_config({}, {**point, "backend": twins[1].backend})
    assert written["backend"] == "openvino"
    assert "backend" not in model_config({}, {**point, "backend": ""})
    # An OpenVINO IR variant brings its weights file into the trial's repository.
    ir = twins[0].model_file.with_name("model.xml")
    ir.write_text("<net/>")
    ir.with_suffix(".bin").write_bytes(b"weights")
    ir_variant = Variant("v1 ir", 1, ir, [], 0.0, "", "original", backend="openvino")
    repository = write_trial_repository(
        tmp_path / "trial", tmp_path / "add_sub", ir_variant, written
    )
    assert sorted(p.name for p in (repository / "add_sub" / "1").iterdir()) == [
        "model.bin",
        "model.xml",
    ]


def test_the_live_line_names_the_configuration_being_re_measured() -> None:
    """After the search, the progress line must not keep showing the last trial."""
    from io import StringIO

    from rich.console import Console

    from slipstream.tune.progress import RichTuneProgress

    out = StringIO()
    with RichTuneProgress(Console(file=out, width=200, force_terminal=False)) as progress:
        progress.started(space_size=12, max_trials=2)
        progress.trial_started(2, {"variant": "v1", "max_batch_size": 4})
        progress.remeasuring(1, {"variant": "v2", "max_batch_size": 16})
    text = out.getvalue()
    assert "re-measuring trial 1: variant=v2 max_batch_size=16" in text, text
    assert "trial 2: variant=v1" not in text.splitlines()[-1], text


def test_a_level_infinitely_far_from_the_slo_is_written_as_null(tmp_path: Path) -> None:
    """A level with failed requests has slo_ratio inf: tune.json (allow_nan=False)
    failed to write, now and then, in test_tune_cli."""
    record = _record(1, 0.0, 80.0, 0.1, status="slo_unmet")
    record.levels[0].slo_ratio = float("inf")
    json_path, _ = write_outputs(_result([record], None, 1), tmp_path)
    (trial,) = json.loads(json_path.read_text())["trials"]
    assert trial["levels"][0]["slo_ratio"] is None
