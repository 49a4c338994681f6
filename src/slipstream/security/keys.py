"""API keys with roles, stored as hashes in a keys file.

A key is 32 random bytes (``ss-`` + URL-safe base64); the file keeps only its SHA-256,
its name (what logs and metrics show), its role, the models it may use and its limits.
A key of that entropy needs no slow hash: no one can search 2^256 guesses.

Example::

    ring = KeyRing.load(Path("keys.json"))
    secret, key = ring.create("ci", role="infer", models=["mlp"])
    ring.save()
    assert ring.find(secret) == key
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import secrets
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson

from slipstream.names import model_name_problem

Role = Literal["infer", "admin"]
ROLES: tuple[Role, ...] = ("infer", "admin")
_PREFIX = "ss-"
_FILE_VERSION = 1


class KeysFileError(ValueError):
    """The keys file is unreadable or malformed; the message names the file and entry."""


@dataclass(frozen=True, slots=True)
class KeyLimits:
    """What one key may cost; 0 means unlimited."""

    # Sustained requests per second (GCRA), with bursts of up to ``burst`` at once.
    requests_per_s: float = 0.0
    burst: int = 0
    # Requests of this key in flight at once, in one server process.
    max_concurrent: int = 0
    # Prompt + completion tokens per minute on the generative (OpenAI) routes.
    tokens_per_minute: int = 0

    @property
    def any(self) -> bool:
        return bool(self.requests_per_s or self.max_concurrent or self.tokens_per_minute)


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One key as the server knows it: never the key itself."""

    name: str
    role: Role
    # Hex SHA-256 of the key.
    sha256: str
    # Models the key may use; None: every model.
    models: frozenset[str] | None = None
    limits: KeyLimits = field(default_factory=KeyLimits)

    def allows_model(self, model: str) -> bool:
        return self.models is None or model in self.models


def file_state(path: Path) -> tuple[int, int, int] | None:
    """What changes when a file is written or replaced (None: it is missing)."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns, stat.st_size


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class KeyRing:
    """The keys of one keys file; :meth:`find` is what each request calls."""

    def __init__(self, path: Path, keys: list[ApiKey]) -> None:
        self.path = path
        self.keys = keys
        # The file as it was read (see file_state): what a later change differs from.
        self.file_state = file_state(path)
        # SHA-256 digest -> (the same digest, the key).
        self._by_hash = {bytes.fromhex(k.sha256): (bytes.fromhex(k.sha256), k) for k in keys}

    @classmethod
    def load(cls, path: Path, missing_ok: bool = False) -> KeyRing:
        """Read a keys file; KeysFileError names the problem (``missing_ok``: empty ring)."""
        before = file_state(path)
        try:
            data = orjson.loads(path.read_bytes())
        except FileNotFoundError:
            if missing_ok:
                return cls(path, [])
            raise KeysFileError(f"{path}: no such keys file; make one with "
                                "`slipstream keys create --auth-file ...`") from None  # fmt: skip
        except (OSError, orjson.JSONDecodeError) as exc:
            raise KeysFileError(f"{path}: cannot read the keys file: {exc}") from None
        if not isinstance(data, dict) or not isinstance(data.get("keys"), list):
            raise KeysFileError(f'{path}: expected {{"keys": [...]}}')
        keys = [_parse_key(entry, f"{path}: keys[{i}]") for i, entry in enumerate(data["keys"])]
        names = [key.name for key in keys]
        if len(set(names)) != len(names):
            raise KeysFileError(f"{path}: key names must be unique, got {sorted(names)}")
        ring = cls(path, keys)
        ring.file_state = before
        return ring

    def find(self, secret: bytes) -> ApiKey | None:
        """The key ``secret`` is, or None; compared in constant time."""
        digest = hashlib.sha256(secret).digest()
        entry = self._by_hash.get(digest)
        if entry is None:
            return None
        # The lookup hashes the digest, never the secret; the deciding comparison runs in
        # constant time against the stored digest.
        stored, key = entry
        return key if hmac.compare_digest(stored, digest) else None

    def create(
        self,
        name: str,
        role: Role,
        models: list[str] | None = None,
        limits: KeyLimits | None = None,
    ) -> tuple[str, ApiKey]:
        """A new key: its secret (shown once) and its entry (add it with :meth:`save`)."""
        # Checked here, not only by the CLI: a file this writes must load again (a server
        # that cannot read a changed file keeps its old keys, revoked ones included).
        if not name.strip() or not name.isprintable():
            raise KeysFileError(f"--name: expected a printable, non-empty name, got {name!r}")
        if any(key.name == name for key in self.keys):
            raise KeysFileError(f"{self.path}: a key named {name!r} exists; choose another --name")
        problem = limits_problem(limits or KeyLimits())
        if problem is not None:
            raise KeysFileError(problem)
        if models is not None and not models:
            # An empty list must not become "every model".
            raise KeysFileError("--models: expected at least one model name; leave --models "
                                "out for a key that may use every model")  # fmt: skip
        for model in models or []:
            problem = model_name_problem(model)
            if problem is not None:
                raise KeysFileError(f"--models: {model!r} {problem}")
        secret = _PREFIX + secrets.token_urlsafe(32)
        key = ApiKey(name, role, hash_key(secret),
                     frozenset(models) if models is not None else None,
                     limits or KeyLimits())  # fmt: skip
        self.keys.append(key)
        self._by_hash[bytes.fromhex(key.sha256)] = (bytes.fromhex(key.sha256), key)
        return secret, key

    def revoke(self, name: str) -> None:
        key = next((k for k in self.keys if k.name == name), None)
        if key is None:
            raise KeysFileError(f"{self.path}: no key named {name!r}")
        self.keys.remove(key)
        del self._by_hash[bytes.fromhex(key.sha256)]

    def save(self) -> None:
        """Write the file atomically, readable by its owner only."""
        data = {"version": _FILE_VERSION, "keys": [_dump_key(key) for key in self.keys]}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".keys-")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(orjson.dumps(data, option=orjson.OPT_INDENT_2))
            os.chmod(tmp, 0o600)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def limits_problem(limits: KeyLimits) -> str | None:
    """What is wrong with ``limits`` ("--rate: ..."), or None. NaN and infinity are
    refused: JSON has no spelling for them (orjson writes null), so the file would not
    load again."""
    for option, value in (("--rate", limits.requests_per_s), ("--burst", limits.burst),
                          ("--concurrency", limits.max_concurrent),
                          ("--tokens-per-minute", limits.tokens_per_minute)):  # fmt: skip
        if not math.isfinite(value) or value < 0:
            return f"{option}: limits must not be negative, NaN or infinite, got {value}"
    return None


def _dump_key(key: ApiKey) -> dict[str, Any]:
    limits = key.limits
    return {
        "name": key.name,
        "role": key.role,
        "sha256": key.sha256,
        "models": sorted(key.models) if key.models is not None else None,
        "limits": {
            "requests_per_s": limits.requests_per_s,
            "burst": limits.burst,
            "max_concurrent": limits.max_concurrent,
            "tokens_per_minute": limits.tokens_per_minute,
        },
    }


def _parse_key(entry: Any, where: str) -> ApiKey:
    if not isinstance(entry, dict):
        raise KeysFileError(f"{where}: expected an object")
    name, role, digest = entry.get("name"), entry.get("role"), entry.get("sha256")
    if not isinstance(name, str) or not name:
        raise KeysFileError(f"{where}.name: expected a non-empty string")
    if role not in ROLES:
        raise KeysFileError(f"{where}.role: expected one of {list(ROLES)}, got {role!r}")
    if not isinstance(digest, str) or len(digest) != 64:
        raise KeysFileError(f"{where}.sha256: expected 64 hex digits")
    try:
        bytes.fromhex(digest)
    except ValueError:
        raise KeysFileError(f"{where}.sha256: expected 64 hex digits") from None
    models = entry.get("models")
    if models is not None and (
        not isinstance(models, list) or not all(isinstance(m, str) for m in models)
    ):
        raise KeysFileError(f"{where}.models: expected a list of model names or null")
    raw = entry.get("limits") or {}
    try:
        limits = KeyLimits(
            requests_per_s=float(raw.get("requests_per_s", 0)),
            burst=int(raw.get("burst", 0)),
            max_concurrent=int(raw.get("max_concurrent", 0)),
            tokens_per_minute=int(raw.get("tokens_per_minute", 0)),
        )
    except (TypeError, ValueError, AttributeError):
        raise KeysFileError(f"{where}.limits: expected numbers") from None
    if limits_problem(limits) is not None:
        raise KeysFileError(f"{where}.limits: must be finite and not negative")
    return ApiKey(name, role, digest.lower(), frozenset(models) if models is not None else None,
                  limits)  # fmt: skip
