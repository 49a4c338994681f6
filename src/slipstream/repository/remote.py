"""Model repositories in an object store, as Triton names them: ``s3://`` (S3 and
S3-compatible stores), ``gs://`` (Google Cloud Storage), ``as://`` (Azure Blob Storage);
:mod:`.stores` reads each.

The repository is copied to a local directory once before the server starts (the
models load from there, in every process layout), then brought up to date every
``--repository-poll-secs`` unless models never change (``--model-control-mode none``):
poll mode sees the copy change as it would a local directory (a model loads once its
files have settled), explicit mode loads what the last copy holds. Only what changed is
fetched (an object's ETag or generation, and its size, tell), each file written beside
the copy and moved into place whole, and files whose objects are gone are removed.

    mirror = open_mirror("s3://127.0.0.1:9000/models/prod", Path("/var/cache/slipstream"), None)
    mirror.directory                 # /var/cache/slipstream/repository
    mirror.sync()                    # what changed since
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from slipstream.repository.stores import SCHEMES, RepositoryError, Store, open_store

__all__ = ["RepositoryError", "RepositoryMirror", "SyncReport", "is_remote", "open_mirror"]

logger = logging.getLogger(__name__)

# Object key -> (ETag, size) of what the copy holds, kept beside it so that a restart
# with the same --repository-cache fetches only what changed.
_MANIFEST = "manifest.json"


def is_remote(value: str) -> bool:
    """Whether a --model-repository value names a cloud store rather than a directory."""
    return value.startswith(SCHEMES)


@dataclass(frozen=True, slots=True)
class SyncReport:
    """What one sync changed in the copy."""

    fetched: int
    fetched_bytes: int
    removed: int
    # Objects left out: keys that would land outside the copy ("..", absolute parts).
    refused: int


class RepositoryMirror:
    """A local copy of a repository in an object store under ``cache``
    (``cache/repository``, with the files being fetched in ``cache/incoming``), brought up
    to date by :meth:`sync`."""

    def __init__(self, store: Store, cache: Path) -> None:
        self._store = store
        self.directory = cache / "repository"
        self._incoming = cache / "incoming"
        self._manifest_path = cache / _MANIFEST
        self._held: dict[str, tuple[str, int]] = self._read_manifest()
        self._refused_keys: set[str] = set()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._incoming.mkdir(parents=True, exist_ok=True)

    def sync(self) -> SyncReport:
        """Fetch new and changed objects, remove files whose objects are gone.
        RepositoryError when the store cannot be listed or a file fetched."""
        listed = self._store.list()
        fetched = fetched_bytes = refused = 0
        wanted: dict[str, tuple[str, int]] = {}
        for key, etag, size in listed:
            relative = _relative(key, self._store.prefix)
            if relative is None:
                if key not in self._refused_keys:
                    self._refused_keys.add(key)
                    logger.warning("%s: object %r left out: its key leaves the repository",
                                   self._store, key)  # fmt: skip
                refused += 1
                continue
            if not relative:
                continue  # a "directory" marker
            wanted[relative] = (etag, size)
            target = self.directory / relative
            if self._held.get(relative) == (etag, size) and _has_size(target, size):
                continue
            self._fetch(key, target)
            self._held[relative] = (etag, size)
            fetched += 1
            fetched_bytes += size
        removed = 0
        for relative in sorted(set(self._held) - set(wanted)):
            _remove(self.directory, relative)
            del self._held[relative]
            removed += 1
        if fetched or removed:
            self._write_manifest()
        return SyncReport(fetched, fetched_bytes, removed, refused)

    def follow(self, interval_s: float, stop: threading.Event) -> threading.Thread:
        """Sync every ``interval_s`` on a daemon thread until ``stop`` is set; a failed
        sync is logged (once until it succeeds again) and retried at the next."""
        thread = threading.Thread(
            target=self._follow, args=(interval_s, stop), name="repository-mirror", daemon=True
        )
        thread.start()
        return thread

    def _follow(self, interval_s: float, stop: threading.Event) -> None:
        failing = ""
        while not stop.wait(interval_s):
            try:
                report = self.sync()
            except Exception as exc:  # the store's, or the disk's (full, read-only): the
                # thread goes on, or the copy would silently stop following the bucket
                if str(exc) != failing:
                    logger.warning("%s: %s; the local copy stays as it is until a sync "
                                   "succeeds", self._store, exc)  # fmt: skip
                    failing = str(exc)
                continue
            if failing:
                logger.info("%s: reachable again", self._store)
                failing = ""
            if report.fetched or report.removed:
                logger.info("%s: %d file(s) fetched (%d bytes), %d removed", self._store,
                            report.fetched, report.fetched_bytes, report.removed)  # fmt: skip

    def _fetch(self, key: str, target: Path) -> None:
        part = self._incoming / f"{os.getpid()}-{threading.get_ident()}.part"
        try:
            self._store.fetch(key, part)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(part, target)  # whole, never half-written, in the copy
        except Exception as exc:
            part.unlink(missing_ok=True)
            raise RepositoryError(f"{self._store}: cannot fetch {key!r}: {exc}") from exc

    def _read_manifest(self) -> dict[str, tuple[str, int]]:
        try:
            held = json.loads(self._manifest_path.read_text())
            return {str(k): (str(v[0]), int(v[1])) for k, v in held.items()}
        except (OSError, ValueError, TypeError, IndexError, AttributeError):
            return {}

    def _write_manifest(self) -> None:
        part = self._manifest_path.with_suffix(".part")
        part.write_text(json.dumps({k: list(v) for k, v in self._held.items()}))
        os.replace(part, self._manifest_path)


def _relative(key: str, prefix: str) -> str | None:
    """The key's path in the copy ("" for a directory marker); None for one that would
    land outside it (``..``, ``.``, empty or absolute parts, backslashes)."""
    rest = key[len(prefix) :]
    if not rest or rest.endswith("/"):
        return ""
    parts = rest.split("/")
    if any(part in ("", ".", "..") or "\\" in part or "\x00" in part for part in parts):
        return None
    return str(PurePosixPath(*parts))


def _has_size(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except OSError:
        return False


def _remove(root: Path, relative: str) -> None:
    """Remove a file of the copy, then the directories it leaves empty."""
    path = root / relative
    path.unlink(missing_ok=True)
    parent = path.parent
    while parent != root and parent.is_dir() and not any(parent.iterdir()):
        parent.rmdir()
        parent = parent.parent


def open_mirror(url: str, cache: Path | None, poll_s: float | None) -> RepositoryMirror:
    """The repository at ``url`` copied under ``cache`` (a temporary directory, removed
    at exit, when None); followed every ``poll_s`` when given. RepositoryError (naming
    the URL and the cause) when it cannot be read."""
    store = open_store(url)
    if cache is None:
        import atexit
        import tempfile

        cache = Path(tempfile.mkdtemp(prefix="slipstream-repository-"))
        atexit.register(shutil.rmtree, cache, True)
    started = time.perf_counter()
    mirror = RepositoryMirror(store, cache)
    report = mirror.sync()
    logger.info("%s: copied to %s: %d file(s), %d bytes fetched in %.1f s", store,
                mirror.directory, report.fetched, report.fetched_bytes,
                time.perf_counter() - started)  # fmt: skip
    if poll_s is not None:
        mirror.follow(poll_s, threading.Event())
    return mirror
