"""The front door's parts without sockets: the keys file, the gate, the GCRA limiter."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import orjson
import pytest

from slipstream.errors import PermissionDenied, TooManyRequests, Unauthenticated
from slipstream.security.gate import Gate, body_model, request_id, watch_keys
from slipstream.security.keys import KeyLimits, KeyRing, KeysFileError
from slipstream.security.limits import Limiter, MemoryStore, gcra
from slipstream.security.metrics import FrontDoorMetrics
from slipstream.server.front_door import HttpFrontDoor
from slipstream.server.httpd import HttpRequest, HttpResponse, StreamingResponse


def test_a_key_is_shown_once_and_only_its_hash_is_stored(tmp_path: Path) -> None:
    ring = KeyRing.load(tmp_path / "keys.json", missing_ok=True)
    secret, key = ring.create("ci", "infer", models=["mlp"])
    ring.save()
    text = (tmp_path / "keys.json").read_text()
    assert secret not in text and key.sha256 in text and secret.startswith("ss-")
    assert (tmp_path / "keys.json").stat().st_mode & 0o777 == 0o600
    again = KeyRing.load(tmp_path / "keys.json")
    assert again.find(secret.encode()) == key
    assert again.find(secret.encode() + b"x") is None
    with pytest.raises(KeysFileError, match="exists"):
        again.create("ci", "admin")
    with pytest.raises(KeysFileError, match="--models"):
        again.create("bad", "infer", models=["../etc"])


def test_create_never_writes_a_key_the_file_cannot_load(tmp_path: Path) -> None:
    """Audit defect 5, below the CLI: whatever calls create, the file loads again and an
    empty model list never means every model."""
    ring = KeyRing.load(tmp_path / "keys.json", missing_ok=True)
    for limits in (KeyLimits(requests_per_s=float("nan")), KeyLimits(requests_per_s=float("inf")),
                   KeyLimits(max_concurrent=-1)):  # fmt: skip
        with pytest.raises(KeysFileError, match="must not be negative, NaN or infinite"):
            ring.create("bad", "infer", limits=limits)
    with pytest.raises(KeysFileError, match="--name"):
        ring.create("", "infer")
    with pytest.raises(KeysFileError, match="--models: expected at least one"):
        ring.create("bad", "infer", models=[])
    ring.create("ok", "infer", models=["mlp"])
    ring.save()
    assert [key.name for key in KeyRing.load(tmp_path / "keys.json").keys] == ["ok"]


_ENTRY = b'{"keys": [{"name": "a", "role": "infer", "sha256": "' + b"0" * 64 + b'", '


@pytest.mark.parametrize(
    ("content", "named"),
    [
        (b"not json", "cannot read"),
        # JSON has no NaN (orjson refuses one), but float() reads the string "nan".
        (_ENTRY + b'"limits": {"requests_per_s": "nan"}}]}', "keys[0].limits"),
        (b'{"keys": [{"name": "a", "role": "root", "sha256": "00"}]}', "keys[0].role"),
        (b'{"keys": [{"name": "a", "role": "infer", "sha256": "zz"}]}', "keys[0].sha256"),
        (b'{"keys": [{"name": "", "role": "infer"}]}', "keys[0].name"),
    ],
)
def test_a_malformed_keys_file_is_refused_naming_the_entry(
    tmp_path: Path, content: bytes, named: str
) -> None:
    (tmp_path / "keys.json").write_bytes(content)
    with pytest.raises(KeysFileError, match=named.replace("[", r"\[").replace("]", r"\]")):
        KeyRing.load(tmp_path / "keys.json")


def test_the_gate_answers_401_403_and_counts_by_reason(tmp_path: Path) -> None:
    ring = KeyRing.load(tmp_path / "k.json", missing_ok=True)
    infer, _ = ring.create("app", "infer", models=["mlp"])
    metrics = FrontDoorMetrics()
    gate = Gate(ring, metrics)
    assert gate.authenticate(None, "open") is None
    assert gate.authenticate(None, "metrics") is None  # /metrics open unless configured
    with pytest.raises(Unauthenticated):
        Gate(ring, metrics, metrics_need_key=True).authenticate(None, "metrics")
    with pytest.raises(Unauthenticated):
        gate.authenticate(b"Bearer ss-nope", "infer")
    key = gate.authenticate(b"bearer " + infer.encode(), "infer")
    assert key is not None and key.name == "app"
    assert gate.authenticate(infer.encode(), "infer") == key  # gRPC metadata: bare key
    with pytest.raises(PermissionDenied, match="needs role 'admin'"):
        gate.authenticate(infer.encode(), "admin")
    gate.authorize_model(key, "mlp")
    with pytest.raises(PermissionDenied, match="may not use model 'minilm'"):
        gate.authorize_model(key, "minilm")
    assert dict(metrics.refused) == {
        "missing_key": 1, "unknown_key": 1, "wrong_role": 1, "wrong_model": 1,
    }  # fmt: skip


def test_body_model_and_request_ids() -> None:
    assert body_model(orjson.dumps({"model": "m", "prompt": "x"})) == "m"
    assert body_model(b"[1]") == body_model(b"{") == body_model(b'{"model": 3}') == ""
    assert request_id(b"abc-1") == "abc-1"
    assert len(request_id(b"bad\nid")) == 32 and len(request_id(b"x" * 129)) == 32


def test_gcra_admits_the_burst_then_one_per_interval() -> None:
    tat, now, admitted = 0.0, 100.0, 0
    for _ in range(20):
        verdict, tat = gcra(tat, now, rate_per_s=10, burst=5, cost=1, force=False)
        admitted += verdict.allowed
    assert admitted == 5
    verdict, _ = gcra(tat, now, 10, 5, 1, False)
    assert not verdict.allowed and verdict.retry_after_s == pytest.approx(0.1)
    verdict, tat = gcra(tat, now + 0.1, 10, 5, 1, False)
    assert verdict.allowed


async def test_the_limiter_refuses_concurrency_and_token_debt_with_ietf_headers() -> None:
    metrics = FrontDoorMetrics()
    limiter = Limiter(MemoryStore(), metrics)
    ring = KeyRing(Path("unused"), [])
    _, key = ring.create("gen", "infer", limits=KeyLimits(max_concurrent=2, tokens_per_minute=600))
    assert await limiter.admit(key, generative=True)
    assert await limiter.admit(key, generative=True)
    with pytest.raises(TooManyRequests) as refused:
        await limiter.admit(key, generative=True)
    assert dict(refused.value.headers)["ratelimit-policy"] == '"concurrency";q=2'
    limiter.release(key)
    limiter.release(key)
    # 900 tokens on a 600/minute budget: in debt for 30 s, so the next request waits.
    await limiter.charge_tokens(key, 900)
    with pytest.raises(TooManyRequests) as refused:
        await limiter.admit(key, generative=True)
    assert 25 <= refused.value.retry_after_s <= 31
    assert dict(refused.value.headers)["ratelimit-policy"] == '"tokens";q=600;w=60'
    assert await limiter.admit(key, generative=False)  # tokens bound generative routes only
    assert metrics.limited == {("gen", "concurrency"): 1, ("gen", "tokens"): 1}


async def test_a_stream_holds_its_slot_until_it_ends_or_is_closed_and_closes_the_route() -> None:
    ring = KeyRing(Path("unused"), [])
    secret, _ = ring.create("single", "infer", limits=KeyLimits(max_concurrent=1))
    metrics = FrontDoorMetrics()
    door = HttpFrontDoor(Gate(ring, metrics), Limiter(MemoryStore(), metrics), access_log=False)
    closed: list[str] = []

    async def tokens() -> AsyncIterator[bytes]:
        try:
            for index in range(100):
                yield b"data: %d\n\n" % index
        finally:
            closed.append("route")  # where the LLM engine frees the sequence's blocks

    async def route(request: HttpRequest) -> StreamingResponse:
        return StreamingResponse(200, tokens())

    def request() -> HttpRequest:
        headers = [(b"authorization", b"Bearer " + secret.encode())]
        return HttpRequest("POST", "/v1/completions", headers, b'{"model": "m"}')

    first = await door(request(), route)
    assert isinstance(first, StreamingResponse)
    assert await anext(first.chunks) == b"data: 0\n\n"
    refused = await door(request(), route)
    assert isinstance(refused, HttpResponse) and refused.status == 429
    await first.chunks.aclose()  # the client left mid-stream
    assert closed == ["route"]
    second = await door(request(), route)
    assert isinstance(second, StreamingResponse)
    assert len([chunk async for chunk in second.chunks]) == 100  # to its end
    third = await door(request(), route)
    assert isinstance(third, StreamingResponse)
    await third.chunks.aclose()


def test_the_gate_remembers_valid_credentials_only_until_the_keys_change(tmp_path: Path) -> None:
    ring = KeyRing.load(tmp_path / "k.json", missing_ok=True)
    secret, _ = ring.create("app", "infer")
    header = b"Bearer " + secret.encode()
    gate = Gate(ring, FrontDoorMetrics())
    assert gate.authenticate(header, "infer") is not None
    assert gate.authenticate(header, "infer") is not None  # the remembered credential
    for _ in range(3):  # an unknown key is refused every time, never remembered
        with pytest.raises(Unauthenticated):
            gate.authenticate(b"Bearer ss-guess", "infer")
    with pytest.raises(PermissionDenied):  # the role is checked on a remembered key too
        gate.authenticate(header, "admin")
    gate.replace_keys(KeyRing(tmp_path / "k.json", []))  # the key was revoked
    with pytest.raises(Unauthenticated):
        gate.authenticate(header, "infer")


async def test_watch_keys_serves_a_changed_file_and_keeps_the_keys_when_it_breaks(
    tmp_path: Path,
) -> None:
    path = tmp_path / "k.json"
    ring = KeyRing.load(path, missing_ok=True)
    first, _ = ring.create("first", "infer")
    ring.save()
    gate = Gate(KeyRing.load(path), FrontDoorMetrics())
    watcher = asyncio.create_task(watch_keys(gate, interval_s=0.01))
    try:
        second, _ = ring.create("second", "admin")
        ring.save()
        await _until(lambda: len(gate.keys.keys) == 2)
        assert gate.authenticate(second.encode(), "admin") is not None
        path.write_text("{broken")
        await asyncio.sleep(0.05)
        assert len(gate.keys.keys) == 2 and gate.authenticate(first.encode(), "infer")
        path.unlink()
        await asyncio.sleep(0.05)
        assert len(gate.keys.keys) == 2
    finally:
        watcher.cancel()


async def _until(condition: Callable[[], bool]) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("never happened")


async def test_small_front_door_fixes_of_the_audit(tmp_path: Path) -> None:
    """Audit defect 8: a 401 names the scheme it wants (RFC 7235); Redis over TLS
    (rediss://) is a --cache and a --rate-limit-store; a tokens-per-minute 429 on /v1/
    has OpenAI's type "tokens"; a missing --tls-cert is named."""
    from slipstream.config import ServerSettings
    from slipstream.config.cache_spec import parse_cache_spec
    from slipstream.protocol import openai_replies
    from slipstream.security.tls import http_context

    ring = KeyRing(Path("unused"), [])
    door = HttpFrontDoor(Gate(ring, FrontDoorMetrics()), None, access_log=False)

    async def route(request: HttpRequest) -> HttpResponse:
        return HttpResponse(200)

    refused = await door(HttpRequest("GET", "/v2/models/m", [], b""), route)
    assert isinstance(refused, HttpResponse) and refused.status == 401
    assert (b"www-authenticate", b'Bearer realm="slipstream"') in refused.headers
    assert parse_cache_spec("rediss://cache:6380?ttl=5") == ("redis", 0, "rediss://cache:6380", 5)
    settings = ServerSettings(model_repository=tmp_path, rate_limit_store="rediss://r:6380")
    assert settings.rate_limit_store == "rediss://r:6380"
    tokens = TooManyRequests("over", 30, [("ratelimit-policy", '"tokens";q=600;w=60')])
    requests = TooManyRequests("over", 1, [("ratelimit-policy", '"requests";q=5;w=1')])
    assert orjson.loads(openai_replies.error(tokens))["error"]["type"] == "tokens"
    assert orjson.loads(openai_replies.error(requests))["error"]["type"] == "requests"
    with pytest.raises(FileNotFoundError, match=f"--tls-cert {tmp_path / 'no.pem'}: no such"):
        http_context(tmp_path / "no.pem", tmp_path / "no.key")
