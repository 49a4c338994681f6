"""The text routes of V2 models with a tokenizer, served against the framework alone, in
one run: ``/v1/embeddings``, ``/classify``, ``/v1/score`` and ``/v1/rerank``.

Prints requests/s, texts/s, p50/p99 and ratios (a script, never a test). For each case
(a route, a model, a request body), in alternating rounds:

- ``alone``: what a client runs in process for the same request: the tokenizer file
  through ``tokenizers`` (``encode_batch``, padded to the request's longest text as the
  server pads it), then ONNX Runtime on the same model with the server's session options
  (one intra-op thread on one core, denormals flushed, no spinning), then the activation
  (sigmoid, softmax); back to back on the server's core while the server idles;
- ``served``: ``slipstream serve`` answering the route over HTTP to a closed-loop
  client (keep-alive connections, one pre-encoded body, asyncio on uvloop) pinned to
  another core, at each ``--concurrency``.

``served/alone`` is served texts/s over alone texts/s, paired round by round: the median
and the range over the rounds. ``CPU alone/served`` is the in-process CPU per request
over the server's (all its processes) CPU per request: what serving costs in capacity,
which other work on a shared host blurs less than throughput does. At concurrency 1 the
served request also pays the loopback round trip and the client; at 8 the server's
batcher may merge requests, which the alone figure (one request's batch) never does.

Cases: ``embed-1`` and ``embed-16`` (/v1/embeddings on ``minilm``, 1 and 16 texts),
``classify-1`` and ``classify-16`` (/classify on a 3-class classifier), ``score-1``
(/v1/score, one query and one document) and ``rerank-16`` (/v1/rerank, one query and 16
documents) on a cross-encoder. Texts are lines of ``benchmarks/data/sentences.txt``; a
document is three of them.

Models (built into ``--repo`` when missing, nothing downloaded): ``minilm`` from
``examples/build_models.py`` (all-MiniLM-L6-v2, mean-pooled and normalised), and
random-weight ``BertForSequenceClassification`` of MiniLM's size (6 layers x 384, 12
heads) with one label (``reranker``) and three (``classifier``), exported to ONNX as
tests/integration/test_rerank.py does, all three with minilm's tokenizer file.

``--src a,b`` serves each source tree (put first on the server's PYTHONPATH) from its own
server, both up for the whole run, and measures them in turn within each round (forwards,
then backwards), so ``src2/src1`` is a before/after taken side by side in time:

    git worktree add /tmp/old HEAD
    .venv/bin/python benchmarks/text_routes.py --src /tmp/old/src,src --json out.json

Usage (from the repository root; ~5 min on 2 cores for one tree at the defaults):
    .venv/bin/python benchmarks/text_routes.py
    .venv/bin/python benchmarks/text_routes.py --cases embed-16,rerank-16 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.utils import free_ports  # noqa: E402

VENV_BIN = Path(sys.executable).parent
SENTENCES = ROOT / "benchmarks" / "data" / "sentences.txt"
# The random BERTs: all-MiniLM-L6-v2's shape.
BERT_SHAPE = {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12,
              "intermediate_size": 1536}  # fmt: skip
CONFIG = (
    "max_batch_size: 64\n"
    "tokenizer: tokenizer.json\n"
    "dynamic_batching:\n"
    "  preferred_batch_size: [4]\n"
)


@dataclass(frozen=True)
class Case:
    """One request sent over and over."""

    name: str
    route: str
    model: str
    # The request's JSON body.
    body: dict[str, Any]
    # Texts (or pairs) the request carries: texts/s is requests/s times this.
    texts: int


@dataclass
class Figures:
    """One case's measurements on one side (alone, or a tree at one concurrency), one
    value per round."""

    requests_per_s: list[float] = field(default_factory=list)
    p50_ms: list[float] = field(default_factory=list)
    p99_ms: list[float] = field(default_factory=list)
    # CPU per request: the alone process's, or the server's (all its processes).
    cpu_ms: list[float] = field(default_factory=list)


def cases(names: set[str]) -> list[Case]:
    lines = [line.strip() for line in SENTENCES.read_text().splitlines() if line.strip()]
    texts = lines[:16]
    query = "Which meeting were the slides from?"
    documents = [" ".join(lines[16 + 3 * i : 19 + 3 * i]) for i in range(16)]
    every = [
        Case("embed-1", "/v1/embeddings", "minilm", {"model": "minilm", "input": texts[0]}, 1),
        Case("embed-16", "/v1/embeddings", "minilm", {"model": "minilm", "input": texts}, 16),
        Case("classify-1", "/classify", "classifier",
             {"model": "classifier", "input": texts[0]}, 1),
        Case("classify-16", "/classify", "classifier",
             {"model": "classifier", "input": texts}, 16),
        Case("score-1", "/v1/score", "reranker",
             {"model": "reranker", "text_1": query, "text_2": documents[0]}, 1),
        Case("rerank-16", "/v1/rerank", "reranker",
             {"model": "reranker", "query": query, "documents": documents}, 16),
    ]  # fmt: skip
    return [case for case in every if case.name in names]


# ---------------------------------------------------------------- models


def build_models(repo: Path) -> None:
    """minilm from examples/build_models.py; the random cross-encoder and classifier."""
    if not (repo / "minilm" / "config.yaml").is_file():
        subprocess.run(
            [sys.executable, str(ROOT / "examples" / "build_models.py"), str(repo),
             "--only", "minilm"],
            check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )  # fmt: skip
    tokenizer = repo / "minilm" / "tokenizer" / "tokenizer.json"
    for name, labels in (("reranker", 1), ("classifier", 3)):
        if not (repo / name / "config.yaml").is_file():
            _export_bert(repo / name, labels, tokenizer)


def _export_bert(directory: Path, labels: int, tokenizer_file: Path) -> None:
    import warnings

    import torch
    from tokenizers import Tokenizer
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    config = BertConfig.from_dict({
        "vocab_size": tokenizer.get_vocab_size(), **BERT_SHAPE, "num_labels": labels,
        "attn_implementation": "eager",
    })  # fmt: skip
    model: Any = BertForSequenceClassification(config)
    model.eval()
    (directory / "1").mkdir(parents=True, exist_ok=True)
    names = ["input_ids", "attention_mask", "token_type_ids"]
    # A padded row in the dummy batch keeps the attention mask in the traced graph.
    encoded = tokenizer.encode_batch([("a cat", "a small cat purrs"), ("a dog", "it barks")])
    sample = [torch.tensor([getattr(e, a) for e in encoded])
              for a in ("ids", "attention_mask", "type_ids")]  # fmt: skip
    with warnings.catch_warnings():  # the legacy exporter's deprecation and tracer notes
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model, tuple(sample), str(directory / "1" / "model.onnx"),
            input_names=names, output_names=["logits"],
            dynamic_axes={**{n: {0: "batch", 1: "tokens"} for n in names},
                          "logits": {0: "batch"}},
            opset_version=17, dynamo=False,
        )  # fmt: skip
    (directory / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    if labels > 1:
        names_by_id = {str(i): f"class_{i}" for i in range(labels)}
        (directory / "config.json").write_text(json.dumps({"id2label": names_by_id}))
    (directory / "config.yaml").write_text(CONFIG)


# ---------------------------------------------------------------- alone


def alone_call(case: Case, repo: Path) -> Callable[[], Any]:
    """The request's work as a client does it in process: tokenize, run, activate."""
    import onnxruntime as ort
    from tokenizers import Tokenizer

    from slipstream.runtime.onnx import session_options

    directory = repo / case.model
    tokenizer_file = next(
        p
        for p in (directory / "tokenizer.json", directory / "tokenizer" / "tokenizer.json")
        if p.is_file()
    )
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")  # to the batch's longest
    # The server's options for one instance on one core: called pinned to one core.
    session = ort.InferenceSession(str(directory / "1" / "model.onnx"),
                                   session_options({}, 1))  # fmt: skip
    wanted = {i.name for i in session.get_inputs()}
    body = case.body
    if case.route == "/v1/embeddings" or case.route == "/classify":
        items: list[Any] = body["input"] if isinstance(body["input"], list) else [body["input"]]
    elif case.route == "/v1/score":
        items = [(body["text_1"], body["text_2"])]
    else:
        items = [(body["query"], document) for document in body["documents"]]

    def call() -> Any:
        encoded = tokenizer.encode_batch(items)
        feeds = {
            "input_ids": np.array([e.ids for e in encoded], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in encoded], dtype=np.int64),
            "token_type_ids": np.array([e.type_ids for e in encoded], dtype=np.int64),
        }
        out = session.run(None, {k: v for k, v in feeds.items() if k in wanted})[0]
        if case.route == "/classify":
            shifted = np.exp(out - out.max(axis=1, keepdims=True))
            return shifted / shifted.sum(axis=1, keepdims=True)
        if case.route != "/v1/embeddings":
            return 1.0 / (1.0 + np.exp(-out[:, 0]))
        return out

    return call


def measure_alone(call: Callable[[], Any], seconds: float) -> dict[str, float]:
    """Calls back to back (this process is pinned to the server's core): requests/s,
    p50/p99 ms, CPU ms per call."""
    warm_until = time.perf_counter() + min(1.0, seconds / 3)
    while time.perf_counter() < warm_until:
        call()
    times: list[float] = []
    cpu_started, started = time.process_time(), time.perf_counter()
    while time.perf_counter() - started < seconds:
        begun = time.perf_counter()
        call()
        times.append(time.perf_counter() - begun)
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    return {"requests_per_s": len(times) / elapsed, "p50_ms": _percentile(times, 50) * 1e3,
            "p99_ms": _percentile(times, 99) * 1e3, "cpu_ms": cpu / len(times) * 1e3}  # fmt: skip


# ---------------------------------------------------------------- served


def measure_served(
    server: psutil.Process,
    port: int,
    case: Case,
    concurrency: int,
    args: argparse.Namespace,
    work: Path,
) -> dict[str, float]:
    """The closed-loop client (a subprocess on the client core) against the server."""
    body = work / f"{case.name}.json"
    body.write_bytes(json.dumps(case.body).encode())
    command = [
        "taskset", "-c", str(args.client_core), sys.executable, __file__, "--client",
        str(port), case.route, str(body), str(concurrency), str(args.seconds),
        str(args.warmup),
    ]  # fmt: skip
    cpu_before = _cpu_seconds(server)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    cpu_used = _cpu_seconds(server) - cpu_before
    if done.returncode != 0:
        raise RuntimeError(f"the client failed on {case.name}: {done.stderr[-1500:]}")
    found = json.loads(done.stdout.splitlines()[-1])
    if found["errors"]:
        raise RuntimeError(f"{case.name}: {found['errors']} requests failed: {found['example']}")
    found["cpu_ms"] = cpu_used / max(1, found["total"]) * 1e3
    return found


def client(port: int, route: str, body_file: Path, concurrency: int, seconds: float,
           warmup: float) -> None:  # fmt: skip
    """Closed loop: ``concurrency`` keep-alive connections, each sending the body as soon
    as its last answer is read. Prints JSON: requests/s and latencies of the requests
    answered in the measured window, every answer counted (``total``) and the errors."""
    import uvloop

    body = body_file.read_bytes()
    request = (
        f"POST {route} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    length_header = re.compile(rb"content-length:\s*(\d+)", re.IGNORECASE)
    latencies: list[float] = []
    counts = {"total": 0, "errors": 0}
    example: list[bytes] = []

    async def connection(measured_from: float, end: float) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while (started := time.perf_counter()) < end:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            match = length_header.search(head)
            answer = await reader.readexactly(int(match.group(1)) if match else 0)
            finished = time.perf_counter()
            counts["total"] += 1
            if not head.startswith(b"HTTP/1.1 200"):
                counts["errors"] += 1
                example[:] = [head + answer[:300]]
            elif measured_from <= finished <= end:
                latencies.append(finished - started)
        writer.close()

    async def run() -> float:
        begun = time.perf_counter()
        measured_from, end = begun + warmup, begun + warmup + seconds
        await asyncio.gather(*(connection(measured_from, end) for _ in range(concurrency)))
        return seconds

    window = uvloop.run(run())
    print(json.dumps({
        "requests_per_s": len(latencies) / window, "p50_ms": _percentile(latencies, 50) * 1e3,
        "p99_ms": _percentile(latencies, 99) * 1e3, "total": counts["total"],
        "errors": counts["errors"], "example": example[0].decode("latin-1") if example else "",
    }))  # fmt: skip


@contextmanager
def slipstream_server(
    repo: Path, core: int, work: Path, tree: str
) -> Iterator[tuple[psutil.Process, int]]:
    """``slipstream serve`` on ``core`` (``tree`` first on its PYTHONPATH): its process
    and HTTP port."""
    http_port, grpc_port = free_ports(2)
    command = [
        "taskset", "-c", str(core), str(VENV_BIN / "slipstream"), "serve",
        "--model-repository", str(repo), "--host", "127.0.0.1", "--http-port",
        str(http_port), "--grpc-port", str(grpc_port), "--log-level", "warning",
    ]  # fmt: skip
    log = work / f"server-{http_port}.log"
    env = {**os.environ, **({"PYTHONPATH": tree} if tree else {})}
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                url = f"http://127.0.0.1:{http_port}/v2/health/ready"
                with urllib.request.urlopen(url, timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(log.read_text()[-2000:])
            time.sleep(0.3)
        yield psutil.Process(proc.pid), http_port
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def _cpu_seconds(process: psutil.Process) -> float:
    """CPU seconds of ``process`` and every process under it."""
    total = 0.0
    for each in [process, *process.children(recursive=True)]:
        try:
            times = each.cpu_times()
        except psutil.Error:  # a process gone meanwhile
            continue
        total += times.user + times.system
    return total


# ---------------------------------------------------------------- the run


def measure(args: argparse.Namespace, work: Path) -> dict[str, dict[str, Figures]]:
    """Every case alone and served (each tree, each concurrency), round by round; figures
    by case, then by side (``alone``, ``served c=N`` or ``served{srcK} c=N``)."""
    repo = args.repo.resolve()
    build_models(repo)
    chosen = cases(set(args.cases.split(",")))
    trees = [str(Path(t).resolve()) for t in args.src.split(",") if t] or [""]
    levels = [int(c) for c in args.concurrency.split(",")]
    calls = {case.name: alone_call(case, repo) for case in chosen}
    table: dict[str, dict[str, Figures]] = {case.name: {} for case in chosen}
    with ExitStack() as stack:
        servers = [stack.enter_context(slipstream_server(repo, args.server_core, work, tree))
                   for tree in trees]  # fmt: skip
        for round_number in range(args.rounds):
            forward = round_number % 2 == 0
            for case in chosen if forward else chosen[::-1]:
                steps: list[tuple[str, Callable[[], dict[str, float]]]] = [
                    ("alone", partial(measure_alone, calls[case.name], args.seconds)),
                ]  # fmt: skip
                for index, (process, port) in enumerate(servers):
                    label = f"{{src{index + 1}}}" if len(trees) > 1 else ""
                    steps += [(f"served{label} c={level}",
                               partial(measure_served, process, port, case, level, args, work))
                              for level in levels]  # fmt: skip
                for side, step in steps if forward else steps[::-1]:
                    found = step()
                    figures = table[case.name].setdefault(side, Figures())
                    for name in ("requests_per_s", "p50_ms", "p99_ms", "cpu_ms"):
                        getattr(figures, name).append(found[name])
            print(f"round {round_number + 1}/{args.rounds} done "
                  f"(load average {os.getloadavg()[0]:.2f})", flush=True)  # fmt: skip
    return table


def report(table: dict[str, dict[str, Figures]], args: argparse.Namespace) -> dict[str, Any]:
    """Prints the figures and the ratios; returns the summary for the JSON."""
    texts = {case.name: case.texts for case in cases(set(args.cases.split(",")))}
    summary: dict[str, Any] = {}
    print(f"\n{'case':12} {'side':18} {'req/s':>8} {'texts/s':>8} {'p50 ms':>7} {'p99 ms':>7}"
          f" {'CPU ms/req':>10}   {'served/alone':>20}   {'CPU alone/served':>20}")  # fmt: skip
    for name, sides in table.items():
        alone = sides["alone"]
        for side, figures in sides.items():
            rate = statistics.median(figures.requests_per_s)
            row = {"requests_per_s": rate, "texts_per_s": rate * texts[name],
                   "p50_ms": statistics.median(figures.p50_ms),
                   "p99_ms": statistics.median(figures.p99_ms),
                   "cpu_ms": statistics.median(figures.cpu_ms)}  # fmt: skip
            line = (f"{name:12} {side:18} {rate:8,.1f} {rate * texts[name]:8,.0f} "
                    f"{row['p50_ms']:7.2f} {row['p99_ms']:7.2f} {row['cpu_ms']:10.2f}")  # fmt: skip
            if side != "alone":
                row["served/alone"] = _paired(figures.requests_per_s, alone.requests_per_s)
                row["cpu alone/served"] = _paired(alone.cpu_ms, figures.cpu_ms)
                line += f"   {_spread(row['served/alone']):>20}   "
                line += f"{_spread(row['cpu alone/served']):>20}"
            summary.setdefault(name, {})[side] = row
            print(line)
    _print_trees(table, summary)
    print("\nratios: the median over rounds of each round's ratio [min-max]; alone = tokenizers "
          "+ ONNX Runtime in process, one thread on the server's core")  # fmt: skip
    return summary


def _print_trees(table: dict[str, dict[str, Figures]], summary: dict[str, Any]) -> None:
    """With --src a,b: each later tree's served figures over the first's, paired by round."""
    lines = []
    for name, sides in table.items():
        for side, figures in sides.items():
            match = re.fullmatch(r"served\{src(\d+)\} (c=\d+)", side)
            if not match or match.group(1) == "1":
                continue
            first = sides[f"served{{src1}} {match.group(2)}"]
            rates = _paired(figures.requests_per_s, first.requests_per_s)
            cpu = _paired(first.cpu_ms, figures.cpu_ms)
            key = f"src{match.group(1)}/src1 {match.group(2)}"
            summary[name][key] = {"requests_per_s": rates, "src1_cpu_over_this": cpu}
            lines.append(f"{name:12} {key:18} {_spread(rates):>20}   {_spread(cpu):>20}")
    if lines:
        print(f"\n{'case':12} {'trees':18} {'req/s, over src1':>20}   {'src1 CPU/req over':>20}")
        print("\n".join(lines))


def _paired(a: list[float], b: list[float]) -> dict[str, float]:
    ratios = sorted(x / y for x, y in zip(a, b, strict=True) if y)
    return {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1]}


def _spread(ratio: dict[str, float]) -> str:
    return f"{ratio['median']:.2f} [{ratio['min']:.2f}-{ratio['max']:.2f}]"


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=ROOT / "benchmarks" / "results" / "models",
                        help="model repository, models built into it when missing")  # fmt: skip
    parser.add_argument("--cases", default="embed-1,embed-16,classify-1,classify-16,"
                        "score-1,rerank-16")  # fmt: skip
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0, help="per measurement")
    parser.add_argument("--warmup", type=float, default=1.0, help="per served measurement")
    parser.add_argument("--server-core", type=int, default=0)
    parser.add_argument("--client-core", type=int, default=1)
    parser.add_argument("--src", default="", help="comma list of source trees to compare")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--client", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        port, route, body, concurrency, seconds, warmup = args.client
        client(int(port), route, Path(body), int(concurrency), float(seconds), float(warmup))
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # still stop the servers
    # This process runs the alone figures: pinned before ONNX Runtime and tokenizers start
    # their threads, so that theirs share the one core too, as the server's do.
    os.sched_setaffinity(0, {args.server_core})
    load_start = os.getloadavg()
    print(f"load average at start: {load_start[0]:.2f} on {os.cpu_count()} cores (figures "
          "taken beside other work are noisy)", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="slipstream-text-routes-") as tmp:
        table = measure(args, Path(tmp))
    summary = report(table, args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "load_average_start": load_start, "load_average_end": os.getloadavg(),
            "cores": os.cpu_count(), "args": {k: str(v) for k, v in vars(args).items()},
            "rounds": {n: {s: vars(f) for s, f in sides.items()} for n, sides in table.items()},
            "summary": summary,
        }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
