"""The device agent: keeps a device's models at the fleet's newest signed bundles.

One loop, beside the server in the same process (``slipstream edge``), each round::

    sync     TUF refresh, the index, each newer bundle downloaded and verified by TUF,
             unpacked, checked against its manifest and by its own samples (a thread)
    install  the new version's directory beside the serving one; the serving core loads
             it beside the old and swaps in one step (no request is dropped), then the
             samples run through the server on the new version; a failure on either
             puts the old files back and reloads them (rolled back)
    report   POST the device's state to the publisher (/v2/fleet/devices/<id>)

A round that fails (publisher unreachable, metadata refused) changes nothing that
serves: the loop waits twice as long each time (with jitter, up to ``max_backoff_s``) and
tries again. Example::

    agent = FleetAgent(AgentSettings("http://publisher:8700", Path("models"), "cam-7"))
    await serve(settings, companions=[agent.run])
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import shutil
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import urllib3

from slipstream.edge.fleet_client import FleetClient, FleetDirs, FleetSyncError
from slipstream.edge.fleet_repo import IndexEntry, write_atomic
from slipstream.edge.manifest import BundleError, read_manifest
from slipstream.edge.samples import check_samples, compare_samples, read_samples
from slipstream.errors import SlipstreamError
from slipstream.serving.core import ModelServer
from slipstream.types import InferRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AgentSettings:
    """What ``slipstream edge``'s options give the agent."""

    # The fleet repository's base URL (metadata/ and targets/ under it).
    fleet_url: str
    # The device's model repository (the server's --model-repository).
    repository: Path
    device_id: str
    # Where reports go ("" = fleet_url): POST <report_url>/v2/fleet/devices/<id>.
    report_url: str = ""
    poll_s: float = 30.0
    max_backoff_s: float = 300.0
    # The models this device follows (empty: every published model).
    models: tuple[str, ...] = ()
    # Socket timeout of each download and report.
    timeout_s: int = 10


@dataclass(slots=True)
class ModelStatus:
    """One model on the device."""

    # The version serving (None: none installed yet).
    version: int | None = None
    # The version before it, whose files stay for a rollback.
    previous: int | None = None
    # serving | rolled back | refused
    state: str = "serving"
    # Why the last newer version was refused or rolled back ("" when none was).
    error: str = ""


@dataclass(slots=True)
class DeviceState:
    """What the device reports (the body of POST /v2/fleet/devices/<id>)."""

    device_id: str
    fleet_url: str
    models: dict[str, ModelStatus] = field(default_factory=dict)
    # UTC ISO 8601 of the last round that reached the repository and verified it.
    last_sync: str | None = None
    last_error: str = ""
    last_error_at: str | None = None
    # Rounds failed in a row (0 after a good one); the wait before the next doubles each.
    failures_in_row: int = 0

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=2).encode()


class FleetAgent:
    """See the module docstring; ``run`` is the companion task of the edge server."""

    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        self.dirs = FleetDirs(settings.repository / ".fleet")
        self.client = FleetClient(settings.fleet_url, self.dirs, settings.timeout_s)
        self.state = DeviceState(settings.device_id, settings.fleet_url)
        # Bundles that failed their own check: signed and intact, they will not change,
        # so they are not fetched again (the publisher publishes a newer version).
        self._refused: dict[tuple[str, int], str] = {}
        self._http = urllib3.PoolManager(timeout=settings.timeout_s, retries=False)
        for name, version in installed_versions(settings.repository).items():
            self.state.models[name] = ModelStatus(version)

    async def run(self, service: ModelServer) -> None:
        """Sync, report, wait; forever (cancelled at shutdown)."""
        logger.info("fleet agent %s: following %s every %.0f s", self.settings.device_id,
                    self.settings.fleet_url, self.settings.poll_s)  # fmt: skip
        while True:
            try:
                await self.sync_once(service)
            except Exception as exc:  # a bug must not stop the updates or the server
                logger.exception("fleet agent: the round failed; retrying")  # once, traced
                self._failed(f"{type(exc).__name__}: {exc}", logged=True)
            await self.report()
            await asyncio.sleep(self.next_delay_s())

    def next_delay_s(self) -> float:
        """poll_s after a good round; after failures, twice as long each, with jitter."""
        failures = self.state.failures_in_row
        if failures == 0:
            return self.settings.poll_s
        wait = min(self.settings.max_backoff_s, self.settings.poll_s * 2.0**failures)
        return wait * random.uniform(0.5, 1.0)

    async def sync_once(self, service: ModelServer) -> bool:
        """One round; True when everything published was verified and what was newer
        installed (or refused for a reason of its own, recorded with the model)."""
        try:
            ready = await asyncio.to_thread(self._fetch)
        except FleetSyncError as exc:
            return self._failed(str(exc))
        self.state.last_sync = _now()
        self.state.failures_in_row = 0
        for entry, staged in ready:
            await self._install(service, entry, staged)
        return True

    def _failed(self, error: str, logged: bool = False) -> bool:
        if not logged:
            logger.warning("fleet agent: %s; serving what was installed, retrying", error)
        self.state.last_error, self.state.last_error_at = error, _now()
        self.state.failures_in_row += 1
        return False

    def _refuse(self, entry: IndexEntry, error: str, state: str) -> None:
        logger.error("fleet agent: %s version %d %s: %s", entry.name, entry.version, state, error)
        status = self.state.models.setdefault(entry.name, ModelStatus(state=""))
        status.state, status.error = state, f"version {entry.version}: {error}"
        self.state.last_error = f"{entry.name} version {entry.version} {state}: {error}"
        self.state.last_error_at = _now()

    # -- sync (a thread: TUF's client blocks) --------------------------------------------

    def _fetch(self) -> list[tuple[IndexEntry, Path]]:
        """The newer bundles, verified, unpacked and passing their own samples."""
        sync = self.client.open()
        ready = []
        for entry in sync.index().values():
            if self.settings.models and entry.name not in self.settings.models:
                continue
            current = self.state.models.get(entry.name)
            if current is not None and (current.version or 0) >= entry.version:
                continue
            if (entry.name, entry.version) in self._refused:
                continue
            try:
                staged = sync.fetch_bundle(entry)
                problems = check_samples(staged)
            except FleetSyncError as exc:
                # Wrong bytes on the server: fetched again next round (it may be fixed).
                raise FleetSyncError(f"{entry.name} version {entry.version}: {exc}") from None
            except (BundleError, SlipstreamError, OSError, ValueError) as exc:
                problems = [f"{type(exc).__name__}: {exc}"]
            if problems:
                shutil.rmtree(staged, ignore_errors=True)
                reason = "failed its own sample check: " + "; ".join(problems)
                self._refused[entry.name, entry.version] = reason
                self._refuse(entry, reason, "refused")
                continue
            ready.append((entry, staged))
        return ready

    # -- install, check, switch or roll back (the event loop) ----------------------------

    async def _install(self, service: ModelServer, entry: IndexEntry, staged: Path) -> None:
        model_dir = self.settings.repository / entry.name
        status = self.state.models.get(entry.name)
        backup = self.dirs.root / "previous" / entry.name
        shutil.rmtree(backup, ignore_errors=True)
        backup.mkdir(parents=True)
        if model_dir.exists():
            # The serving version's directory stays; its config and samples step aside.
            for item in model_dir.iterdir():
                if not item.name.isdigit():
                    item.rename(backup / item.name)
        else:
            model_dir.mkdir()
        for item in staged.iterdir():
            item.rename(model_dir / item.name)
        shutil.rmtree(staged, ignore_errors=True)
        problems = await self._load_and_check(service, entry, model_dir)
        if problems:
            self._refused[entry.name, entry.version] = problems
            await self._roll_back(service, entry, model_dir, backup)
            self._refuse(entry, problems, "rolled back")
            return
        previous = status.version if status is not None else None
        self.state.models[entry.name] = ModelStatus(entry.version, previous)
        _prune(model_dir, keep={entry.version, previous})
        shutil.rmtree(backup, ignore_errors=True)
        was = "first install" if previous is None else f"was version {previous}"
        logger.info("fleet agent: %s version %d serving (%s)", entry.name, entry.version, was)

    async def _load_and_check(
        self, service: ModelServer, entry: IndexEntry, model_dir: Path
    ) -> str:
        """Load the new version beside the old (the swap is one step), then run the
        samples through the server on it; why it failed, or ""."""
        try:
            await service.models.load(entry.name)
        except SlipstreamError as exc:
            return f"the server did not load it: {exc}"
        failure = service.models.failures(entry.name)
        if failure:
            return f"the server did not load it: {failure}"
        if str(entry.version) not in service.models.loaded_versions(entry.name):
            return "the server loaded another version (is the version newest on disk?)"
        manifest = read_manifest(model_dir)
        inputs, expected = read_samples(model_dir, manifest)
        request = InferRequest(entry.name, str(entry.version), inputs)
        try:
            response = await service.infer(request)
        except SlipstreamError as exc:
            return f"the samples failed on the server: {exc}"
        problems = compare_samples(expected, response.outputs, "the server")
        return "sample check on the server: " + "; ".join(problems) if problems else ""

    async def _roll_back(
        self, service: ModelServer, entry: IndexEntry, model_dir: Path, backup: Path
    ) -> None:
        """Put the previous files back and load them (beside the new version, swapped in
        one step); a first install is removed."""
        for item in list(model_dir.iterdir()):
            if item.name == str(entry.version) or not item.name.isdigit():
                shutil.rmtree(item) if item.is_dir() else item.unlink()
        for item in backup.iterdir():
            item.rename(model_dir / item.name)
        shutil.rmtree(backup, ignore_errors=True)
        if any(item.name.isdigit() for item in model_dir.iterdir()):
            await service.models.load(entry.name)
        else:
            await service.models.unload(entry.name)
            shutil.rmtree(model_dir, ignore_errors=True)

    # -- report ------------------------------------------------------------------------

    async def report(self) -> None:
        """POST the state to the publisher; a failure is logged (the next round retries)."""
        body = self.state.to_json()
        # Whole or not at all: a reader (an operator's tool, a test) never sees it empty.
        write_atomic(self.dirs.root / "state.json", body)
        base = (self.settings.report_url or self.settings.fleet_url).rstrip("/")
        url = f"{base}/v2/fleet/devices/{self.settings.device_id}"
        try:
            reply = await asyncio.to_thread(
                self._http.request, "POST", url, body=body,
                headers={"content-type": "application/json"},
            )  # fmt: skip
        except urllib3.exceptions.HTTPError as exc:
            # After a round that failed, the publisher's being down was just logged.
            logged = self.state.failures_in_row > 0 and base == self.settings.fleet_url.rstrip("/")
            level = logging.DEBUG if logged else logging.INFO
            logger.log(level, "fleet agent: report to %s failed: %s", url, exc)
            return
        if reply.status >= 300:
            logger.warning("fleet agent: report to %s answered %d", url, reply.status)


def installed_versions(repository: Path) -> dict[str, int]:
    """Each installed bundle's version (from its manifest.json), by model."""
    found = {}
    if repository.is_dir():
        for model_dir in sorted(repository.iterdir()):
            if model_dir.name.startswith(".") or not (model_dir / "manifest.json").is_file():
                continue
            try:
                found[model_dir.name] = read_manifest(model_dir).version
            except BundleError as exc:
                logger.warning("fleet agent: %s", exc)
    return found


def _prune(model_dir: Path, keep: set[int | None]) -> None:
    """Remove version directories other than ``keep`` (the serving one and the one before)."""
    for item in model_dir.iterdir():
        if item.is_dir() and item.name.isdigit() and int(item.name) not in keep:
            shutil.rmtree(item)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
