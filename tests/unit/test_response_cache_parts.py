"""The response cache's key, its LRU by bytes and its Redis entry format (no sockets)."""

from __future__ import annotations

import numpy as np
import pytest

from slipstream.config import ConfigError, parse_cache_spec, parse_model_config
from slipstream.datatypes import BF16
from slipstream.serving.cache import CacheEntry, LocalCache, decode_entry, encode_entry, request_key
from slipstream.types import InferRequest, RequestedOutput


def make(**changes: object) -> InferRequest:
    request = InferRequest("m", "", {"x": np.arange(4, dtype=np.float32).reshape(1, 4)})
    for name, value in changes.items():
        setattr(request, name, value)
    return request


def test_the_key_covers_version_inputs_outputs_and_parameters() -> None:
    base = request_key("m", "1", make())
    assert base == request_key("m", "1", make(id="other id", priority=2))  # not in the key
    variants = [
        request_key("m", "2", make()),  # a new version never serves an old answer
        request_key("n", "1", make()),
        request_key("m", "1", make(inputs={"x": np.arange(4, dtype=np.float64).reshape(1, 4)})),
        request_key("m", "1", make(inputs={"x": np.arange(4, dtype=np.float32).reshape(2, 2)})),
        request_key("m", "1", make(inputs={"y": np.arange(4, dtype=np.float32).reshape(1, 4)})),
        request_key("m", "1", make(inputs={"x": np.ones((1, 4), np.float32)})),
        request_key("m", "1", make(outputs=[RequestedOutput("a")])),
        request_key("m", "1", make(parameters={"k": 1})),
    ]
    assert base not in variants and len(set(variants)) == len(variants)
    text = {"t": np.array([b"ab", b"c"], dtype=object)}
    split = {"t": np.array([b"a", b"bc"], dtype=object)}
    assert request_key("m", "1", make(inputs=text)) != request_key("m", "1", make(inputs=split))


async def test_the_local_cache_evicts_the_least_recently_used_by_bytes() -> None:
    cache = LocalCache(size_bytes=3 * (400 + 64))
    outputs = CacheEntry({"y": np.zeros(100, np.float32)})  # 400 bytes (+64 per output)
    for key in (b"a", b"b", b"c"):
        await cache.put(key, outputs)
    assert await cache.get(b"a") is not None  # a is now the most recently used
    await cache.put(b"d", outputs)
    assert await cache.get(b"b") is None and await cache.get(b"a") is not None
    assert cache.used_bytes <= cache.size_bytes
    await cache.put(b"huge", CacheEntry({"y": np.zeros(10_000, np.float32)}))  # too large
    assert await cache.get(b"huge") is None and await cache.get(b"d") is not None
    stored = await cache.get(b"d")
    assert stored is not None and not stored.outputs["y"].flags.writeable


def test_redis_entries_round_trip_and_a_corrupt_one_is_refused() -> None:
    outputs = {
        "f": np.arange(6, dtype=np.float16).reshape(2, 3),
        "s": np.array([[b"x", b""], [b"yz", b"\x00"]], dtype=object),
        # numpy names bfloat16 a void type ("<V2"): the entry names it by its V2 datatype.
        "b": np.array([[1.5, -np.inf], [np.nan, 3e38]], dtype=BF16),
    }
    parameters = {"run": 3, "label": "x", "sure": True}
    decoded = decode_entry(encode_entry(CacheEntry(outputs, parameters)))
    assert decoded.parameters == parameters
    assert decoded.outputs["f"].dtype == np.float16
    assert np.array_equal(decoded.outputs["f"], outputs["f"])
    assert decoded.outputs["s"].shape == (2, 2)
    assert decoded.outputs["s"].tolist() == outputs["s"].tolist()
    assert decoded.outputs["b"].dtype == BF16
    assert decoded.outputs["b"].view(np.uint16).tolist() == outputs["b"].view(np.uint16).tolist()
    data = encode_entry(CacheEntry(outputs))
    assert decode_entry(data).parameters == {}
    head = b'{"outputs":[["y","FP99",[1],4]],"parameters":{}}'
    unknown_type = b"SSC2" + len(head).to_bytes(4, "little") + head + b"\0" * 4
    old_format = b"SSC1" + data[4:]  # what servers before parameters were kept wrote
    for corrupt in (b"garbage", data[:-1], data + b"!", b"SSC2" + data[4:10], unknown_type,
                    old_format):  # fmt: skip
        with pytest.raises(ValueError, match="not a valid cache entry"):
            decode_entry(corrupt)
    with pytest.raises(TypeError):  # a parameter JSON cannot carry: the caller stores nothing
        encode_entry(CacheEntry(outputs, {"x": object()}))


def test_cache_settings_are_validated_naming_the_fix() -> None:
    assert parse_cache_spec("local:size=64KiB")[1] == 64 * 1024
    for bad in ("local:size=lots", "memcached://x", "redis://h:1?ttl=x", "local:size=10"):
        with pytest.raises(ValueError, match=r"expected|only ttl|at least"):
            parse_cache_spec(bad)
    assert parse_model_config({"response_cache": {"enable": True}}, "c").response_cache.enable
    with pytest.raises(ConfigError, match=r"response_cache\.enabled"):
        parse_model_config({"response_cache": {"enabled": True}}, "c")
