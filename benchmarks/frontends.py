"""Front-end throughput: HTTP and gRPC, unary and streaming, system shared memory, and the
no-work grpc.aio cap, in one run on one model.

    .venv/bin/python benchmarks/frontends.py --json benchmarks/results/frontends.json

The server runs on ``--server-cores`` (default core 0) and the load generator on
``--client-cores`` (default core 1), both pinned with taskset. The load generator is
Triton's own ``perf_analyzer`` (C++, installed on first use into ``.bench-venvs/``, see
``peers/perf_analyzer.py``); with ``--no-perf-analyzer`` (or where it cannot be had) it is
``slipstream bench``, which has no streaming or shared-memory mode: those rows then read
n/a.

The cap is a grpc.aio server on the same cores doing no work at all: it answers every
RPC with bytes recorded once from the real server (metadata, config, one inference), so
its throughput is what grpcio itself costs per call. ``ours / cap`` is the fraction of
that ceiling the gRPC front end reaches (issue #25's target: >= 0.8 for unary).

Each (case, concurrency) is measured once per round; ``--rounds`` alternates the cases so
that a machine whose speed drifts (shared cores) touches every case alike, and the median
over the rounds is reported.

The cap ladder (``cap_grpc_decode``, ``cap_grpc_coded``, ``cap_grpc_model``) adds, one
at a time, what serving a request needs on top of the cap, still without Slipstream's
serving core: the request parsed into arrays by our codec; then a fresh answer encoded by
it; then the model run by ONNX Runtime inline. Each is a grpc.aio server of its own on the
same cores; ``<rung> / cap_grpc`` shows what grpcio leaves for each layer (issue #25).

    .venv/bin/python benchmarks/frontends.py --cases grpc,cap_grpc,cap_grpc_decode,\
cap_grpc_coded,cap_grpc_model --concurrency 16 --rounds 3

``--layouts`` measures the same Slipstream cases against each process layout in turn (one
server at a time; with ``--rounds``, whole rounds alternate the layouts, forwards then
backwards, a fresh server each): ``one`` (everything in one process, the default layout), and
``split<N>`` (``--frontends N``: N front-end processes and one engine process, under
SCHED_BATCH, the default ``--cpu-scheduling``; ``split<N>-default`` under the normal
policy). A layout may name its own cores as ``split2@0,1``; otherwise it runs on
``--server-cores``. The
ratios ``<case>[split<N>] / <case>[one]`` are issue #25's layout targets (>= 0.9 for one
front end on the same core; >= 1.4 for two front ends on two cores, the load generator on
cores of its own where the host has them: the host's core count is printed).

    .venv/bin/python benchmarks/frontends.py --layouts one,split1,split2@0,1 --cases http,grpc

Beside infer/s, each Slipstream case prints the server's CPU per inference: the CPU time
of the server and every process under it (supervisor, engine, front ends) over the
measurement, divided by the inferences its statistics counted. On a host where other
work moves throughput by 20% between runs, the ratio of those (``by CPU``) is a capacity
ratio that other work blurs less. A split layout's line also splits it between the engine
and the front ends, and a cap server's line gives its CPU per call (its CPU over the run's
wall time, per call at the measured rate: perf_analyzer's idle start counts as the cap's,
so this errs in the cap's favour). ``grpc[split<N>] front ends / cap_grpc by CPU`` is then
issue #25's "gRPC unary per front-end process against the no-work cap" where the host has
too few cores to give each front end one of its own:

    .venv/bin/python benchmarks/frontends.py --layouts one,split1,split2@0,1 \
        --cases grpc,cap_grpc --concurrency 16,64
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from peers.perf_analyzer import ensure_perf_analyzer  # noqa: E402

SERVICE = "inference.GRPCInferenceService"


@dataclass(frozen=True)
class Case:
    """One way of sending the same request."""

    name: str
    # "http" or "grpc": which port of the server (or the cap) it talks to.
    protocol: str
    # Extra perf_analyzer arguments.
    perf_args: tuple[str, ...] = ()
    # Against a cap server with this handler (see CAP_HANDLERS) instead of Slipstream.
    cap: str = ""
    # slipstream bench's --protocol for this case; None: perf_analyzer only.
    bench_protocol: str | None = None


CASES = [
    Case("http", "http", bench_protocol="http-binary"),
    Case("http_shm", "http", ("--shared-memory", "system")),
    Case("grpc", "grpc", bench_protocol="grpc"),
    Case("grpc_shm", "grpc", ("--shared-memory", "system")),
    Case("grpc_stream", "grpc", ("--streaming",)),
    Case("cap_grpc", "grpc", cap="recorded", bench_protocol="grpc"),
    Case("cap_grpc_stream", "grpc", ("--streaming",), cap="recorded"),
    Case("cap_grpc_decode", "grpc", cap="decode", bench_protocol="grpc"),
    Case("cap_grpc_coded", "grpc", cap="coded", bench_protocol="grpc"),
    Case("cap_grpc_model", "grpc", cap="model", bench_protocol="grpc"),
]
# What a cap server's ModelInfer does, each rung adding one layer to the one before:
# answer recorded bytes; parse the request into arrays (protobuf, then our codec); encode
# a fresh answer with our codec; run the model with ONNX Runtime, inline on the loop.
CAP_HANDLERS = ("recorded", "decode", "coded", "model")
# Printed as "a / b": the ratios the targets are stated in.
# A split layout's front ends' share of the server's CPU, under "<case>[<layout>]" + this.
FRONT_ENDS = " front ends"
# The load generator's CPU per inference, under the case's name with this suffix.
LOAD = " load"
# The cases whose split layouts are compared with one process.
LAYOUT_CASES = ("http", "grpc", "grpc_stream")

RATIOS = [
    ("grpc", "cap_grpc"),
    ("grpc_stream", "cap_grpc_stream"),
    ("grpc", "http"),
    ("grpc_stream", "http"),
    ("http_shm", "http"),
    ("grpc_shm", "grpc"),
    ("cap_grpc_decode", "cap_grpc"),
    ("cap_grpc_coded", "cap_grpc"),
    ("cap_grpc_model", "cap_grpc"),
    ("grpc", "cap_grpc_model"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mlp", help="a model of --repo (default: mlp)")
    parser.add_argument("--repo", type=Path, help="model repository (default: build mlp)")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--measurement-ms", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--server-cores", default="0")
    parser.add_argument("--client-cores", default="1")
    parser.add_argument("--cases", default=",".join(c.name for c in CASES))
    parser.add_argument(
        "--layouts", default="one",
        help="process layouts to measure, e.g. one,split1,split2@0,1 (see the docstring)",
    )  # fmt: skip
    parser.add_argument(
        "--src",
        default="",
        help="comma list of source trees (src directories) to alternate, "
        "each put first on the server's PYTHONPATH; results are "
        "labelled with the tree and their ratio printed",
    )
    parser.add_argument("--no-perf-analyzer", action="store_true")
    parser.add_argument("--json", type=Path, help="write the results here")
    # Internal: run a cap server (started by this script).
    parser.add_argument("--cap-server", nargs=2, metavar=("RECORD_FROM", "PORT"))
    parser.add_argument("--cap-handler", choices=CAP_HANDLERS, default="recorded")
    args = parser.parse_args()
    if args.cap_server:
        record_from, port = args.cap_server[0], int(args.cap_server[1])
        asyncio.run(serve_cap(record_from, port, args.model, args.cap_handler, args.repo))
        return
    run(args)


def run(args: argparse.Namespace) -> None:
    # Stopped with SIGTERM: still stop the servers (the with blocks' exits).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    levels = [int(c) for c in args.concurrency.split(",")]
    wanted = set(args.cases.split(","))
    cases = [case for case in CASES if case.name in wanted]
    tool = None if args.no_perf_analyzer else ensure_perf_analyzer()
    layouts = parse_layouts(args.layouts, args.server_cores)
    results: dict[str, dict[int, list[float | None]]] = {}
    cpu: dict[str, dict[int, list[float | None]]] = {}
    trees = [str(Path(tree).resolve()) for tree in args.src.split(",") if tree]
    with tempfile.TemporaryDirectory() as tmp:
        repo = args.repo or build_mlp(Path(tmp) / "models")
        if len(trees) < 2 and len(layouts) < 2:
            env = {"PYTHONPATH": trees[0]} if trees else {}
            measure_layouts(tool, cases, levels, layouts, args, repo, Path(tmp), env, "",
                            results, cpu)  # fmt: skip
        else:
            # Whole rounds alternate the trees and the layouts (a server each), in turn
            # forwards and backwards, so drift touches every one alike.
            servers = [(tree, layout) for tree in trees or [""] for layout in layouts]
            rounds, args.rounds = args.rounds, 1
            for index in range(rounds):
                for tree, layout in servers if index % 2 == 0 else servers[::-1]:
                    print(f"== round {index + 1}" + (f", {tree}" if tree else ""))
                    measure_layouts(tool, cases, levels, [layout], args, repo, Path(tmp),
                                    {"PYTHONPATH": tree} if tree else {},
                                    _tree_label(tree, trees) if len(trees) > 1 else "",
                                    results, cpu, with_caps=layout == layouts[0])  # fmt: skip
            args.rounds = rounds
    report(results, cpu, levels, args, tool is not None, layouts, trees)


def _tree_label(tree: str, trees: list[str]) -> str:
    return "{" + f"src{trees.index(tree) + 1}" + "}"


def measure_layouts(
    tool: tuple[Path, dict[str, str]] | None,
    cases: list[Case],
    levels: list[int],
    layouts: list[tuple[str, int, str]],
    args: argparse.Namespace,
    repo: Path,
    tmp: Path,
    env: dict[str, str],
    label: str,
    results: dict[str, dict[int, list[float | None]]],
    cpu: dict[str, dict[int, list[float | None]]],
    with_caps: bool = True,
) -> None:
    """Every layout in turn, a server each, its figures added to ``results`` and ``cpu``
    under the case's name, ``[layout]`` and ``label``; the caps (with ``with_caps``) beside the
    first layout only: they do not depend on the layout."""
    for layout_index, (layout, frontends, cores) in enumerate(layouts):
        wanted_here = [c for c in cases if not (c.cap and (layout_index or not with_caps))]
        handlers = sorted({c.cap for c in wanted_here if c.cap})
        http_port, grpc_port, *cap_ports = free_ports(2 + len(handlers))
        ports = {"http": http_port, "grpc": grpc_port}
        by_handler = dict(zip(handlers, cap_ports, strict=True))
        ports.update({f"cap:{h}": port for h, port in by_handler.items()})
        with (
            slipstream_server(
                repo,
                cores,
                http_port,
                grpc_port,
                tmp,
                frontends,
                "default" if "-default" in layout else "batch",
                env,
            ) as server,
            cap_servers(args, repo, grpc_port, by_handler) as caps,
        ):
            print(f"layout {layout}: {frontends or 'one process'} front ends, cores {cores}")
            measured, spent = measure_all(tool, wanted_here, levels, ports, args, server, caps)
        for figures, into in ((measured, results), (spent, cpu)):
            for name, by_level in figures.items():
                key = _key(name, layout) + label
                for level, values in by_level.items():
                    into.setdefault(key, {}).setdefault(level, []).extend(values)


def _key(name: str, layout: str) -> str:
    """A case's figures' name in a layout: ``grpc[split1@0]``, ``grpc[split1@0] front ends``
    (its front ends' CPU); a cap's, and one process's, as the case is named."""
    if layout == "one" or name.startswith("cap"):
        return name
    suffix = next((s for s in (FRONT_ENDS, LOAD) if name.endswith(s)), "")
    return f"{name.removesuffix(suffix)}[{layout}]" + suffix


def measure_all(
    tool: tuple[Path, dict[str, str]] | None,
    cases: list[Case],
    levels: list[int],
    ports: dict[str, int],
    args: argparse.Namespace,
    server: psutil.Process,
    caps: dict[str, psutil.Process],
) -> tuple[dict[str, dict[int, list[float | None]]], dict[str, dict[int, list[float | None]]]]:
    """Each case at each level once per round, rounds alternating the cases: infer/s, and
    CPU us per inference: the server's (all its processes; in a split layout also its
    front ends' alone, as ``<case> front ends``) and a cap server's (its CPU over the
    run's wall time, per call at the measured rate: perf_analyzer's idle start counts as
    the cap's time, so this errs in the cap's favour)."""
    results: dict[str, dict[int, list[float | None]]] = {
        c.name: {n: [] for n in levels} for c in cases
    }
    cpu: dict[str, dict[int, list[float | None]]] = {c.name: {n: [] for n in levels} for c in cases}
    for _ in range(args.rounds):
        for case in cases:
            port = ports[f"cap:{case.cap}" if case.cap else case.protocol]
            for level in levels:
                before = None if case.cap else _server_work(server, ports["http"], args.model)
                roles_before = _role_cpu(server)
                cap_before = (_cpu_seconds(caps[case.cap]), time.monotonic()) if case.cap else None
                rate, load_seconds = measure(tool, case, port, level, args)
                results[case.name][level].append(rate)
                line = f"  {case.name:16s} C={level:<3d} {_fmt(rate)} infer/s"
                if cap_before is not None and rate:
                    seconds = time.monotonic() - cap_before[1]
                    used = _cpu_seconds(caps[case.cap]) - cap_before[0]
                    cpu[case.name][level].append(used / (seconds * rate) * 1e6)
                    line += f", {_fmt(cpu[case.name][level][-1])} us CPU/call"
                if before is not None:
                    after = _server_work(server, ports["http"], args.model)
                    done = after[1] - before[1]
                    spent = (after[0] - before[0]) / done * 1e6 if done else None
                    cpu[case.name][level].append(spent)
                    line += f", server {_fmt(spent)} us CPU/infer"
                    if done:
                        load = load_seconds / done * 1e6
                        cpu.setdefault(case.name + LOAD, {}).setdefault(level, []).append(load)
                        line += f", load generator {load:.0f}"
                    roles = _role_cpu(server)
                    if done and len(roles) > 1:  # split: the engine's share and the rest
                        shares = {
                            role: (roles[role] - roles_before.get(role, 0.0)) / done * 1e6
                            for role in sorted(roles)
                        }
                        line += " (" + ", ".join(f"{r} {v:.0f}" for r, v in shares.items()) + ")"
                        fronts = cpu.setdefault(case.name + FRONT_ENDS, {})
                        fronts.setdefault(level, []).append(shares["front ends"])
                print(line, flush=True)
    return results, cpu


def _cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def _role_cpu(server: psutil.Process) -> dict[str, float]:
    """CPU seconds by role: the engine process (the one listening on the engine's Unix
    socket) and the rest of the server; only ``server`` where there is no engine."""
    seconds: dict[str, float] = {}
    for process in [server, *server.children(recursive=True)]:
        try:
            times = process.cpu_times()
            engine = any(
                isinstance(c.laddr, str) and c.laddr.endswith("/engine")
                for c in process.net_connections(kind="unix")
            )
        except psutil.NoSuchProcess:
            continue
        role = "engine" if engine else "front ends"
        seconds[role] = seconds.get(role, 0.0) + times.user + times.system
    return seconds if "engine" in seconds else {"server": sum(seconds.values())}


def _server_work(server: psutil.Process, http_port: int, model: str) -> tuple[float, int]:
    """(CPU seconds of the server and every process under it, inferences it counted)."""
    seconds = 0.0
    for process in [server, *server.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        seconds += times.user + times.system
    url = f"http://127.0.0.1:{http_port}/v2/models/{model}/stats"
    with urllib.request.urlopen(url, timeout=10) as reply:
        stats = json.load(reply)["model_stats"]
    return seconds, sum(int(s["inference_stats"]["success"]["count"]) for s in stats)


def measure(
    tool: tuple[Path, dict[str, str]] | None,
    case: Case,
    port: int,
    concurrency: int,
    args: argparse.Namespace,
) -> tuple[float | None, float]:
    """Inferences per second of one case at one concurrency (None when it cannot run) and
    the CPU seconds the load generator spent on it, warm-up and every trial included."""
    before = _children_cpu()
    rate = _measure_rate(tool, case, port, concurrency, args)
    return rate, _children_cpu() - before


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _measure_rate(
    tool: tuple[Path, dict[str, str]] | None,
    case: Case,
    port: int,
    concurrency: int,
    args: argparse.Namespace,
) -> float | None:
    pin = ["taskset", "-c", args.client_cores]
    with tempfile.TemporaryDirectory() as tmp:
        if tool is not None:
            binary, env = tool
            out = Path(tmp) / "pa.csv"
            command = [
                *pin, str(binary), "-m", args.model, "-x", "1", "-i", case.protocol,
                "-u", f"127.0.0.1:{port}", "--concurrency-range", str(concurrency),
                "--measurement-interval", str(args.measurement_ms),
                "--stability-percentage", "999", "--max-trials", "3", "-f", str(out),
                *case.perf_args,
            ]  # fmt: skip
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            if done.returncode != 0 or not out.exists():
                print(f"  {case.name}: perf_analyzer failed: {(done.stdout + done.stderr)[-600:]}")
                return None
            with out.open() as f:
                return float(next(csv.DictReader(f))["Inferences/Second"])
        if case.bench_protocol is None:
            return None
        out = Path(tmp) / "bench.json"
        url = f"http://127.0.0.1:{port}" if case.protocol == "http" else f"127.0.0.1:{port}"
        command = [
            *pin, str(VENV_BIN / "slipstream"), "bench", url, "-m", args.model,
            "--protocol", case.bench_protocol, "--concurrency", str(concurrency),
            "--duration", str(args.measurement_ms / 1000), "--workers", "1",
            "--json", str(out),
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"  {case.name}: slipstream bench failed: {done.stderr[-400:]}")
            return None
        levels = json.loads(out.read_text())["levels"]
        return float(levels[0]["throughput_infer_per_s"])


def parse_layouts(text: str, default_cores: str) -> list[tuple[str, int, str]]:
    """(name, front ends, cores) of each layout in ``one,split1,split2@0,1``; a split
    named ``split<N>-default`` runs under ``--cpu-scheduling default``."""
    layouts = []
    for item in text.replace(",split", ";split").replace(",one", ";one").split(";"):
        name, _, cores = item.partition("@")
        count = name[5:].removesuffix("-default")
        if name != "one" and not (name.startswith("split") and count.isdigit()):
            raise SystemExit(f"--layouts: {item!r} is neither one nor split<N>[-default][@cores]")
        frontends = 0 if name == "one" else int(count)
        layouts.append((name if name == "one" else f"{name}@{cores or default_cores}",
                        frontends, cores or default_cores))  # fmt: skip
    return layouts


def report(
    results: dict[str, dict[int, list[float | None]]],
    cpu: dict[str, dict[int, list[float | None]]],
    levels: list[int],
    args: argparse.Namespace,
    perf_analyzer: bool,
    layouts: list[tuple[str, int, str]],
    trees: list[str],
) -> None:
    if len(trees) > 1:
        print("trees: " + ", ".join(f"{_tree_label(t, trees)} {t}" for t in trees))
    medians = {
        name: {n: _median(values) for n, values in by_level.items()}
        for name, by_level in results.items()
    }
    print(f"\ninfer/s, median of {args.rounds} round(s); server on cores {args.server_cores}, "
          f"load on {args.client_cores}; load generator: "
          f"{'perf_analyzer' if perf_analyzer else 'slipstream bench'}")  # fmt: skip
    print(f"{'case':18s}" + "".join(f"{'C=' + str(n):>12s}" for n in levels))
    for name, by_level in medians.items():
        print(f"{name:18s}" + "".join(f"{_fmt(by_level[n]):>12s}" for n in levels))
    print()
    pairs = list(RATIOS)
    for layout, _, _ in layouts:
        if layout != "one":
            pairs += [(f"{case}[{layout}]", case) for case in LAYOUT_CASES]
            pairs += [(f"grpc[{layout}]", "cap_grpc"), (f"grpc[{layout}]{FRONT_ENDS}", "cap_grpc")]
    if len(trees) > 1:
        # Each tree against the first, case by case; the layout pairs within each tree.
        first = _tree_label(trees[0], trees)
        labelled = [(a + label, b + label) for a, b in pairs
                    for label in (_tree_label(t, trees) for t in trees)]  # fmt: skip
        bases = sorted({key.removesuffix(first) for key in medians if key.endswith(first)})
        pairs = labelled + [(base + _tree_label(t, trees), base + first)
                            for base in bases for t in trees[1:]]  # fmt: skip
    ratios = _print_ratios(pairs, medians, levels, "", results)
    cpu_medians = {
        name: {n: _median(values) for n, values in by_level.items()}
        for name, by_level in cpu.items()
    }
    print(
        "\nCPU us per inference, median of the rounds: the server's (all its processes);"
        f' "<case>{LOAD}": the load generator\'s'
    )
    for name, by_level in cpu_medians.items():
        print(f"{name:18s}" + "".join(f"{_fmt(by_level[n]):>12s}" for n in levels))
    # By CPU: the layout's inferences per CPU-second over one process's (a capacity ratio):
    # b's CPU per inference over a's.
    flipped = [(b, a) for a, b in pairs]
    by_cpu = _print_ratios(flipped, cpu_medians, levels, " by CPU", cpu, swap_names=True)
    labels = [_tree_label(t, trees) for t in trees] if len(trees) > 1 else [""]
    ceilings = _print_ceilings(medians, cpu_medians, levels, args, layouts, labels)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "model": args.model, "server_cores": args.server_cores,
            "layouts": [{"name": n, "frontends": f, "cores": c} for n, f, c in layouts],
            "client_cores": args.client_cores, "host_cpus": os.cpu_count(),
            "load_generator": "perf_analyzer" if perf_analyzer else "slipstream bench",
            "cases": [asdict(c) for c in CASES],
            "infer_per_s": {k: {str(n): v for n, v in m.items()} for k, m in medians.items()},
            "rounds": {k: {str(n): v for n, v in m.items()} for k, m in results.items()},
            "ratios": {k: {str(n): v for n, v in m.items()} for k, m in ratios.items()},
            "server_cpu_us_per_infer": {
                k: {str(n): v for n, v in m.items()} for k, m in cpu_medians.items()
            },
            "ratios_by_cpu": {
                k: {str(n): v for n, v in m.items()} for k, m in by_cpu.items()
            },
            "ceilings_over_one_process": {
                k: {str(n): v for n, v in m.items()} for k, m in ceilings.items()
            },
        }, indent=2))  # fmt: skip
        print(f"\nwrote {args.json}")


def _print_ceilings(
    medians: dict[str, dict[int, float | None]],
    cpu: dict[str, dict[int, float | None]],
    levels: list[int],
    args: argparse.Namespace,
    layouts: list[tuple[str, int, str]],
    labels: list[str],
) -> dict[str, dict[int, float | None]]:
    """What each layout could reach on its cores if they were always busy, over what one
    process measured: the fewest of its server cores over the server's CPU per inference,
    the load generator's cores over its CPU per inference, and all the cores they use
    over both together (where they share cores, each inference costs the two of them).
    A layout target above its ceiling cannot be met on this host."""
    print("\nceiling with every core busy: min(server cores / server us, load cores / load "
          "us, all cores / both), over one process's measured infer/s")  # fmt: skip
    client = _cores(args.client_cores)
    ceilings: dict[str, dict[int, float | None]] = {}
    for layout, _, cores in layouts:
        server = _cores(cores)
        for case in LAYOUT_CASES:
            for label in labels:
                name = case if layout == "one" else f"{case}[{layout}]"
                spent, load = cpu.get(name + label), cpu.get(name + LOAD + label)
                one = medians.get(case + label)
                if spent is None or load is None or one is None:
                    continue
                row: dict[int, float | None] = {}
                for n in levels:
                    s, c = spent.get(n), load.get(n)
                    bound = None if s is None or c is None else min(
                        len(server) / s, len(client) / c, len(server | client) / (s + c)
                    ) * 1e6  # fmt: skip
                    row[n] = _ratio(bound, one.get(n))
                key = f"{name}{label} ceiling / {case}{label}"
                ceilings[key] = row
                print(f"{key:28s}" + "".join(
                    f"{'n/a' if r is None else f'{r:.2f}':>10s}" for r in row.values()
                ))  # fmt: skip
    return ceilings


def _cores(text: str) -> set[int]:
    """taskset's list (``0,1``, ``0-3``) as a set of core numbers."""
    found: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        found.update(range(int(first), int(last or first) + 1))
    return found


def _print_ratios(
    pairs: list[tuple[str, str]],
    table: dict[str, dict[int, float | None]],
    levels: list[int],
    suffix: str,
    rounds: dict[str, dict[int, list[float | None]]],
    swap_names: bool = False,
) -> dict[str, dict[int, float | None]]:
    """``table[a] / table[b]`` per level for each pair both sides of which were measured,
    printed and returned by name ("a / b" + suffix; ``swap_names``: named "b / a"). With
    several rounds, each level's line also gives the ratio round by round (``rounds``, the
    values in round order): their median and range, in brackets; where the rounds
    alternate the servers, the pairs are side by side in time, so drift blurs them less
    than the medians' ratio."""
    ratios: dict[str, dict[int, float | None]] = {}
    for a, b in pairs:
        if a in table and b in table:
            key = (f"{b} / {a}" if swap_names else f"{a} / {b}") + suffix
            ratios[key] = {n: _ratio(table[a][n], table[b][n]) for n in levels}
            cells = []
            for n, r in ratios[key].items():
                cell = "n/a" if r is None else f"{r:.2f}"
                paired = [_ratio(x, y) for x, y in zip(rounds[a][n], rounds[b][n], strict=False)]
                known = sorted(p for p in paired if p is not None)
                if len(known) > 1:
                    cell += f" [{_median(list(known)):.2f}: {known[0]:.2f}-{known[-1]:.2f}]"
                cells.append(f"{cell:>10s}")
            print(f"{key:28s}" + "".join(cells))
    return ratios


# ---------------------------------------------------------------- servers


def build_mlp(repo: Path) -> Path:
    subprocess.run(
        [sys.executable, str(ROOT / "examples" / "build_models.py"), str(repo), "--only", "mlp"],
        check=True, capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    return repo


@contextmanager
def slipstream_server(
    repo: Path,
    cores: str,
    http_port: int,
    grpc_port: int,
    log_dir: Path,
    frontends: int = 0,
    scheduling: str = "batch",
    env: dict[str, str] | None = None,
) -> Iterator[psutil.Process]:
    command = [
        "taskset", "-c", cores, str(VENV_BIN / "slipstream"), "serve",
        "--model-repository", str(repo), "--host", "127.0.0.1",
        "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--allow-client-shm",
        "--log-level", "warning", "--frontends", str(frontends),
        "--cpu-scheduling", scheduling,
    ]  # fmt: skip
    with _process(command, log_dir / "slipstream.log", env) as proc:
        wait_http(f"http://127.0.0.1:{http_port}/v2/health/ready")
        yield psutil.Process(proc.pid)


@contextmanager
def cap_servers(
    args: argparse.Namespace, repo: Path, grpc_port: int, ports: dict[str, int]
) -> Iterator[dict[str, psutil.Process]]:
    """A cap server for each handler in ``ports`` (handler -> its port); yields each
    handler's process."""
    processes: dict[str, psutil.Process] = {}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        for handler, port in ports.items():
            command = [
                "taskset", "-c", args.server_cores, sys.executable, __file__,
                "--model", args.model, "--repo", str(repo), "--cap-handler", handler,
                "--cap-server", f"127.0.0.1:{grpc_port}", str(port),
            ]  # fmt: skip
            proc = stack.enter_context(_process(command, Path(tmp) / f"cap-{handler}.log"))
            processes[handler] = psutil.Process(proc.pid)
        for port in ports.values():
            _wait_port(port)
        yield processes


@contextmanager
def _process(
    command: list[str], log: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **(env or {})},
        )  # fmt: skip
        try:
            yield proc
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def model_metrics(port: int, model: str, wanted: dict[str, str]) -> dict[str, float]:
    """``model``'s samples named in ``wanted`` (sample name -> key), summed over their
    other labels, from the server's /metrics on ``port``; 0 for a sample not there."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    found = dict.fromkeys(wanted.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted and sample.labels.get("model") == model:
                found[wanted[sample.name]] += sample.value
    return found


def wait_http(url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} never answered 200")


def _wait_port(port: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"nothing listens on port {port}")


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


# ---------------------------------------------------------------- the no-work cap


async def serve_cap(
    record_from: str, port: int, model: str, handler: str, repo: Path | None
) -> None:
    """A grpc.aio server answering each RPC with bytes recorded once from the real one;
    ModelInfer does what ``handler`` names (CAP_HANDLERS) before answering."""
    import grpc

    from slipstream.protocol.grpc_codec import varint

    answers = record_answers(record_from, model)
    infer_answer = answers["ModelInfer"]

    def unary(answer: bytes) -> grpc.RpcMethodHandler:
        async def call(request: bytes, context: object) -> bytes:
            return answer

        return grpc.unary_unary_rpc_method_handler(call)

    async def stream(requests: object, context: object) -> object:
        # Stream clients match answers to requests by id: echo it, appended to the
        # recorded answer as field 3 (a parser reads fields in any order).
        async for request in requests:  # type: ignore[attr-defined]
            request_id = _request_id(request)
            inner = infer_answer + b"\x1a" + varint(len(request_id)) + request_id
            yield b"\x12" + varint(len(inner)) + inner

    handlers = {name: unary(answer) for name, answer in answers.items()}
    handlers["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(stream)
    if handler != "recorded":
        handlers["ModelInfer"] = ladder_handler(handler, infer_answer, repo, model)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def ladder_handler(handler: str, infer_answer: bytes, repo: Path | None, model: str) -> object:
    """ModelInfer for a rung of the cap ladder above "recorded" (see CAP_HANDLERS)."""
    import grpc
    import numpy as np

    from slipstream.protocol import grpc_codec
    from slipstream.protocol.proto import inference_pb2 as pb
    from slipstream.types import InferResponse

    recorded = pb.ModelInferResponse.FromString(infer_answer)
    outputs = {
        tensor.name: grpc_codec.decode_raw_tensor(tensor.name, tensor.datatype,
                                                  list(tensor.shape), raw)
        for tensor, raw in zip(recorded.outputs, recorded.raw_output_contents, strict=True)
    }  # fmt: skip
    run = None
    if handler == "model":
        import onnxruntime as ort

        assert repo is not None, "the model rung needs --repo"
        versions = sorted(
            (repo / model).iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else -1
        )
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        session = ort.InferenceSession(str(versions[-1] / "model.onnx"), options)
        names = [o.name for o in session.get_outputs()]

        def run(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            return dict(zip(names, session.run(None, inputs), strict=True))

    async def call(request: pb.ModelInferRequest, context: object) -> bytes:
        decoded = grpc_codec.decode_infer_request(request)
        if handler == "decode":
            return infer_answer
        answer = outputs if run is None else run(decoded.inputs)
        response = InferResponse(model_name=model, model_version="1", outputs=answer)
        return grpc_codec.serialize_infer_response(response)

    return grpc.unary_unary_rpc_method_handler(
        call, request_deserializer=pb.ModelInferRequest.FromString
    )


def record_answers(address: str, model: str) -> dict[str, bytes]:
    """Serialised answers of the real server to what perf_analyzer asks, once."""
    import grpc
    import numpy as np

    from slipstream.protocol.proto import inference_pb2 as pb

    channel = grpc.insecure_channel(address)
    metadata = pb.ModelMetadataResponse.FromString(
        _call(channel, "ModelMetadata", pb.ModelMetadataRequest(name=model))
    )
    infer = pb.ModelInferRequest(model_name=model)
    for tensor in metadata.inputs:
        shape = [1 if d < 0 else d for d in tensor.shape]
        infer.inputs.add(name=tensor.name, datatype=tensor.datatype, shape=shape)
        dtype = np.dtype(np.float32 if tensor.datatype == "FP32" else np.int64)
        infer.raw_input_contents.append(np.zeros(shape, dtype).tobytes())
    answers = {
        "ServerLive": _call(channel, "ServerLive", pb.ServerLiveRequest()),
        "ServerReady": _call(channel, "ServerReady", pb.ServerReadyRequest()),
        "ModelReady": _call(channel, "ModelReady", pb.ModelReadyRequest(name=model)),
        "ServerMetadata": _call(channel, "ServerMetadata", pb.ServerMetadataRequest()),
        "ModelMetadata": metadata.SerializeToString(),
        "ModelConfig": _call(channel, "ModelConfig", pb.ModelConfigRequest(name=model)),
        "ModelStatistics": _call(channel, "ModelStatistics", pb.ModelStatisticsRequest(name=model)),
        "ModelInfer": _call(channel, "ModelInfer", infer),
    }
    channel.close()
    return answers


def _call(channel: object, method: str, request: object) -> bytes:
    stub = channel.unary_unary(f"/{SERVICE}/{method}")  # type: ignore[attr-defined]
    answer: bytes = stub(request.SerializeToString())  # type: ignore[attr-defined]
    return answer


def _request_id(message: bytes) -> bytes:
    """ModelInferRequest.id (field 3) read off the wire: fields 1 and 2 are strings."""
    position = 0
    while position < len(message):
        tag, position = _readvarint(message, position)
        if tag & 7 != 2 or tag >> 3 > 3:
            return b""
        length, position = _readvarint(message, position)
        if tag >> 3 == 3:
            return message[position : position + length]
        position += length
    return b""


def _readvarint(data: bytes, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


if __name__ == "__main__":
    main()
