"""The checks every request passes at the front door, whatever its protocol.

The HTTP middleware (``server/front_door.py``) and the gRPC interceptor
(``server/grpc_front_door.py``) read the key and the route from their wire format and
ask this gate; it answers with the key, or raises the 401 / 403 / 429 to send.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import orjson

from slipstream.errors import PermissionDenied, Unauthenticated
from slipstream.security.access import Need
from slipstream.security.keys import ApiKey, KeyRing, KeysFileError, file_state
from slipstream.security.metrics import FrontDoorMetrics

access_logger = logging.getLogger("slipstream.access")
logger = logging.getLogger(__name__)

_BEARER = b"bearer "
# Longest X-Request-Id taken from a client; a longer or unprintable one is replaced.
_MAX_REQUEST_ID = 128
# Most verified credentials remembered (spellings of the keys' Authorization values).
_MAX_KNOWN = 1024


class Gate:
    """API-key checks; one per server, shared by the HTTP and gRPC front doors.

    A credential (the whole ``Authorization`` value) that passed the full check once is
    remembered, so a client's next requests cost one dict lookup instead of a SHA-256 and
    a constant-time comparison. The lookup compares only with credentials already proven
    valid, and its hash is Python's keyed SipHash (a random key per process), so its
    timing tells an attacker nothing about any secret. Only valid credentials enter, in
    at most ``_MAX_KNOWN`` spellings; :meth:`replace_keys` (a changed keys file) forgets
    them all, so a revoked key is refused from then on.
    """

    def __init__(
        self, keys: KeyRing, metrics: FrontDoorMetrics, metrics_need_key: bool = False
    ) -> None:
        self._keys = keys
        self._metrics = metrics
        self._metrics_need_key = metrics_need_key
        self._known: dict[bytes, ApiKey] = {}

    @property
    def keys(self) -> KeyRing:
        return self._keys

    def replace_keys(self, keys: KeyRing) -> None:
        """Serve ``keys`` from now on (the keys file changed)."""
        self._keys = keys
        self._known = {}

    def authenticate(self, authorization: bytes | None, need: Need) -> ApiKey | None:
        """The request's key (None on an open route); raises 401 or 403 (wrong role)."""
        if need == "open" or (need == "metrics" and not self._metrics_need_key):
            return None
        key = self._known.get(authorization) if authorization else None
        if key is None:
            key = self._verify(authorization)
        if need == "admin" and key.role != "admin":
            self._metrics.refused["wrong_role"] += 1
            raise PermissionDenied(
                f"API key {key.name!r} has role {key.role!r}; this route needs role 'admin'"
            )
        return key

    def key_name(self, authorization: bytes | None) -> str:
        """The name of the key ``authorization`` carries, "" for none or an unknown one.
        Neither checks nor counts a refusal: for what is keyed by the caller (a gRPC
        stream's shared-memory regions) where each message is checked later."""
        if not authorization:
            return ""
        key = self._known.get(authorization) or self._keys.find(_secret(authorization))
        return key.name if key is not None else ""

    def _verify(self, authorization: bytes | None) -> ApiKey:
        if not authorization:
            self._metrics.refused["missing_key"] += 1
            raise Unauthenticated(
                "no API key: send it as 'Authorization: Bearer <key>' (gRPC: metadata "
                "authorization); make one with `slipstream keys create`"
            )
        key = self._keys.find(_secret(authorization))
        if key is None:
            self._metrics.refused["unknown_key"] += 1
            raise Unauthenticated("the API key is not known to this server; check it")
        if len(self._known) >= _MAX_KNOWN:
            self._known = {}
        self._known[authorization] = key
        return key

    def authorize_model(self, key: ApiKey | None, model: str, named: bool = False) -> None:
        """403 unless ``key`` may use ``model``. ``named``: the request must name its model
        (in its body); one whose model cannot be read is refused to a key limited to some
        models, since the route may still find one there that the key may not use."""
        if key is None or key.models is None or model in key.models:
            return
        if not model and not named:  # the route names no model (e.g. /v2/jobs/{job})
            return
        self._metrics.refused["wrong_model"] += 1
        if not model:
            raise PermissionDenied(
                f"API key {key.name!r} may use only models {sorted(key.models)}, and the "
                "request names none that the front door can read: put the model in the "
                'JSON "model" field (with binary tensors, in the JSON header part that '
                "Inference-Header-Content-Length measures)"
            )
        raise PermissionDenied(
            f"API key {key.name!r} may not use model {model!r}; it may use {sorted(key.models)}"
        )


async def watch_keys(
    gate: Gate,
    on_revoked: Callable[[list[str]], Awaitable[None]] | None = None,
    interval_s: float = 0.25,
) -> None:
    """Serve the keys file's changes (`slipstream keys create|revoke` on a running
    server) within ``interval_s`` (a stat of the file each time: a revoked key is refused
    within a quarter second); a file that does not parse is logged and the keys in use
    stay. ``on_revoked`` is called with the names of keys that are gone, or whose name
    now belongs to another secret (what a key owned, its shared-memory regions, goes
    with it). Runs until cancelled."""
    path = gate.keys.path
    seen = gate.keys.file_state
    while True:
        await asyncio.sleep(interval_s)
        state = file_state(path)
        if state == seen:
            continue
        seen = state
        try:
            keys = KeyRing.load(path)
        except KeysFileError as exc:
            logger.error("keys file changed but cannot be used (%s); the %d keys read "
                         "before stay in use", exc, len(gate.keys.keys))  # fmt: skip
            continue
        before = {(key.name, key.sha256) for key in gate.keys.keys}
        gone = sorted({name for name, _ in before - {(k.name, k.sha256) for k in keys.keys}})
        gate.replace_keys(keys)
        logger.info("keys file %s read again: %d keys", path, len(keys.keys))
        if gone and on_revoked is not None:
            try:
                await on_revoked(gone)
            except Exception:
                logger.exception("what the revoked keys %s owned could not be released", gone)


def _secret(authorization: bytes) -> bytes:
    """The key in an Authorization value: after "Bearer " when it has one."""
    if authorization[:7].lower() == _BEARER:
        return authorization[7:].strip()
    return authorization


def body_model(body: bytes, header_length: bytes | None = None) -> str:
    """The ``model`` field of a JSON body ("" when absent or unreadable: the route then
    answers its own 400). ``header_length``: the Inference-Header-Content-Length value of
    a binary-tensor body, whose JSON is only its first that many bytes (as the routes
    read it)."""
    if header_length is not None:
        if not header_length.strip().isdigit():
            return ""
        body = body[: int(header_length)]
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return ""
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) else ""


def request_id(given: bytes | str | None) -> str:
    """The client's X-Request-Id when it is printable and short, else a new one."""
    if given:
        text = given.decode("latin-1") if isinstance(given, bytes) else given
        if len(text) <= _MAX_REQUEST_ID and text.isprintable():
            return text
    return uuid.uuid4().hex


@dataclass(slots=True)
class AccessRecord:
    """One line of the access log."""

    request_id: str
    protocol: str  # http, grpc
    method: str  # GET / POST, or the gRPC method name
    path: str
    key: str  # the key's name, "-" without one
    model: str
    version: str
    status: str  # HTTP status, or gRPC status code name
    latency_ms: float
    bytes_in: int
    bytes_out: int

    def emit(self) -> None:
        access_logger.info(
            "%s",
            orjson.dumps({
                "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + "Z",
                "request_id": self.request_id, "protocol": self.protocol,
                "method": self.method, "path": self.path, "key": self.key,
                "model": self.model, "version": self.version, "status": self.status,
                "latency_ms": round(self.latency_ms, 3), "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out,
            }).decode(),
        )  # fmt: skip
