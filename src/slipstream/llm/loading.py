"""Loading a generative model's engine: where its files are, how many threads it gets, the
thread it loads on, and closing the engine it replaces once its sequences are done."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from slipstream.config import ConfigError, ModelConfig
from slipstream.llm.engine import Engine
from slipstream.repository.layout import (
    contained_file,
    model_path,
    named_model_file,
    read_config,
    read_model_directory,
)
from slipstream.runtime import heap
from slipstream.runtime.base import usable_cpu_count

T = TypeVar("T")


async def in_own_thread(function: Callable[..., T], *args: Any) -> T:
    """Run ``function`` on a new thread that exits when it returns.

    Not the event loop's executor: a torch model run on a thread that stays alive
    leaves an OpenMP worker pool behind it. With the generation thread's own pool that
    makes more OpenMP threads than cores, and libgomp then puts its workers to sleep
    between parallel regions: the same decode measured 13-15 instead of 18-28 tokens/s
    on two cores.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def run() -> None:
        try:
            result = function(*args)
        except BaseException as exc:  # handed to the awaiting coroutine
            loop.call_soon_threadsafe(_settle, future, None, exc)
        else:
            loop.call_soon_threadsafe(_settle, future, result, None)

    threading.Thread(target=run, name="slipstream-llm-load", daemon=True).start()
    return await future


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def model_source(version_dir: Path, config: ModelConfig) -> Path:
    """The GGUF file or Hugging Face directory inside a version directory."""
    named = named_model_file(version_dir, config)
    if named is not None:
        return named
    if (version_dir / "config.json").is_file():
        return version_dir
    ggufs = sorted(version_dir.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    found = ", ".join(p.name for p in sorted(version_dir.iterdir())) or "nothing"
    raise ConfigError(
        f"{version_dir}: expected one .gguf file or a Hugging Face model directory "
        f"(config.json + weights); found {found}"
    )


def config_backend(repository: Path, name: str) -> str:
    try:
        return read_config(read_model_directory(model_path(repository, name))).backend
    except (ConfigError, OSError):
        return ""


async def drain_and_close(engine: Engine, timeout_s: float = 30.0) -> None:
    """Close ``engine`` once its running and waiting sequences are done (or after
    ``timeout_s``: those still running then end with a 503)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = engine.cache_stats()
        if not (stats.running or stats.waiting):
            break
        await asyncio.sleep(0.05)
    await engine.close()
    heap.reclaim_soon()


def llama_threads(models: int) -> int:
    """Threads of one llama.cpp model when ``models`` of them share this process's cores.

    Each llama.cpp context runs its own thread pool; two models both using every core
    would oversubscribe them, and a decode step waits for its slowest thread.
    """
    return max(1, usable_cpu_count() // max(1, models))


def load_engine(
    source: Path, config: ModelConfig, threads: int, adapters: Mapping[str, Path]
) -> Engine:
    """Load the engine of ``config.backend`` from ``source`` with the LoRA ``adapters``
    (name -> GGUF file, see :func:`adapter_files`). Blocking."""
    if config.backend == "llama_cpp":
        from slipstream.llm.llamacpp import load_llama_cpp_engine

        # Set by the config: that many throughout; automatic: fewer while the CPU is crowded.
        fixed = config.generation.threads
        return load_llama_cpp_engine(
            source, config.generation, fixed or threads, not fixed, adapters
        )
    if adapters:
        raise ConfigError(
            f"generation.lora_modules: the {config.backend} engine cannot apply LoRA "
            "adapters (it has no peft); serve the model's GGUF with backend: llama_cpp, or "
            "remove generation.lora_modules"
        )
    if config.backend == "transformers":
        from slipstream.llm.hf import load_transformers_engine

        return load_transformers_engine(source, config.generation)
    raise ConfigError(f"backend: {config.backend!r} is not a generative backend")


def adapter_files(model_dir: Path, config: ModelConfig) -> dict[str, Path]:
    """The LoRA adapters ``generation.lora_modules`` names, as files inside the model
    directory ``model_dir``; ConfigError naming the adapter whose file is missing."""
    files = {}
    for name, relative in config.generation.lora_modules.items():
        field = f"generation.lora_modules.{name}"
        path = contained_file(model_dir, relative, field)
        if not path.is_file():
            raise ConfigError(f"{field}: {path} does not exist; name the adapter's GGUF file, "
                              "relative to the model's directory")  # fmt: skip
        files[name] = path
    return files
