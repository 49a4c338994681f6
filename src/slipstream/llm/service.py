"""The generative models of a repository, and text generation with metrics: every model
directory whose ``config.yaml`` names a generative backend (``backend: transformers``,
``llama_cpp``) is loaded here, beside the V2 model manager (its requests are token streams,
not tensor batches); one version per model, the newest its version policy selects."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import weakref
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry

from slipstream.config import ConfigError, ModelConfig
from slipstream.errors import InvalidRequest, ModelNotFound, Unavailable
from slipstream.llm.api import AdapterCard, GenerationService, Job
from slipstream.llm.engine import CacheStats, Engine
from slipstream.llm.loading import (
    adapter_files,
    config_backend,
    drain_and_close,
    in_own_thread,
    llama_threads,
    load_engine,
    model_source,
)
from slipstream.llm.metrics import LlmMetrics
from slipstream.llm.text import TextDelta
from slipstream.observability.lifecycle import LifecycleMetrics
from slipstream.observability.startup import TRACE
from slipstream.repository.layout import (
    Share,
    is_generative,
    list_models,
    model_path,
    read_config,
    read_model_directory,
)
from slipstream.types import RepositoryEntry

logger = logging.getLogger(__name__)


class LlmModels(GenerationService):
    """Loads the repository's generative models and runs generation on them."""

    def __init__(
        self,
        repository: Path,
        registry: CollectorRegistry,
        idle_unload_s: float = 0.0,
        load_wait_s: float = 60.0,
        lifecycle: LifecycleMetrics | None = None,
        share: Share | None = None,
    ) -> None:
        """``idle_unload_s``: the default idle delay (a model's config may set its own, or
        pin it); ``load_wait_s``: how long a request waits for an idle model to load;
        ``share``: the repository's models this process serves (repository/placement.py),
        all if None."""
        self.repository = repository
        self._share = share
        self._engines: dict[str, Engine] = {}
        self._created: dict[str, int] = {}
        self._default_max_tokens: dict[str, int] = {}
        # Each model's generation.max_queue_size, and its requests' jobs handed to
        # generate() whose engine has not yet counted them as waiting (see admit).
        self._queue_limit: dict[str, int] = {}
        self._unstarted: dict[str, int] = {}
        self._versions: dict[str, int] = {}
        self._loading: set[str] = set()
        self._unloading: set[str] = set()
        self._failures: dict[str, str] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        # The LoRA adapters of the loaded models (kept while their model sleeps: a request
        # naming one wakes it), by the name they are served as.
        self._adapters: dict[str, AdapterCard] = {}
        self.metrics = LlmMetrics(registry, self.cache_stats)
        self._lifecycle = lifecycle or LifecycleMetrics()
        # Scale to zero: each model's idle delay (0: never), its requests admitted (the
        # idle check's activity count), what it last saw, the models asleep (name ->
        # the version to load again) and the loads that wake them.
        self._idle_default_s = idle_unload_s
        self._load_wait_s = load_wait_s
        self._idle_delay: dict[str, float] = {}
        self._admitted: dict[str, int] = {}
        self._seen: dict[str, tuple[int, float]] = {}
        self._asleep: dict[str, int] = {}
        self._retry_at: dict[str, float] = {}
        self._failed_wakes: dict[str, int] = {}
        self._waking: dict[str, asyncio.Task[None]] = {}
        self._idle_task: asyncio.Task[None] | None = None

    # -- loading -------------------------------------------------------------------------

    async def load_all(self, only: set[str] | None = None) -> None:
        """Load every generative model (or those named in ``only``)."""
        try:
            directories = list_models(self.repository, self._share)
        except FileNotFoundError:
            return
        wanted = []
        for name, directory in directories.items():
            try:
                config = read_config(directory)
            except ConfigError:
                continue  # the V2 manager reports a broken config.yaml
            if config.generative and (only is None or name in only):
                wanted.append((name, directory.path, list(directory.versions), config))
        self._loading.update(name for name, *_ in wanted)
        threads = llama_threads(sum(config.backend == "llama_cpp" for *_, config in wanted))
        await asyncio.gather(*(self._load(*item, threads) for item in wanted))
        if self._idle_task is None:
            self._idle_task = asyncio.create_task(self._unload_idle_forever())

    async def _load(
        self, name: str, path: Path, versions: list[int], config: ModelConfig, threads: int
    ) -> bool:
        """Load beside whatever serves ``name`` now, then swap; on failure keep serving."""
        try:
            selected = config.version_policy.select(versions)
            if not selected:
                raise ConfigError(f"{name}: no version directory to serve (found {versions})")
            version = max(selected)
            source = model_source(path / str(version), config)
            adapters = adapter_files(path, config)
            self._check_adapter_names(name, adapters)
            started = time.perf_counter()
            engine = await in_own_thread(load_engine, source, config, threads, adapters)
            TRACE.model_loaded(name, time.perf_counter() - started, 0.0)
            self._lifecycle.loaded(name, time.perf_counter() - started, ok=True)
        except Exception as exc:
            self._failures[name] = f"{type(exc).__name__}: {exc}"
            logger.error("generative model %s failed to load: %s", name, exc)
            self._lifecycle.loaded(name, 0.0, ok=False)
            return False
        else:
            own = config.idle_unload_seconds
            self._idle_delay[name] = 0.0 if config.pin else (
                self._idle_default_s if own is None else own
            )  # fmt: skip
            self._asleep.pop(name, None)
            self._failed_wakes.pop(name, None)
            self._seen.pop(name, None)  # a fresh load starts the idle clock again
            previous = self._engines.get(name)
            self._engines[name] = engine
            self._versions[name] = version
            self._created[name] = int(time.time())
            self._default_max_tokens[name] = config.generation.default_max_tokens
            self._queue_limit[name] = config.generation.max_queue_size
            self._failures.pop(name, None)
            self._drop_adapters(name)
            for adapter, file in config.generation.lora_modules.items():
                self._adapters[adapter] = AdapterCard(parent=name, root=file)
            logger.info("generative model %s is READY (%s)", name, source)
            if previous is not None:
                await drain_and_close(previous)
            return True
        finally:
            self._loading.discard(name)

    # -- model control (the repository API) --------------------------------------------

    def handles(self, name: str) -> bool:
        """Whether ``name`` is a generative model of the repository (this lane's)."""
        try:
            return read_config(read_model_directory(model_path(self.repository, name))).generative
        except (ConfigError, FileNotFoundError, OSError):
            return False

    async def load(self, name: str) -> None:
        """(Re)load one model from the repository; InvalidRequest naming the error."""
        async with self._locks.setdefault(name, asyncio.Lock()):
            directory = read_model_directory(model_path(self.repository, name))
            config = read_config(directory)
            self._loading.add(name)
            others = sum(
                config_backend(self.repository, other) == "llama_cpp"
                for other in set(self._engines) - {name}
            )
            threads = llama_threads(others + 1)
            versions = list(directory.versions)
            if not await self._load(name, directory.path, versions, config, threads):
                raise InvalidRequest(f"failed to load model {name!r}: {self._failures[name]}")

    async def unload(self, name: str) -> None:
        """Stop serving ``name``: new requests get 404, running ones finish first."""
        async with self._locks.setdefault(name, asyncio.Lock()):
            asleep = self._asleep.pop(name, None)  # unloaded on purpose: it stays so
            if asleep is not None:  # the index lists it as unloaded, the version it had
                self._versions[name] = asleep
            engine = self._engines.pop(name, None)
            self._created.pop(name, None)
            self._failures.pop(name, None)
            self._drop_adapters(name)
            if engine is None:
                return
            self._lifecycle.unloads[name, "request"] += 1
            self._unloading.add(name)
            try:
                await drain_and_close(engine)
            finally:
                self._unloading.discard(name)
            logger.info("generative model %s is unloaded", name)

    def index(self, ready_only: bool = False) -> list[RepositoryEntry]:
        """The repository's generative models and their states, as the V2 index lists them."""
        try:
            models = list_models(self.repository, self._share)
        except FileNotFoundError:
            models = {}
        names = [name for name, directory in models.items() if is_generative(directory)]
        entries = []
        for name in sorted(set(names) | set(self._engines)):
            engine = self._engines.get(name)
            failure = None if engine is None else engine.failure
            if engine is not None and failure is None:
                entries.append(RepositoryEntry(name, str(self._versions[name]), "READY", ""))
            elif ready_only:
                continue
            elif failure is not None:
                version = str(self._versions[name])
                entries.append(RepositoryEntry(name, version, "UNAVAILABLE", failure))
            elif name in self._loading:
                entries.append(RepositoryEntry(name, "", "LOADING", ""))
            elif name in self._asleep:
                version, reason = str(self._asleep[name]), self._failures.get(name, "idle")
                entries.append(RepositoryEntry(name, version, "UNAVAILABLE", reason))
            elif name in self._unloading:
                entries.append(RepositoryEntry(name, "", "UNLOADING", ""))
            elif name in self._failures:
                entries.append(RepositoryEntry(name, "", "UNAVAILABLE", self._failures[name]))
            elif name in self._versions:  # served, then unloaded: as Triton lists it
                unloaded = str(self._versions[name])
                entries.append(RepositoryEntry(name, unloaded, "UNAVAILABLE", "unloaded"))
            else:
                entries.append(RepositoryEntry(name, "", "", ""))
        return entries

    async def close(self) -> None:
        if self._idle_task is not None:
            self._idle_task.cancel()
        engines, self._engines = self._engines, {}
        await asyncio.gather(*(engine.close() for engine in engines.values()))

    # -- scale to zero -------------------------------------------------------------------

    async def _unload_idle_forever(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            try:
                await self.unload_idle(time.monotonic())
            except Exception:
                logger.exception("idle check of the generative models failed")

    async def unload_idle(self, now: float) -> list[str]:
        """Unload the models without a request for their idle delay; the names."""
        unloaded = []
        for name, engine in list(self._engines.items()):
            delay = self._idle_delay.get(name, 0.0)
            if delay <= 0:
                continue
            stats = engine.cache_stats()
            activity = self._admitted.get(name, 0)
            seen = self._seen.get(name)
            if seen is None or seen[0] != activity or stats.running or stats.waiting:
                self._seen[name] = (activity, now)
            elif now - seen[1] >= delay and await self._sleep(name):
                unloaded.append(name)
        return unloaded

    async def _sleep(self, name: str) -> bool:
        lock = self._locks.setdefault(name, asyncio.Lock())
        if lock.locked():
            return False
        async with lock:
            engine = self._engines.pop(name, None)
            if engine is None:
                return False
            self._asleep[name] = self._versions.pop(name)
            self._seen.pop(name, None)
            self._lifecycle.unloads[name, "idle"] += 1
            await drain_and_close(engine)
        logger.info("generative model %s: unloaded after being idle; its next request "
                    "loads it again", name)  # fmt: skip
        return True

    async def wake(self, name: str) -> None:
        name = self._base(name)
        if name not in self._asleep:
            return
        wait = self._retry_at.get(name, 0.0) - time.monotonic()
        if name in self._failures and wait > 0 and name not in self._waking:
            raise Unavailable(
                f"model {name!r} failed to load on demand: {self._failures[name]}; the next "
                f"attempt is in {math.ceil(wait)} s",
                retry_after_s=math.ceil(wait),
            )
        task = self._waking.get(name)
        if task is None:
            task = self._waking[name] = asyncio.create_task(self._wake(name))
            task.add_done_callback(lambda _: self._waking.pop(name, None))
        self._lifecycle.load_waits[name] += 1
        try:
            await asyncio.wait_for(asyncio.shield(task), self._load_wait_s)
        except TimeoutError:
            raise Unavailable(
                f"model {name!r} is still loading after being idle ({self._load_wait_s:g} s, "
                "--load-wait-s); retry shortly",
                retry_after_s=1,
            ) from None
        if name in self._asleep:
            raise Unavailable(f"model {name!r} failed to load on demand: "
                              f"{self._failures.get(name, 'unknown error')}")  # fmt: skip

    async def _wake(self, name: str) -> None:
        logger.info("generative model %s: a request arrived; loading it again", name)
        try:
            await self.load(name)
        except Exception as exc:  # InvalidRequest naming the failure, a vanished directory
            self._failures.setdefault(name, str(exc))
            failed = self._failed_wakes[name] = self._failed_wakes.get(name, 0) + 1
            self._retry_at[name] = time.monotonic() + min(60.0, 2.0 ** (failed - 1))

    # -- lookup --------------------------------------------------------------------------

    def models(self) -> list[tuple[str, int]]:
        """(name, created unix time) of every ready model and its LoRA adapters."""
        engines = self._engines
        listed = {
            name: created
            for name, created in self._created.items()
            if name not in engines or engines[name].failure is None
        }
        for adapter, card in self._adapters.items():
            if card.parent in listed:
                listed.setdefault(adapter, listed[card.parent])
        return sorted(listed.items())

    def adapters(self) -> dict[str, AdapterCard]:
        served = dict(self.models())
        return {name: card for name, card in self._adapters.items() if name in served}

    def _base(self, name: str) -> str:
        """The model that runs ``name``: its parent for a LoRA adapter, else ``name``."""
        card = self._adapters.get(name)
        return name if card is None else card.parent

    def _drop_adapters(self, parent: str) -> None:
        for name in [name for name, card in self._adapters.items() if card.parent == parent]:
            del self._adapters[name]

    def _check_adapter_names(self, name: str, adapters: Mapping[str, Path]) -> None:
        """ConfigError for an adapter named as a model of the repository, or as another
        model's adapter: requests name either by the same field."""
        for adapter in adapters:
            field = f"generation.lora_modules.{adapter}"
            if adapter == name or (self.repository / adapter).is_dir():
                raise ConfigError(f"{field}: the repository has a model of that name; give "
                                  "the adapter a name of its own")  # fmt: skip
            card = self._adapters.get(adapter)
            if card is not None and card.parent != name:
                raise ConfigError(f"{field}: model {card.parent!r} serves an adapter of that "
                                  "name; give this one a name of its own")  # fmt: skip

    def is_ready(self) -> bool:
        # A model loading again for a request after being idle keeps the server ready.
        return not self._loading.difference(self._asleep)

    def engine(self, name: str) -> Engine:
        name = self._base(name)
        engine = self._engines.get(name)
        if engine is not None:
            return engine
        if name in self._loading:
            raise Unavailable(f"model {name!r} is still loading", retry_after_s=5)
        if name in self._asleep:
            raise Unavailable(f"model {name!r} is asleep (idle); a generation request loads it")
        if name in self._failures:
            raise Unavailable(f"model {name!r} failed to load: {self._failures[name]}")
        if self.handles(name):  # in the repository, not loaded (explicit model control)
            raise ModelNotFound(
                f"model: {name!r} is not loaded; load it with POST /v2/repository/models/"
                f"{name}/load (model control mode explicit; in mode none, after a restart)"
            )
        served = ", ".join(self._engines) or "none"
        raise ModelNotFound(f"model: {name!r} is not a generative model here (served: {served})")

    def version_of(self, name: str) -> int | None:
        """The version of ``name`` served, or asleep (its next request loads it); None: none."""
        engine = self._engines.get(name)
        return self._asleep.get(name) if engine is None or engine.failure else self._versions[name]

    def default_max_tokens(self, name: str) -> int:
        return self._default_max_tokens.get(self._base(name), 256)

    def cache_stats(self) -> dict[str, CacheStats]:
        return {name: engine.cache_stats() for name, engine in self._engines.items()}

    # -- generation ----------------------------------------------------------------------

    def admit(self, model: str, jobs: Sequence[Job]) -> Engine:
        """Check every job fits before anything is sent (400/503 come before a stream).

        The queue is checked for all the request's jobs at once (until 2026-12 each job
        alone, as it was queued: the first ones started, then a 503): more than
        ``generation.max_queue_size`` is a 400, as both engines count all of a request's
        jobs waiting when they arrive together; more than the room left now, a 503. That
        room counts the jobs of requests admitted, not yet queued by their engine (see
        :meth:`generate`, called right after this with nothing awaited between)."""
        engine = self.engine(model)
        model = self._base(model)  # an adapter's requests queue in its model's engine
        self._admitted[model] = self._admitted.get(model, 0) + 1
        if jobs:  # the jobs of one request share everything the engine checks here
            engine.check_features(jobs[0].params)
        limit = self._queue_limit.get(model, 0)
        if limit and len(jobs) > limit:
            raise _too_many(jobs, limit)
        for job in jobs:
            engine.admit(len(job.prompt_ids), job.params.max_tokens)
        waiting = engine.cache_stats().waiting + self._unstarted.get(model, 0)
        if limit and waiting + len(jobs) > limit:
            raise Unavailable(
                f"{waiting} sequences are already waiting for the KV cache, and this request "
                f"adds {len(jobs)} (generation.max_queue_size {limit}); retry later",
                retry_after_s=1,
            )
        return engine

    def generate(
        self, model: str, jobs: Sequence[Job], arrived: float
    ) -> AsyncIterator[tuple[int, TextDelta]]:
        """Run the jobs concurrently; yield (job index, delta) as deltas come.

        ``arrived`` is the request's ``time.perf_counter()`` at arrival, for TTFT and
        end-to-end latency. Closing the iterator cancels every unfinished sequence.
        The jobs count as waiting from this call (see :meth:`admit`) until their engine
        counts them, or the iterator ends or is dropped unstarted.
        """
        engine = self.engine(model)
        base = self._base(model)
        unstarted = _Unstarted(self._unstarted, base, len(jobs))
        adapter = None if base == model else model
        stream = self._generate(model, engine, jobs, arrived, unstarted, adapter)
        weakref.finalize(stream, unstarted.release_all)
        return stream

    async def _generate(
        self, model: str, engine: Engine, jobs: Sequence[Job], arrived: float,
        unstarted: _Unstarted, adapter: str | None,
    ) -> AsyncIterator[tuple[int, TextDelta]]:  # fmt: skip
        if len(jobs) == 1:
            job = jobs[0]
            async for delta in self._one(model, engine, job, arrived, unstarted, adapter):
                yield job.index, delta
            return
        merged: asyncio.Queue[tuple[int, TextDelta] | BaseException | None] = asyncio.Queue()

        async def pump(job: Job) -> None:
            try:
                async for delta in self._one(model, engine, job, arrived, unstarted, adapter):
                    merged.put_nowait((job.index, delta))
            except Exception as exc:
                merged.put_nowait(exc)
            finally:
                merged.put_nowait(None)

        tasks = [asyncio.create_task(pump(job)) for job in jobs]
        try:
            remaining = len(tasks)
            while remaining:
                item = await merged.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            unstarted.release_all()  # the jobs whose task never ran
            for task in tasks:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _one(
        self, model: str, engine: Engine, job: Job, arrived: float, unstarted: _Unstarted,
        adapter: str | None,
    ) -> AsyncIterator[TextDelta]:  # fmt: skip
        metrics = self.metrics
        metrics.prompt_tokens.labels(model).inc(len(job.prompt_ids))
        per_model = metrics.of(model)
        steps = engine.generate(job.prompt_ids, job.params, adapter)
        previous_tokens = 0
        previous_at = arrived
        outcome = "cancelled"
        # The engine counts the job as waiting from here: stream_text starts ``steps`` at
        # once, and the engine checks its queue and queues the job without awaiting.
        unstarted.release(1)
        try:
            async for delta in job.text(steps, engine.decode):
                now = time.perf_counter()
                new = delta.completion_tokens - previous_tokens
                if new > 0:
                    if previous_tokens == 0:
                        per_model.ttft.observe(now - arrived)
                    else:
                        gap = (now - previous_at) / new
                        for _ in range(new):
                            per_model.itl.observe(gap)
                    per_model.generation_tokens.inc(new)
                    previous_tokens, previous_at = delta.completion_tokens, now
                if delta.finish_reason is not None:
                    outcome = delta.finish_reason
                    per_model.e2e.observe(now - arrived)
                yield delta
        except Exception:
            outcome = "error"
            raise
        finally:
            metrics.requests.labels(model, outcome).inc()


class _Unstarted:
    """One request's jobs counted in ``counts[model]`` until their engine counts them."""

    def __init__(self, counts: dict[str, int], model: str, jobs: int) -> None:
        self._counts, self._model, self._left = counts, model, jobs
        counts[model] = counts.get(model, 0) + jobs

    def release(self, jobs: int) -> None:
        jobs = min(jobs, self._left)
        self._left -= jobs
        self._counts[self._model] -= jobs

    def release_all(self) -> None:
        self.release(self._left)


def _too_many(jobs: Sequence[Job], limit: int) -> InvalidRequest:
    """The 400 of a request with more jobs than may ever wait at once, naming ``prompt``
    when its prompts alone are too many, else ``n`` (the jobs of one prompt share its
    list of ids)."""
    prompts = len({id(job.prompt_ids) for job in jobs})
    field = "prompt" if prompts > limit else "n"
    return InvalidRequest(
        f"{field}: {prompts} prompt(s) x n = {len(jobs)} sequences, more than may wait for "
        f"the KV cache at once (generation.max_queue_size {limit}); send at most {limit} "
        "per request"
    )
