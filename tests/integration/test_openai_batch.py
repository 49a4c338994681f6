"""OpenAI's Files and Batch APIs against a real ``slipstream serve``, through the stock
openai SDK: upload, create, poll, read the output and error files (each answer equal to
the live route's), cancel, lists and their pages, delete, two tenants' keys kept apart,
bad uploads refused naming the line, a restart mid-batch resuming without running
answered requests again, and the split layout once.

The server holds a tiny random-weight Llama (``tiny``, transformers) and a
mean-of-token-rows embedding model (``embed``), with --auth-file: ``ops`` (admin),
``alice`` (every model) and ``bob`` (``embed`` only).
"""

from __future__ import annotations

import io
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from slipstream.security.keys import KeyRing
from tests.llm_models import build_tiny_llama
from tests.models import build_mean_embedding, write_config
from tests.utils import RemoteServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

CHAT = {"max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory, embed_repo: Path) -> Path:
    root = tmp_path_factory.mktemp("batch-repo")
    tiny = build_tiny_llama(tmp_path_factory.mktemp("tiny") / "hf")
    shutil.copytree(tiny, root / "tiny" / "1")
    write_config(root, "tiny", {"backend": "transformers",
                                "generation": {"num_blocks": 64, "block_size": 16}})  # fmt: skip
    shutil.copytree(embed_repo / "embed", root / "embed")
    return root


@pytest.fixture(scope="module")
def embed_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedding model alone: the servers of the tests that run no chat start without
    loading the generative model."""
    root = tmp_path_factory.mktemp("batch-embed-repo")
    tiny = build_tiny_llama(tmp_path_factory.mktemp("tiny-tokenizer") / "hf")
    table = np.random.default_rng(0).standard_normal((512, 8)).astype(np.float32)
    build_mean_embedding(root, "embed", table)
    shutil.copy(tiny / "tokenizer.json", root / "embed" / "tokenizer.json")
    write_config(root, "embed", {"max_batch_size": 8, "tokenizer": "tokenizer.json"})
    return root


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("batch-keys")
    ring = KeyRing.load(root / "keys.json", missing_ok=True)
    made = {"ops": ring.create("ops", "admin")[0], "alice": ring.create("alice", "infer")[0],
            "bob": ring.create("bob", "infer", models=["embed"])[0]}  # fmt: skip
    ring.save()
    made["file"] = str(root / "keys.json")
    return made


@pytest.fixture(scope="module")
def server(repo: Path, keys: dict[str, str], tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[RemoteServer]:  # fmt: skip
    files = tmp_path_factory.mktemp("batch-files")
    args = ["--auth-file", keys["file"], "--files-dir", str(files), "--batch-concurrency", "2"]
    with RemoteServer(repo, args, log_dir=repo) as running:
        yield running


def _jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def _line(custom_id: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def _run(client: openai.OpenAI, lines: list[dict[str, Any]], endpoint: str,
         timeout_s: float = 120) -> Any:  # fmt: skip
    """Upload ``lines``, run them as a batch and wait until it ends."""
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=endpoint,  # type: ignore[arg-type]
                                  completion_window="24h", metadata={"suite": "batch"})  # fmt: skip
    assert batch.status in ("validating", "in_progress")
    return _wait(client, batch.id, timeout_s)


def _wait(client: openai.OpenAI, batch_id: str, timeout_s: float = 120) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.1)


def _read(client: openai.OpenAI, file_id: str | None) -> dict[str, dict[str, Any]]:
    if file_id is None:
        return {}
    lines = [json.loads(raw) for raw in client.files.content(file_id).text.splitlines()]
    return {line["custom_id"]: line for line in lines}


def test_a_chat_batch_answers_as_the_live_route_and_a_bad_line_lands_in_the_error_file(
    server: RemoteServer, keys: dict[str, str]
) -> None:
    client = server.openai(keys["alice"])
    questions = [f"Question {i}: what is {i} plus {i}?" for i in range(4)]
    lines = [_line(f"q{i}", "/v1/chat/completions",
                   {"model": "tiny", "messages": [{"role": "user", "content": q}], **CHAT})
             for i, q in enumerate(questions)]  # fmt: skip
    lines.append(_line("bad", "/v1/chat/completions", {"model": "tiny", "messages": "nope"}))
    batch = _run(client, lines, "/v1/chat/completions")
    assert batch.status == "completed", batch
    assert batch.request_counts.model_dump() == {"total": 5, "completed": 4, "failed": 1}
    assert batch.metadata == {"suite": "batch"}
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    outputs, errors = _read(client, batch.output_file_id), _read(client, batch.error_file_id)
    assert sorted(outputs) == [f"q{i}" for i in range(4)] and list(errors) == ["bad"]
    for i, question in enumerate(questions):
        live = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": question}], **CHAT
        )
        response = outputs[f"q{i}"]["response"]
        assert response["status_code"] == 200 and outputs[f"q{i}"]["error"] is None
        assert response["request_id"].startswith("req_")
        assert response["body"]["choices"][0]["message"]["content"] == (
            live.choices[0].message.content
        )
    refused = errors["bad"]["response"]
    assert refused["status_code"] == 400
    assert refused["body"]["error"]["param"].startswith("messages")
    output_file = client.files.retrieve(batch.output_file_id)
    assert output_file.purpose == "batch_output"


def test_an_embeddings_batch_equals_the_live_route(
    server: RemoteServer, keys: dict[str, str]
) -> None:
    client = server.openai(keys["bob"])
    texts = [f"text number {i}" for i in range(6)]
    lines = [_line(f"e{i}", "/v1/embeddings", {"model": "embed", "input": text})
             for i, text in enumerate(texts)]  # fmt: skip
    batch = _run(client, lines, "/v1/embeddings")
    assert batch.status == "completed" and batch.error_file_id is None
    outputs = _read(client, batch.output_file_id)
    for i, text in enumerate(texts):
        live = client.embeddings.create(model="embed", input=text).data[0].embedding
        # Rows batched with others (padded) may sum in another order: float32's last bit.
        np.testing.assert_allclose(
            outputs[f"e{i}"]["response"]["body"]["data"][0]["embedding"], live, rtol=1e-6
        )


def test_keys_see_and_use_only_their_own_files_and_batches(
    server: RemoteServer, keys: dict[str, str]
) -> None:
    alice, bob, ops = (server.openai(keys[name]) for name in ("alice", "bob", "ops"))
    data = _jsonl([_line("x", "/v1/embeddings", {"model": "embed", "input": "hi"})])
    own = alice.files.create(file=("a.jsonl", io.BytesIO(data)), purpose="batch")
    with pytest.raises(openai.NotFoundError):
        bob.files.retrieve(own.id)
    with pytest.raises(openai.NotFoundError):
        bob.batches.create(input_file_id=own.id, endpoint="/v1/embeddings",
                           completion_window="24h")  # fmt: skip
    assert own.id not in {f.id for f in bob.files.list()}
    assert own.id in {f.id for f in ops.files.list()}
    # bob's key may use embed only: a line naming tiny is refused 403 in the error file.
    lines = [_line("ok", "/v1/embeddings", {"model": "embed", "input": "a"}),
             _line("other", "/v1/embeddings", {"model": "tiny", "input": "a"})]  # fmt: skip
    batch = _run(bob, lines, "/v1/embeddings")
    assert batch.request_counts.model_dump() == {"total": 2, "completed": 1, "failed": 1}
    refused = _read(bob, batch.error_file_id)["other"]["response"]
    assert (
        refused["status_code"] == 403
        and "may not use model 'tiny'" in (refused["body"]["error"]["message"])
    )
    with pytest.raises(openai.NotFoundError):
        alice.batches.retrieve(batch.id)
    assert ops.batches.retrieve(batch.id).id == batch.id
    assert batch.id not in {b.id for b in alice.batches.list()}
    # Without a key: 401.
    assert httpx.get(server.url("/v1/files")).status_code == 401


def test_cancel_stops_new_requests_and_ends_cancelled(
    server: RemoteServer, keys: dict[str, str]
) -> None:
    client = server.openai(keys["alice"])
    lines = [_line(f"c{i}", "/v1/chat/completions",
                   {"model": "tiny", "messages": [{"role": "user", "content": f"n {i}"}],
                    "max_tokens": 24, "temperature": 0})
             for i in range(60)]  # fmt: skip
    uploaded = client.files.create(file=("c.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")  # fmt: skip
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    done = _wait(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at
    counts = done.request_counts
    assert counts.total == 60 and counts.completed + counts.failed < 60
    assert len(_read(client, done.output_file_id)) == counts.completed
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(_run(client, lines[:1], "/v1/chat/completions").id)


def test_lists_page_newest_first_and_a_deleted_file_is_gone(
    server: RemoteServer, keys: dict[str, str]
) -> None:
    client = server.openai(keys["alice"])
    made = [_run(client, [_line("p", "/v1/embeddings", {"model": "embed", "input": str(i)})],
                 "/v1/embeddings").id for i in range(3)]  # fmt: skip
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == made[::-1][:2] and first.has_more
    rest = client.batches.list(limit=2, after=first.data[-1].id)
    assert rest.data[0].id == made[0]
    assert [b.id for b in client.batches.list(limit=2)][:3] == made[::-1]  # every page
    data = _jsonl([_line("d", "/v1/embeddings", {"model": "embed", "input": "d"})])
    file = client.files.create(file=("d.jsonl", io.BytesIO(data)), purpose="batch")
    assert client.files.content(file.id).content == data
    assert client.files.delete(file.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file.id)
    assert file.id not in {f.id for f in client.files.list()}


@pytest.mark.parametrize(
    ("content", "purpose", "message"),
    [
        (b'{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {}}\n{oops\n',
         "batch", "file: line 2: not valid JSON"),
        (_jsonl([_line("a", "/v1/embeddings", {}), _line("a", "/v1/embeddings", {})]),
         "batch", "file: line 2: custom_id: 'a' is used by an earlier line"),
        (_jsonl([{"custom_id": "a", "method": "GET", "url": "/v1/embeddings", "body": {}}]),
         "batch", "file: line 1: method: expected 'POST'"),
        (_jsonl([_line("a", "/v1/embeddings", {}), _line("b", "/v1/completions", {})]),
         "batch", "file: line 2: url: '/v1/completions'"),
        (_jsonl([_line("a", "/v1/audio", {})]), "batch", "file: line 1: url: expected one of"),
        (b"\n", "batch", "file: no requests"),
        (_jsonl([_line("a", "/v1/embeddings", {})]), "fine-tune", "purpose: 'fine-tune'"),
    ],
)  # fmt: skip
def test_bad_uploads_are_400_naming_the_line_and_field(
    server: RemoteServer, keys: dict[str, str], content: bytes, purpose: str, message: str
) -> None:
    client = server.openai(keys["alice"])
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.create(file=("x.jsonl", io.BytesIO(content)), purpose=purpose)  # type: ignore[arg-type]
    assert refused.value.body["message"].startswith(message)  # type: ignore[index]
    assert refused.value.body["param"] == message.split(":")[0]  # type: ignore[index]


def test_an_upload_past_the_request_limit_is_413(tmp_path: Path, embed_repo: Path) -> None:
    big = _jsonl([_line(f"{i}", "/v1/embeddings", {"model": "embed", "input": "x" * 100})
                  for i in range(20)])  # fmt: skip
    args = ["--max-request-bytes", "1024", "--files-dir", str(tmp_path / "files")]
    with RemoteServer(embed_repo, args, log_dir=tmp_path) as running:
        reply = running.http.post("/v1/files", files={"file": ("b.jsonl", big)},
                                  data={"purpose": "batch"})  # fmt: skip
        assert reply.status_code == 413


def test_a_restarted_server_resumes_without_running_answered_requests_again(
    tmp_path: Path, embed_repo: Path
) -> None:
    files = tmp_path / "files"
    args = ["--files-dir", str(files), "--batch-concurrency", "1"]
    total = 1500
    lines = [_line(f"r{i}", "/v1/embeddings", {"model": "embed", "input": f"t {i}"})
             for i in range(total)]  # fmt: skip
    with RemoteServer(embed_repo, args, log_dir=tmp_path) as first:
        client = first.openai()
        uploaded = client.files.create(file=("r.jsonl", io.BytesIO(_jsonl(lines))),
                                       purpose="batch")  # fmt: skip
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings",
                                      completion_window="24h")  # fmt: skip
        deadline = time.monotonic() + 60
        while client.batches.retrieve(batch.id).request_counts.completed < 50:  # type: ignore[union-attr]
            assert time.monotonic() < deadline
            time.sleep(0.05)
    journal = (files / "batches" / f"{batch.id}.answers").read_bytes().splitlines()
    answered = len(journal)
    assert 0 < answered < total, answered
    # The rest may run side by side (they batch together): what is resumed is the same.
    args[-1] = "8"
    with RemoteServer(embed_repo, args, log_dir=tmp_path) as second:
        client = second.openai()
        done = _wait(client, batch.id)
        assert done.status == "completed"
        assert done.request_counts.model_dump() == {"total": total, "completed": total,
                                                    "failed": 0}  # fmt: skip
        outputs = _read(client, done.output_file_id)
        assert sorted(outputs) == sorted(f"r{i}" for i in range(total))
        stats = second.http.get("/v2/models/embed/stats").json()["model_stats"][0]
        assert stats["inference_count"] == total - answered


def test_the_split_layout_runs_batches_in_its_engine(tmp_path: Path, embed_repo: Path) -> None:
    args = ["--frontends", "1", "--files-dir", str(tmp_path / "files")]
    with RemoteServer(embed_repo, args, log_dir=tmp_path) as running:
        client = running.openai()
        lines = [_line(f"s{i}", "/v1/embeddings", {"model": "embed", "input": f"s {i}"})
                 for i in range(4)]  # fmt: skip
        batch = _run(client, lines, "/v1/embeddings")
        assert batch.status == "completed"
        outputs = _read(client, batch.output_file_id)
        live = client.embeddings.create(model="embed", input="s 2").data[0].embedding
        got = outputs["s2"]["response"]["body"]["data"][0]["embedding"]
        np.testing.assert_allclose(got, live, rtol=1e-6)
        assert [b.id for b in client.batches.list()] == [batch.id]
