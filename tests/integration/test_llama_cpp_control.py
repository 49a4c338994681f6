"""Generative llama.cpp models under model control: indexed, loaded and unloaded at run
time in explicit mode, and a file that is not a GGUF refused without harming the rest."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from tests.llm_models import smollm2_gguf
from tests.models import write_config
from tests.utils import RemoteServer

pytest.importorskip("llama_cpp", reason="the llama extra is not installed")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_generative_models_are_indexed_loaded_and_unloaded_at_run_time(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    for name in ("first", "second"):
        (repo / name / "1").mkdir(parents=True)
        os.link(smollm2_gguf(), repo / name / "1" / "model.gguf")
        write_config(repo, name, {"backend": "llama_cpp", "generation": {"num_blocks": 16}})
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "1" / "model.gguf").write_bytes(b"GGML but not GGUF")
    write_config(repo, "broken", {"backend": "llama_cpp"})
    args = ["--model-control-mode", "explicit", "--load-model", "first"]
    with RemoteServer(repo, args, log_dir=tmp_path) as server:

        def index() -> dict[str, tuple[str, str, str]]:
            entries = server.http.post("/v2/repository/index", json={}).json()
            return {e["name"]: (e.get("version", ""), e.get("state", ""), e.get("reason", ""))
                    for e in entries}  # fmt: skip

        def served() -> list[str]:
            return sorted(m["id"] for m in server.http.get("/v1/models").json()["data"])

        def complete(model: str) -> httpx.Response:
            body = {"model": model, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True}
            return server.http.post("/v1/completions", json=body, timeout=60)

        assert index() == {"first": ("1", "READY", ""), "second": ("", "", ""),
                           "broken": ("", "", "")}  # fmt: skip
        assert served() == ["first"]
        not_loaded = complete("second")
        assert not_loaded.status_code == 404
        assert not_loaded.json()["error"]["message"] == (
            "model: 'second' is not loaded; load it with POST /v2/repository/models/second/load"
            " (model control mode explicit; in mode none, after a restart)"
        )

        load = server.http.post("/v2/repository/models/second/load", timeout=60)
        assert load.status_code == 200, load.text
        assert index()["second"] == ("1", "READY", "")
        assert served() == ["first", "second"]
        assert complete("second").json()["usage"]["completion_tokens"] == 3

        unload = server.http.post("/v2/repository/models/first/unload", timeout=60)
        assert unload.status_code == 200, unload.text
        assert index()["first"] == ("1", "UNAVAILABLE", "unloaded")  # as Triton lists it
        assert served() == ["second"]
        assert complete("first").status_code == 404

        bad = server.http.post("/v2/repository/models/broken/load", timeout=60)
        assert bad.status_code == 400
        assert "not a GGUF file" in bad.json()["error"]
        _version, state, reason = index()["broken"]
        assert state == "UNAVAILABLE" and "not a GGUF file" in reason
        # Nothing else was harmed.
        assert complete("second").status_code == 200
