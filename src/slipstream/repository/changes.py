"""Noticing that a model's files changed, and when a change has settled.

A copy into the repository is not atomic: ``cp -r``, ``rsync`` or an upload writes a
version directory file by file, and each file in pieces. Polling loads a model only once
its fingerprint (every file's size and modification time) is the same on two consecutive
polls, so a half-written file is never loaded, and retries a failed load only when the
files change again, so a broken version is neither retried nor logged on every poll.

    previous = {}                                   # what the last poll saw
    current = {name: fingerprint(path) for ...}     # what this poll sees
    decision = settled_changes(previous, current, attempted)
    # load decision.load now; decision.noticed are changes first seen by this poll
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from slipstream.config import ModelConfig
from slipstream.repository.layout import CONFIG_FILES, version_number

# (path relative to the model directory, size_bytes, mtime_ns, inode); the inode tells a
# file replaced by rename (``mv`` of a finished copy) within one mtime tick. -1s when it
# could not be read (vanished mid-scan, a dangling link).
FileStamp = tuple[str, int, int, int]


@dataclass(frozen=True, slots=True)
class ModelFingerprint:
    """What a model directory holds, precisely enough to notice any change to a file."""

    # Stamps of the config file(s); empty when the model has none.
    config: tuple[FileStamp, ...]
    # (version number, stamps of every file under the version directory), ascending.
    versions: tuple[tuple[int, tuple[FileStamp, ...]], ...]

    def version(self, number: int) -> tuple[FileStamp, ...] | None:
        """The stamps of one version directory; None when it does not exist."""
        for found, stamps in self.versions:
            if found == number:
                return stamps
        return None


@dataclass(frozen=True, slots=True)
class PollDecision:
    """What one poll should do about the models it found."""

    # Changed since their last load attempt and unchanged since the previous poll.
    load: list[str]
    # Changed since their last load attempt, and first seen changing by this poll (for a
    # log line per change rather than per poll).
    noticed: list[str]


def with_override(found: ModelFingerprint, override: ModelConfig) -> ModelFingerprint:
    """``found`` with a load request's config override counted as one more config file:
    a changed override reloads every version, as a changed config.yaml does."""
    digest = hashlib.blake2b(override.model_dump_json().encode(), digest_size=8).digest()
    stamp: FileStamp = ("parameters.config", int.from_bytes(digest, "big"), 0, 0)
    return dataclasses.replace(found, config=(*found.config, stamp))


def fingerprint(model_dir: Path) -> ModelFingerprint:
    """Stamp the config and every file of every version directory of one model."""
    config = tuple(_stamp(model_dir, model_dir / name) for name in CONFIG_FILES)
    versions = []
    for entry in _list(model_dir):
        number = version_number(entry.name)
        if number is not None and entry.is_dir():
            versions.append((number, _stamp_tree(model_dir, entry)))
    return ModelFingerprint(
        config=tuple(stamp for stamp in config if stamp[3] != -1),
        versions=tuple(sorted(versions)),
    )


def settled_changes(
    previous: Mapping[str, ModelFingerprint],
    current: Mapping[str, ModelFingerprint],
    attempted: Mapping[str, ModelFingerprint | None],
) -> PollDecision:
    """Which models to load now, given the last poll's, this poll's and the last tried files.

    A model is loaded when its files differ from those of its last load attempt (or it was
    never tried) and are the same as one poll interval ago: still changing means still
    being written. A load that failed is not tried again until the files change.
    """
    load, noticed = [], []
    for name, seen in current.items():
        tried = attempted.get(name)
        if seen == tried:
            continue
        before = previous.get(name)
        if before == seen:
            load.append(name)
        elif before == tried or name not in previous:
            noticed.append(name)
    return PollDecision(load=load, noticed=noticed)


def changed_versions(before: ModelFingerprint | None, after: ModelFingerprint) -> list[str]:
    """Names of what differs ("config", version numbers), for log lines and reasons."""
    if before is None:
        return ["new model"]
    names = ["config"] if before.config != after.config else []
    numbers = {n for n, _ in before.versions} | {n for n, _ in after.versions}
    names.extend(str(n) for n in sorted(numbers) if before.version(n) != after.version(n))
    return names


def _list(directory: Path) -> list[Path]:
    try:
        return sorted(directory.iterdir())
    except OSError:
        return []


def _stamp(root: Path, path: Path) -> FileStamp:
    relative = path.relative_to(root).as_posix()
    try:
        info = path.stat()
    except OSError:
        return (relative, -1, -1, -1)
    return (relative, info.st_size, info.st_mtime_ns, info.st_ino)


def _stamp_tree(root: Path, directory: Path) -> tuple[FileStamp, ...]:
    """Every file under ``directory`` (a SavedModel or a TorchScript folder has several)."""
    stamps = [_stamp(root, directory)]
    for folder, _dirs, files in os.walk(directory):
        stamps.extend(_stamp(root, Path(folder) / name) for name in files)
    return tuple(sorted(stamps))
