"""A bundle's ``manifest.json``: what it holds, checked file by file.

The manifest lists every file of the bundle but itself, each with its size and SHA-256,
so a device (or ``slipstream export verify``) can tell a complete, unchanged bundle from
a truncated download or an edited file, and name the file::

    manifest = read_manifest(Path("minilm-mobile"))
    report = verify_bundle(Path("minilm-mobile"))     # BundleError names each bad file
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MANIFEST_NAME = "manifest.json"
# What a manifest says it is; read_manifest refuses anything else.
BUNDLE_FORMAT = "slipstream-edge-bundle"
FORMAT_VERSION = 1
# Files read in 1 MiB pieces: a 90 MB model is hashed without holding it in memory.
_CHUNK_BYTES = 1 << 20


class BundleError(ValueError):
    """A bundle is incomplete or changed; the message names each file and what is wrong."""


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One file of the bundle."""

    # Relative to the bundle directory, with "/" separators: "1/model.ort".
    path: str
    sha256: str
    size_bytes: int


@dataclass(frozen=True, slots=True)
class SampleFiles:
    """The sample rows shipped with the bundle and what the bundle's model answers."""

    # .npz of the model's inputs, rows first; one request as it is.
    inputs: str
    # .npz of every output of the model for those inputs, run as one batch.
    outputs: str
    rows: int


@dataclass(frozen=True, slots=True)
class Manifest:
    """The content of manifest.json (see the module docstring)."""

    # The model's name in a repository (the bundle directory's name when served as is).
    name: str
    # The model version exported; the bundle serves it as this version.
    version: int
    # edge, mobile or openvino.
    target: str
    # The backend config.yaml names (onnxruntime, openvino).
    backend: str
    # UTC, ISO 8601.
    created: str
    files: list[FileEntry]
    samples: SampleFiles
    # The accuracy gate of the bundle's model against the original (optimize's GateResult).
    gate: dict[str, Any]
    # Releases that wrote and checked the bundle: older ones are not known to read it.
    minimum_runtime_versions: dict[str, str]
    # Sizes: the source model file(s), the bundle's model file(s), their ratio.
    size: dict[str, float]
    # The source model file and the passes that made the bundle's model from it.
    source: dict[str, Any] = field(default_factory=dict)
    format: str = BUNDLE_FORMAT
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, default=str) + "\n"


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """A bundle that passed ``verify_bundle``."""

    manifest: Manifest
    # Files checked against the manifest (all of them passed).
    checked: list[FileEntry]
    # Files in the bundle directory the manifest does not list (allowed, reported).
    unlisted: list[str]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def bundle_files(bundle: Path) -> list[str]:
    """Every file under ``bundle`` but the manifest, relative, sorted."""
    found = (p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file())
    return sorted(path for path in found if path != MANIFEST_NAME)


def file_entries(bundle: Path) -> list[FileEntry]:
    """Every file under ``bundle`` but the manifest, sorted, with its size and hash."""
    return [
        FileEntry(path, sha256_of(bundle / path), (bundle / path).stat().st_size)
        for path in bundle_files(bundle)
    ]


def read_manifest(bundle: Path) -> Manifest:
    """The bundle's manifest; BundleError when it is missing or not a bundle manifest."""
    path = bundle / MANIFEST_NAME
    if not bundle.is_dir():
        raise BundleError(f"{bundle}: not a directory (a bundle is the directory export wrote)")
    if not path.is_file():
        raise BundleError(
            f"{path}: missing; a bundle written by slipstream export holds its manifest.json"
        )
    try:
        data = json.loads(path.read_text())
        if data.get("format") != BUNDLE_FORMAT:
            raise BundleError(f"{path}: format is {data.get('format')!r}, not {BUNDLE_FORMAT!r}")
        if data.get("format_version") != FORMAT_VERSION:
            raise BundleError(
                f"{path}: format_version {data.get('format_version')!r}; this slipstream reads "
                f"{FORMAT_VERSION} (upgrade slipstream to read a newer bundle)"
            )
        files = [FileEntry(**entry) for entry in data.pop("files")]
        samples = SampleFiles(**data.pop("samples"))
        return Manifest(files=files, samples=samples, **data)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        if isinstance(exc, BundleError):
            raise
        raise BundleError(
            f"{path}: not a valid manifest ({exc}); export the bundle again"
        ) from None


def verify_bundle(bundle: Path) -> VerifyReport:
    """Check every listed file's presence, size and SHA-256; BundleError names each problem."""
    manifest = read_manifest(bundle)
    problems = []
    inside = bundle.resolve()
    for entry in manifest.files:
        path = bundle / entry.path
        if Path(entry.path).is_absolute() or not path.resolve().is_relative_to(inside):
            problems.append(f"{entry.path}: the manifest names a file outside the bundle")
        elif not path.is_file():
            problems.append(f"{entry.path}: missing (the manifest lists {entry.size_bytes} bytes)")
        elif (size := path.stat().st_size) != entry.size_bytes:
            problems.append(
                f"{entry.path}: {size} bytes, the manifest says {entry.size_bytes} "
                "(truncated or replaced)"
            )
        elif (digest := sha256_of(path)) != entry.sha256:
            problems.append(
                f"{entry.path}: sha256 {digest[:16]}..., the manifest says "
                f"{entry.sha256[:16]}... (the file was changed)"
            )
    if problems:
        raise BundleError(f"bundle {bundle} failed verification: " + "; ".join(problems))
    listed = {entry.path for entry in manifest.files}
    unlisted = [path for path in bundle_files(bundle) if path not in listed]
    return VerifyReport(manifest, list(manifest.files), unlisted)
