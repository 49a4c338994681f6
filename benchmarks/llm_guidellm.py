"""`slipstream bench`'s OpenAI mode cross-checked against guidellm, on two servers.

Prints ratios (a script, never a test). guidellm is the vLLM project's load generator;
here it runs from a venv of its own (`.bench-venvs/guidellm`, built once with the same
CPU torch wheel the lock pins, since guidellm requires torch). Both tools drive the same
server in turns with the same request shape: SmolLM2-135M-Instruct Q4_1, prompts of
`--prompt-tokens` synthetic tokens, `--output-tokens` tokens out with `ignore_eos`,
streamed `/v1/completions`, greedy (`temperature: 0`, which guidellm is told to send as
an extra body field; bench always does), closed loop at each `--concurrency`,
`--requests` requests. (guidellm also asks for `continuous_usage_stats`, bench only for
the final usage: a usage object in every chunk, the one difference left.)
Servers: Slipstream (`backend: llama_cpp`, prefix cache off: with it, each run's prompts
stay cached and later runs decode beside that residue, which spread one tool's runs by
20% at C=4) and llama.cpp's own `llama-server` (benchmarks/peers/llama_server.py builds
it once).

The server is pinned to core 0 with one thread, the load generators to core 1, so a
tool's own CPU use does not slow the server it measures. For each server and level the
tools alternate (`--rounds` times each, every run with prompts of its own, so a prompt
cache never serves one run the last one's) and the medians are compared:

- output tok/s: output tokens of the level / its duration (bench: first send to last
  response; guidellm: its benchmark's duration);
- TTFT p50 and mean. At C>1 with requests of one length, a closed loop's streams lock
  into a phase: prompts are read one after another, so TTFTs fall in steps (one prompt's
  reading, two, three...) and which step the median lands on changes from run to run of
  the same tool (bench's C=4 runs on one server: p50 1,520 and 1,910 ms). Each run of a
  Slipstream server is also checked against the server's own TTFT over the same requests
  (its `/metrics` histogram's sum and count before and after): a tool's mean should sit a
  few ms above it;
- time per output token after the first, p50 over requests: bench's TPOT (vLLM's:
  (E2E - TTFT) / (tokens - 1)) against guidellm's `inter_token_latency` (the same
  quantity per request: first token to last over tokens - 1). guidellm's name is not
  vLLM's ITL, which bench also reports (every gap between chunks, whose median sits
  below the per-request means when a few gaps are long): printed beside, not compared.

Target (issue #19): within 5% on all three, on both servers.

guidellm needs a tokenizer for its synthetic prompts: the GGUF's own, exported to a
Hugging Face tokenizer directory by transformers (no download). It asks a server's
`/health` first (vLLM's and llama-server's probe, which Slipstream answers too).

    .venv/bin/python benchmarks/llm_guidellm.py                 # ~12 min on 2 cores
    .venv/bin/python benchmarks/llm_guidellm.py --concurrency 1 --rounds 1
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx
from llm_llama_cpp import SLIPSTREAM, gguf_path, llama_server_spec, slipstream_spec
from prometheus_client.parser import text_string_to_metric_families

from servers import ServerSpec, ensure_venv, running

ROOT = Path(__file__).resolve().parents[1]
METRICS = ("output_tok_per_s", "ttft_p50_ms", "ttft_mean_ms", "per_token_p50_ms")
TTFT_METRIC = "slipstream_llm_time_to_first_token_seconds"
ITL_METRIC = "slipstream_llm_inter_token_latency_seconds"


def export_tokenizer(directory: Path) -> Path:
    """The GGUF's tokenizer as a Hugging Face tokenizer directory (for guidellm)."""
    from transformers import AutoTokenizer

    gguf = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer.save_pretrained(str(directory))
    return directory


def run_bench(
    url: str, level: int, seed: int, args: argparse.Namespace, out: Path
) -> dict[str, float]:
    argv = ["taskset", "-c", str(args.client_core), SLIPSTREAM, "bench", url, "-m", "smollm2",
            "--protocol", "openai-completions", "--concurrency", str(level),
            "--num-requests", str(args.requests), "--prompt-tokens", str(args.prompt_tokens),
            "--output-tokens", str(args.output_tokens), "--ignore-eos",
            "--seed", str(seed), "--json", str(out)]  # fmt: skip
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    report = json.loads(out.read_text())
    result = report["levels"][0]
    return {
        "probe_ttft_ms": report["probe_ttft_ms"],
        "output_tok_per_s": result["output_throughput_tok_per_s"],
        "ttft_p50_ms": result["ttft"]["p50_ms"],
        "ttft_mean_ms": result["ttft"]["mean_ms"],
        "per_token_p50_ms": result["tpot"]["p50_ms"],
        "per_token_mean_ms": result["tpot"]["mean_ms"],
        "gap_p50_ms": result["itl"]["p50_ms"],
        "errors": result["errors"],
    }


def run_guidellm(
    python: Path, url: str, health: str, tokenizer: Path, level: int, seed: int,
    args: argparse.Namespace, out: Path,
) -> dict[str, float]:  # fmt: skip
    scenario = {
        "spec": {
            "backend": {
                "kind": "openai_http",
                "target": url,
                "model": "smollm2",
                "request_format": "/v1/completions",
                "api_routes": {"/health": health},
                # bench sends temperature 0; guidellm sends none, so servers drew each
                # token from the whole vocabulary (OpenAI's default temperature 1) for
                # guidellm and took the argmax for bench: not the same request.
                "extras": {"body": {"temperature": 0.0}},
            },
            "profile": {"kind": "concurrent", "streams": [level]},
            "tokenizer": {"kind": "hf_auto", "model": str(tokenizer)},
            "data": [
                {
                    "kind": "synthetic_text",
                    "prompt_tokens": args.prompt_tokens,
                    "output_tokens": args.output_tokens,
                }
            ],
            "constraints": [{"kind": "max_requests", "count": args.requests}],
            "seed": {"kind": "static", "value": seed},
            "outputs": [{"kind": "json", "path": str(out)}],
        }
    }
    config = out.with_suffix(".scenario.json")
    config.write_text(json.dumps(scenario))
    guidellm = str(python.parent / "guidellm")
    argv = ["taskset", "-c", str(args.client_core), "env", "-u", "PYTHONPATH",
            "HF_HUB_OFFLINE=1", guidellm, "run", "-c", str(config),
            "--disable-console"]  # fmt: skip
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    benchmark = json.loads(out.read_text())["benchmarks"][0]
    metrics = benchmark["metrics"]
    tokens = metrics["output_token_count"]["successful"]["total_sum"]
    return {
        "output_tok_per_s": tokens / benchmark["duration"],
        "ttft_p50_ms": metrics["time_to_first_token_ms"]["successful"]["median"],
        "ttft_mean_ms": metrics["time_to_first_token_ms"]["successful"]["mean"],
        "per_token_p50_ms": metrics["inter_token_latency_ms"]["successful"]["median"],
        "per_token_mean_ms": metrics["inter_token_latency_ms"]["successful"]["mean"],
        "errors": metrics["request_totals"]["errored"],
    }


def server_histograms(url: str) -> dict[str, tuple[float, float]] | None:
    """Slipstream's own TTFT and inter-token gaps so far, each (sum in seconds, count),
    from its /metrics, as the server timed them; None from another server."""
    try:
        reply = httpx.get(url + "/metrics", timeout=10)
        families = list(text_string_to_metric_families(reply.text)) if reply.is_success else []
    except (httpx.HTTPError, ValueError):  # no /metrics, or not Prometheus's text
        return None
    totals = {}
    for family in families:
        if family.name in (TTFT_METRIC, ITL_METRIC):
            samples = [(s.name, s.value) for s in family.samples]
            totals[family.name] = (
                sum(v for n, v in samples if n.endswith("_sum")),
                sum(v for n, v in samples if n.endswith("_count")),
            )
    return totals if TTFT_METRIC in totals else None


def measured(url: str, run: Callable[[], dict[str, float]]) -> dict[str, float]:
    """``run``'s figures, with the server's own means over the run's requests where it
    reports them: TTFT (a tool's should sit a few ms above: the first chunk's way back)
    and the gap between tokens (the token-weighted mean of the requests' time per output
    token; with ``ignore_eos`` every request has as many, so the tools' mean TPOT).
    bench's warm-up request is taken out of the server's TTFT by the TTFT bench measured
    for it (its 3 gaps stay in, among thousands)."""
    before = server_histograms(url)
    figures = run()
    after = server_histograms(url)
    if before is None or after is None:
        return figures
    # A warm-up request bench ran besides the measured ones: (its TTFT in s, 1 request).
    probe = (figures["probe_ttft_ms"] / 1000, 1) if "probe_ttft_ms" in figures else (0, 0)
    for metric, key, extra in ((TTFT_METRIC, "server_ttft_mean_ms", probe),
                               (ITL_METRIC, "server_per_token_mean_ms", (0, 0))):  # fmt: skip
        total_s = after[metric][0] - before[metric][0] - extra[0]
        count = after[metric][1] - before[metric][1] - extra[1]
        if count > 0:
            figures[key] = 1000 * total_s / count
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--requests", type=int, default=16, help="per level and tool")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="turns of each tool")
    parser.add_argument("--servers", default="slipstream,llama-server")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--raw", type=Path, help="keep every run's own JSON report here")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs two cores: the server on one, the load generators on another")
    server_core, args.client_core = cores[0], cores[1]
    python = ensure_venv("guidellm")
    if python is None:
        raise SystemExit("could not build the guidellm venv (see above)")
    levels = [int(c) for c in args.concurrency.split(",")]
    makers = {
        "slipstream": (lambda work: slipstream_spec(work / "repo", 1, False), "health"),
        "llama-server": (lambda _work: llama_server_spec(1, max(levels)), "health"),
    }
    print(f"load average at start: {os.getloadavg()}", flush=True)
    results: dict[str, Any] = {}
    # Every run its own prompts (seeds), so no run finds the last one's in a prompt cache.
    fresh = itertools.count(1)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tokenizer = export_tokenizer(work / "tokenizer")
        logs = ROOT / "benchmarks" / "results" / "work" / "logs"
        for label in args.servers.split(","):
            make, health = makers[label]
            spec: ServerSpec = make(work)
            with running(spec, server_core, logs / f"guidellm-{label}.log"):
                url = spec.url("")
                for level in levels:
                    runs: dict[str, list[dict[str, float]]] = {"bench": [], "guidellm": []}
                    for turn in range(args.rounds):
                        out = work / f"{label}-{level}-{turn}"
                        seeds = next(fresh), next(fresh)
                        runs["bench"].append(
                            measured(
                                url,
                                partial(
                                    run_bench, url, level, seeds[0], args, out.with_suffix(".b")
                                ),
                            )
                        )
                        runs["guidellm"].append(measured(url, partial(
                            run_guidellm, python, url, health, tokenizer, level, seeds[1],
                            args, out.with_suffix(".g.json"))))  # fmt: skip
                    results.setdefault(label, {})[str(level)] = runs
                    if args.raw:
                        args.raw.mkdir(parents=True, exist_ok=True)
                        for report in work.glob(f"{label}-{level}-*"):
                            shutil.copy(report, args.raw / report.name)
                    report_level(label, level, runs)
    print(f"load average at end: {os.getloadavg()}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def report_level(label: str, level: int, runs: dict[str, list[dict[str, float]]]) -> None:
    cells = []
    for metric in METRICS:
        ours = statistics.median(r[metric] for r in runs["bench"])
        theirs = statistics.median(r[metric] for r in runs["guidellm"])
        spread = [round(r[metric], 1) for tool in ("bench", "guidellm") for r in runs[tool]]
        cells.append(f"{metric} bench {ours:.1f} / guidellm {theirs:.1f} = {ours / theirs:.3f} "
                     f"(runs {spread})")  # fmt: skip
    for tool, done in runs.items():
        for ours, server, what in (("ttft_mean_ms", "server_ttft_mean_ms", "TTFT"),
                                   ("per_token_mean_ms", "server_per_token_mean_ms",
                                    "time per output token")):  # fmt: skip
            if all(server in r for r in done):
                ratios = [f"{r[ours] / r[server]:.3f}" for r in done]
                cells.append(f"{tool}'s {what} mean / the server's, per run: {ratios}")
    errors = sum(r["errors"] for tool in runs.values() for r in tool)
    gaps = statistics.median(r["gap_p50_ms"] for r in runs["bench"])
    print(f"{label} C={level}: " + "; ".join(cells) + f"; bench's ITL p50 (every gap) "
          f"{gaps:.1f}; errors {errors}", flush=True)  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
