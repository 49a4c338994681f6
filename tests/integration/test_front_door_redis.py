"""Issue #13: rate limits and the response cache kept in a real Redis (``redis-server``
on a free port).

Two server processes share one key's budget through the Lua GCRA, and one cache; Redis
killed mid-run leaves requests served (the limiter fails open, logged once and counted;
the cache is bypassed) and both work again once Redis is back; a corrupt cache entry is
a miss; ``--rate-limit-fail-closed`` semantics are checked against a Redis that is down.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis as redis_client

from slipstream.errors import TooManyRequests, Unavailable
from slipstream.security.keys import KeyLimits, KeyRing
from slipstream.security.limits import Limiter
from slipstream.security.metrics import FrontDoorMetrics
from slipstream.security.redis_store import RedisStore
from tests.limit_stores import wait_for
from tests.models import ADD_SUB_WIDTH, build_add_sub, write_config
from tests.redis_server import RedisServer
from tests.utils import RemoteServer

pytestmark = pytest.mark.slow

SHARED_RATE, SHARED_BURST = 20.0, 20


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("redis")) as running:
        yield running


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    ring = KeyRing.load(path, missing_ok=True)
    made = {
        "shared": ring.create("shared", "infer", limits=KeyLimits(SHARED_RATE, SHARED_BURST))[0],
        "outage": ring.create("outage", "infer", limits=KeyLimits(2.0, 2))[0],
        "free": ring.create("free", "infer")[0],
    }
    ring.save()
    return path, made


@pytest.fixture(scope="module")
def servers(
    tmp_path_factory: pytest.TempPathFactory, redis: RedisServer, keys: tuple[Path, dict[str, str]]
) -> Iterator[list[RemoteServer]]:
    root = tmp_path_factory.mktemp("redis_limits")
    build_add_sub(root / "repo")
    build_add_sub(root / "repo", "cached")
    write_config(root / "repo", "cached", {"response_cache": {"enable": True}})
    args = ["--auth-file", str(keys[0]), "--rate-limit-store", redis.url,
            "--cache", f"{redis.url}?ttl=600"]  # fmt: skip
    with (
        RemoteServer(root / "repo", args, log_dir=root) as one,
        RemoteServer(root / "repo", args, log_dir=root) as two,
    ):
        yield [one, two]


async def _hammer(urls: list[str], secret: str, duration_s: float) -> tuple[list[int], float]:
    """Clients looping on every server for ``duration_s``: every status, and the time."""
    statuses: list[int] = []
    headers = {"Authorization": f"Bearer {secret}"}

    async def client_loop(client: httpx.AsyncClient, url: str, until: float) -> None:
        while time.monotonic() < until:
            statuses.append((await client.get(url, headers=headers)).status_code)

    async with httpx.AsyncClient(timeout=30) as client:
        started = time.monotonic()
        until = started + duration_s
        await asyncio.gather(*(client_loop(client, url, until) for url in urls for _ in range(4)))
        return statuses, time.monotonic() - started


def test_two_servers_share_one_budget(
    servers: list[RemoteServer], keys: tuple[Path, dict[str, str]]
) -> None:
    urls = [server.url("/v2/models/add_sub") for server in servers]
    statuses, elapsed_s = asyncio.run(_hammer(urls, keys[1]["shared"], 3.0))
    admitted = statuses.count(200)
    assert statuses.count(429) == len(statuses) - admitted
    budget = SHARED_BURST + SHARED_RATE * elapsed_s
    # One budget for both: each server alone would admit up to the whole of it.
    assert 0.8 * budget <= admitted <= budget + 1, (admitted, elapsed_s, len(statuses))


def _metric(server: RemoteServer, pattern: str) -> float:
    text = httpx.get(server.url("/metrics")).text
    found = re.search(pattern + r" (\S+)", text)
    return float(found.group(1)) if found else 0.0


def test_a_redis_outage_fails_open_and_the_limiter_recovers(
    servers: list[RemoteServer], redis: RedisServer, keys: tuple[Path, dict[str, str]]
) -> None:
    server = servers[0]
    url = server.url("/v2/models/add_sub")
    headers = {"Authorization": f"Bearer {keys[1]['outage']}"}
    with httpx.Client(timeout=30) as client:
        before = [client.get(url, headers=headers).status_code for _ in range(10)]
        assert before.count(429) >= 7  # burst 2 at 2/s
        redis.kill()
        during = [client.get(url, headers=headers).status_code for _ in range(30)]
        assert during == [200] * 30  # fail open: served, not limited
        errors = r'slipstream_rate_limit_store_errors_total\{outcome="admitted"\}'
        assert _metric(server, errors) >= 1
        assert server.log_text().count("rate-limit store unreachable") == 1
        redis.start()
        deadline = time.monotonic() + 15
        while True:
            after = [client.get(url, headers=headers).status_code for _ in range(10)]
            if after.count(429) >= 5:
                break
            assert time.monotonic() < deadline, f"limiter never recovered: {after}"
            time.sleep(0.2)
    assert "rate-limit store answers again" in server.log_text()


async def test_fail_closed_refuses_while_redis_is_down(tmp_path: Path) -> None:
    with RedisServer(tmp_path) as redis:
        url = redis.url
    # The server is gone now: a real client meets a real refused connection.
    ring = KeyRing(tmp_path / "k.json", [])
    _, key = ring.create("k", "infer", limits=KeyLimits(5.0, 5))
    metrics = FrontDoorMetrics()
    closed = Limiter(RedisStore(url), metrics, fail_closed=True)
    with pytest.raises(Unavailable, match="rate-limit store is unreachable"):
        await closed.admit(key, generative=False)
    opened = Limiter(RedisStore(url), metrics)
    assert await opened.admit(key, generative=False) is False
    assert metrics.store_errors == {"refused": 1, "admitted": 1}
    await closed.store.close()
    await opened.store.close()


def _cached_infer(server: RemoteServer, secret: str, value: float) -> list[float]:
    data = [value] * ADD_SUB_WIDTH
    body = {"inputs": [
        {"name": name, "datatype": "FP32", "shape": [1, ADD_SUB_WIDTH], "data": data}
        for name in ("INPUT0", "INPUT1")
    ]}  # fmt: skip
    reply = httpx.post(server.url("/v2/models/cached/infer"), json=body,
                       headers={"Authorization": f"Bearer {secret}"}, timeout=30)  # fmt: skip
    assert reply.status_code == 200, reply.text
    outputs = {output["name"]: output["data"] for output in reply.json()["outputs"]}
    return list(outputs["OUTPUT0"])


def test_the_redis_cache_is_shared_and_survives_outages_and_corrupt_entries(
    servers: list[RemoteServer], redis: RedisServer, keys: tuple[Path, dict[str, str]]
) -> None:
    one, two = servers
    secret = keys[1]["free"]
    hits = r'nv_cache_num_hits_per_model\{model="cached",version="1"\}'
    misses = r'nv_cache_num_misses_per_model\{model="cached",version="1"\}'
    expected = [2.0] * ADD_SUB_WIDTH
    assert _cached_infer(one, secret, 1.0) == expected  # a miss on one, stored in Redis
    assert _cached_infer(two, secret, 1.0) == expected  # a hit on two: one cache
    assert (_metric(one, misses), _metric(two, hits)) == (1, 1)

    store = redis_client.Redis(port=redis.port)
    entries = store.keys("slipstream:cache:*")
    assert len(entries) == 1 and store.ttl(entries[0]) > 500  # ?ttl=600
    store.set(entries[0], b"SSC1\xff\xff not an entry")
    assert _cached_infer(two, secret, 1.0) == expected  # a miss, served and overwritten
    assert _metric(two, misses) == 1
    assert _cached_infer(two, secret, 1.0) == expected
    assert _metric(two, hits) == 2
    store.close()

    redis.kill()
    assert _cached_infer(one, secret, 1.0) == expected  # bypassed: computed, never failed
    assert _cached_infer(one, secret, 5.0) == [10.0] * ADD_SUB_WIDTH
    assert "response cache: Redis unreachable" in one.log_text()
    redis.start()
    time.sleep(0.6)  # past the pause after a failure
    deadline = time.monotonic() + 15
    before = _metric(one, hits)
    while _metric(one, hits) == before:
        assert time.monotonic() < deadline, "the cache never recovered"
        assert _cached_infer(one, secret, 7.0) == [14.0] * ADD_SUB_WIDTH
        time.sleep(0.2)


async def test_requests_admitted_while_redis_is_down_count_once_it_is_back(
    tmp_path: Path,
) -> None:
    """Fail open: requests in flight are admitted (and held) while Redis is down; once it
    is back (empty: its data went with it) the process tells it what it holds, so the
    limit counts them; their releases free the slots."""
    ring = KeyRing(Path("unused.json"), [])
    _, key = ring.create("two", "infer", limits=KeyLimits(max_concurrent=2))
    with RedisServer(tmp_path) as redis:
        down = Limiter(RedisStore(redis.url, gone_after_s=1.0), FrontDoorMetrics())
        other = Limiter(RedisStore(redis.url, gone_after_s=1.0), FrontDoorMetrics())
        try:
            redis.kill()
            assert await down.admit(key, generative=False)
            assert await down.admit(key, generative=False)
            redis.start()
            # With its next sign of life (every 0.2 s) Redis counts both: the other
            # process is refused from then on.
            deadline = time.monotonic() + 5.0
            while True:
                try:
                    await other.admit(key, generative=False)
                except TooManyRequests:
                    break
                other.release(key)
                assert time.monotonic() < deadline, "Redis never counted the held requests"
                await asyncio.sleep(0.05)
            down.release(key)
            assert await wait_for(lambda: other.admit(key, generative=False), 2.0)
        finally:
            await down.store.close()
            await other.store.close()
