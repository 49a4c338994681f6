"""The device's side of the fleet repository: what is published, downloaded through TUF.

``tuf.ngclient.Updater`` does every check: the root this device was given is the only
source of trust, each metadata file must be signed by its role's keys, newer than (or as
new as) what the device trusted before, and not expired, and each download must have the
length and SHA-256 the signed targets metadata gives. What it refuses raises; nothing
unverified is ever written where the server reads it. Blocking (urllib3): the agent runs
it in a thread. Example::

    client = FleetClient("http://publisher:8700", Path("models/.fleet"), root_bytes)
    sync = client.open()                   # refresh: root, timestamp, snapshot, targets
    index = sync.index()                   # {"digits": IndexEntry(version=3, ...)}
    bundle = sync.fetch_bundle(index["digits"])   # verified, unpacked, manifest checked
"""

from __future__ import annotations

import logging
import shutil
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

import urllib3
from tuf.api import exceptions as tuf_errors
from tuf.ngclient import Updater
from tuf.ngclient.fetcher import FetcherInterface
from tuf.ngclient.urllib3_fetcher import Urllib3Fetcher

from slipstream.edge.fleet_repo import INDEX_TARGET, IndexEntry, read_index
from slipstream.edge.manifest import BundleError, verify_bundle

logger = logging.getLogger(__name__)


# A download that did not complete: the publisher is down, the network is, or it is slow.
_NETWORK_ERRORS = (tuf_errors.DownloadError, urllib3.exceptions.HTTPError, OSError)
# True while this client's requests run (in their thread's context only).
_IN_FLEET_REQUEST: ContextVar[bool] = ContextVar("slipstream_fleet_request", default=False)


class _QuietRetries(logging.Filter):
    """Drops urllib3's "Retrying (...)" warnings of the fleet client's requests: a poll
    that fails is logged once, by the agent, with its cause. urllib3's other users in the
    process keep theirs (the filter looks at the context the record is logged in)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (_IN_FLEET_REQUEST.get() and str(record.msg).startswith("Retrying"))


_QUIET_RETRIES = _QuietRetries()


@contextmanager
def _fleet_requests() -> Iterator[None]:
    token = _IN_FLEET_REQUEST.set(True)
    try:
        yield
    finally:
        _IN_FLEET_REQUEST.reset(token)


class FleetSyncError(RuntimeError):
    """A sync step failed; the message names the step and the cause (TUF's refusal, a
    network error, a bundle that fails its manifest)."""


@dataclass(frozen=True, slots=True)
class FleetDirs:
    """The device's fleet state, beside the models (hidden: the repository skips it)."""

    # DIR/.fleet
    root: Path

    @property
    def metadata(self) -> Path:
        """TUF's trusted metadata (root history, timestamp, snapshot, targets)."""
        return self.root / "metadata"

    @property
    def downloads(self) -> Path:
        """Verified target files (the index, bundle tars)."""
        return self.root / "downloads"

    @property
    def staging(self) -> Path:
        """Bundles unpacked and checked before they are installed."""
        return self.root / "staging"

    @property
    def trusted_root(self) -> Path:
        """The root.json this device was provisioned with (``--root``)."""
        return self.root / "trusted_root.json"


class FleetClient:
    """Opens one TUF session per sync (an Updater refreshes once, as ngclient intends)."""

    def __init__(
        self,
        url: str,
        dirs: FleetDirs,
        timeout_s: int = 10,
        fetcher: FetcherInterface | None = None,
    ) -> None:
        """``fetcher``: how files are fetched (default: urllib3 with ``timeout_s``)."""
        self.url = url.rstrip("/")
        self.dirs = dirs
        self._fetcher = fetcher or Urllib3Fetcher(socket_timeout=timeout_s)
        # urllib3 logs its retries there (addFilter adds a filter once).
        logging.getLogger("urllib3.connectionpool").addFilter(_QUIET_RETRIES)

    def open(self) -> FleetSync:
        """A refreshed session; FleetSyncError when the metadata is refused or unreachable."""
        for directory in (self.dirs.metadata, self.dirs.downloads, self.dirs.staging):
            directory.mkdir(parents=True, exist_ok=True)
        try:
            updater = Updater(
                metadata_dir=str(self.dirs.metadata),
                metadata_base_url=f"{self.url}/metadata/",
                target_dir=str(self.dirs.downloads),
                target_base_url=f"{self.url}/targets/",
                fetcher=self._fetcher,
                bootstrap=self.dirs.trusted_root.read_bytes(),
            )
        except tuf_errors.RepositoryError as exc:  # DeserializationError included
            # slipstream edge checks it at start: this is a file changed since.
            raise FleetSyncError(f"{self.dirs.trusted_root} refused: {_cause(exc)}") from None
        try:
            with _fleet_requests():
                updater.refresh()
        except tuf_errors.RepositoryError as exc:
            raise FleetSyncError(f"fleet metadata refused: {_cause(exc)}") from None
        except _NETWORK_ERRORS as exc:
            raise FleetSyncError(
                f"fleet repository unreachable at {self.url}: {_cause(exc)}"
            ) from None
        return FleetSync(updater, self.dirs)


class FleetSync:
    """One refreshed view of the fleet repository."""

    def __init__(self, updater: Updater, dirs: FleetDirs) -> None:
        self._updater = updater
        self._dirs = dirs

    def index(self) -> dict[str, IndexEntry]:
        """The published models (empty before the first publish)."""
        path = self._download(INDEX_TARGET)
        if path is None:
            return {}
        try:
            return read_index(path.read_bytes())
        except (ValueError, TypeError, KeyError) as exc:
            raise FleetSyncError(f"{INDEX_TARGET}: not a fleet index ({exc})") from None

    def fetch_bundle(self, entry: IndexEntry) -> Path:
        """The entry's bundle, downloaded (verified by TUF), unpacked into staging and
        checked against its manifest, which must name the same model and version."""
        tar = self._download(entry.target)
        if tar is None:
            raise FleetSyncError(f"{entry.target}: in the index but not in the signed targets")
        return unpack_bundle(tar, self._dirs.staging / entry.name, entry)

    def _download(self, target: str) -> Path | None:
        """A verified local copy of ``target`` (downloaded unless already cached)."""
        try:
            with _fleet_requests():
                info = self._updater.get_targetinfo(target)
                if info is None:
                    return None
                cached = self._updater.find_cached_target(info)
                return Path(cached or self._updater.download_target(info))
        except (tuf_errors.RepositoryError, *_NETWORK_ERRORS) as exc:
            raise FleetSyncError(f"{target} refused: {_cause(exc)}") from None


def unpack_bundle(tar: Path, staged: Path, entry: IndexEntry) -> Path:
    """Unpack ``tar`` into ``staged`` and check it against its manifest, which must name
    the entry's model and version; FleetSyncError names what is wrong (nothing is left)."""
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    try:
        with tarfile.open(tar, mode="r:") as archive:
            archive.extractall(staged, filter="data")
        manifest = verify_bundle(staged).manifest
        if (manifest.name, manifest.version) != (entry.name, entry.version):
            raise BundleError(
                f"its manifest says {manifest.name} version {manifest.version}, the index "
                f"{entry.name} version {entry.version}"
            )
    except (tarfile.TarError, OSError, BundleError) as exc:
        shutil.rmtree(staged, ignore_errors=True)
        raise FleetSyncError(f"bundle {entry.target} refused: {exc}") from None
    return staged


def _cause(exc: BaseException) -> str:
    """TUF's refusal by its name (the class says which check failed); anything else with
    the innermost exception it was raised from, the reason (tuf's SlowRetrievalError, which
    has no message, also wraps a refused connection: its name alone would mislead)."""
    kind = {
        tuf_errors.UnsignedMetadataError: "not signed by the trusted keys",
        tuf_errors.ExpiredMetadataError: "expired metadata",
        tuf_errors.BadVersionNumberError: "an older version than the one trusted (replay)",
        tuf_errors.LengthOrHashMismatchError: "length or sha256 differs from the signed one",
        tuf_errors.DownloadLengthMismatchError: "longer than the signed length",
        tuf_errors.DownloadHTTPError: "HTTP error",
    }
    for cls, what in kind.items():
        if isinstance(exc, cls):
            return f"{what} ({_describe(exc)})"
    inner = _innermost(exc)
    if inner is exc or not str(exc):
        return _describe(inner)
    return f"{_describe(exc)} ({_describe(inner)})"


def _innermost(exc: BaseException) -> BaseException:
    """The end of ``exc``'s __cause__ / __context__ chain."""
    seen = {id(exc)}
    while True:
        inner = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
        if inner is None or id(inner) in seen:
            return exc
        seen.add(id(inner))
        exc = inner


def _describe(exc: BaseException) -> str:
    message = str(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__
