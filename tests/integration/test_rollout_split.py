"""Weighted splits and sticky routing through a real server (HTTP, gRPC, parameters).

Model ``ab`` serves versions 1 and 2 with ``rollout: {weights: {"1": 90, "2": 10}}`` in
its config.yaml; requests that name no version are split, keyed requests stick, and a
reload with new weights moves only the keys that must move.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.models import build_add_constant, build_mean_embedding, mean_embedding, write_config
from tests.utils import RemoteServer

ROW = [0.0, 1.0, 2.0, 3.0]
BODY = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": ROW}]}


def config(weights: dict[str, int]) -> dict[str, Any]:
    return {"version_policy": {"all": {}}, "rollout": {"weights": weights}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    root = tmp_path_factory.mktemp("rollout_split")
    repo = root / "repo"
    for version in (1, 2):
        build_add_constant(repo, "ab", version, float(version))
    write_config(repo, "ab", config({"1": 90, "2": 10}))
    build_add_constant(repo, "mirror", 1, 1.0)
    build_add_constant(repo, "mirror", 2, 1.0)  # the same answers
    build_add_constant(repo, "mirror", 3, 1.5)  # answers that differ
    shadow = {"version": "2", "share": 1.0, "queue": 64}
    write_config(
        repo, "mirror", {**config({"1": 100}), "rollout": {"weights": {"1": 100}, "shadow": shadow}}
    )
    build_embedding_versions(repo)
    build_add_constant(repo, "bad", 1, 1.0)
    write_config(repo, "bad", {"rollout": {"weights": {"one": 90}}})
    args = ["--model-control-mode", "explicit", "--load-model", "ab", "--load-model", "mirror",
            "--load-model", "emb"]  # fmt: skip
    with RemoteServer(repo, args, log_dir=root) as running:
        yield running


WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
TABLE = np.random.default_rng(0).standard_normal((len(WORDS) + 1, 4)).astype(np.float32)


def build_embedding_versions(repo: Path) -> None:
    """``emb``: mean-of-token-rows embeddings; version 2's table is twice version 1's, so
    a vector tells which version made it. A word-level tokenizer over WORDS."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    for version, scale in ((1, 1.0), (2, 2.0)):
        path = build_mean_embedding(repo, "emb", TABLE * scale)
        if version == 2:
            path.parent.rename(repo / "emb" / "2")
    build_mean_embedding(repo, "emb", TABLE)
    vocab = {"[UNK]": 0, **{word: i + 1 for i, word in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(repo / "emb" / "tokenizer.json"))
    write_config(repo, "emb", {**config({"1": 50, "2": 50}), "tokenizer": "tokenizer.json",
                               "max_batch_size": 2})  # fmt: skip


def embedding_version(vector: list[float], words: str) -> str:
    ids = [WORDS.index(w) + 1 for w in words.split()]
    base = mean_embedding(TABLE, ids)
    for version, scale in (("1", 1.0), ("2", 2.0)):
        if np.allclose(vector, base * scale, atol=1e-4):
            return version
    raise AssertionError(f"{vector} is neither version's embedding of {words!r}")


def versions_of(client: httpx.Client, server: RemoteServer, keys: list[str]) -> dict[str, str]:
    url = server.url("/v2/models/ab/infer")
    return {
        key: client.post(url, json=BODY, headers={"X-Slipstream-Route-Key": key}).json()[
            "model_version"
        ]
        for key in keys
    }


def test_a_90_10_split_over_5000_requests(server: RemoteServer) -> None:
    url = server.url("/v2/models/ab/infer")
    with httpx.Client(timeout=10) as client:
        counts = Counter(client.post(url, json=BODY).json()["model_version"] for _ in range(5000))
        # Naming a version bypasses the split.
        explicit = server.url("/v2/models/ab/versions/2/infer")
        assert {client.post(explicit, json=BODY).json()["model_version"] for _ in range(20)} == {
            "2"
        }
        metrics = client.get(server.url("/metrics")).text
    assert counts["1"] + counts["2"] == 5000
    assert abs(counts["2"] / 5000 - 0.10) <= 0.015, counts
    assert 'slipstream_rollout_weight{model="ab",version="2"} 10.0' in metrics


def test_grpc_splits_and_sticks_by_metadata(server: RemoteServer) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_address)
    request = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
    request.set_data_from_numpy(np.array([ROW], np.float32))
    counts = Counter(client.infer("ab", [request]).get_response().model_version for _ in range(500))
    assert abs(counts["2"] / 500 - 0.10) <= 0.03, counts
    keys = [f"grpc-user-{i}" for i in range(60)]
    with httpx.Client(timeout=10) as http:
        over_http = versions_of(http, server, keys)
    for key in keys:
        headers = {"x-slipstream-route-key": key}
        got = {client.infer("ab", [request], headers=headers).get_response().model_version
               for _ in range(3)}  # fmt: skip
        assert got == {over_http[key]}, key  # one key, one version, whatever the protocol
    client.close()


def test_sticky_keys_and_a_weight_change_that_moves_only_the_keys_that_must(
    server: RemoteServer,
) -> None:
    keys = [f"user-{i}" for i in range(1000)]
    with httpx.Client(timeout=10) as client:
        before = versions_of(client, server, keys)
        assert versions_of(client, server, keys) == before  # 100% consistent
        # The same key as a request parameter routes the same way.
        url = server.url("/v2/models/ab/infer")
        for key in keys[:50]:
            body = {**BODY, "parameters": {"route_key": key}}
            assert client.post(url, json=body).json()["model_version"] == before[key]
        share = sum(v == "2" for v in before.values()) / len(keys)
        assert abs(share - 0.10) < 0.03
        write_config(server.repository, "ab", config({"1": 75, "2": 25}))
        load = client.post(server.url("/v2/repository/models/ab/load"))
        assert load.status_code == 200, load.text
        after = versions_of(client, server, keys)
    moved = [key for key in keys if after[key] != before[key]]
    assert all(before[key] == "1" and after[key] == "2" for key in moved)
    assert abs(len(moved) / len(keys) - 0.15) < 0.03, len(moved)


def test_bad_weights_are_refused_naming_the_field(server: RemoteServer) -> None:
    with httpx.Client(timeout=10) as client:
        reply = client.post(server.url("/v2/repository/models/bad/load"))
    assert reply.status_code == 400
    assert "rollout.weights" in reply.json()["error"], reply.text


def shadow_counts(client: httpx.Client, server: RemoteServer, version: str) -> dict[str, float]:
    counts = {}
    for line in client.get(server.url("/metrics")).text.splitlines():
        prefix = "slipstream_shadow_requests_total{"
        if line.startswith(prefix) and 'model="mirror"' in line and f'version="{version}"' in line:
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            counts[outcome] = float(line.rsplit(" ", 1)[1])
    return counts


def _rows(index: int) -> dict[str, Any]:
    """Request ``index``: 1 or 3 rows, its own values (copies run stacked, so an answer
    sliced at the wrong offset would disagree with its primary)."""
    rows = 1 + 2 * (index % 2)
    data = (np.arange(rows * 4, dtype=np.float32) + 10 * index).tolist()
    return {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [rows, 4], "data": data}]}


def test_shadow_copies_are_compared_and_never_returned(server: RemoteServer) -> None:
    url = server.url("/v2/models/mirror/infer")
    with httpx.Client(timeout=10) as client:
        answers = [client.post(url, json=_rows(index)).json() for index in range(300)]
        assert {a["model_version"] for a in answers} == {"1"}  # the shadow's never returned
        time.sleep(0.5)  # the copies run after the answers
        same = shadow_counts(client, server, "2")
        assert same["agreed"] + same["dropped"] == 300 and same["agreed"] > 0, same
        assert same["disagreed"] == same["failed"] == 0
        write_config(server.repository, "mirror", {**config({"1": 100}), "rollout": {
            "weights": {"1": 100}, "shadow": {"version": "3", "share": 0.5}}})  # fmt: skip
        assert client.post(server.url("/v2/repository/models/mirror/load")).status_code == 200
        for _ in range(200):
            client.post(url, json=BODY)
        time.sleep(0.5)
        differ = shadow_counts(client, server, "3")
    # Half the requests mirrored (share 0.5), every copy differing from its primary.
    assert 95 <= differ["disagreed"] + differ["dropped"] <= 105, differ
    assert differ["agreed"] == 0 and differ["disagreed"] > 0


def test_openai_embeddings_split_stick_to_user_and_keep_one_request_on_one_version(
    server: RemoteServer,
) -> None:
    url = server.url("/v1/embeddings")
    texts = ["alpha beta", "gamma", "delta epsilon zeta", "eta theta", "alpha", "beta gamma"]
    seen: Counter[str] = Counter()
    with httpx.Client(timeout=10) as client:
        for i in range(60):
            # Six texts, three pieces at max_batch_size 2: every piece on one version.
            body = {"model": "emb", "input": texts}
            data = client.post(url, json=body).json()["data"]
            versions = {
                embedding_version(d["embedding"], t) for d, t in zip(data, texts, strict=True)
            }
            assert len(versions) == 1, versions
            seen.update(versions)
            # OpenAI's `user` is the route key: the same user, the same version.
            keyed = {"model": "emb", "input": "alpha beta", "user": f"user-{i}"}
            once, again = (
                embedding_version(client.post(url, json=keyed).json()["data"][0]["embedding"],
                                  "alpha beta")
                for _ in range(2)
            )  # fmt: skip
            assert once == again
    assert seen["1"] > 10 and seen["2"] > 10, seen
