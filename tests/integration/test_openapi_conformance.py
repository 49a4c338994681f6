"""schemathesis against a real ``slipstream serve``: every route of ``/openapi.json``,
with generated valid and invalid requests; no 5xx on any of them, and every response's
status, content type, headers and body are what the document says.

The server holds a V2 model (``add_sub``), an embedding model (``embed``, with a
tokenizer) and SmolLM2 on llama.cpp (``smollm2``), in explicit model-control mode so the
repository routes do their work. Generated model names rarely name a served model, so a
hook puts a served name in the path and in the ``model`` field of some positive cases:
those reach the decoders, the batcher and the engine instead of stopping at 404.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from schemathesis.specs.openapi.checks import positive_data_acceptance

from slipstream import __version__
from slipstream.protocol.openapi import openapi_document
from tests.llm_models import build_tiny_llama, smollm2_gguf
from tests.models import build_add_sub, build_mean_embedding, write_config
from tests.utils import RemoteServer

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("llama_cpp", reason="the llama extra is not installed")

pytestmark = [pytest.mark.timeout(240)]

SERVED = ["add_sub", "embed", "smollm2"]
# Generated cases per operation: enough to reach every documented status of a route
# (the served-name hook, negative cases), few enough that the module adds ~30 s here.
# A deeper search: SLIPSTREAM_CONFORMANCE_EXAMPLES=1000 (about 7 min here); against the
# split layout: SLIPSTREAM_CONFORMANCE_FRONTENDS=1.
MAX_EXAMPLES = int(os.environ.get("SLIPSTREAM_CONFORMANCE_EXAMPLES", "25"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    repo = tmp_path_factory.mktemp("openapi-repo")
    build_add_sub(repo)
    tiny = build_tiny_llama(tmp_path_factory.mktemp("tiny") / "hf")
    table = np.random.default_rng(0).standard_normal((512, 8)).astype(np.float32)
    build_mean_embedding(repo, "embed", table)
    shutil.copy(tiny / "tokenizer.json", repo / "embed" / "tokenizer.json")
    write_config(repo, "embed", {"max_batch_size": 8, "tokenizer": "tokenizer.json"})
    (repo / "smollm2" / "1").mkdir(parents=True)
    os.link(smollm2_gguf(), repo / "smollm2" / "1" / "model.gguf")
    # A short context bounds what any generated request can cost: at most 64 tokens.
    generation = {"num_blocks": 32, "block_size": 16, "max_model_len": 64,
                  "default_max_tokens": 4, "max_num_seqs": 16}  # fmt: skip
    write_config(repo, "smollm2", {"backend": "llama_cpp", "generation": generation})
    args = ["--model-control-mode", "explicit", "--grpc-port", "0",
            "--files-dir", str(repo.parent / "openai-files"),
            "--frontends", os.environ.get("SLIPSTREAM_CONFORMANCE_FRONTENDS", "0")]  # fmt: skip
    for name in SERVED:
        args += ["--load-model", name]
    with RemoteServer(repo, args, log_dir=repo) as running:
        yield running


# Built from the same function the server serves (test_served_document_is_this_one
# checks): loaded at collection, so each operation is a test of its own.
schema = schemathesis.openapi.from_dict(openapi_document(__version__))
schema.config.generation.update(max_examples=MAX_EXAMPLES, database="none")


def flatmap_case(context: Any, case: Any) -> Any:
    """Some positive cases name a served model, so they get past the 404."""
    if case.meta is None or case.meta.generation.mode.name != "POSITIVE":
        return st.just(case)
    path_parameters = dict(case.path_parameters or {})
    body = case.body

    def served(name: str | None) -> Any:
        if name is None:
            return case
        if "model" in path_parameters:
            case.path_parameters = {**path_parameters, "model": name}
        if isinstance(body, dict) and "model" in body:
            case.body = {**body, "model": name}
        return case

    return st.sampled_from([None, *SERVED]).map(served)


schema.hook(flatmap_case)

# 400s that depend on the model named, which no schema of the route can know: a request
# that fits the schema may still be too long for this model's context, hold token ids
# outside its vocabulary, or ask a V2 model for embeddings. Other 400s to schema-valid
# requests still fail the test.
MODEL_DEPENDENT = (
    "context length", "can never fit the KV cache", "outside the model's vocabulary",
    "must contain at least one token", "is not an embedding model", "max_request_tokens",
    # Scores: of a generative model; a truncation shorter than the tokenizer's special
    # tokens, or longer than its file's.
    "is a generative model", "leaves no room for text", "its tokenizer file's truncation",
    # Classes: of a model that is no classifier (an embedding model, a V2 model).
    "is not a classifier",
)  # fmt: skip


# 400s that depend on what a field's text means or on other fields, which a JSON schema
# cannot say: a grammar, regex or JSON schema that does not compile (or that the model's
# vocabulary cannot follow), one constraint at a time, a tool_choice naming a tool the
# request does not offer, top_logprobs without logprobs. The document states each rule in
# the field's description.
CONTENT_DEPENDENT = (
    "does not compile", "cannot follow it", "set one constraint", "needs tools", "no tool named",
    "only allowed when", "not supported together with", "cannot be combined with",
    # Scores pair one text_1 with each text_2, or as many of each.
    "expected 1:1, 1:N or N:N",
    # A rollout's plan: steps in increasing order, a candidate that is loaded, a baseline
    # other than it, no rollout active already, an action its state allows.
    "expected increasing percentages", "is not loaded", "is not a loaded version",
    "promote or abort it first", "cannot pause", "cannot resume", "cannot promote",
    "cannot abort", "are both version",
    # A load's config override: a model config in Triton's JSON form, carried as a string.
    "parameters.config:",
    # A batch input file's lines: JSON requests, each naming a route, which a binary
    # field's schema cannot say.
    "file: line ", "file: no requests",
)  # fmt: skip


# 400s that depend on how the server runs: shared-memory regions are refused without
# --allow-client-shm, and CUDA regions on a server without CUDA.
SETTING_DEPENDENT = ("client shared memory is disabled", "this server has no usable CUDA device")


def filter_failure(context: Any, failure: Any, case: Any, response: Any) -> bool:
    if type(failure).__name__ == "RejectedPositiveData" and response.status_code == 400:
        reasons = MODEL_DEPENDENT + CONTENT_DEPENDENT + SETTING_DEPENDENT
        return not any(reason in response.text for reason in reasons)
    return True


schema.hook(filter_failure)


def test_served_document_is_this_one(server: RemoteServer) -> None:
    reply = httpx.get(server.url("/openapi.json"))
    assert reply.status_code == 200
    assert reply.headers["content-type"] == "application/json"
    assert reply.json() == openapi_document(__version__)


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_every_route_conforms_and_never_answers_5xx(case: Any, server: RemoteServer) -> None:
    # Unloading a served model would turn later cases into 404s: keep the models.
    if case.path.endswith("/unload") and case.path_parameters.get("model") in SERVED:
        return
    excluded = []
    if case.path.endswith(("/infer", "/ready", "/generate", "/generate_stream", ":predict")):
        # Whether a schema-valid inference request is valid depends on the model's
        # signature, and /ready answers 400 for a model that is not ready (Triton's
        # answer): such 400s are checked against the document, not called wrong.
        excluded.append(positive_data_acceptance)
    case.call_and_validate(base_url=server.http_url, timeout=60, excluded_checks=excluded)


# -- what schemathesis found, pinned -----------------------------------------------------


def test_a_wrong_method_on_a_route_is_405_naming_the_allowed_ones(server: RemoteServer) -> None:
    reply = httpx.request("TRACE", server.url("/v2/models/add_sub/infer"))
    assert reply.status_code == 405
    assert reply.headers["allow"] == "POST"
    assert "use POST" in reply.json()["error"]
    reply = httpx.delete(server.url("/v1/models/smollm2"))
    assert (reply.status_code, reply.headers["allow"]) == (405, "GET, HEAD")
    assert reply.json()["error"]["type"] == "invalid_request_error"
    assert httpx.request("TRACE", server.url("/nowhere")).status_code == 404


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v2/repository/models/nothing_here/load", {"parameters": [None]}, "parameters"),
        ("/v2/repository/index", {"ready": {}}, "ready"),
    ],
)
def test_repository_options_of_the_wrong_type_are_400(
    server: RemoteServer, path: str, body: dict[str, Any], field: str
) -> None:
    reply = httpx.post(server.url(path), json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"].startswith(f"{field}: expected")


def test_a_rollout_of_a_models_only_version_is_400_naming_the_baseline(
    server: RemoteServer,
) -> None:
    """``add_sub`` serves one version: rolling it out leaves nothing to compare it with
    (found by the conformance run: a 500 until 2026-11-28)."""
    reply = httpx.post(server.url("/v2/models/add_sub/rollout"),
                       json={"action": "start", "candidate": "1", "steps": [50]})  # fmt: skip
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"].startswith("baseline: version (none) of 'add_sub' is not")


def test_v2_requests_for_a_generative_model_take_the_vllm_backend_s_inputs(
    server: RemoteServer,
) -> None:
    """Served on V2 as Triton's vLLM backend serves a model (tests/integration/test_llm_v2.py
    in depth; until 2026-11-29 a 404 naming the OpenAI routes)."""
    reply = httpx.post(server.url("/v2/models/smollm2/infer"), json={"inputs": []})
    assert reply.status_code == 400
    assert reply.json()["error"].startswith("text_input: missing")
    reply = httpx.get(server.url("/v2/models/smollm2"))
    assert reply.status_code == 200 and reply.json()["platform"] == "vllm"


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([49152], "prompt: token id 49152 is outside the model's vocabulary (ids 0 to 49151)"),
        ([[1], [2**31 - 1]], "prompt[1]: token id 2147483647 is outside"),
        ([[1], []], "prompt[1]: is empty"),
        ([5, -1], "prompt: holds a negative token id -1"),
        ([[1], [2**70]], "prompt.1.0: "),
        ([], "prompt: must not be empty"),
    ],
)
def test_bad_token_ids_are_400_naming_the_prompt(
    server: RemoteServer, prompt: Any, message: str
) -> None:
    reply = httpx.post(
        server.url("/v1/completions"), json={"model": "smollm2", "prompt": prompt}, timeout=30
    )
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["message"].startswith(message)


def test_a_token_id_outside_the_vocabulary_fails_no_other_sequence(server: RemoteServer) -> None:
    """llama.cpp refuses a whole decode step holding such an id: before the check, every
    sequence decoding beside it failed with a 500."""
    body = {"model": "smollm2", "prompt": "Count to twenty:", "max_tokens": 24,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", server.url("/v1/completions"), json=body, timeout=60) as good:
        assert good.status_code == 200
        lines = good.iter_lines()
        assert next(lines).startswith("data: ")  # decoding has begun
        bad = httpx.post(
            server.url("/v1/completions"), json={"model": "smollm2", "prompt": [10**6]}
        )
        assert bad.status_code == 400
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert not any('"error"' in line for line in rest)
