"""OpenAI's files, kept on disk under ``--files-dir``: the uploads batches read and the
output and error files they write (:mod:`slipstream.server.openai_batches`).

    <files-dir>/.lock                  held (flock) by the one server using the directory
    <files-dir>/files/<id>.json        the file object, its owner (an API key's name)
    <files-dir>/files/<id>.data        its bytes

Each file belongs to the key that made it: a key sees and uses only its own, an admin key
(or any caller, on a server without --auth-file) every one. Another key's file is 404,
as one that does not exist, so ids tell nothing. The directory is opened on first use (a
server that never sees these routes never touches it).
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from slipstream.errors import InvalidRequest, NotFound, Unavailable
from slipstream.protocol.openai_batch import file_object, is_object_id, new_file_id


@dataclass(frozen=True, slots=True)
class Viewer:
    """Who asks: an API key's name ("" without keys) and whether it sees every owner's."""

    name: str
    admin: bool

    def sees(self, owner: str) -> bool:
        return self.admin or owner == self.name


@dataclass(slots=True)
class StoredFile:
    """One file's record: its OpenAI object and what the server keeps beside it."""

    object: dict[str, Any]
    owner: str
    # Nanoseconds since the epoch: the order of lists (created_at has whole seconds).
    created_ns: int


def write_json(path: Path, doc: Any) -> None:
    """``doc`` as JSON at ``path``, replaced whole (a crash leaves the old or the new)."""
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_bytes(orjson.dumps(doc))
    os.replace(temporary, path)


class FilesDirectory:
    """The directory of one server's files and batches, held with an exclusive lock so
    that two servers never run the same batch."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock_fd: int | None = None

    @property
    def is_open(self) -> bool:
        return self._lock_fd is not None

    def open(self) -> None:
        """Create and lock it; 503 naming the fix when another process holds it."""
        if self._lock_fd is not None:
            return
        try:
            for sub in ("files", "batches"):
                (self.root / sub).mkdir(parents=True, exist_ok=True)
            fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise Unavailable(f"the files directory {self.root} cannot be used ({exc}); "
                              "give the server a writable --files-dir") from None  # fmt: skip
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise Unavailable(
                f"the files directory {self.root} is in use by another server; give each "
                "server its own --files-dir"
            ) from None
        self._lock_fd = fd

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the lock
            self._lock_fd = None


class FileStore:
    """The files of one :class:`FilesDirectory`; see the module docstring."""

    def __init__(self, directory: FilesDirectory) -> None:
        self._directory = directory
        self._files: dict[str, StoredFile] | None = None

    @property
    def _dir(self) -> Path:
        return self._directory.root / "files"

    def _index(self) -> dict[str, StoredFile]:
        if self._files is None:
            self._directory.open()
            files = {}
            for meta in self._dir.glob("*.json"):
                try:
                    doc = orjson.loads(meta.read_bytes())
                    files[meta.stem] = StoredFile(doc["object"], doc["owner"], doc["created_ns"])
                except (OSError, orjson.JSONDecodeError, KeyError, TypeError):
                    continue  # a record written half (a crash): its file was never listed
            self._files = dict(sorted(files.items(), key=lambda item: item[1].created_ns))
        return self._files

    async def create(self, data: bytes, filename: str, purpose: str, owner: str) -> StoredFile:
        files = self._index()
        file_id = new_file_id()
        created_ns = time.time_ns()
        record = StoredFile(file_object(file_id, len(data), created_ns // 10**9, filename,
                                        purpose), owner, created_ns)  # fmt: skip
        await asyncio.to_thread(self._write, file_id, data, record)
        files[file_id] = record
        return record

    def _write(self, file_id: str, data: bytes, record: StoredFile) -> None:
        (self._dir / f"{file_id}.data").write_bytes(data)
        write_json(self._dir / f"{file_id}.json",
                   {"object": record.object, "owner": record.owner,
                    "created_ns": record.created_ns})  # fmt: skip

    def get(self, file_id: str, viewer: Viewer) -> StoredFile:
        """The file, if ``viewer`` may see it; else 404 (as one that does not exist)."""
        record = self._index().get(file_id) if is_object_id(file_id) else None
        if record is None or not viewer.sees(record.owner):
            raise NotFound(f"file_id: no file {file_id!r} here")
        return record

    async def content(self, file_id: str, viewer: Viewer) -> bytes:
        self.get(file_id, viewer)
        try:
            return await asyncio.to_thread((self._dir / f"{file_id}.data").read_bytes)
        except FileNotFoundError:
            raise NotFound(f"file_id: the content of {file_id!r} is gone") from None

    def listed(self, viewer: Viewer, purpose: str | None) -> list[dict[str, Any]]:
        """The files ``viewer`` sees, oldest first."""
        return [
            record.object
            for record in self._index().values()
            if viewer.sees(record.owner) and purpose in (None, record.object["purpose"])
        ]

    async def delete(self, file_id: str, viewer: Viewer) -> None:
        self.get(file_id, viewer)
        files = self._index()
        del files[file_id]
        await asyncio.to_thread(self._remove, file_id)

    def _remove(self, file_id: str) -> None:
        for suffix in (".json", ".data"):
            (self._dir / f"{file_id}{suffix}").unlink(missing_ok=True)


def check_filename(filename: str | None) -> str:
    """The upload's name as the file object shows it (never a path on disk)."""
    name = (filename or "upload.jsonl").rsplit("/", 1)[-1]
    if len(name) > 255 or not name.isprintable():
        raise InvalidRequest("file: its filename must be printable and at most 255 characters")
    return name
