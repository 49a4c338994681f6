"""Rate limits shared between the processes of a server, whatever keeps them: Redis
(replicas, ``--rate-limit-store redis://``) and the engine process (the front ends of
``--frontends N`` with the default ``--rate-limit-store memory``). The same contract runs
against both (:mod:`tests.limit_stores`): exact GCRA admission of concurrent checks,
leases that keep one budget, requests in flight counted across processes, a process
that stops freeing its share. Then a served ``--frontends 2`` keeps one budget per key
over both front ends.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from slipstream.errors import TooManyRequests
from slipstream.security.keys import ApiKey, KeyLimits, KeyRing
from slipstream.security.limits import Limiter
from slipstream.security.metrics import FrontDoorMetrics
from tests.limit_stores import EngineStores, RedisStores, Stores, wait_for
from tests.models import build_add_sub
from tests.redis_server import RedisServer
from tests.utils import RemoteServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("redis")) as running:
        yield running


@pytest.fixture(params=["redis", "engine"])
async def stores(
    request: pytest.FixtureRequest, redis: RedisServer, tmp_path: Path
) -> AsyncIterator[Stores]:
    made: Stores
    if request.param == "redis":
        made = RedisStores(redis)
    else:
        made = EngineStores(tmp_path)
        await made.start()
    try:
        yield made
    finally:
        await made.close()


async def test_the_shared_gcra_admits_concurrent_checks_exactly_as_the_local_one(
    stores: Stores,
) -> None:
    store = await stores.make()
    try:
        verdicts = await asyncio.gather(
            *(store.acquire("exact", rate_per_s=1.0, burst=10, cost=1) for _ in range(50))
        )
        assert [v.allowed for v in verdicts] == [True] * 10 + [False] * 40
        refused = verdicts[-1]
        assert 0 < refused.retry_after_s <= 1.01 and 9 <= refused.reset_s <= 10.01
        # Tokens: a cost-0 check passes until forced charges put the bucket in debt.
        assert (await store.acquire("tokens", 10.0, 600, 0)).allowed
        assert (await store.acquire("tokens", 10.0, 600, 900, force=True)).allowed
        debt = await store.acquire("tokens", 10.0, 600, 0)
        assert not debt.allowed and 29 <= debt.retry_after_s <= 30.01
    finally:
        await store.close()


async def test_fast_keys_spend_leases_and_two_processes_still_share_one_budget(
    stores: Stores,
) -> None:
    """Two stores (two server processes) share each key's budget: at 2,000 requests/s
    (leases of 10 tokens, LEASE_S of the rate) they admit no more than it together; at
    10^6 requests/s (a key that never refuses) the backend answers a small share of the
    checks."""
    ring = KeyRing(Path("unused.json"), [])
    _, shared = ring.create("shared", "infer", limits=KeyLimits(2000.0, 40))
    _, fast = ring.create("fast", "infer", limits=KeyLimits(1e6, 1_000_000))
    limiters = [Limiter(await stores.make(), FrontDoorMetrics()) for _ in range(2)]

    async def drive(key: ApiKey, seconds: float) -> tuple[int, int, float, int]:
        """(admitted, refused, elapsed s, backend calls) of 64 clients over both stores."""
        counts = [0, 0]
        calls = stores.calls()

        async def client(limiter: Limiter, until: float) -> None:
            while time.monotonic() < until:
                try:
                    await limiter.admit(key, generative=False)
                    counts[0] += 1
                except TooManyRequests:
                    counts[1] += 1
                await asyncio.sleep(0)

        started = time.monotonic()
        await asyncio.gather(
            *(client(limiter, started + seconds) for limiter in limiters for _ in range(32))
        )
        elapsed = time.monotonic() - started
        calls = stores.calls() - calls
        return counts[0], counts[1], elapsed, calls

    try:
        admitted, refused, elapsed, _ = await drive(shared, 1.0)
        budget = 40 + 2000.0 * elapsed
        assert refused > 0, "the clients never asked for more than the budget"
        assert 0.8 * budget <= admitted <= budget + 1, (admitted, budget)
        admitted, refused, _, calls = await drive(fast, 0.5)
        assert refused == 0 and admitted > 1000
        assert calls <= admitted / 20, f"{calls} backend calls for {admitted} admitted requests"
    finally:
        for limiter in limiters:
            await limiter.store.close()


async def test_requests_in_flight_count_across_processes_and_a_stopped_one_frees_its_share(
    stores: Stores,
) -> None:
    """A key's concurrency limit is one budget for every process sharing the backend
    (the front ends of --frontends N, replicas): 3 in flight over two processes fill a limit
    of 3; a release in one lets the other in; a process that stops without releasing
    (killed) stops counting once it has been silent for ``gone_after_s``."""
    ring = KeyRing(Path("unused.json"), [])
    _, key = ring.create("three", "infer", limits=KeyLimits(max_concurrent=3))
    one, two = [Limiter(await stores.make(gone_after_s=0.5), FrontDoorMetrics())
                for _ in range(2)]  # fmt: skip
    try:
        assert await one.admit(key, generative=False)
        assert await one.admit(key, generative=False)
        assert await two.admit(key, generative=False)
        for limiter in (one, two):
            with pytest.raises(TooManyRequests) as refused:
                await limiter.admit(key, generative=False)
            assert ("ratelimit-policy", '"concurrency";q=3') in refused.value.headers
        one.release(key)
        assert await wait_for(lambda: two.admit(key, generative=False), 2.0)
        with pytest.raises(TooManyRequests):
            await one.admit(key, generative=False)
        # `one` stops holding its request without releasing it (a killed process).
        await one.store.close()
        started = time.monotonic()
        assert await wait_for(lambda: two.admit(key, generative=False), 5.0)
        assert 0.3 <= time.monotonic() - started <= 3.0
        # Now `two` holds all three; its releases free them for anyone.
        for _ in range(3):
            two.release(key)
        for _ in range(3):
            assert await wait_for(lambda: two.admit(key, generative=False), 2.0)
    finally:
        await one.store.close()
        await two.store.close()


async def test_a_request_that_goes_away_while_counted_leaves_no_slot_taken(
    stores: Stores,
) -> None:
    ring = KeyRing(Path("unused.json"), [])
    _, key = ring.create("one-at-a-time", "infer", limits=KeyLimits(max_concurrent=1))
    first, other = [Limiter(await stores.make(), FrontDoorMetrics()) for _ in range(2)]
    try:
        for _ in range(5):
            admitting = asyncio.ensure_future(first.admit(key, generative=False))
            await asyncio.sleep(0)  # the call is on its way to the backend
            admitting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await admitting
        # Whether or not the backend counted them, none of the five holds the key's one slot.
        assert await wait_for(lambda: other.admit(key, generative=False), 2.0)
    finally:
        await first.store.close()
        await other.store.close()


RATE, BURST = 20.0, 20


@pytest.fixture(scope="module")
def split_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RemoteServer, str]]:
    """``--frontends 2`` with an API key limited to RATE/s (burst BURST); the server and
    the key's secret."""
    tmp = tmp_path_factory.mktemp("split_limits")
    ring = KeyRing.load(tmp / "keys.json", missing_ok=True)
    secret, _ = ring.create("shared", "infer", limits=KeyLimits(RATE, BURST))
    ring.save()
    build_add_sub(tmp / "repo")
    args = ["--frontends", "2", "--auth-file", str(tmp / "keys.json")]
    with RemoteServer(tmp / "repo", args, log_dir=tmp) as server:
        yield server, secret


def test_the_front_ends_of_one_server_share_each_keys_budget(
    split_server: tuple[RemoteServer, str],
) -> None:
    """A key's requests over sixteen connections (spread by the kernel over both front
    ends) are admitted within one budget, not one per front end; both refused some."""
    server, secret = split_server
    admitted, (least, most), statuses = _within_budget(server, secret, 3.0)
    assert 0.9 * least <= admitted <= most + 1, (admitted, least, most, len(statuses))
    metrics = httpx.get(server.url("/metrics"), timeout=30).text
    for frontend in ("0", "1"):
        labels = ('key="shared"', 'limit="requests"', f'frontend="{frontend}"')
        refused = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith("slipstream_rate_limited_total{")
                   and all(label in line for label in labels)]  # fmt: skip
        assert refused and refused[0] > 0, f"front end {frontend} refused nothing"


def test_limits_fail_open_while_the_engine_restarts_and_hold_again_after(
    split_server: tuple[RemoteServer, str],
) -> None:
    """kill -9 of the engine: the front ends cannot ask it, so they admit (and say so
    once in the log); the engine started again counts from a full budget, and the key
    is limited again within one budget."""
    server, secret = split_server
    os.kill(server.engine_pids()[-1], signal.SIGKILL)
    url = server.url("/v2/models/add_sub")
    headers = {"Authorization": f"Bearer {secret}"}
    deadline = time.monotonic() + 60
    statuses = []
    with httpx.Client(timeout=30) as client:
        while client.get(server.url("/v2/health/ready")).status_code != 200:
            assert time.monotonic() < deadline, "the engine never came back"
            statuses.append(client.get(url, headers=headers).status_code)
            time.sleep(0.05)
    assert 503 in statuses and 429 not in statuses, statuses
    assert "rate-limit store unreachable" in server.log_text()
    time.sleep(1.0)  # past any lease, and the budget back
    admitted, (least, most), statuses = _within_budget(server, secret, 2.0)
    assert 0.9 * least <= admitted <= most + 1, (admitted, least, most, len(statuses))
    assert "rate-limit store answers again" in server.log_text()


def _within_budget(server: RemoteServer, secret: str, seconds: float
                   ) -> tuple[int, tuple[float, float], list[int]]:  # fmt: skip
    """(admitted, the key's budget at least and at most, every status) of sixteen clients
    hammering ``add_sub`` for ``seconds``; every status is 200 or 429.

    The budget is BURST plus RATE over the time the limiter saw checks: at least from the
    first answer to the last request sent (its bucket, full before, holds BURST however
    late the first check comes), at most from the first request sent to the last answer.
    """
    url = server.url("/v2/models/add_sub")
    statuses, (first_sent, first_answered, last_sent, last_answered) = asyncio.run(
        _hammer(url, secret, connections=16, seconds=seconds)
    )
    admitted = statuses.count(200)
    assert statuses.count(429) == len(statuses) - admitted, set(statuses)
    least = BURST + RATE * max(0.0, last_sent - first_answered)
    return admitted, (least, BURST + RATE * (last_answered - first_sent)), statuses


async def _hammer(url: str, secret: str, connections: int, seconds: float
                  ) -> tuple[list[int], tuple[float, float, float, float]]:  # fmt: skip
    """Each of ``connections`` clients (a connection each) looping for ``seconds``: every
    status, and when the first request was sent, the first answered, the last sent and the
    last answered."""
    statuses: list[int] = []
    sent: list[float] = []
    answered: list[float] = []
    headers = {"Authorization": f"Bearer {secret}"}

    async def client_loop(until: float) -> None:
        limits = httpx.Limits(max_connections=1)
        async with httpx.AsyncClient(timeout=30, limits=limits) as client:
            while time.monotonic() < until:
                sent.append(time.monotonic())
                statuses.append((await client.get(url, headers=headers)).status_code)
                answered.append(time.monotonic())

    started = time.monotonic()
    await asyncio.gather(*(client_loop(started + seconds) for _ in range(connections)))
    return statuses, (min(sent), min(answered), max(sent), max(answered))
