"""The engine journal (server/journal.py) carries what a restart must not undo from one
engine's model manager to the next one's: models asleep stay asleep, and a model whose
failed reload kept its earlier version serving serves that version again."""

from __future__ import annotations

import asyncio
from pathlib import Path

from slipstream.config import ServerSettings
from slipstream.server.journal import EngineJournal
from slipstream.serving.core import ModelServer
from slipstream.serving.manager import ModelManager
from tests.models import build_add_sub


async def _journaled(models: ModelManager, path: Path) -> None:
    """Let the engine's journal watcher see ``models`` once and save what it sees."""
    started: asyncio.Task[None] = asyncio.create_task(asyncio.sleep(0))
    watch = asyncio.create_task(EngineJournal(path).watch(models, started))
    await asyncio.sleep(0.1)
    watch.cancel()


async def test_a_model_asleep_stays_asleep_in_the_next_engine_and_answers_metadata(
    tmp_path: Path,
) -> None:
    repo = tmp_path / "models"
    build_add_sub(repo, "napper")
    build_add_sub(repo, "awake")
    before = ModelServer(ServerSettings(model_repository=repo, idle_unload_seconds=5))
    await before.models.load_all()
    assert await before.models.sleep("napper")
    await _journaled(before.models, tmp_path / "state.json")
    await before.stop()

    after = ModelServer(ServerSettings(model_repository=repo, idle_unload_seconds=5))
    assert EngineJournal(tmp_path / "state.json").restore_models(after.models) == {"napper"}
    await after.models.load_all()
    await after.models.poll_once()
    await after.models.poll_once()  # files seen unchanged twice: a poll would load now
    assert after.models.loaded_versions("napper") == []
    assert after.models.loaded_versions("awake") == ["1"]
    states = {(e.name, e.version, e.state, e.reason) for e in after.models.index()}
    assert ("napper", "1", "UNAVAILABLE", "idle") in states
    metadata, config = after.models.sleeping_version("napper", "")
    assert (metadata.name, [t.name for t in metadata.inputs]) == ("napper", ["INPUT0", "INPUT1"])
    assert config.input[0].name == "INPUT0"
    await after.models.wake("napper", 30)  # its next request loads it, as before
    assert after.models.loaded_versions("napper") == ["1"]
    await after.stop()


async def test_a_version_kept_after_a_failed_reload_serves_in_the_next_engine(
    tmp_path: Path,
) -> None:
    repo = tmp_path / "models"
    build_add_sub(repo, "mlp", version=1)
    before = ModelServer(ServerSettings(model_repository=repo))
    await before.models.load_all()
    (repo / "mlp" / "2").mkdir()
    (repo / "mlp" / "2" / "model.onnx").write_bytes(b"not a model")
    await before.models.load("mlp")
    assert before.models.loaded_versions("mlp") == ["1"]
    await _journaled(before.models, tmp_path / "state.json")
    await before.stop()

    after = ModelServer(ServerSettings(model_repository=repo))
    EngineJournal(tmp_path / "state.json").restore_models(after.models)
    await after.models.load_all()
    assert after.models.loaded_versions("mlp") == ["1"]
    states = [(e.version, e.state) for e in after.models.index()]
    assert states == [("1", "READY"), ("2", "UNAVAILABLE")]
    assert not after.models.has_failures()  # still ready, as before the restart
    await after.stop()


async def test_without_the_kept_versions_on_disk_the_model_fails_as_before(
    tmp_path: Path,
) -> None:
    repo = tmp_path / "models"
    (repo / "mlp" / "2").mkdir(parents=True)
    (repo / "mlp" / "2" / "model.onnx").write_bytes(b"not a model")
    journal = EngineJournal(tmp_path / "state.json")
    journal.kept = {"mlp": [1]}
    after = ModelServer(ServerSettings(model_repository=repo))
    journal.restore_models(after.models)
    await after.models.load_all()
    assert after.models.loaded_versions("mlp") == []
    assert after.models.has_failures()
    await after.stop()
