"""The response cache, with Triton's semantics: a request identical to an earlier one of
the same model version is answered from the cache and never enters the batcher.

A model opts in with ``response_cache: {enable: true}`` in its config.yaml; the server
holds one cache, ``--cache local:size=256MB`` (this process, LRU by bytes) or
``--cache redis://host:port[?ttl=600]`` (shared by every server using it). The key hashes
the model name and version, every input's name, datatype, shape and bytes, the
requested outputs and the request parameters, so a new version never answers with an
old version's result. An entry keeps the outputs and the parameters the model's response
carried (a Python model's ``InferenceResponse(parameters=...)``), so a hit answers what
the model answered. A Redis outage or an entry that does not decode is a miss: the cache
never fails a request.

Example::

    cache = build_cache("local:size=64MB")
    entry = await cache.get(key) or CacheEntry(run_the_model())
"""

from __future__ import annotations

import hashlib
import logging
import struct
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import orjson

from slipstream.config import parse_cache_spec
from slipstream.datatypes import numpy_dtype, v2_datatype
from slipstream.errors import SlipstreamError
from slipstream.types import InferRequest

logger = logging.getLogger(__name__)

Outputs = dict[str, np.ndarray]
# SSC1 entries named their arrays' types by numpy's dtype.str, which is a void type for
# bfloat16: they are read as misses and written again.
_MAGIC = b"SSC2"
# After a failed Redis call, skip Redis this long: an outage costs requests one check.
_RETRY_AFTER_FAILURE_S = 0.5
_SOCKET_TIMEOUT_S = 0.5


def request_key(name: str, version: str, request: InferRequest) -> bytes | None:
    """The cache key of ``request`` on this model version (None: not cacheable);
    ``version``: the version's ``cache_identity`` (its number and a digest of its files,
    so new weights under the same number are never answered from the old ones)."""
    if request.shared_memory_inputs or any(o.shared_memory for o in request.outputs or ()):
        # A client's region: the key would not see its bytes, and a hit would write no
        # output into it.
        return None
    digest = hashlib.blake2b(digest_size=20)
    digest.update(f"{name}\0{version}\0".encode())
    for input_name in sorted(request.inputs):
        array = request.inputs[input_name]
        digest.update(f"{input_name}\0{array.dtype.str}\0{array.shape}\0".encode())
        if array.dtype == object:
            for item in array.flat:
                data = item if isinstance(item, bytes) else str(item).encode()
                digest.update(struct.pack("<I", len(data)))
                digest.update(data)
        else:
            digest.update(np.ascontiguousarray(array).data)
    wanted = "*" if request.outputs is None else ",".join(sorted(o.name for o in request.outputs))
    digest.update(f"\0{wanted}\0".encode())
    if request.parameters:
        try:
            digest.update(orjson.dumps(request.parameters, option=orjson.OPT_SORT_KEYS))
        except TypeError:
            return None
    return digest.digest()


class CacheEntry(NamedTuple):
    """What a hit answers: the outputs, and the parameters the response carried."""

    outputs: Outputs
    parameters: Mapping[str, Any] = {}


class ResponseCache(ABC):
    """Outputs by request key."""

    @abstractmethod
    async def get(self, key: bytes) -> CacheEntry | None:
        """The entry stored under ``key``, or None (a miss, an outage, a bad entry)."""

    @abstractmethod
    async def put(self, key: bytes, entry: CacheEntry) -> None:
        """Store ``entry`` (never raises)."""

    async def close(self) -> None:  # noqa: B027 - the local cache holds nothing to release
        """Release connections."""


def _nbytes(outputs: Outputs) -> int:
    total = 0
    for array in outputs.values():
        if array.dtype == object:
            total += sum(len(item) if isinstance(item, bytes) else 64 for item in array.flat)
        else:
            total += array.nbytes
    return total + 64 * len(outputs)


class LocalCache(ResponseCache):
    """An LRU of this process bounded by the bytes its outputs hold."""

    def __init__(self, size_bytes: int) -> None:
        self.size_bytes = size_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[bytes, tuple[CacheEntry, int]] = OrderedDict()

    async def get(self, key: bytes) -> CacheEntry | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    async def put(self, key: bytes, entry: CacheEntry) -> None:
        # Copies: a batch's outputs are views of one array, which an entry would keep alive.
        kept = {name: np.array(array, copy=True) for name, array in entry.outputs.items()}
        for array in kept.values():
            array.setflags(write=False)
        size = _nbytes(kept) + len(entry.parameters) * 64
        if size > self.size_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.used_bytes -= old[1]
        while self.used_bytes + size > self.size_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.used_bytes -= evicted
        self._entries[key] = (CacheEntry(kept, dict(entry.parameters)), size)
        self.used_bytes += size


class RedisCache(ResponseCache):
    """Entries in Redis (``redis://host:port[/db]``), expiring after ``ttl_s`` (0: never)."""

    def __init__(self, url: str, ttl_s: int = 0) -> None:
        from redis.asyncio import Redis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self._client = Redis.from_url(url, socket_timeout=_SOCKET_TIMEOUT_S,
                                      socket_connect_timeout=_SOCKET_TIMEOUT_S,
                                      retry=Retry(NoBackoff(), 0))  # fmt: skip
        self._ttl_s = ttl_s or None
        self._down_until = 0.0
        self._down = False
        # Entries that did not decode (a bug or a stranger's writes); each read a miss.
        self.corrupt_entries = 0

    async def get(self, key: bytes) -> CacheEntry | None:
        data = await self._call("GET", b"slipstream:cache:" + key)
        if data is None:
            return None
        try:
            return decode_entry(data)
        except ValueError as exc:
            if not self.corrupt_entries:
                logger.warning("response cache: an entry does not decode (%s); served as a "
                               "miss and overwritten", exc)  # fmt: skip
            self.corrupt_entries += 1
            return None

    async def put(self, key: bytes, entry: CacheEntry) -> None:
        try:
            data = encode_entry(entry)
        except TypeError:  # parameters JSON cannot carry: not stored
            return
        await self._call("SET", b"slipstream:cache:" + key, data)

    async def _call(self, command: str, key: bytes, value: bytes | None = None) -> Any:
        from redis.exceptions import RedisError

        if self._down_until and time.monotonic() < self._down_until:
            return None
        result: Any
        try:
            if value is None:
                result = await self._client.get(key)
            else:
                result = await self._client.set(key, value, ex=self._ttl_s)
        except (RedisError, OSError) as exc:
            self._down_until = time.monotonic() + _RETRY_AFTER_FAILURE_S
            if not self._down:
                self._down = True
                logger.error("response cache: Redis unreachable (%s); requests bypass the "
                             "cache until it answers", exc)  # fmt: skip
            return None
        if self._down:
            self._down = False
            self._down_until = 0.0
            logger.warning("response cache: Redis answers again")
        return result

    async def close(self) -> None:
        await self._client.aclose()


def encode_entry(entry: CacheEntry) -> bytes:
    """``SSC2``, the header's length, a JSON header, the arrays' bytes. The header:
    ``{"outputs": [[name, V2 datatype, shape, nbytes]...], "parameters": {...}}``;
    TypeError when a parameter is not JSON."""
    header = []
    chunks = []
    for name, array in entry.outputs.items():
        if array.dtype == object:
            items = [item if isinstance(item, bytes) else str(item).encode() for item in array.flat]
            data = b"".join(struct.pack("<I", len(item)) + item for item in items)
            header.append([name, "BYTES", list(array.shape), len(data)])
        else:
            data = np.ascontiguousarray(array).tobytes()
            header.append([name, v2_datatype(array.dtype), list(array.shape), len(data)])
        chunks.append(data)
    head = orjson.dumps({"outputs": header, "parameters": dict(entry.parameters)})
    return b"".join([_MAGIC, struct.pack("<I", len(head)), head, *chunks])


def decode_entry(data: bytes) -> CacheEntry:
    """The inverse of :func:`encode_entry`; ValueError when ``data`` is not one."""
    try:
        return _decode(data)
    except (struct.error, KeyError, TypeError, ValueError, SlipstreamError) as exc:
        raise ValueError(f"not a valid cache entry: {exc}") from None


def _decode(data: bytes) -> CacheEntry:
    if data[:4] != _MAGIC:
        raise ValueError("not a Slipstream cache entry of this version")
    (head_length,) = struct.unpack_from("<I", data, 4)
    offset = 8 + head_length
    head = orjson.loads(data[8:offset])
    parameters = head["parameters"]
    if not isinstance(parameters, dict):
        raise ValueError("its parameters are not an object")
    outputs: Outputs = {}
    for name, datatype, shape, nbytes in head["outputs"]:
        chunk = data[offset : offset + nbytes]
        if len(chunk) != nbytes:
            raise ValueError(f"output {name!r} is truncated")
        offset += nbytes
        if datatype == "BYTES":
            items, position = [], 0
            while position < nbytes:
                (length,) = struct.unpack_from("<I", chunk, position)
                items.append(chunk[position + 4 : position + 4 + length])
                position += 4 + length
            array = np.empty(len(items), dtype=object)
            array[:] = items
            outputs[name] = array.reshape(shape)
        else:
            outputs[name] = np.frombuffer(chunk, dtype=numpy_dtype(datatype)).reshape(shape)
    if offset != len(data):
        raise ValueError("trailing bytes after the outputs")
    return CacheEntry(outputs, parameters)


def build_cache(spec: str) -> ResponseCache | None:
    """The cache ``--cache`` names (None for "")."""
    if not spec:
        return None
    kind, size_bytes, url, ttl_s = parse_cache_spec(spec)
    return LocalCache(size_bytes) if kind == "local" else RedisCache(url, ttl_s)
