"""``slipstream tune`` as a user runs it, on add_sub with tiny trials (two or three real
servers each, levels of ~0.4 s): the files it writes, the accuracy budget, ``--apply``
picked up by a running server, an SLO nothing meets (exit 3, the closest shown) and a
trial whose server cannot load its model (recorded failed with its log tail).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from click.testing import CliRunner, Result

from slipstream.tune.cli import EXIT_SLO_UNMET, tune
from tests.models import build_add_sub, build_mean_embedding
from tests.utils import RemoteServer

pytestmark = pytest.mark.slow

TINY = [
    "--mode", "brute", "--queue-delays-us", "0", "--instances", "1", "--threads", "1",
    "--warmup-s", "0.1", "--window-s", "0.1", "--max-windows", "3", "--max-concurrency", "2",
    # The model's own backend only (with the openvino extra, each variant is tried on
    # OpenVINO too: tests/unit/test_tune_parts.py checks those twins).
    "--backends", "onnxruntime",
]  # fmt: skip


def _tune(*args: str) -> Result:
    return CliRunner().invoke(tune, [*TINY, *args], catch_exceptions=False)


def _document(out: Path) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((out / "tune.json").read_text())
    return document


def test_tune_reports_and_applies_the_winner_to_a_running_server(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    build_add_sub(repo)
    build_add_sub(repo, version=2)
    gate = {"metric": "agreement", "after": {"agreement_percent": 95.0}}
    record = {"passes": [{"name": "int8-dynamic"}], "gate": gate}
    (repo / "add_sub" / "2" / "optimization.json").write_text(json.dumps(record))
    out = tmp_path / "out"
    poll = ["--model-control-mode", "poll", "--repository-poll-secs", "0.3"]
    with RemoteServer(repo, poll, log_dir=tmp_path) as server:
        result = _tune(
            str(repo / "add_sub"), "--slo", "p99_ms=1000", "--batch-sizes", "1,4",
            "--max-accuracy-drop", "1", "--price-per-hour", "0.5", "--remeasure", "1",
            "--out", str(out), "--apply",
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        document = _document(out)
        [v1, v2] = document["variants"]
        assert v1["excluded"] == ""
        assert v2["excluded"] == ("accuracy drop 5 (agreement) is over --max-accuracy-drop 1")
        assert len(document["trials"]) == 2
        assert {t["status"] for t in document["trials"]} == {"ok"}
        assert {t["config"]["variant"] for t in document["trials"]} == {"v1 original"}
        winner = next(t for t in document["trials"] if t["trial"] == document["winner"])
        # Re-measured once: two runs, a spread, and bench's cost formula at their median.
        assert len(winner["throughput_runs"]) == 2 and winner["spread_pct"] is not None
        assert winner["cost_per_1m_infer"] == pytest.approx(
            0.5 / (winner["throughput_infer_per_s"] * 3600) * 1e6
        )
        level = winner["levels"][winner["chosen_level"]]
        assert level["cost_per_1m_infer"] is not None and level["p99_ms"] <= 1000
        assert document["applied_version"] == 3 and document["pareto"]
        page = (out / "tune.html").read_text()
        assert 'src="data:image/png;base64,' in page and "best within SLO" in page
        # The running server loads version 3 with the winner's batch size.
        ready = server.url("/v2/models/add_sub/versions/3/ready")
        deadline = time.monotonic() + 30
        while httpx.get(ready).status_code != 200:
            assert time.monotonic() < deadline, "version 3 not loaded:\n" + server.log_tail()
            time.sleep(0.2)
        config = httpx.get(server.url("/v2/models/add_sub/versions/3/config")).json()
        assert config["max_batch_size"] == winner["config"]["max_batch_size"]
    tuned = json.loads((repo / "add_sub" / "3" / "tuned.json").read_text())
    assert tuned["trial"] == document["winner"] and tuned["from_version"] == 1
    # add_sub had no config.yaml: there was none to keep as config.yaml.before-tune.
    assert not (repo / "add_sub" / "config.yaml.before-tune").exists()


def test_an_slo_nothing_meets_and_a_server_that_cannot_load(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    build_add_sub(repo)
    broken = repo / "add_sub" / "2" / "model.onnx"
    broken.parent.mkdir()
    broken.write_bytes(b"not an onnx file")
    out = tmp_path / "out"
    result = _tune(
        str(repo / "add_sub"), "--slo", "p99_ms=0.001", "--batch-sizes", "1",
        "--out", str(out),
    )  # fmt: skip
    assert result.exit_code == EXIT_SLO_UNMET, result.output
    assert "SLO NOT MET (p99_ms<=0.001)" in result.output
    document = _document(out)
    unmet, failed = sorted(document["trials"], key=lambda t: t["config"]["variant"])
    assert unmet["status"] == "slo_unmet" and document["closest"] == unmet["trial"]
    assert document["winner"] is None and document["leaderboard"] == []
    assert failed["status"] == "failed"
    assert failed["error"].startswith("the model failed to load")
    assert "INVALID_PROTOBUF" in failed["log_tail"]
    assert f"trial {failed['trial']} failed" in result.output
    assert "INVALID_PROTOBUF" in (out / "tune.html").read_text()


def test_bad_input_is_a_usage_error(tmp_path: Path) -> None:
    build_add_sub(tmp_path)
    result = _tune(str(tmp_path / "add_sub"), "--slo", "p99=5")
    assert result.exit_code == 2 and "--slo 'p99=5': expected FIGURE=MS" in result.output
    catalogue = tmp_path / "catalogue.yaml"
    catalogue.write_text("profiles: [{name: big, cores: 4096, price_per_hour: 1}]")
    result = _tune(str(tmp_path / "add_sub"), "--slo", "p99_ms=5", "--profiles", str(catalogue))
    assert (
        result.exit_code == 2 and "no hardware profile of the catalogue runs here" in result.output
    )


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--price-per-hour", "-1"), ("--price-per-hour", "nan"), ("--warmup-s", "-1"),
     ("--window-s", "0"), ("--window-s", "inf"), ("--min-throughput", "0")],
)  # fmt: skip
def test_an_out_of_range_number_is_a_usage_error_naming_its_flag(
    tmp_path: Path, flag: str, value: str
) -> None:
    build_add_sub(tmp_path)
    out = tmp_path / "out"
    result = _tune(str(tmp_path / "add_sub"), "--slo", "p99_ms=10", flag, value, "--out", str(out))
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{flag}'" in result.output
    assert not out.exists()  # refused before a trial ran


def test_inputs_bench_cannot_make_stop_the_tune_at_the_first_trial(tmp_path: Path) -> None:
    # Variable token dims and no --shape: every trial would fail the same way.
    build_mean_embedding(tmp_path, "embed", np.eye(8, dtype=np.float32))
    result = _tune(str(tmp_path / "embed"), "--slo", "p99_ms=50", "--out", str(tmp_path / "o"))
    assert result.exit_code == 2, result.output
    assert "input 'input_ids' has variable dims" in result.output
    assert "slipstream tune takes --shape and --input-data" in result.output
    assert not (tmp_path / "o" / "tune.json").exists()
