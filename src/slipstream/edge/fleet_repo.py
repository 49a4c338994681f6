"""The fleet's publisher: edge bundles in a TUF repository of static files.

The Update Framework (``tuf``, its Metadata API and securesystemslib's signers) does the
signing: one key per top-level role (root, targets, snapshot, timestamp), every file
versioned and expiring, so a device that trusts the first ``root.json`` refuses a file
nobody signed, a changed file, an expired one and an older one replayed. Layout::

    DIR/keys/<role>.pem              private keys (0600, in a 0700 directory; never served)
    DIR/public/metadata/N.root.json  the signed metadata, consistent snapshots:
                    N.targets.json, N.snapshot.json, timestamp.json (+ unversioned copies)
    DIR/public/targets/<sha256>.fleet.json                 the index: each model's newest
    DIR/public/targets/bundles/<model>/<sha256>.<model>-<version>.tar       the bundles
    DIR/devices.json                 the devices' last reports (``slipstream fleet serve``)

``DIR/public`` is what any static file server (or ``slipstream fleet serve``) serves.
Each publish signs new targets and snapshot metadata and a new timestamp, written in
that order (timestamp.json last, each by an atomic rename), so a device polling during a
publish sees the old repository or the new one.

Example::

    paths = FleetPaths.of(Path("fleet"))
    init_repository(paths)                       # keys and version-1 metadata
    publish_bundle(paths, Path("bundles/digits"))  # a bundle slipstream export wrote
"""

from __future__ import annotations

import io
import json
import logging
import os
import tarfile
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.serialization import load_pem_private_key
from securesystemslib.signer import CryptoSigner, SSlibKey
from tuf.api.metadata import (
    Metadata,
    MetaFile,
    Root,
    Signed,
    Snapshot,
    TargetFile,
    Targets,
    Timestamp,
)
from tuf.api.serialization.json import JSONSerializer

from slipstream.edge.manifest import bundle_files, verify_bundle

logger = logging.getLogger(__name__)

ROLES = ("root", "targets", "snapshot", "timestamp")
# The target a device reads first: which bundle is the newest of each model.
INDEX_TARGET = "fleet.json"
INDEX_FORMAT = "slipstream-fleet-index"
# Metadata files are pretty-printed: operators read them.
_SERIALIZER = JSONSerializer(compact=False)


class FleetRepoError(ValueError):
    """The repository cannot be changed as asked; the message names the file or the fix."""


@dataclass(frozen=True, slots=True)
class FleetPaths:
    """Where a fleet repository keeps its keys and its served files."""

    # The repository directory (``--repo``).
    repo: Path
    # The private keys (``--keys``; default DIR/keys): never under ``public``.
    keys: Path

    @classmethod
    def of(cls, repo: Path, keys: Path | None = None) -> FleetPaths:
        return cls(repo, keys if keys is not None else repo / "keys")

    @property
    def public(self) -> Path:
        """The directory a static file server serves."""
        return self.repo / "public"

    @property
    def metadata(self) -> Path:
        return self.public / "metadata"

    @property
    def targets(self) -> Path:
        return self.public / "targets"

    @property
    def devices(self) -> Path:
        return self.repo / "devices.json"


@dataclass(frozen=True, slots=True)
class Lifetimes:
    """How long each role's metadata stays valid after it is signed (days).

    The timestamp is short: a device that cannot get a fresh one within a day knows it
    may be shown a frozen repository (and says so); ``slipstream fleet refresh`` renews
    it and the snapshot without publishing (run it daily, e.g. from cron).
    """

    root_days: float = 365.0
    targets_days: float = 90.0
    snapshot_days: float = 7.0
    timestamp_days: float = 1.0
    # ``fleet refresh`` signs a new root version once the root has less left than this.
    root_renew_days: float = 30.0

    def expires(self, role: str) -> datetime:
        days = float(getattr(self, f"{role}_days"))
        return (datetime.now(UTC) + timedelta(days=days)).replace(microsecond=0)


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """One model of the fleet index (``fleet.json``)."""

    name: str
    version: int
    # The bundle's target path: "bundles/<name>/<name>-<version>.tar".
    target: str
    # edge, mobile or openvino (the bundle manifest's target).
    bundle_target: str


@dataclass(frozen=True, slots=True)
class PublishResult:
    """What ``publish_bundle`` signed."""

    entry: IndexEntry
    # The new versions of the targets, snapshot and timestamp metadata.
    targets_version: int
    timestamp_version: int
    bundle_bytes: int


def init_repository(paths: FleetPaths, lifetimes: Lifetimes | None = None) -> Path:
    """Make the four keys and the version-1 metadata; return the root.json to give
    devices (``slipstream edge --root``). FleetRepoError when DIR already holds one."""
    lifetimes = lifetimes or Lifetimes()
    if (paths.metadata / "1.root.json").exists() or any(
        (paths.keys / f"{role}.pem").exists() for role in ROLES
    ):
        raise FleetRepoError(f"--repo {paths.repo}: already a fleet repository (keys or root)")
    paths.keys.mkdir(parents=True, exist_ok=True)
    paths.keys.chmod(0o700)
    paths.metadata.mkdir(parents=True, exist_ok=True)
    paths.targets.mkdir(parents=True, exist_ok=True)
    signers = {role: CryptoSigner.generate_ed25519() for role in ROLES}
    for role, signer in signers.items():
        _write_private(paths.keys / f"{role}.pem", signer.private_bytes)
    root = Root(expires=lifetimes.expires("root"))
    for role, signer in signers.items():
        root.add_key(signer.public_key, role)
    repo = _Repository(
        paths,
        signers,
        Metadata(root),
        Metadata(Targets(expires=lifetimes.expires("targets"))),
        Metadata(Snapshot(expires=lifetimes.expires("snapshot"))),
        Metadata(Timestamp(expires=lifetimes.expires("timestamp"))),
    )
    repo.write_root()
    repo.write_index({})
    repo.commit(lifetimes, bump_targets=False)
    logger.info("fleet repository %s: keys in %s, metadata in %s", paths.repo, paths.keys,
                paths.metadata)  # fmt: skip
    return paths.metadata / "root.json"


def publish_bundle(
    paths: FleetPaths, bundle: Path, lifetimes: Lifetimes | None = None
) -> PublishResult:
    """Sign ``bundle`` (a directory ``slipstream export`` wrote) into the repository as
    its model's newest version. BundleError when the bundle fails its own manifest;
    FleetRepoError when the repository already has that version or a newer one."""
    lifetimes = lifetimes or Lifetimes()
    report = verify_bundle(bundle)  # BundleError names each missing or changed file
    manifest = report.manifest
    repo = _Repository.load(paths)
    index = repo.read_index()
    current = index.get(manifest.name)
    if current is not None and current.version >= manifest.version:
        raise FleetRepoError(
            f"{bundle}: {manifest.name} version {manifest.version} is not newer than the "
            f"published version {current.version}; export it with a higher --version "
            "(devices never go back to an older version)"
        )
    target = f"bundles/{manifest.name}/{manifest.name}-{manifest.version}.tar"
    data = pack_bundle(bundle)
    info = repo.add_target(target, data, {"model": manifest.name, "version": manifest.version,
                                          "bundle_target": manifest.target})  # fmt: skip
    entry = IndexEntry(manifest.name, manifest.version, info.path, manifest.target)
    repo.write_index({**index, manifest.name: entry})
    repo.commit(lifetimes, bump_targets=True)
    logger.info("published %s version %d (%d bytes) as target %s", manifest.name, manifest.version,
                len(data), target)  # fmt: skip
    return PublishResult(
        entry, repo.targets.signed.version, repo.timestamp.signed.version, len(data)
    )


def refresh_metadata(paths: FleetPaths, lifetimes: Lifetimes | None = None) -> int:
    """Sign the targets, snapshot and timestamp again (renewed expiry, nothing else
    changed), and a new root version once the root is within ``root_renew_days`` of its
    expiry; return the timestamp's version.

    The new root has the same keys, signed by the same root key: a device, which trusts
    the root before it, takes it as TUF's clients take any root rotation (N+1.root.json,
    checked against root N's keys and its own).
    """
    lifetimes = lifetimes or Lifetimes()
    repo = _Repository.load(paths)
    root = repo.root.signed
    if root.expires - datetime.now(UTC) < timedelta(days=lifetimes.root_renew_days):
        root.version += 1
        root.expires = lifetimes.expires("root")
        repo.root.signatures.clear()
        repo.write_root()
        logger.info("root version %d signed, expiring %s", root.version, root.expires)
    repo.commit(lifetimes, bump_targets=False)
    return repo.timestamp.signed.version


def read_index(data: bytes) -> dict[str, IndexEntry]:
    """The models of a fleet.json; ValueError when it is not one."""
    parsed = json.loads(data)
    if not isinstance(parsed, dict) or parsed.get("format") != INDEX_FORMAT:
        raise ValueError(f"{INDEX_TARGET}: not a {INDEX_FORMAT} document")
    return {name: IndexEntry(**entry) for name, entry in parsed["models"].items()}


def pack_bundle(bundle: Path) -> bytes:
    """The bundle as an uncompressed tar of its files (manifest.json included), in a
    fixed order with no owners or times, so one bundle always packs to the same bytes.
    (Model files are dense: gzip would save little and cost the device time.)"""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for name in ["manifest.json", *bundle_files(bundle)]:
            source = bundle / name
            info = tarfile.TarInfo(name)
            info.size = source.stat().st_size
            info.mode = 0o644
            with source.open("rb") as file:
                archive.addfile(info, file)
    return buffer.getvalue()


def _write_private(path: Path, data: bytes) -> None:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        file.write(data)


def write_atomic(path: Path, data: bytes) -> None:
    """Write beside, then rename: a server never serves half a file."""
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".", delete=False) as file:
        file.write(data)
    os.chmod(file.name, 0o644)
    os.replace(file.name, path)


class _Repository:
    """The four top-level metadata and their signers, as on disk."""

    def __init__(
        self,
        paths: FleetPaths,
        signers: dict[str, CryptoSigner],
        root: Metadata[Root],
        targets: Metadata[Targets],
        snapshot: Metadata[Snapshot],
        timestamp: Metadata[Timestamp],
    ) -> None:
        self.paths = paths
        self.signers = signers
        self.root = root
        self.targets = targets
        self.snapshot = snapshot
        self.timestamp = timestamp

    @classmethod
    def load(cls, paths: FleetPaths) -> _Repository:
        if not (paths.metadata / "root.json").is_file():
            raise FleetRepoError(
                f"--repo {paths.repo}: no {paths.metadata / 'root.json'}; make the repository "
                "first with slipstream fleet init --repo DIR"
            )
        root = _read(paths.metadata / "root.json", Root)
        signers = {role: _signer(paths.keys, role, root.signed) for role in ROLES}
        return cls(
            paths,
            signers,
            root,
            _read(paths.metadata / "targets.json", Targets),
            _read(paths.metadata / "snapshot.json", Snapshot),
            _read(paths.metadata / "timestamp.json", Timestamp),
        )

    def write_root(self) -> None:
        self.root.sign(self.signers["root"])
        data = self.root.to_bytes(_SERIALIZER)
        write_atomic(self.paths.metadata / f"{self.root.signed.version}.root.json", data)
        write_atomic(self.paths.metadata / "root.json", data)

    def add_target(self, path: str, data: bytes, custom: dict[str, Any]) -> TargetFile:
        """Store ``data`` as target ``path`` (under its hash: consistent snapshots)."""
        info = TargetFile.from_data(path, data, ["sha256"])
        info.unrecognized_fields["custom"] = custom
        directory, _, name = path.rpartition("/")
        stored = self.paths.targets / directory / f"{info.hashes['sha256']}.{name}"
        stored.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(stored, data)
        self.targets.signed.targets[path] = info
        return info

    def read_index(self) -> dict[str, IndexEntry]:
        info = self.targets.signed.targets.get(INDEX_TARGET)
        if info is None:
            return {}
        stored = self.paths.targets / f"{info.hashes['sha256']}.{INDEX_TARGET}"
        return read_index(stored.read_bytes())

    def write_index(self, models: dict[str, IndexEntry]) -> None:
        document = {
            "format": INDEX_FORMAT,
            "models": {name: _entry_dict(entry) for name, entry in sorted(models.items())},
        }
        data = (json.dumps(document, indent=2) + "\n").encode()
        self.add_target(INDEX_TARGET, data, {"models": len(models)})

    def commit(self, lifetimes: Lifetimes, bump_targets: bool) -> None:
        """Sign and write targets (when changed), then snapshot, then timestamp."""
        targets, snapshot, timestamp = (
            self.targets.signed, self.snapshot.signed, self.timestamp.signed,
        )  # fmt: skip
        if bump_targets:
            targets.version += 1
        targets.expires = lifetimes.expires("targets")
        self._write(self.targets, "targets", versioned=True)
        snapshot.meta["targets.json"] = MetaFile(version=targets.version)
        snapshot.version += 1
        snapshot.expires = lifetimes.expires("snapshot")
        self._write(self.snapshot, "snapshot", versioned=True)
        timestamp.snapshot_meta = MetaFile(version=snapshot.version)
        timestamp.version += 1
        timestamp.expires = lifetimes.expires("timestamp")
        self._write(self.timestamp, "timestamp", versioned=False)

    def _write(self, metadata: Metadata[Any], role: str, versioned: bool) -> None:
        metadata.signatures.clear()
        metadata.sign(self.signers[role])
        data = metadata.to_bytes(_SERIALIZER)
        if versioned:
            write_atomic(self.paths.metadata / f"{metadata.signed.version}.{role}.json", data)
        write_atomic(self.paths.metadata / f"{role}.json", data)


def _read(path: Path, kind: type[Signed]) -> Metadata[Any]:
    try:
        metadata: Metadata[Any] = Metadata.from_file(str(path))
    except (OSError, ValueError) as exc:
        raise FleetRepoError(f"{path}: cannot be read ({exc})") from None
    if not isinstance(metadata.signed, kind):
        raise FleetRepoError(f"{path}: holds {metadata.signed.type} metadata")
    return metadata


def _signer(keys: Path, role: str, root: Root) -> CryptoSigner:
    """The role's private key, checked against the public key root.json names."""
    path = keys / f"{role}.pem"
    if not path.is_file():
        raise FleetRepoError(
            f"{path}: missing; the {role} key is needed to sign (--keys names the directory)"
        )
    if path.stat().st_mode & 0o077:
        raise FleetRepoError(
            f"{path}: readable by others; a private key must be 0600 (chmod 600 {path})"
        )
    key = root.get_key(root.roles[role].keyids[0])
    if not isinstance(key, SSlibKey):
        raise FleetRepoError(f"root.json: the {role} key is not a key this publisher signs with")
    private = load_pem_private_key(path.read_bytes(), None)
    signer = CryptoSigner(private, key)
    if SSlibKey.from_crypto(private.public_key()).keyval != key.keyval:
        raise FleetRepoError(f"{path}: not the {role} key root.json names (wrong --keys?)")
    return signer


def _entry_dict(entry: IndexEntry) -> dict[str, Any]:
    return {
        "name": entry.name,
        "version": entry.version,
        "target": entry.target,
        "bundle_target": entry.bundle_target,
    }
