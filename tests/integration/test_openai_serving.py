"""What OpenAI clients (the openai SDK, LangChain, LiteLLM) send and rely on, against a real
server: ``null`` inside nested request objects, embeddings of token ids and
``dimensions``, constraint errors named by the field that carried them, context
overflows answered with OpenAI's ``context_length_exceeded``, and a sleeping embedding
model still listed by /v1/models with a stable ``created``.

One server (explicit model control) serves a tiny random-weight Llama, a mean-of-token-
rows embedding model, the same with a tokenizer that truncates at
``SHORT_TOKENS``, and one that sleeps when idle. Another, skipped without the llama
extra, serves SmolLM2 on llama.cpp with a KV stream per sequence.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from tokenizers import Tokenizer

from tests.llm_models import build_tiny_llama, smollm2_gguf
from tests.models import build_mean_embedding, mean_embedding, write_config
from tests.utils import RemoteServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

CONTEXT = 512  # the tiny Llama's max_position_embeddings
SHORT_TOKENS = 4  # embed_short's tokenizer truncates there
IDLE_S = 0.6
EMBEDDERS = ("embed", "embed_short", "embed_sleepy", "embed_gone")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "hf")


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path) -> Any:
    return Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def table(tokenizer: Any) -> np.ndarray:
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    return np.random.default_rng(0).standard_normal((vocab, 8)).astype(np.float32)


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path, tokenizer: Any, table: np.ndarray
) -> Iterator[RemoteServer]:
    repo = tmp_path_factory.mktemp("serving-repo")
    shutil.copytree(tiny_dir, repo / "tiny" / "1")
    write_config(repo, "tiny", {"backend": "transformers",
                                "generation": {"num_blocks": 64, "block_size": 16}})  # fmt: skip
    for name in EMBEDDERS:
        build_mean_embedding(repo, name, table)
        config: dict[str, Any] = {"max_batch_size": 8, "tokenizer": "tokenizer.json"}
        if name == "embed_sleepy":
            config["idle_unload_seconds"] = IDLE_S
        write_config(repo, name, config)
        shutil.copy(tiny_dir / "tokenizer.json", repo / name / "tokenizer.json")
    short = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    short.enable_truncation(max_length=SHORT_TOKENS)
    short.save(str(repo / "embed_short" / "tokenizer.json"))
    args = ["--model-control-mode", "explicit", "--grpc-port", "0"]
    for name in ("tiny", *EMBEDDERS):
        args += ["--load-model", name]
    with RemoteServer(repo, args, log_dir=repo) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> Any:
    return server.openai()


def _error(reply: Any, status: int = 400) -> dict[str, Any]:
    assert reply.status_code == status, reply.text
    error: dict[str, Any] = reply.json()["error"]
    return error


# -- null in nested objects ----------------------------------------------------------------


def test_null_in_a_tool_and_an_earlier_call_is_the_default(server: RemoteServer) -> None:
    """The openai SDK sends None as null at any depth (a tool's description or strict,
    an earlier call's id): each is the field's default, not a 400."""
    body = {
        "model": "tiny", "max_tokens": 2,
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": None, "type": "function",
                 "function": {"name": "get_weather", "arguments": None}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": None, "strict": None, "parameters": None}}],
        "tool_choice": "none",
    }  # fmt: skip
    reply = server.http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    # A required field stays required, nested too.
    body["tools"] = [{"type": "function", "function": {"name": None}}]
    assert _error(server.http.post("/v1/chat/completions", json=body))["param"] == (
        "tools.0.function.name"
    )


# -- embeddings of token ids -----------------------------------------------------------------


def test_embeddings_of_token_ids_are_those_of_the_same_tokens(
    client: Any, tokenizer: Any, table: np.ndarray
) -> None:
    """LangChain's OpenAIEmbeddings sends token id lists: they embed as the same tokens."""
    ids = tokenizer.encode("Hello world").ids
    one = client.embeddings.create(model="embed", input=ids, encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, mean_embedding(table, ids), rtol=1e-5)
    text = client.embeddings.create(model="embed", input="Hello world", encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, text.data[0].embedding, rtol=1e-6)
    lists = [ids, [5, 6, 7], [9]]
    many = client.embeddings.create(model="embed", input=lists, encoding_format="float")
    assert [item.index for item in many.data] == [0, 1, 2]
    for item, row in zip(many.data, lists, strict=True):
        np.testing.assert_allclose(item.embedding, mean_embedding(table, row), rtol=1e-5)
    assert many.usage.prompt_tokens == sum(len(row) for row in lists)


def test_token_ids_are_cut_where_the_tokenizer_cuts_text(client: Any, table: np.ndarray) -> None:
    ids = list(range(10, 20))
    reply = client.embeddings.create(model="embed_short", input=[ids], encoding_format="float")
    expected = mean_embedding(table, ids[:SHORT_TOKENS])
    np.testing.assert_allclose(reply.data[0].embedding, expected, rtol=1e-5)
    assert reply.usage.prompt_tokens == SHORT_TOKENS


def test_token_ids_beyond_the_vocabulary_are_refused_naming_input(
    server: RemoteServer, tokenizer: Any
) -> None:
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    for given, param in (([5, vocab], "input"), ([[5], [vocab + 7]], "input[1]")):
        reply = server.http.post("/v1/embeddings", json={"model": "embed", "input": given})
        error = _error(reply)
        assert error["param"] == param and "outside the model's vocabulary" in error["message"]


def test_dimensions_may_name_the_models_own_width_only(client: Any, server: RemoteServer) -> None:
    reply = client.embeddings.create(model="embed", input="Hi", dimensions=8)
    assert len(reply.data[0].embedding) == 8
    body = {"model": "embed", "input": "Hi", "dimensions": 4}
    error = _error(server.http.post("/v1/embeddings", json=body))
    assert error["param"] == "dimensions" and "embeds in 8 dimensions" in error["message"]


# -- constraint errors -----------------------------------------------------------------------


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("field", ["guided_json", "json_schema", "response_format"])
def test_a_schema_that_does_not_compile_is_named_by_its_field(
    server: RemoteServer, route: str, field: str
) -> None:
    bad = {"type": "nonsense"}
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 2}
    body |= (
        {"messages": [{"role": "user", "content": "Hi"}]} if "chat" in route else {"prompt": "Hi"}
    )
    if field == "response_format":
        body[field] = {"type": "json_schema", "json_schema": {"name": "x", "schema": bad}}
    else:
        body[field] = bad
    error = _error(server.http.post(route, json=body))
    assert error["param"] == field and "does not compile" in error["message"], error


def test_a_grammar_that_does_not_compile_is_named_by_its_field(server: RemoteServer) -> None:
    body = {
        "model": "tiny",
        "prompt": "Hi",
        "max_tokens": 2,
        "guided_grammar": "root ::= undefined",
    }
    assert _error(server.http.post("/v1/completions", json=body))["param"] == "guided_grammar"


# -- context overflow --------------------------------------------------------------------------


LONG = "Hello world " * 400  # 1,600 tokens of the tiny tokenizer: past its 512


@pytest.mark.parametrize(
    ("route", "extra", "param"),
    [
        ("/v1/completions", {"prompt": LONG}, "prompt"),
        ("/v1/completions", {"prompt": LONG, "max_tokens": 3}, "max_tokens"),
        ("/v1/completions", {"prompt": "Hello world " * 120, "max_tokens": 100}, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, "messages"),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 600},
         "max_completion_tokens"),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 600}, "max_tokens"),
        ("/v1/responses", {"input": LONG}, "input"),
        ("/v1/responses", {"input": "Hi", "max_output_tokens": 600}, "max_output_tokens"),
    ],
)  # fmt: skip
def test_a_context_overflow_is_context_length_exceeded_naming_the_field_sent(
    server: RemoteServer, route: str, extra: dict[str, Any], param: str
) -> None:
    error = _error(server.http.post(route, json={"model": "tiny", **extra}))
    assert (error["code"], error["param"]) == ("context_length_exceeded", param), error
    assert error["type"] == "invalid_request_error"
    message = error["message"]
    assert message.startswith(f"This model's maximum context length is {CONTEXT} tokens. ")
    if param in ("prompt", "messages", "input"):
        assert f"your {param} resulted in " in message
    else:
        assert "you requested " in message and f" or {param}" in message


def test_the_sdk_raises_a_bad_request_with_the_code(client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt=LONG)
    assert caught.value.code == "context_length_exceeded"


# -- /v1/models ------------------------------------------------------------------------------


def test_a_sleeping_embedding_model_stays_listed_with_a_stable_created(
    client: Any, server: RemoteServer
) -> None:
    deadline = time.monotonic() + 15
    while _state(server, "embed_sleepy") != ("UNAVAILABLE", "idle"):
        assert time.monotonic() < deadline, _state(server, "embed_sleepy")
        time.sleep(0.1)
    first = {model.id: model.created for model in client.models.list()}
    assert {"tiny", *EMBEDDERS} <= set(first)
    time.sleep(1.1)
    again = {model.id: model.created for model in client.models.list()}
    assert again == first
    assert client.models.retrieve("embed_sleepy").created == first["embed_sleepy"]
    # Unloaded on purpose: no longer offered.
    assert server.http.post("/v2/repository/models/embed_gone/unload").status_code == 200
    assert "embed_gone" not in {model.id for model in client.models.list()}


def _state(server: RemoteServer, model: str) -> tuple[str, str]:
    for entry in server.http.post("/v2/repository/index", json={}).json():
        if entry["name"] == model:
            return entry.get("state", ""), entry.get("reason", "")
    return "", ""


# -- a KV stream per sequence ------------------------------------------------------------------


STREAM_TOKENS = 256  # each of smol_streams' 8 KV streams


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    pytest.importorskip("llama_cpp", reason="the llama extra is not installed")
    repo = tmp_path_factory.mktemp("streams-repo")
    (repo / "smol_streams" / "1").mkdir(parents=True)
    os.link(smollm2_gguf(), repo / "smol_streams" / "1" / "model.gguf")
    generation = {"num_blocks": 128, "block_size": 16, "max_num_seqs": 8,
                  "max_model_len": 1024, "kv_streams": "per_sequence"}  # fmt: skip
    write_config(repo, "smol_streams", {"backend": "llama_cpp", "generation": generation})
    with RemoteServer(repo, log_dir=repo) as running:
        yield running


def test_without_max_tokens_a_sequence_gets_the_room_of_its_kv_stream(
    llama_server: RemoteServer,
) -> None:
    """The default max_tokens (256) would not fit one stream with the prompt: the
    completion gets what the stream leaves, as it gets what the context leaves."""
    prompt = "one two three four five six seven eight nine ten " * 20
    reply = llama_server.http.post(
        "/v1/completions",
        json={"model": "smol_streams", "prompt": prompt, "ignore_eos": True},
    )
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == STREAM_TOKENS
    assert reply.json()["choices"][0]["finish_reason"] == "length"
