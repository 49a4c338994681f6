"""What the front door (issue #13) costs and saves, as the issue's target ratios.

1. Auth + in-process limiter on `mlp` at C=64, as a fraction of the same server without
   them (target >= 0.97); with the limiter in Redis (target >= 0.85). The key's limits
   are set so high that every request passes the limiter's full check and none is refused.
2. Response cache, 100% hits (one request body repeated): `minilm` against no cache
   (target >= 20x), `mlp` against no cache (target >= 0.9); a Redis hit's p50 at C=1 over
   a local hit's (target <= +1 ms).
3. Two server processes sharing a Redis limiter of 100 req/s for one key: requests
   admitted per second by both together, after the burst (target 100 +- 5).

The server is pinned to one core (`taskset -c 0`), this script's load generator (a
closed loop of keep-alive HTTP/1.1 connections on httptools, each sending one pre-built
request at a time) to another; redis-server runs on `--redis-core` (default: the load
generator's; on two cores there is no third to give it). Each level
runs a warm-up (discarded), then `--duration` seconds; the servers of one figure all run
at once and its levels take turns, `--rounds` times, and the figure is the median of the
per-round ratios (the range beside it); figure 1 starts its servers afresh each round and
rotates the order, and measures a second identical server beside them (the noise floor
between two processes). Beside req/s, each level prints the server's CPU
per request (its process's CPU time over the level, by psutil) and a figure's ratio of
those ("by CPU/req"): a capacity ratio that other work on the server's core blurs less.
Figures taken beside other work are noisy: the load average is printed with them.

Where even that is too noisy (two identical servers differing by 10-30% a round),
``--only instructions`` measures figure 1's levels in instructions instead: each server
runs under valgrind's callgrind, counted idle for a third of ``--duration`` seconds (its
timers: the auth level's keys-file watcher, ~200-280x more of a request under
callgrind's slowdown than in real time), then over ``--duration`` seconds of load, and the figure is
the server's instructions per request (every thread of the process, less the idle rate
over the same time) and their ratio, the same on a busy machine as on an idle one. It
counts work, not time: cache misses and the other core's interference are not in it, and
the level's mean batch (printed beside it) must match for the counts to compare. Under
callgrind the server answers ~40 requests a second (~2,400 a level), ~200-280x fewer
than by the clock (8,300-11,100 req/s in `--only auth` runs on the same machine).

    .venv/bin/python benchmarks/front_door.py                  # everything, 5 s a level
    .venv/bin/python benchmarks/front_door.py --duration 3 --only auth
    .venv/bin/python benchmarks/front_door.py --duration 60 --only instructions
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httptools
import psutil

import models
from servers import ServerSpec, free_port, running

BENCH_DIR = Path(__file__).resolve().parent
SLIPSTREAM = Path(sys.executable).parent / "slipstream"
FIGURES = ("auth", "cache", "shared")
# Not run by default: figure 1 counted by callgrind (see the module docstring).
INSTRUCTIONS = "instructions"


@dataclass
class Load:
    """What one level measured."""

    requests: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    latencies_s: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0
    # Requests answered over the whole level, warm-up included, and the CPU seconds the
    # server process spent meanwhile: CPU per request holds up better than req/s when
    # other work shares the server's core.
    all_requests: int = 0
    server_cpu_s: float = 0.0
    # The model's inferences and batch executions over the level (V2 statistics): their
    # ratio is the mean batch, which moves CPU per request more than any per-request step.
    inferences: int = 0
    executions: int = 0

    @property
    def mean_batch(self) -> float:
        return self.inferences / self.executions if self.executions else 0.0

    @property
    def cpu_per_request_us(self) -> float:
        return self.server_cpu_s / self.all_requests * 1e6 if self.all_requests else 0.0

    @property
    def req_per_s(self) -> float:
        return self.requests / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def p50_ms(self) -> float:
        return statistics.median(self.latencies_s) * 1e3 if self.latencies_s else 0.0


class _Connection(asyncio.Protocol):
    """One keep-alive connection sending ``request`` again as soon as it is answered."""

    def __init__(self, request: bytes, load: Load, measure_from: float, until: float) -> None:
        self._request = request
        self._load = load
        self._measure_from = measure_from
        self._until = until
        self._parser = httptools.HttpResponseParser(self)
        self._sent = 0.0
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._send()

    def _send(self) -> None:
        self._sent = time.perf_counter()
        self._transport.write(self._request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_message_complete(self) -> None:
        now = time.perf_counter()
        self._load.all_requests += 1
        if now >= self._measure_from:
            load = self._load
            load.requests += 1
            status = self._parser.get_status_code()
            load.statuses[status] = load.statuses.get(status, 0) + 1
            load.latencies_s.append(now - self._sent)
        if now < self._until:
            self._send()
        elif not self.done.done():
            self.done.set_result(None)
            self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


def request_bytes(port: int, path: str, body: bytes, headers: dict[str, str]) -> bytes:
    lines = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json"
        f"\r\nContent-Length: {len(body)}\r\n{lines}\r\n"
    )
    return head.encode() + body


async def _drive(
    targets: list[tuple[int, bytes]], connections: int, warmup_s: float, duration_s: float
) -> Load:
    loop = asyncio.get_running_loop()
    load = Load()
    start = time.perf_counter()
    measure_from, until = start + warmup_s, start + warmup_s + duration_s
    protocols = []
    for index in range(connections):
        port, request = targets[index % len(targets)]
        _, protocol = await loop.create_connection(
            lambda request=request: _Connection(request, load, measure_from, until),  # type: ignore[misc]
            "127.0.0.1",
            port,
        )
        protocols.append(protocol)
    await asyncio.gather(*(p.done for p in protocols))
    load.elapsed_s = time.perf_counter() - measure_from
    return load


def drive(
    targets: list[tuple[int, bytes]], connections: int, warmup_s: float, duration_s: float
) -> Load:
    try:
        import uvloop

        return uvloop.run(_drive(targets, connections, warmup_s, duration_s))
    except ImportError:
        return asyncio.run(_drive(targets, connections, warmup_s, duration_s))


def serve_spec(label: str, repo: Path, *args: str) -> ServerSpec:
    port = free_port()
    argv = [
        str(SLIPSTREAM),
        "serve",
        "--model-repository",
        str(repo),
        "--host",
        "127.0.0.1",
        "--http-port",
        str(port),
        "--grpc-port",
        "0",
        "--log-level",
        "warning",
        *args,
    ]
    return ServerSpec(label, argv, port, "/v2/health/ready")


@contextmanager
def redis_server(work: Path, core: int | None) -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is missing: `make install` installs it")
    port = free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(work)]
    pinned = (["taskset", "-c", str(core)] if core is not None else []) + argv
    process = subprocess.Popen(pinned, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        time.sleep(0.5)
        yield f"redis://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(10)


def make_key(work: Path, name: str, *limits: str, file: str = "") -> tuple[Path, str]:
    """A new key named ``name`` in ``work/<file or name>.json``: the file and the key."""
    auth_file = work / f"{file or name}.json"
    made = subprocess.run(
        [str(SLIPSTREAM), "keys", "create", "--auth-file", str(auth_file), "--name", name, *limits],
        check=True,
        capture_output=True,
        text=True,
    )
    return auth_file, made.stdout.strip()


def prepare_repo(source: Path, work: Path) -> Path:
    """mlp and minilm copied with ``response_cache: {enable: true}`` added to their configs."""
    repo = work / "repo"
    for name in ("mlp", "minilm"):
        shutil.copytree(source / name, repo / name, symlinks=True)
        config = repo / name / "config.yaml"
        text = config.read_text() if config.exists() else ""
        config.write_text(text + "\nresponse_cache:\n  enable: true\n")
    return repo


def infer_request(port: int, model: str, headers: dict[str, str] | None = None) -> bytes:
    body = models.json_body(models.sample_inputs(model)).body
    return request_bytes(port, f"/v2/models/{model}/infer", body, headers or {})


@contextmanager
def servers(specs: list[ServerSpec], core: int | None, work: Path) -> Iterator[None]:
    """Every server of ``specs`` running (idle until driven) for the block."""
    with ExitStack() as stack:
        for spec in specs:
            stack.enter_context(running(spec, core, work / f"{spec.label}.log"))
        yield


def rounds(
    levels: dict[str, tuple[int, bytes]],
    connections: int,
    args: argparse.Namespace,
    stats: tuple[str, dict[str, str]] | None = None,
) -> dict[str, list[Load]]:
    """Every level once per round, in turn, so drift on a shared machine hits all alike.
    ``stats``: (model, headers) to read each level's mean batch from the V2 statistics."""
    results: dict[str, list[Load]] = {label: [] for label in levels}
    processes = {label: _listening(port) for label, (port, _) in levels.items()}
    for _ in range(args.rounds):
        for label, target in levels.items():
            before = _cpu_s(processes[label])
            counts = _model_counts(target[0], stats)
            load = drive([target], connections, args.warmup, args.duration)
            load.server_cpu_s = _cpu_s(processes[label]) - before
            after = _model_counts(target[0], stats)
            load.inferences, load.executions = after[0] - counts[0], after[1] - counts[1]
            results[label].append(load)
    return results


def _model_counts(port: int, stats: tuple[str, dict[str, str]] | None) -> tuple[int, int]:
    """(inference_count, execution_count) of the model's first version, or zeros."""
    if stats is None:
        return 0, 0
    model, headers = stats
    url = f"http://127.0.0.1:{port}/v2/models/{model}/stats"
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers)) as reply:
        entry = json.load(reply)["model_stats"][0]
    return int(entry["inference_count"]), int(entry["execution_count"])


def _listening(port: int) -> psutil.Process | None:
    """The process listening on ``port`` (None when it cannot be seen)."""
    for connection in psutil.net_connections("tcp"):
        if connection.laddr and connection.laddr.port == port and connection.status == "LISTEN":
            return psutil.Process(connection.pid) if connection.pid else None
    return None


def _cpu_s(process: psutil.Process | None) -> float:
    if process is None:
        return 0.0
    times = process.cpu_times()
    return float(times.user + times.system)


def report(label: str, loads: list[Load], base: list[Load] | None = None, target: str = "") -> None:
    """Median req/s and p50 over the rounds; with ``base``, the median of per-round ratios."""
    rate = statistics.median(load.req_per_s for load in loads)
    p50 = statistics.median(load.p50_ms for load in loads)
    cpu_us = statistics.median(load.cpu_per_request_us for load in loads)
    batch = statistics.median(load.mean_batch for load in loads)
    ratio = ""
    if base:
        ratios = [load.req_per_s / b.req_per_s for load, b in zip(loads, base, strict=True)]
        capacity = [
            b.cpu_per_request_us / load.cpu_per_request_us
            for load, b in zip(loads, base, strict=True)
            if load.cpu_per_request_us
        ]
        ratio = (
            f"  ratio {statistics.median(ratios):6.3f} "
            f"[{min(ratios):.3f}..{max(ratios):.3f}]"
            + (f" (target {target})" if target else "")
            + (f"; by CPU/req {statistics.median(capacity):.3f}" if capacity else "")
        )
    other: dict[int, int] = {}
    for load in loads:
        for status, count in load.statuses.items():
            if status != 200:
                other[status] = other.get(status, 0) + count
    print(
        f"  {label:<30} {rate:9.0f} req/s  p50 {p50:7.3f} ms  CPU/req {cpu_us:6.1f} us"
        + (f"  batch {batch:5.1f}" if batch else "")
        + ratio
        + (f"  non-200: {other}" if other else ""),
        flush=True,
    )


def auth_figures(repo: Path, work: Path, args: argparse.Namespace) -> None:
    print(f"1. auth + limiter, mlp, C={args.connections}")
    # An admin key: it may also read the statistics (the mean batch of each level).
    auth_file, key = make_key(
        work, "bench", "--role", "admin", "--rate", "1000000", "--burst", "1000000"
    )
    bearer = {"Authorization": f"Bearer {key}"}
    # The same limits and a concurrency limit (counted in Redis across processes), in the
    # same keys file: the statistics are read with the first key on every server.
    _, counted = make_key(
        work, "bench-concurrency", "--role", "admin", "--rate", "1000000",
        "--burst", "1000000", "--concurrency", "1000000", file="bench",
    )  # fmt: skip
    counted_bearer = {"Authorization": f"Bearer {counted}"}
    labels = ("none", "twin", "header", "memory", "redis", "redis_concurrency")
    loads: dict[str, list[Load]] = {label: [] for label in labels}
    one_round = argparse.Namespace(**{**vars(args), "rounds": 1})
    with redis_server(work, args.redis_core) as url:
        # Fresh server processes every round, the levels' order rotated: two identical
        # processes kept for a whole run differed by 2.5%, as much as the door costs, so
        # that difference must average out over the rounds, not stay in every round's
        # ratio.
        for turn in range(args.rounds):
            none = serve_spec("none", repo)
            # The same server again: the noise floor of comparing two processes.
            twin = serve_spec("twin", repo)
            memory = serve_spec("auth", repo, "--auth-file", str(auth_file))
            shared = serve_spec(
                "redis", repo, "--auth-file", str(auth_file), "--rate-limit-store", url
            )
            concurrent = serve_spec(
                "redis-concurrency", repo, "--auth-file", str(auth_file),
                "--rate-limit-store", url,
            )  # fmt: skip
            levels = {
                "none": (none.port, infer_request(none.port, "mlp")),
                "twin": (twin.port, infer_request(twin.port, "mlp")),
                "header": (none.port, infer_request(none.port, "mlp", bearer)),
                "memory": (memory.port, infer_request(memory.port, "mlp", bearer)),
                "redis": (shared.port, infer_request(shared.port, "mlp", bearer)),
                "redis_concurrency": (
                    concurrent.port,
                    infer_request(concurrent.port, "mlp", counted_bearer),
                ),
            }
            order = labels[turn % len(labels) :] + labels[: turn % len(labels)]
            with servers([none, twin, memory, shared, concurrent], args.server_core, work):
                measured = rounds(
                    {label: levels[label] for label in order},
                    args.connections,
                    one_round,
                    stats=("mlp", bearer),
                )
            for label in labels:
                loads[label] += measured[label]
    report("no auth, no limits", loads["none"])
    report("the same, a second process", loads["twin"], loads["none"])
    # What the Authorization header costs the HTTP parser alone, with no front door.
    report("no auth, header sent anyway", loads["header"], loads["none"])
    report("auth + in-process limiter", loads["memory"], loads["none"], ">= 0.97")
    report("auth + Redis limiter", loads["redis"], loads["none"], ">= 0.85")
    report("the same, concurrency too", loads["redis_concurrency"], loads["none"])


def auth_instructions(repo: Path, work: Path, args: argparse.Namespace) -> None:
    """Figure 1's first levels in instructions per request, counted by callgrind."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("valgrind is missing: `make install` installs it")
    print(f"1. auth + limiter, mlp, C={args.connections}, in instructions (callgrind)")
    auth_file, key = make_key(
        work, "bench", "--role", "admin", "--rate", "1000000", "--burst", "1000000"
    )
    bearer = {"Authorization": f"Bearer {key}"}
    levels = [
        ("no auth, no limits", (), {}),
        ("no auth, header sent anyway", (), bearer),
        ("auth + in-process limiter", ("--auth-file", str(auth_file)), bearer),
    ]
    base = 0.0
    for label, extra, headers in levels:
        count, batch, requests = _instructions_per_request(
            repo, work, label, extra, headers, bearer, args
        )
        line = (f"  {label:32s} {count:10,.0f} instructions/request  batch {batch:5.1f}"
                f"  ({requests} requests)")  # fmt: skip
        if base:
            line += f"  ratio {base / count:.4f}"
            line += " (target >= 0.97)" if label.startswith("auth") else ""
        base = base or count
        print(line, flush=True)


def _instructions_per_request(
    repo: Path,
    work: Path,
    label: str,
    extra: tuple[str, ...],
    headers: dict[str, str],
    bearer: dict[str, str],
    args: argparse.Namespace,
) -> tuple[float, float, int]:
    """(instructions per request, mean batch, requests) of one level: a server under
    callgrind, counted idle for a third of ``args.duration`` s, then over ``args.duration``
    s of load; a request's count is the load's less the idle rate over the same time.
    No request is in flight at either end: each drive ends once every connection has its
    answer."""
    spec = serve_spec(label, repo, *extra)
    out = work / f"callgrind-{spec.port}.out"
    argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable,
            *spec.argv]  # fmt: skip
    spec = ServerSpec(label, argv, spec.port, spec.ready_path, startup_timeout_s=900)
    target = [(spec.port, infer_request(spec.port, "mlp", headers))]
    with running(spec, args.server_core, work / f"callgrind-{spec.port}.log"):
        process = _listening(spec.port)
        assert process is not None, "the server under callgrind is not listening"
        drive(target, args.connections, 0.0, max(5.0, args.warmup * 10))
        idle_s = _counted(process.pid, lambda: time.sleep(args.duration / 3))
        before = _model_counts(spec.port, ("mlp", bearer))
        load = Load()

        def run_load() -> None:
            nonlocal load
            load = drive(target, args.connections, 0.0, args.duration)

        load_s = _counted(process.pid, run_load)
        after = _model_counts(spec.port, ("mlp", bearer))
    # The dumps asked for are the first two part files (the last is written at exit).
    idle, loaded = (_summary(Path(f"{out}.{part}")) for part in (1, 2))
    executions = after[1] - before[1]
    mean_batch = (after[0] - before[0]) / executions if executions else 0.0
    requests = load.all_requests
    return (loaded - idle / idle_s * load_s) / requests, mean_batch, requests


def _counted(pid: int, work: Callable[[], None]) -> float:
    """Zero callgrind's counters, run ``work``, dump them: the seconds it took."""
    control = ["callgrind_control", "--zero", str(pid)]
    subprocess.run(control, check=True, capture_output=True)
    started = time.perf_counter()
    work()
    elapsed = time.perf_counter() - started
    subprocess.run([*control[:1], "--dump", str(pid)], check=True, capture_output=True)
    return elapsed


def _summary(dump: Path) -> int:
    """The instructions a callgrind dump counted."""
    for line in dump.read_text(errors="replace").splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    raise RuntimeError(f"{dump}: no summary line")


def cache_figures(repo: Path, work: Path, args: argparse.Namespace) -> None:
    print(f"2. response cache, 100% hits, C={args.connections}; Redis vs local hit p50 at C=1")
    with redis_server(work, args.redis_core) as url:
        none = serve_spec("nocache", repo)
        local = serve_spec("local", repo, "--cache", "local:size=64MB")
        remote = serve_spec("rediscache", repo, "--cache", url)
        with servers([none, local, remote], args.server_core, work):
            for model, target in (("minilm", ">= 20"), ("mlp", ">= 0.9")):
                loads = rounds(
                    {
                        "none": (none.port, infer_request(none.port, model)),
                        "local": (local.port, infer_request(local.port, model)),
                    },
                    args.connections,
                    args,
                )
                report(f"{model}: no cache", loads["none"])
                report(f"{model}: local cache hits", loads["local"], loads["none"], target)
            hits = rounds(
                {
                    "local": (local.port, infer_request(local.port, "mlp")),
                    "redis": (remote.port, infer_request(remote.port, "mlp")),
                },
                1,
                args,
            )
    report("mlp: local cache hit, C=1", hits["local"])
    report("mlp: Redis cache hit, C=1", hits["redis"])
    added = statistics.median(
        r.p50_ms - loc.p50_ms for r, loc in zip(hits["redis"], hits["local"], strict=True)
    )
    print(f"  Redis hit p50 - local hit p50: {added:+.3f} ms (target <= +1 ms)")


def shared_figure(repo: Path, work: Path, args: argparse.Namespace) -> None:
    print("3. two servers, one Redis limiter of 100 req/s for one key")
    auth_file, key = make_key(work, "shared", "--rate", "100", "--burst", "100")
    bearer = {"Authorization": f"Bearer {key}"}
    with redis_server(work, args.redis_core) as url:
        specs = [
            serve_spec(f"s{i}", repo, "--auth-file", str(auth_file), "--rate-limit-store", url)
            for i in (1, 2)
        ]
        with (
            running(specs[0], args.server_core, work / "s1.log"),
            running(specs[1], args.server_core, work / "s2.log"),
        ):
            targets = [(s.port, infer_request(s.port, "mlp", bearer)) for s in specs]
            # The warm-up spends the burst; what is measured is the sustained rate.
            load = drive(targets, 16, max(args.warmup, 2.0), args.duration)
    admitted = load.statuses.get(200, 0) / load.elapsed_s
    print(
        f"  admitted {admitted:6.1f} req/s of {load.req_per_s:.0f} offered "
        f"(target 100 +- 5); refused with 429: {load.statuses.get(429, 0)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=Path("models"), help="example models")
    parser.add_argument("--duration", type=float, default=5.0, help="measured s per level")
    parser.add_argument("--warmup", type=float, default=1.0, help="discarded s per level")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="levels repeated, in turn")
    parser.add_argument(
        "--only", default=",".join(FIGURES), help=f"auth,cache,shared (or {INSTRUCTIONS})"
    )
    parser.add_argument("--server-core", type=int, default=0)
    parser.add_argument("--client-core", type=int, default=1)
    parser.add_argument("--redis-core", type=int, default=1, help="where redis-server runs")
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.client_core})
    models.build_repository(args.repo, ["mlp", "minilm"])
    print(
        f"load average at start: {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores); "
        f"server on core {args.server_core}, load generator on core "
        f"{args.client_core}, redis-server on core {args.redis_core}"
    )
    with tempfile.TemporaryDirectory(prefix="front-door-") as tmp:
        work = Path(tmp)
        repo = prepare_repo(args.repo, work)
        wanted = set(args.only.split(","))
        for name, figure in (
            ("auth", auth_figures),
            ("cache", cache_figures),
            ("shared", shared_figure),
            (INSTRUCTIONS, auth_instructions),
        ):
            if name in wanted:
                figure(repo, work, args)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
