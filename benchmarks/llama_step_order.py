"""What one decode step costs llama.cpp by the order and ids of its sequences (a script).

With a KV stream per sequence (`kv_unified = false`, `kv_streams: per_sequence`),
llama.cpp splits a batch into micro-batches of consecutive sequence ids, taken in batch
order, and runs each as a forward pass of its own (each reads every weight again). This
times `llama_decode` of one token for each of N sequences on SmolLM2-135M Q4_1, with the
sequences' ids contiguous and in order, contiguous but shuffled, and every other id, for
both layouts. The shared cache takes any batch whole. Prints the medians, the ratios
to contiguous-in-order, and the decode tokens a second of N sequences in one pass over
one sequence alone: the most continuous batching can gain on this host.

    .venv/bin/python benchmarks/llama_step_order.py            # ~1 min; --sequences 16
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import llama_cpp as lib
from llm_llama_cpp import gguf_path

STREAM_TOKENS = 512
PROMPT_TOKENS = 64
# llama.cpp's log, silenced (kept referenced: llama.cpp calls it for the process's life).
_QUIET = lib.llama_log_callback(lambda *_: None)


def load_model() -> Any:
    """SmolLM2's GGUF on llama.cpp, its log silenced."""
    lib.llama_backend_init()
    lib.llama_log_set(_QUIET, None)
    return lib.llama_model_load_from_file(str(gguf_path()).encode(),
                                          lib.llama_model_default_params())  # fmt: skip


def context(model: Any, slots: int, unified: bool, threads: int, flash: bool = True) -> Any:
    """A context of ``slots`` sequences of STREAM_TOKENS cells each, steps of up to 256
    tokens; ``flash``: llama.cpp's default flash attention (auto), else off."""
    params = lib.llama_context_default_params()
    params.n_ctx = slots * STREAM_TOKENS
    params.n_batch = params.n_ubatch = 256
    params.n_seq_max = slots
    params.kv_unified = unified
    params.n_threads = params.n_threads_batch = threads
    params.no_perf = True
    if not flash:
        params.flash_attn_type = 0  # LLAMA_FLASH_ATTN_TYPE_DISABLED
    return lib.llama_init_from_model(model, params)


def put_token(
    batch: Any, index: int, token: int, position: int, sequence: int, logits: bool
) -> None:
    """Token ``index`` of a llama_batch: one sequence id, logits wanted or not."""
    batch.token[index] = token
    batch.pos[index] = position
    batch.n_seq_id[index] = 1
    batch.seq_id[index][0] = sequence
    batch.logits[index] = logits


def step_ms(ctx: Any, order: list[int], steps: int) -> float:
    """Median time of a one-token step of every sequence of ``order`` (batch order), after
    each read a prompt of PROMPT_TOKENS random tokens alone."""
    lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
    batch = lib.llama_batch_init(256, 0, 1)
    rng = random.Random(0)
    try:
        for sequence in order:
            for i in range(PROMPT_TOKENS):
                put_token(batch, i, rng.randrange(1000, 20000), i, sequence, i == PROMPT_TOKENS - 1)
            batch.n_tokens = PROMPT_TOKENS
            assert lib.llama_decode(ctx, batch) == 0
        times = []
        for step in range(steps):
            position = PROMPT_TOKENS + step
            for i, sequence in enumerate(order):
                put_token(batch, i, rng.randrange(1000, 20000), position, sequence, True)
            batch.n_tokens = len(order)
            started = time.perf_counter()
            assert lib.llama_decode(ctx, batch) == 0
            times.append((time.perf_counter() - started) * 1e3)
    finally:
        lib.llama_batch_free(batch)
    return statistics.median(times[3:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args()
    n = args.sequences
    orders = {
        "one sequence": [0],
        f"{n} contiguous, in order": list(range(n)),
        f"{n} contiguous, shuffled": random.Random(1).sample(range(n), n),
        f"{n} on every other id, in order": list(range(0, 2 * n, 2)),
    }
    model = load_model()
    print(f"{Path(gguf_path()).name}, {args.threads} threads, load average {os.getloadavg()}")
    for unified in (False, True):
        ctx = context(model, 2 * n, unified, args.threads)
        figures = {label: step_ms(ctx, order, args.steps) for label, order in orders.items()}
        base = figures[f"{n} contiguous, in order"]
        print("shared cache" if unified else "a KV stream per sequence")
        for label, ms in figures.items():
            print(f"  {label:<32} {ms:7.2f} ms a step  x{ms / base:.2f}")
        # The most continuous batching can gain on this host: decode tokens a second of
        # n sequences in one pass against one sequence alone.
        print(f"  tokens/s, {n} in one run / one alone: {n * figures['one sequence'] / base:.2f}")
        lib.llama_free(ctx)
    lib.llama_model_free(model)


if __name__ == "__main__":
    main()
