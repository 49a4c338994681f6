"""The OpenAI routes against a real server, driven by the stock openai SDK and httpx.

One server per module serves a tiny random-weight Llama three times over (a roomy cache,
a cache too small for three sequences at once, a one-slot waiting queue) and a
mean-of-token-rows embedding model. Greedy completions are checked token for token
against an in-process ``generate()`` of the same weights.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.llm_models import build_tiny_llama
from tests.models import build_mean_embedding, mean_embedding, write_config
from tests.utils import RemoteServer

# Token limit of the embedding model's requests (max_request_tokens in its config).
EMBED_MAX_TOKENS = 2000

# Slow: the whole module runs in `make test`, not in `make test-fast`.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SMALL_CACHE_TOKENS = 64  # tiny_small: 4 blocks x 16 tokens


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "hf")


@pytest.fixture(scope="module")
def table(tiny_dir: Path) -> np.ndarray:
    vocab = len(AutoTokenizer.from_pretrained(tiny_dir))
    return np.random.default_rng(0).standard_normal((vocab, 8)).astype(np.float32)


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path, table: np.ndarray
) -> Iterator[RemoteServer]:
    repo = tmp_path_factory.mktemp("llm-repo")
    generation = {
        "tiny": {"num_blocks": 64, "block_size": 16},
        "tiny_small": {"num_blocks": 4, "block_size": 16, "max_queue_size": 8},
        "tiny_queue": {"num_blocks": 4, "block_size": 16, "max_queue_size": 1},
    }
    for name, settings in generation.items():
        shutil.copytree(tiny_dir, repo / name / "1")
        write_config(repo, name, {"backend": "transformers", "generation": settings})
    build_mean_embedding(repo, "embed", table)
    shutil.copy(tiny_dir / "tokenizer.json", repo / "embed" / "tokenizer.json")
    # Like make run's minilm: a preferred batch size below max_batch_size.
    write_config(
        repo,
        "embed",
        {
            "max_batch_size": 8,
            "dynamic_batching": {"preferred_batch_size": [4]},
            "tokenizer": "tokenizer.json",
            "max_request_tokens": EMBED_MAX_TOKENS,
        },
    )
    with RemoteServer(repo, log_dir=repo) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def reference(tiny_dir: Path) -> Any:
    """Greedy completion of a prompt by in-process transformers generate()."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()

    def complete(prompt_ids: list[int], max_tokens: int) -> list[int]:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt_ids]),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        return [int(t) for t in out[0, len(prompt_ids) :]]

    complete.tokenizer = tokenizer  # type: ignore[attr-defined]
    complete.model = model  # type: ignore[attr-defined]
    return complete


def metric(server: RemoteServer, name: str, **labels: str) -> float:
    text = server.http.get("/metrics").text
    wanted = "".join(f'(?=[^}}]*{k}="{v}")' for k, v in labels.items())
    match = re.search(rf"^{name}\{{{wanted}[^}}]*\}} (\S+)$", text, re.M)
    assert match, f"{name} {labels} not in /metrics"
    return float(match.group(1))


# -- discovery --------------------------------------------------------------------------


def test_models_lists_generative_and_embedding_models(client: openai.OpenAI) -> None:
    ids = sorted(model.id for model in client.models.list())
    assert ids == ["embed", "tiny", "tiny_queue", "tiny_small"]
    assert client.models.retrieve("tiny").id == "tiny"


# -- completions ------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", ["Hello world", "The capital of France is", "A"])
def test_greedy_completion_matches_in_process_generate(
    client: openai.OpenAI, reference: Any, prompt: str
) -> None:
    ids = reference.tokenizer.encode(prompt)
    expected = reference(ids, 12)
    reply = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.choices[0].text == reference.tokenizer.decode(expected, skip_special_tokens=True)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), 12)
    assert reply.usage.total_tokens == len(ids) + 12


def test_a_prompt_longer_than_one_step_is_prefilled_in_chunks(
    client: openai.OpenAI, reference: Any
) -> None:
    # 300 prompt tokens where one engine step takes at most max_batch_tokens (256): the
    # same class of request as a V2 batch above every preferred size. It must run.
    ids = [int(t) for t in np.random.default_rng(3).integers(5, 300, size=300)]
    reply = client.completions.create(
        model="tiny", prompt=ids, max_tokens=4, temperature=0, extra_body={"ignore_eos": True},
        timeout=60,
    )  # fmt: skip
    expected = reference.tokenizer.decode(reference(ids, 4), skip_special_tokens=True)
    assert reply.choices[0].text == expected
    assert reply.usage is not None and reply.usage.prompt_tokens == 300


def test_token_id_prompts_and_several_prompts(client: openai.OpenAI, reference: Any) -> None:
    ids = reference.tokenizer.encode("Hello world")
    reply = client.completions.create(
        model="tiny", prompt=[ids, ids[:1]], max_tokens=5, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in reply.choices] == [0, 1]
    decode = reference.tokenizer.decode
    assert reply.choices[0].text == decode(reference(ids, 5), skip_special_tokens=True)
    assert reply.choices[1].text == decode(reference(ids[:1], 5), skip_special_tokens=True)
    assert reply.usage is not None and reply.usage.completion_tokens == 10


def test_streamed_completion_concatenates_to_the_unstreamed_text(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": "tiny", "prompt": "Hello", "max_tokens": 10,
                              "temperature": 0, "extra_body": {"ignore_eos": True}}  # fmt: skip
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 10


def test_stop_sequence_ends_the_text_before_it(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": "tiny", "prompt": "Hello", "max_tokens": 16,
                              "temperature": 0, "extra_body": {"ignore_eos": True}}  # fmt: skip
    full = client.completions.create(**kwargs).choices[0].text
    stop = full[5:7]
    assert stop, "the greedy text is too short to pick a stop sequence from"
    cut = client.completions.create(**kwargs, stop=[stop]).choices[0]
    assert cut.text == full[: full.index(stop)]
    assert cut.finish_reason == "stop"


def test_seeded_sampling_is_reproducible_and_n_fans_out(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": "tiny", "prompt": "Hello", "max_tokens": 12, "seed": 7,
                              "temperature": 1.0, "extra_body": {"ignore_eos": True}}  # fmt: skip
    first = client.completions.create(**kwargs, n=3)
    second = client.completions.create(**kwargs, n=3)
    texts = [c.text for c in first.choices]
    assert len(texts) == 3 and texts == [c.text for c in second.choices]
    # Each choice samples its own sequence (seed + index), so they differ.
    assert len(set(texts)) > 1
    assert first.usage is not None and first.usage.completion_tokens == 36


# -- chat -------------------------------------------------------------------------------


def test_chat_applies_the_template(client: openai.OpenAI, reference: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    reply = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    expected = reference.tokenizer.decode(reference(ids, 6), skip_special_tokens=True)
    assert choice.message.content == expected
    assert reply.usage is not None and reply.usage.prompt_tokens == len(ids)


def test_streamed_chat_sends_role_first_and_reason_last(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
        temperature=0, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] in ("stop", "length") and all(r is None for r in reasons[:-1])
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert len({c.id for c in chunks}) == 1


# -- errors -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "tiny", "prompt": "x", "temperature": 5}, 400, "temperature"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 100_000}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "logprobs": 30}, 400, "logprobs"),
        ({"model": "tiny", "prompt": "x", "n": 100}, 400, "n"),
        ({"model": "tiny", "prompt": "x", "seed": 2**63}, 400, "seed"),
        ({"model": "tiny", "prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
        ({"model": "tiny", "prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
        ({"model": "tiny", "prompt": "x", "grammar": "root ::= ("}, 400, "grammar"),
        ({"model": "tiny"}, 400, "prompt"),
        ({"model": "nope", "prompt": "x"}, 404, "model"),
        ({"model": "../tiny", "prompt": "x"}, 400, "model"),
        ({"model": "embed", "prompt": "x"}, 404, "model"),
    ],
)
def test_bad_requests_get_openai_errors(
    server: RemoteServer, body: dict[str, Any], status: int, param: str
) -> None:
    reply = server.http.post("/v1/completions", json=body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"functions": [{"name": "f", "parameters": {"type": "object"}}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
        ({"service_tier": "flex"}, "service_tier"),
    ],
)
def test_chat_fields_for_what_this_server_does_not_do_are_refused_naming_them(
    client: openai.OpenAI, fields: dict[str, Any], param: str
) -> None:
    """The openai SDK sends OpenAI's own fields; one this server would have to ignore
    (a legacy function call answered as plain text, audio never made) is a 400."""
    messages: Any = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, **fields)
    assert refused.value.param == param, refused.value.body
    # What changes nothing in the text is accepted: a prediction, text-only modalities.
    reply = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=2, modalities=["text"],
        service_tier="auto", prediction={"type": "content", "content": "Hello"},
    )  # fmt: skip
    assert reply.choices[0].message.content is not None


def test_only_an_unknown_model_is_a_model_not_found(server: RemoteServer) -> None:
    """error.code ``model_not_found`` is what clients retry with another model on; an
    unknown route under /v1 is a 404 without it."""
    reply = server.http.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    assert (reply.status_code, reply.json()["error"]["code"]) == (404, "model_not_found")
    for method in ("GET", "POST"):
        reply = server.http.request(method, "/v1/nowhere", json={})
        error = reply.json()["error"]
        assert (reply.status_code, error["code"], error["type"]) == (
            404, None, "invalid_request_error"), reply.text  # fmt: skip
        assert error["message"] == f"no route for {method} /v1/nowhere"


def test_malformed_json_and_sdk_error_types(server: RemoteServer, client: openai.OpenAI) -> None:
    reply = server.http.post("/v1/chat/completions", content=b"{nope")
    assert reply.status_code == 400 and "JSON" in reply.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="missing", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="tool_choice: no tool named 'g'"):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}],
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        )  # fmt: skip


# -- the KV cache -----------------------------------------------------------------------


def test_a_request_larger_than_the_cache_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="KV cache"):
        client.completions.create(model="tiny_small", prompt="Hello", max_tokens=SMALL_CACHE_TOKENS)


def test_sequences_that_do_not_fit_together_wait_and_all_finish_correctly(
    server: RemoteServer,
) -> None:
    # Each needs 40 + prompt tokens; three at once need about twice the 64-token cache.
    body = {"model": "tiny_small", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    prompts = ["Hello world", "The capital", "A paged"]
    alone = [
        server.http.post("/v1/completions", json=body | {"prompt": p}, timeout=60).json()
        for p in prompts
    ]

    async def together() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=60) as http:
            replies = await asyncio.gather(
                *(http.post(server.url("/v1/completions"), json=body | {"prompt": p})
                  for p in prompts)
            )  # fmt: skip
        return [r.json() for r in replies]

    concurrent = asyncio.run(together())
    for single, shared in zip(alone, concurrent, strict=True):
        assert shared["choices"][0]["text"] == single["choices"][0]["text"]
        assert shared["usage"]["completion_tokens"] == 40


def test_a_full_waiting_queue_answers_503(server: RemoteServer) -> None:
    body = {"model": "tiny_queue", "prompt": "Hello", "max_tokens": 50, "ignore_eos": True}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as http:
            return await asyncio.gather(
                *(http.post(server.url("/v1/completions"), json=body) for _ in range(6))
            )

    statuses = sorted(r.status_code for r in asyncio.run(burst()))
    assert 200 in statuses and 503 in statuses and set(statuses) <= {200, 503}


def test_a_client_that_disconnects_frees_its_blocks(server: RemoteServer) -> None:
    cancelled_before = _cancelled(server)
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 400, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with server.http.stream("POST", "/v1/completions", json=body, timeout=30) as reply:
        lines = reply.iter_lines()
        assert next(lines).startswith("data: ")
        assert metric(server, "slipstream_llm_kv_cache_blocks_used", model="tiny") > 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if metric(server, "slipstream_llm_kv_cache_blocks_used", model="tiny") == 0:
            break
        time.sleep(0.05)
    assert metric(server, "slipstream_llm_kv_cache_blocks_used", model="tiny") == 0
    assert metric(server, "slipstream_llm_sequences_running", model="tiny") == 0
    assert _cancelled(server) == cancelled_before + 1


def _cancelled(server: RemoteServer) -> float:
    try:
        return metric(
            server, "slipstream_llm_requests_total", model="tiny", finish_reason="cancelled"
        )
    except AssertionError:
        return 0.0


def test_generation_metrics_are_exported(server: RemoteServer, client: openai.OpenAI) -> None:
    before = metric(server, "slipstream_llm_generation_tokens_total", model="tiny")
    client.completions.create(
        model="tiny", prompt="Hi", max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert metric(server, "slipstream_llm_generation_tokens_total", model="tiny") == before + 4
    assert metric(server, "slipstream_llm_time_to_first_token_seconds_count", model="tiny") >= 1
    assert metric(server, "slipstream_llm_inter_token_latency_seconds_count", model="tiny") >= 3
    assert metric(server, "slipstream_llm_kv_cache_blocks_free", model="tiny") == 64


# -- embeddings -------------------------------------------------------------------------


def test_embeddings_tokenize_and_run_the_v2_model(
    client: openai.OpenAI, reference: Any, table: np.ndarray
) -> None:
    texts = ["Hello world", "A paged KV cache stores keys", "Hi"]
    reply = client.embeddings.create(model="embed", input=texts)  # SDK asks for base64
    assert [d.index for d in reply.data] == [0, 1, 2]
    for text, item in zip(texts, reply.data, strict=True):
        expected = mean_embedding(table, reference.tokenizer.encode(text))
        np.testing.assert_allclose(item.embedding, expected, rtol=1e-5, atol=1e-6)
    total = sum(len(reference.tokenizer.encode(t)) for t in texts)
    assert reply.usage.prompt_tokens == total
    floats = client.embeddings.create(model="embed", input="Hi", encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, reply.data[2].embedding, rtol=1e-6)


@pytest.mark.parametrize("count", [4, 5, 8, 19])
def test_embeddings_of_any_count_up_to_the_limit_are_answered(
    client: openai.OpenAI, reference: Any, table: np.ndarray, count: int
) -> None:
    # More inputs than the preferred size (4) or max_batch_size (8): split into pieces
    # that all run, in order.
    texts = [f"sentence number {i} " + "word " * (i % 5) for i in range(count)]
    reply = client.embeddings.create(model="embed", input=texts, timeout=30)
    assert [d.index for d in reply.data] == list(range(count))
    for text, item in zip(texts, reply.data, strict=True):
        expected = mean_embedding(table, reference.tokenizer.encode(text))
        np.testing.assert_allclose(item.embedding, expected, rtol=1e-5, atol=1e-6)


def test_embeddings_beyond_the_limits_are_refused_naming_them(server: RemoteServer) -> None:
    url = server.url("/v1/embeddings")
    reply = httpx.post(url, json={"model": "embed", "input": ["x"] * 2049}, timeout=30)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "input" and "2049" in error["message"]
    assert "2048" in error["message"]
    long_texts = ["many words in this input " * 20] * 40
    reply = httpx.post(url, json={"model": "embed", "input": long_texts}, timeout=30)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert "max_request_tokens" in error["message"] and str(EMBED_MAX_TOKENS) in error["message"]


def test_embeddings_of_a_generative_model_are_refused(server: RemoteServer) -> None:
    reply = server.http.post("/v1/embeddings", json={"model": "tiny", "input": "x"})
    error = reply.json()["error"]
    assert (reply.status_code, error["param"]) == (404, "model"), reply.text
    assert "generative model, served on /v1/completions" in error["message"]
    reply = server.http.post("/v1/embeddings", json={"model": "embed", "input": [""]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "input[0]"
    # An unknown one: named as the field, as on the other routes.
    reply = server.http.post("/v1/embeddings", json={"model": "nope", "input": "x"})
    error = reply.json()["error"]
    assert (reply.status_code, error["param"], error["code"]) == (404, "model", "model_not_found")


# -- penalties, logprobs, constraints and tools on this engine -------------------------------


def _penalized_path(
    reference: Any, prompt: list[int], steps: int, frequency: float = 0.0,
    presence: float = 0.0, repetition: float = 1.0,
) -> tuple[list[int], list[np.ndarray]]:  # fmt: skip
    """Greedy tokens and log-softmax rows of the in-process model, penalties applied."""
    tokens: list[int] = []
    rows: list[np.ndarray] = []
    with torch.no_grad():
        for _ in range(steps):
            logits = reference.model(torch.tensor([prompt + tokens])).logits[0, -1].double()
            for token in set(prompt) | set(tokens) if repetition != 1.0 else ():
                value = logits[token]
                logits[token] = value / repetition if value > 0 else value * repetition
            for token in set(tokens):
                logits[token] -= tokens.count(token) * frequency + presence
            row = torch.log_softmax(logits, dim=-1).numpy()
            tokens.append(int(row.argmax()))
            rows.append(row)
    return tokens, rows


@pytest.mark.parametrize(
    "penalties",
    [{}, {"frequency_penalty": 1.5, "presence_penalty": 0.5}, {"repetition_penalty": 1.8}],
    ids=["plain", "frequency-presence", "repetition"],
)
def test_logprobs_and_penalties_follow_the_model(
    client: openai.OpenAI, reference: Any, penalties: dict[str, float]
) -> None:
    prompt = reference.tokenizer.encode("Hello world! How are you")
    tokens, rows = _penalized_path(
        reference, prompt, 10, penalties.get("frequency_penalty", 0.0),
        penalties.get("presence_penalty", 0.0), penalties.get("repetition_penalty", 1.0),
    )  # fmt: skip
    extra = {"ignore_eos": True, "repetition_penalty": penalties.pop("repetition_penalty", 1.0)}
    reply = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=10, temperature=0, logprobs=3,
        extra_body=extra, **penalties,
    )  # fmt: skip
    got = reply.choices[0].logprobs
    assert got is not None and got.token_logprobs and got.top_logprobs and got.tokens
    assert reply.choices[0].text == reference.tokenizer.decode(tokens)
    expected = [row[token] for row, token in zip(rows, tokens, strict=True)]
    assert np.allclose(got.token_logprobs, expected, atol=1e-4)
    for row, top, chosen in zip(rows, got.top_logprobs, got.token_logprobs, strict=True):
        best = np.sort(row)[::-1][:3]
        assert chosen == pytest.approx(best[0], abs=1e-4)  # greedy: the penalized argmax
        # Tokens that decode alike (byte pieces) share one key of the legacy dict.
        assert all(np.isclose(best, value, atol=1e-4).any() for value in top.values())


def test_constraints_hold_even_on_random_weights(server: RemoteServer) -> None:
    """A random model would never write JSON; constrained, every reply validates."""
    import jsonschema

    schema = {"type": "object", "additionalProperties": False,
              "required": ["colour", "count", "ok"],
              "properties": {"colour": {"enum": ["red", "green"]},
                             "count": {"type": "integer", "minimum": 1, "maximum": 99},
                             "ok": {"type": "boolean"}}}  # fmt: skip
    cases: list[tuple[dict[str, Any], Any]] = [
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": schema}}},
         lambda text: jsonschema.validate(json.loads(text), schema)),
        ({"guided_choice": ["alpha", "beta"]}, lambda text: text in ("alpha", "beta")),
        ({"guided_regex": "[0-9]{3}-[a-c]{2}"},
         lambda text: re.fullmatch("[0-9]{3}-[a-c]{2}", text)),
    ]  # fmt: skip
    for extra, check in cases:
        for seed in range(3):
            body = {"model": "tiny", "messages": [{"role": "user", "content": "Go"}],
                    "max_tokens": 60, "temperature": 1.0, "seed": seed, **extra}  # fmt: skip
            reply = server.http.post("/v1/chat/completions", json=body, timeout=60).json()
            choice = reply["choices"][0]
            assert choice["finish_reason"] == "stop", (extra, choice)
            assert check(choice["message"]["content"]) is not False, (extra, choice)


def test_a_named_tool_call_validates_and_bias_forces_tokens(
    client: openai.OpenAI, reference: Any
) -> None:
    parameters = {"type": "object", "additionalProperties": False, "required": ["n"],
                  "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}  # fmt: skip
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Count"}], max_tokens=15,
        tools=[{"type": "function", "function": {"name": "count", "parameters": parameters}}],
        tool_choice={"type": "function", "function": {"name": "count"}}, temperature=0,
    ).choices[0]  # fmt: skip
    assert reply.finish_reason == "tool_calls" and reply.message.tool_calls
    call = reply.message.tool_calls[0]
    assert call.function.name == "count" and 0 <= json.loads(call.function.arguments)["n"] <= 9
    forced = reference.tokenizer.encode(" Paris")[0]
    text = client.completions.create(
        model="tiny", prompt="A", max_tokens=3, temperature=0, logit_bias={str(forced): 100},
        extra_body={"ignore_eos": True},
    ).choices[0].text  # fmt: skip
    assert text == reference.tokenizer.decode([forced] * 3)


def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(
    client: openai.OpenAI,
) -> None:
    """vLLM's stream_options.continuous_usage_stats, which guidellm asks for."""
    chunks = list(client.completions.create(
        model="tiny", prompt="Hello", max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        extra_body={"ignore_eos": True},
    ))  # fmt: skip
    texts = [chunk for chunk in chunks if chunk.choices]
    assert all(chunk.usage is not None for chunk in texts)
    so_far = [chunk.usage.completion_tokens for chunk in texts if chunk.usage]
    assert so_far == sorted(so_far) and so_far[-1] == 6
    prompt = {chunk.usage.prompt_tokens for chunk in chunks if chunk.usage}
    assert len(prompt) == 1 and prompt.pop() > 0
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6
