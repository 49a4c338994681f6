"""What structured outputs cost on the llama.cpp engine: the same load with and without
a JSON-schema constraint on every request, in one run. Prints the ratio (a script,
never a test).

`slipstream serve` serves SmolLM2-135M-Instruct Q4_1 with `backend: llama_cpp`;
`slipstream bench -i openai-chat` drives it closed loop at each concurrency, first
unconstrained, then with `--response-format` (a schema of an unbounded list of short
strings, so that every reply runs the whole `--output-tokens` inside the grammar), and
again unconstrained to see the drift. Target (issue #20): constrained output tok/s at
C=16 >= 0.85 of unconstrained.

    .venv/bin/python benchmarks/llm_constrained.py              # ~4 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from llm_llama_cpp import SLIPSTREAM, slipstream_spec

from servers import running

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 24}}


def bench(url: str, args: argparse.Namespace, out: Path, schema: Path | None) -> Any:
    argv = [SLIPSTREAM, "bench", url, "-m", "smollm2", "--protocol", "openai-chat",
            "--concurrency", args.concurrency, "--num-requests", str(args.requests),
            "--prompt-tokens", str(args.prompt_tokens), "--output-tokens",
            str(args.output_tokens), "--ignore-eos", "--json", str(out)]  # fmt: skip
    if schema is not None:
        argv += ["--response-format", str(schema)]
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return {lvl["concurrency"]: lvl for lvl in json.loads(out.read_text())["levels"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        schema = work / "schema.json"
        schema.write_text(json.dumps(SCHEMA))
        spec = slipstream_spec(work / "repo", args.threads, True)
        logs = ROOT / "benchmarks" / "results" / "work" / "logs"
        with running(spec, None, logs / "llm-constrained.log"):
            url = spec.url("")
            runs = [
                ("plain", bench(url, args, work / "a.json", None)),
                ("constrained", bench(url, args, work / "b.json", schema)),
                ("plain again", bench(url, args, work / "c.json", None)),
            ]

    def tok_s(run: int, c: int) -> float:
        return float(runs[run][1][c]["output_throughput_tok_per_s"])

    plain = {c: (tok_s(0, c) + tok_s(2, c)) / 2 for c in runs[0][1]}
    print(f"{'C':>3} | " + " | ".join(f"{label:>12} tok/s" for label, _ in runs)
          + " | constrained / plain")  # fmt: skip
    for c in sorted(plain):
        cells = " | ".join(f"{levels[c]['output_throughput_tok_per_s']:>18.1f}"
                           for _, levels in runs)  # fmt: skip
        ratio = runs[1][1][c]["output_throughput_tok_per_s"] / plain[c]
        print(f"{c:>3} | {cells} | {ratio:.2f}")
    errors = sum(levels[c]["errors"] for _, levels in runs for c in levels)
    print(f"errors: {errors}; target at C=16: constrained / plain >= 0.85")
    print(f"load average at end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
