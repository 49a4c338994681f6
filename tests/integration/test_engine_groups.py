"""Inference requests sent to the engine in groups and stacks (``engine/groups.py``),
and lone requests the engine gathers when several reach it in one turn of its loop.

A real serving core (ONNX models) behind a real engine host, and a front end's
:class:`RemoteInferenceService` on a Unix socket, in one process. Whatever mix of
requests a front end makes in one turn of its loop (alike ones, which travel stacked;
other shapes, datatypes, models; requests the checks refuse; a token the model itself
refuses, in the middle of a stack; stacks past ``max_batch_size``), each gets exactly the
answer or the error the serving core gives it alone, and is counted once in the
statistics. The same holds for lone ``infer`` calls, from one front end or two, that the
engine gathers and stacks itself. Hypothesis draws the mixes.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slipstream.config import ServerSettings
from slipstream.engine import groups
from slipstream.engine.client import EngineClient
from slipstream.engine.company import Company
from slipstream.engine.groups import answer_gathered
from slipstream.engine.host import EngineHost, Gatherer
from slipstream.engine.remote import RemoteInferenceService, engine_calls, engine_gathered
from slipstream.engine.wire import rebuild_error, request_fields, response_from
from slipstream.errors import SlipstreamError
from slipstream.serving.core import ModelServer
from slipstream.serving.service import InferenceService
from slipstream.types import InferRequest, InferResponse, RequestedOutput
from tests.models import ADD_SUB_WIDTH, build_add_sub, build_mean_embedding, write_config

TABLE = np.arange(40, dtype=np.float32).reshape(10, 4)
EMBED_MAX_BATCH = 8


class CountingServer(ModelServer):
    """The serving core, noting each stack it is given (its parts' rows)."""

    def __init__(self, settings: ServerSettings) -> None:
        super().__init__(settings)
        self.stacks: list[list[int]] = []

    async def infer_stack(
        self, stacked: InferRequest, parts: Sequence[InferRequest], rows: Sequence[int]
    ) -> InferResponse | list[InferResponse | Exception]:
        self.stacks.append(list(rows))
        return await super().infer_stack(stacked, parts, rows)


class Engine:
    """A serving core behind an engine host, and a front end's service on its socket."""

    def __init__(self, root: Path) -> None:
        repo = root / "repo"
        build_mean_embedding(repo, "embed", TABLE)
        write_config(repo, "embed", {"max_batch_size": EMBED_MAX_BATCH})
        build_add_sub(repo)
        write_config(repo, "add_sub", {"max_batch_size": 64})
        build_add_sub(repo, "held")
        # Held in the queue for up to 30 s until 64 rows wait: a group can be given up on.
        write_config(repo, "held", {
            "max_batch_size": 64,
            "dynamic_batching": {"preferred_batch_size": [64],
                                 "max_queue_delay_microseconds": 30_000_000},
        })  # fmt: skip
        self.repo = repo
        self.loop = asyncio.new_event_loop()
        self.server = CountingServer(ServerSettings(model_repository=repo))
        # Per gathered method, how many calls the engine gathered each time.
        self.gathered: dict[str, list[int]] = {}
        gatherers = {
            method: self._noted(method, gatherer)
            for method, gatherer in engine_gathered(self.server).items()
        }
        self.host = EngineHost(str(root / "engine"), engine_calls(self.server), gathered=gatherers)
        self.client_path = str(root / "engine")
        self.client = EngineClient(self.client_path)
        self.other = EngineClient(self.client_path)  # a second front end
        # Without the wait for company (engine/company.py, tested at the end): these
        # tests say what reaches the engine in one turn.
        self.remote = RemoteInferenceService([self.client], company=Company(0))
        self.other_remote = RemoteInferenceService([self.other], company=Company(0))
        self.run(self._start())

    def _noted(self, method: str, gatherer: Gatherer) -> Gatherer:
        async def noted(calls: list[tuple[Any, ...]], reply: Any) -> None:
            self.gathered.setdefault(method, []).append(len(calls))
            await gatherer(calls, reply)

        return noted

    async def _start(self) -> None:
        await self.server.start()
        await self.host.start()
        for client in (self.client, self.other):
            client.start()
            assert await client.wait_connected(10)

    def run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(coroutine)

    def close(self) -> None:
        self.run(self.client.close())
        self.run(self.other.close())
        self.run(self.host.close())
        self.run(self.server.stop())
        self.loop.close()

    def successes(self, model: str) -> int:
        stats = self.run(self.server.model_statistics(model))
        return int(stats[0].inference_stats.success.count)


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    root = Path(tempfile.mkdtemp(prefix="engine-groups-"))
    served = Engine(root)
    try:
        yield served
    finally:
        served.close()
        shutil.rmtree(root, ignore_errors=True)


def _embed(ids: list[list[int]], dtype: Any = np.int64, **kwargs: Any) -> InferRequest:
    array = np.array(ids, dtype=dtype)
    return InferRequest("embed", "", {"input_ids": array, "attention_mask": np.ones_like(array)},
                        **kwargs)  # fmt: skip


def _add_sub(rows: int, seed: int, **kwargs: Any) -> InferRequest:
    values = np.random.default_rng(seed).random((2, rows, ADD_SUB_WIDTH), dtype=np.float32)
    return InferRequest("add_sub", "", {"INPUT0": values[0], "INPUT1": values[1]}, **kwargs)


@st.composite
def requests(draw: st.DrawFn) -> InferRequest:
    kind = draw(st.sampled_from(
        ["embed", "embed", "embed", "refused_token", "wrong_dtype", "wrong_width",
         "too_many_rows", "unknown_model", "unknown_output", "add_sub", "add_sub_one_output",
         "unequal_rows", "no_rows"]
    ))  # fmt: skip
    rows = draw(st.integers(1, 4))
    request_id = f"r{draw(st.integers(0, 10**6))}"
    ids = [[draw(st.integers(0, 9)) for _ in range(3)] for _ in range(rows)]
    if kind == "embed":
        return _embed(ids, id=request_id)
    if kind == "refused_token":  # passes every check; ONNX Runtime refuses it
        ids[draw(st.integers(0, rows - 1))][1] = 10
        return _embed(ids, id=request_id)
    if kind == "wrong_dtype":
        return _embed(ids, np.int32, id=request_id)
    if kind == "wrong_width":
        return _embed([row[:2] for row in ids], id=request_id)
    if kind == "too_many_rows":
        return _embed(ids * EMBED_MAX_BATCH, id=request_id)
    if kind == "unequal_rows":  # its inputs disagree on the batch dim: never stacked
        request = _embed(ids, id=request_id)
        request.inputs["attention_mask"] = np.ones((rows + 1, 3), np.int64)
        return request
    if kind == "no_rows":  # a batch of none: never stacked
        empty = np.zeros((0, 3), np.int64)
        return InferRequest("embed", "", {"input_ids": empty, "attention_mask": empty},
                            id=request_id)  # fmt: skip
    if kind == "unknown_model":
        return InferRequest("nothing", "", _embed(ids).inputs, id=request_id)
    if kind == "unknown_output":
        return _embed(ids, id=request_id, outputs=[RequestedOutput("nope")])
    seed = draw(st.integers(0, 1000))
    if kind == "add_sub_one_output":
        return _add_sub(rows, seed, id=request_id, outputs=[RequestedOutput("OUTPUT1")])
    return _add_sub(rows, seed, id=request_id)


def _same(got: InferResponse | Exception, alone: InferResponse | Exception) -> None:
    if isinstance(alone, Exception):
        assert type(got) is type(alone), (got, alone)
        assert str(got) == str(alone)
        return
    assert isinstance(got, InferResponse), got
    assert (got.model_name, got.model_version, got.id) == (
        alone.model_name, alone.model_version, alone.id,
    )  # fmt: skip
    assert list(got.outputs) == list(alone.outputs)
    for name, array in alone.outputs.items():
        assert got.outputs[name].dtype == array.dtype
        np.testing.assert_array_equal(got.outputs[name], array)


def _answered_as_alone(
    engine: Engine, drawn: list[InferRequest], send: Callable[[], Awaitable[list[Any]]]
) -> None:
    """``send()`` (run after the engine's gathering record is cleared) answers each of
    ``drawn`` as the serving core answers it alone, and each model's success count moves
    by the number of its requests served."""
    alone = engine.run(_each([engine.server.infer(request) for request in drawn]))
    before = {model: engine.successes(model) for model in ("embed", "add_sub")}
    engine.gathered.clear()
    got = engine.run(send())
    for answer, expected in zip(got, alone, strict=True):
        if isinstance(answer, SlipstreamError | InferResponse):
            _same(answer, expected)
        else:
            raise answer
    for model in ("embed", "add_sub"):
        served = sum(
            1 for request, answer in zip(drawn, got, strict=True)
            if request.model_name == model and isinstance(answer, InferResponse)
        )  # fmt: skip
        assert engine.successes(model) - before[model] == served


async def _each(calls: list[Any]) -> list[Any]:
    """Every call's answer or error, the calls started in one turn of the loop."""
    answers: list[Any] = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 20)
    return answers


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(requests(), min_size=1, max_size=24))
def test_each_request_of_a_group_is_answered_as_it_would_be_alone(
    engine: Engine, drawn: list[InferRequest]
) -> None:
    _answered_as_alone(engine, drawn, lambda: _each([engine.remote.infer(r) for r in drawn]))


def test_alike_requests_are_checked_and_queued_as_one(engine: Engine) -> None:
    """Twelve alike requests of one row: two stacks (max_batch_size 8), each counted as
    its requests in the queue and success statistics, run in two batches of 8 and 4."""
    stats = engine.run(engine.server.model_statistics("embed"))[0]
    queued, runs = stats.inference_stats.queue.count, stats.execution_count
    drawn = [_embed([[i % 10, (i + 1) % 10, 2]], id=str(i)) for i in range(12)]
    engine.server.stacks.clear()
    answers = engine.run(_each([engine.remote.infer(request) for request in drawn]))
    assert engine.server.stacks == [[1] * 12]
    for i, answer in enumerate(answers):
        assert isinstance(answer, InferResponse) and answer.id == str(i)
        expected = TABLE[[i % 10, (i + 1) % 10, 2]].mean(axis=0)
        np.testing.assert_allclose(answer.outputs["embedding"][0], expected, rtol=1e-6)
    stats = engine.run(engine.server.model_statistics("embed"))[0]
    assert stats.inference_stats.queue.count - queued == 12
    assert stats.execution_count - runs == 2


@pytest.mark.parametrize("count", [1, 3])
def test_a_group_every_requester_gave_up_on_leaves_the_queue(engine: Engine, count: int) -> None:
    async def give_up() -> int:
        held = [InferRequest("held", "", _add_sub(1, seed).inputs) for seed in range(count)]
        calls = [asyncio.ensure_future(engine.remote.infer(request)) for request in held]
        batcher = engine.server.models.resolve("held").batcher
        for _ in range(200):
            await asyncio.sleep(0.01)
            if batcher.num_pending == count:
                break
        assert batcher.num_pending == count  # queued in the engine, waiting for 64 rows
        for call in calls:
            call.cancel()
        for _ in range(200):
            await asyncio.sleep(0.01)
            if not batcher.num_pending:
                break
        return batcher.num_pending

    assert engine.run(give_up()) == 0


async def _lone_calls(
    clients: list[EngineClient], drawn: list[InferRequest]
) -> list[InferResponse | Exception]:
    """Each request as a lone ``infer`` call, the calls started in one turn of the loop,
    spread over ``clients`` in turn; every answer or error."""
    calls = [
        clients[index % len(clients)].start_call("infer", request_fields(request))[1]
        for index, request in enumerate(drawn)
    ]
    answers = await _each(calls)
    return [a if isinstance(a, Exception) else response_from(a) for a in answers]


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(requests(), min_size=1, max_size=12), st.lists(requests(), min_size=1, max_size=12))
def test_groups_of_two_front_ends_the_engine_gathers_are_answered_as_alone(
    engine: Engine, first: list[InferRequest], second: list[InferRequest]
) -> None:
    """Two front ends' groups (or lone requests) that reach the engine in one turn are
    served together, alike entries of the two merged into one stack, and each request
    answered as alone."""
    _answered_as_alone(
        engine,
        first + second,
        lambda: _each(
            [engine.remote.infer(r) for r in first] + [engine.other_remote.infer(r) for r in second]
        ),
    )
    # Each front end sends one call per model: alone as infer, several as infer_group;
    # the engine gathers each method's calls of its turn when there are several.
    calls: dict[str, int] = {}
    for sent in (first, second):
        for count in Counter((r.model_name, r.model_version) for r in sent).values():
            method = "infer" if count == 1 else "infer_group"
            calls[method] = calls.get(method, 0) + 1
    assert engine.gathered == {method: [n] for method, n in calls.items() if n > 1}


def test_alike_entries_of_two_front_ends_groups_are_merged(engine: Engine) -> None:
    """Four alike requests from each of two front ends, a lone one among them, all in
    one turn: the engine stacks the two groups' stacks into one of eight rows."""
    drawn = [_embed([[i, 9 - i, 2]], id=f"m{i}") for i in range(8)]
    extra = _add_sub(2, 3, id="other")  # another model in the first group: a ONE entry
    engine.gathered.clear()
    engine.server.stacks.clear()
    calls = [engine.remote.infer(r) for r in [*drawn[:4], extra]]
    calls += [engine.other_remote.infer(r) for r in drawn[4:]]
    answers = engine.run(_each(calls))
    assert engine.gathered == {"infer_group": [2]}
    assert engine.server.stacks == [[1] * 8]
    for i, answer in enumerate(answers[:4] + answers[5:]):
        assert isinstance(answer, InferResponse) and answer.id == f"m{i}"
        np.testing.assert_allclose(
            answer.outputs["embedding"][0], TABLE[[i, 9 - i, 2]].mean(axis=0), rtol=1e-6
        )
    inputs = extra.inputs
    assert isinstance(answers[4], InferResponse) and answers[4].id == "other"
    np.testing.assert_allclose(answers[4].outputs["OUTPUT0"], inputs["INPUT0"] + inputs["INPUT1"])


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(requests(), min_size=1, max_size=24), st.sampled_from([1, 2]))
def test_lone_calls_the_engine_gathers_are_answered_as_they_would_be_alone(
    engine: Engine, drawn: list[InferRequest], front_ends: int
) -> None:
    """Lone calls that reach the engine in one turn, from one front end or two, are
    served together (alike ones stacked by the engine) and answered each as alone."""
    clients = [engine.client, engine.other][:front_ends]
    _answered_as_alone(engine, drawn, lambda: _lone_calls(clients, drawn))
    if len(drawn) > 1:  # all of them reached the engine in one turn of its loop
        assert engine.gathered == {"infer": [len(drawn)]}


def test_alike_lone_calls_are_stacked_by_the_engine(engine: Engine) -> None:
    """Eight alike lone calls from two front ends: gathered in one turn, checked and
    queued as one stack (one queue entry of eight requests, one run of eight rows)."""
    stats = engine.run(engine.server.model_statistics("embed"))[0]
    queued, runs = stats.inference_stats.queue.count, stats.execution_count
    batches = {b.batch_size: b.compute_infer.count for b in stats.batch_stats}
    waits = _histogram_count(engine, "embed", "queue")
    served = _histogram_count(engine, "embed", "request")
    drawn = [_embed([[i, 9 - i, 2]], id=f"g{i}") for i in range(8)]
    engine.gathered.clear()
    engine.server.stacks.clear()
    answers = engine.run(_lone_calls([engine.client, engine.other], drawn))
    assert engine.gathered == {"infer": [8]}
    assert engine.server.stacks == [[1] * 8]
    for i, answer in enumerate(answers):
        assert isinstance(answer, InferResponse) and answer.id == f"g{i}"
        np.testing.assert_allclose(
            answer.outputs["embedding"][0], TABLE[[i, 9 - i, 2]].mean(axis=0), rtol=1e-6
        )
    stats = engine.run(engine.server.model_statistics("embed"))[0]
    assert stats.inference_stats.queue.count - queued == 8
    assert stats.execution_count - runs == 1
    after = {b.batch_size: b.compute_infer.count for b in stats.batch_stats}
    assert after.get(8, 0) - batches.get(8, 0) == 1
    # /metrics' queue-time and request-time histograms count each request of the stack.
    assert _histogram_count(engine, "embed", "queue") - waits == 8
    assert _histogram_count(engine, "embed", "request") - served == 8


def _histogram_count(engine: Engine, model: str, what: str) -> float:
    for family in engine.server.metrics.registry.collect():
        for sample in family.samples:
            if (sample.name == f"slipstream_{what}_duration_seconds_count"
                    and sample.labels.get("model") == model):  # fmt: skip
                return float(sample.value)
    raise AssertionError(f"no {what}-time histogram for {model}")


def test_a_gathered_call_given_up_on_leaves_the_others_answered(engine: Engine) -> None:
    """Three lone calls gathered into one stack on ``held`` (which waits for 64 rows): one
    given up on gets no answer and the stack stays queued for the other two, which are
    answered when 61 more rows fill the batch; once every call of a stack is given up on,
    it leaves the queue."""

    async def scenario() -> tuple[list[Any], int, int]:
        batcher = engine.server.models.resolve("held").batcher
        held = [InferRequest("held", "", _add_sub(1, seed).inputs, id=f"h{seed}")
                for seed in range(3)]  # fmt: skip
        calls = [engine.client.start_call("infer", request_fields(r)) for r in held]
        await _until(lambda: batcher.num_pending == 3)
        engine.client.give_up(calls[0][0])
        await asyncio.sleep(0.05)
        still = batcher.num_pending  # the stack is one queue entry: it stays
        filler = InferRequest("held", "", _add_sub(61, 7).inputs)
        await asyncio.wait_for(engine.client.start_call("infer", request_fields(filler))[1], 20)
        answers = await _each([future for _, future in calls[1:]])
        # Three more, all given up on: they leave the queue.
        more = [engine.client.start_call("infer", request_fields(r)) for r in held]
        await _until(lambda: batcher.num_pending == 3)
        for call_id, _ in more:
            engine.client.give_up(call_id)
        await _until(lambda: batcher.num_pending == 0)
        return answers, still, batcher.num_pending

    answers, still, left = engine.run(scenario())
    assert still == 3 and left == 0
    for seed, answer in zip((1, 2), answers, strict=True):
        assert isinstance(answer, tuple), answer
        response = response_from(answer)
        inputs = _add_sub(1, seed).inputs
        assert response.id == f"h{seed}"
        np.testing.assert_allclose(response.outputs["OUTPUT0"], inputs["INPUT0"] + inputs["INPUT1"])


async def _until(condition: Any) -> None:
    for _ in range(300):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out waiting")


class OneByOne(ModelServer):
    """The serving core with the contract's own ``infer_group`` and ``infer_stack``
    (one request at a time), as any other InferenceService has them."""

    infer_group = InferenceService.infer_group
    infer_stack = InferenceService.infer_stack


def test_the_contracts_defaults_answer_gathered_calls_as_alone(engine: Engine) -> None:
    """A service without the serving core's group and stack paths still answers calls
    the engine gathered and stacked (its defaults run the parts one by one)."""
    drawn = [_embed([[i, 1, 2]], id=f"d{i}") for i in range(5)]
    drawn[2] = _embed([[3, 10, 2]], id="refused")  # in the middle of the stack
    drawn += [_add_sub(2, 1, id="a"), InferRequest("nothing", "", drawn[0].inputs, id="x")]
    plain = OneByOne(ServerSettings(model_repository=engine.repo))
    engine.run(plain.start())
    try:
        alone = engine.run(_each([engine.server.infer(request) for request in drawn]))
        replies: dict[int, tuple[bool, Any]] = {}
        calls = [(request_fields(request),) for request in drawn]
        engine.run(answer_gathered(plain)(calls, lambda i, ok, v: replies.update({i: (ok, v)})))
    finally:
        engine.run(plain.stop())
    answers = [replies[index] for index in range(len(drawn))]
    for (ok, value), expected in zip(answers, alone, strict=True):
        _same(response_from(value) if ok else rebuild_error(value), expected)
    assert isinstance(alone[2], SlipstreamError) and isinstance(alone[0], InferResponse)


def test_a_front_end_that_goes_away_leaves_the_rest_of_a_gathering(engine: Engine) -> None:
    """Lone calls of two front ends gathered into one stack on ``held``: the front end
    that goes away loses its calls; the stack stays queued for the other's until that
    one gives up too, and then leaves the queue."""

    async def scenario() -> tuple[int, int]:
        batcher = engine.server.models.resolve("held").batcher
        leaving = EngineClient(engine.client_path)
        leaving.start()
        assert await leaving.wait_connected(10)
        one = InferRequest("held", "", _add_sub(1, 1).inputs)
        staying, _ = engine.other.start_call("infer", request_fields(one))
        leaving.start_call("infer", request_fields(one))
        await _until(lambda: batcher.num_pending == 2)
        await leaving.close()
        await asyncio.sleep(0.1)
        still = batcher.num_pending
        engine.other.give_up(staying)
        await _until(lambda: batcher.num_pending == 0)
        return still, batcher.num_pending

    gathered = len(engine.gathered.get("infer", []))
    assert engine.run(scenario()) == (2, 0)
    assert engine.gathered["infer"][gathered:] == [2]


@pytest.mark.parametrize("sent_as", ["lone calls", "a front end's group"])
def test_large_alike_requests_are_not_copied_into_one_stack(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, sent_as: str
) -> None:
    """Alike requests whose inputs are larger than MERGE_MAX_BYTES each are not stacked,
    neither by the engine (lone calls) nor by a front end (its group): they travel and run
    as they came, and the batcher joins them off the event loops. Smaller ones are."""
    drawn = [_add_sub(2, seed, id=f"s{seed}") for seed in range(4)]  # 256 bytes each
    for limit, stacks in ((256, [[2, 2, 2, 2]]), (255, [])):
        monkeypatch.setattr(groups, "MERGE_MAX_BYTES", limit)
        engine.server.stacks.clear()
        if sent_as == "lone calls":
            answers = engine.run(_lone_calls([engine.client], drawn))
        else:
            answers = engine.run(_each([engine.remote.infer(request) for request in drawn]))
        assert engine.server.stacks == stacks
        for request, answer in zip(drawn, answers, strict=True):
            assert isinstance(answer, InferResponse) and answer.id == request.id
            np.testing.assert_allclose(
                answer.outputs["OUTPUT1"], request.inputs["INPUT0"] - request.inputs["INPUT1"]
            )


def test_a_slow_models_requests_do_not_hold_back_anothers(engine: Engine) -> None:
    """A front end's turn carries a request for ``held`` (queued until 64 rows wait) and
    two for ``embed``: the embed answers come while the held one still waits. The same
    for two front ends' lone calls that the engine gathers in one turn."""

    async def scenario() -> None:
        batcher = engine.server.models.resolve("held").batcher
        held = InferRequest("held", "", _add_sub(1, 0).inputs)
        slow = asyncio.ensure_future(engine.remote.infer(held))
        fast = [engine.remote.infer(_embed([[1, 2, i]], id=f"f{i}")) for i in range(2)]
        for i, answer in enumerate(await asyncio.wait_for(asyncio.gather(*fast), 10)):
            assert answer.id == f"f{i}"
        assert not slow.done() and batcher.num_pending == 1
        engine.gathered.clear()
        slow_lone = engine.other.start_call("infer", request_fields(held))[1]
        fast_lone = engine.client.start_call("infer", request_fields(_embed([[4, 5, 6]])))[1]
        np.testing.assert_allclose(
            response_from(await asyncio.wait_for(fast_lone, 10)).outputs["embedding"][0],
            TABLE[[4, 5, 6]].mean(axis=0),
        )
        assert engine.gathered == {"infer": [2]}
        assert not slow_lone.done() and batcher.num_pending == 2
        filler = InferRequest("held", "", _add_sub(62, 5).inputs)  # 64 rows: they run
        await asyncio.wait_for(asyncio.gather(engine.remote.infer(filler), slow, slow_lone), 10)

    engine.run(scenario())


# A lone request waiting for company (engine/company.py), through a real engine.


def _company_remote(engine: Engine, hold_s: float) -> RemoteInferenceService:
    """A front end holding lone requests up to ``hold_s``, remembering its peak for 10 s
    (a loaded host's pauses between the steps of a test do not make it forget)."""
    return RemoteInferenceService([engine.client], company=Company(hold_s, window_s=10.0))


async def _two_at_once(remote: RemoteInferenceService) -> None:
    """Two requests in flight at once: the front end now expects company for a lone one."""
    await _each([remote.infer(_add_sub(1, seed)) for seed in (90, 91)])


def test_a_lone_request_waits_for_the_company_that_is_due(engine: Engine) -> None:
    """After two requests in flight at once, a lone one is held (hold: 5 s) until a
    second comes 30 ms later, and both travel as one stack."""

    async def scenario() -> tuple[Any, Any, float]:
        loop = asyncio.get_running_loop()
        remote = _company_remote(engine, 5.0)
        await _two_at_once(remote)
        engine.server.stacks.clear()
        started = loop.time()
        first = asyncio.ensure_future(remote.infer(_add_sub(1, 1, id="a")))
        await asyncio.sleep(0.03)
        assert not first.done() and engine.server.stacks == []  # still in the front end
        second = await asyncio.wait_for(remote.infer(_add_sub(1, 2, id="b")), 10)
        return await first, second, loop.time() - started

    first, second, took = engine.run(scenario())
    assert engine.server.stacks == [[1, 1]]
    assert 0.03 <= took < 2.0
    for answer, seed in ((first, 1), (second, 2)):
        inputs = _add_sub(1, seed).inputs
        np.testing.assert_allclose(answer.outputs["OUTPUT0"], inputs["INPUT0"] + inputs["INPUT1"])


def test_a_held_request_leaves_alone_after_the_longest_hold(engine: Engine) -> None:
    """When no company comes, the lone request leaves after the hold (0.2 s) alone."""

    async def scenario() -> tuple[InferResponse, float]:
        loop = asyncio.get_running_loop()
        remote = _company_remote(engine, 0.2)
        await _two_at_once(remote)
        started = loop.time()
        answer = await asyncio.wait_for(remote.infer(_add_sub(1, 3, id="c")), 10)
        return answer, loop.time() - started

    answer, took = engine.run(scenario())
    assert answer.id == "c"
    assert 0.19 <= took < 2.0


def test_only_a_lone_request_waits_for_company(engine: Engine) -> None:
    """A turn of two requests leaves at once, though three were in flight before."""

    async def scenario() -> float:
        loop = asyncio.get_running_loop()
        remote = _company_remote(engine, 5.0)
        await _each([remote.infer(_add_sub(1, seed)) for seed in range(3)])
        started = loop.time()
        answers = await _each([remote.infer(_add_sub(1, seed)) for seed in range(2)])
        assert all(isinstance(answer, InferResponse) for answer in answers), answers
        return loop.time() - started

    assert engine.run(scenario()) < 2.0


def test_a_client_alone_never_waits_for_company(engine: Engine) -> None:
    """One request at a time (C=1) never waits, however long the hold (5 s)."""

    async def scenario() -> float:
        loop = asyncio.get_running_loop()
        remote = _company_remote(engine, 5.0)
        started = loop.time()
        for seed in range(20):
            answer = await asyncio.wait_for(remote.infer(_add_sub(1, seed, id=f"s{seed}")), 10)
            assert answer.id == f"s{seed}"
        return loop.time() - started

    assert engine.run(scenario()) < 4.0  # 20 holds would take 100 s


def test_a_held_request_given_up_on_never_reaches_the_engine(engine: Engine) -> None:
    """A lone request cancelled while it waits for company is never sent: when the hold
    (0.2 s) ends there is nothing to send, and the model runs nothing."""

    async def held_then_given_up(remote: RemoteInferenceService) -> None:
        held = asyncio.ensure_future(remote.infer(_add_sub(1, 4)))
        await asyncio.sleep(0.05)
        held.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await held
        await asyncio.sleep(0.3)

    remote = _company_remote(engine, 0.2)
    engine.run(_two_at_once(remote))
    before = engine.successes("add_sub")
    engine.server.stacks.clear()
    engine.run(held_then_given_up(remote))
    assert engine.successes("add_sub") == before
    assert engine.server.stacks == []
    # The front end still serves: its next request is answered.
    answer = engine.run(asyncio.wait_for(remote.infer(_add_sub(1, 5, id="after")), 10))
    assert answer.id == "after"
