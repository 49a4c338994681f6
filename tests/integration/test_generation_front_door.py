"""Issue #13 on the generative routes: the response cache answers deterministic
generations of a model that enables it (and nothing else), and a key's tokens-per-minute
limit counts each answer's usage (prompt + completion) and refuses once it is spent.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import httpx
import openai
import pytest

from slipstream.security.keys import KeyLimits, KeyRing
from tests.llm_models import build_tiny_llama
from tests.models import write_config
from tests.utils import RemoteServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

TOKENS_PER_MINUTE = 60


@pytest.fixture(scope="module")
def setup(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[RemoteServer, dict[str, str]]]:
    root = tmp_path_factory.mktemp("generation")
    tiny = build_tiny_llama(root / "hf")
    for name, cached in (("tiny_cached", True), ("tiny", False)):
        shutil.copytree(tiny, root / "repo" / name / "1")
        write_config(root / "repo", name, {
            "backend": "transformers", "generation": {"num_blocks": 32, "block_size": 16},
            "response_cache": {"enable": cached},
        })  # fmt: skip
    ring = KeyRing.load(root / "keys.json", missing_ok=True)
    secrets = {
        "free": ring.create("free", "infer")[0],
        "metered": ring.create("metered", "infer",
                               limits=KeyLimits(tokens_per_minute=TOKENS_PER_MINUTE))[0],
        "tenant": ring.create("tenant", "admin", models=["tiny"])[0],
    }  # fmt: skip
    ring.save()
    args = ["--cache", "local:size=8MB", "--auth-file", str(root / "keys.json")]
    with RemoteServer(root / "repo", args, log_dir=root) as server:
        yield server, secrets


def chat(client: openai.OpenAI, model: str, max_tokens: int = 8, **options: object) -> str:
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hello world"}],
        max_tokens=max_tokens, **options,  # type: ignore[arg-type]
    )  # fmt: skip
    return reply.id


def test_deterministic_generations_of_an_enabled_model_come_from_the_cache(
    setup: tuple[RemoteServer, dict[str, str]],
) -> None:
    server, secrets = setup
    client = server.openai(secrets["free"])
    first = chat(client, "tiny_cached", temperature=0)
    assert chat(client, "tiny_cached", temperature=0) == first  # the same answer, id and all
    assert chat(client, "tiny_cached", temperature=0, max_tokens=7) != first  # another request
    # A vanishing temperature is greedy too (SamplingParams.greedy), so it is cached.
    tiny = chat(client, "tiny_cached", temperature=1e-7)
    assert chat(client, "tiny_cached", temperature=1e-7) == tiny
    seeded = chat(client, "tiny_cached", temperature=0.9, seed=7)
    assert chat(client, "tiny_cached", temperature=0.9, seed=7) == seeded
    # Sampled without a seed, streamed, or a model that does not enable it: never cached.
    assert chat(client, "tiny_cached", temperature=0.9) != chat(client, "tiny_cached",
                                                                 temperature=0.9)  # fmt: skip
    assert chat(client, "tiny", temperature=0) != chat(client, "tiny", temperature=0)
    stream = client.chat.completions.create(
        model="tiny_cached", messages=[{"role": "user", "content": "Hello world"}],
        max_tokens=8, temperature=0, stream=True,
    )  # fmt: skip
    ids = {chunk.id for chunk in stream}
    assert len(ids) == 1 and first not in ids
    # Counted in Triton's nv_cache_* series, as a V2 model's cache is: three hits, four
    # misses (the cacheable requests above that came first).
    scraped = httpx.get(server.url("/metrics")).text
    for name, value in (("hits", 3), ("misses", 4)):
        line = f'nv_cache_num_{name}_per_model{{model="tiny_cached",version="1"}} {value}.0'
        assert line in scraped, [s for s in scraped.splitlines() if "nv_cache" in s]
    assert 'nv_cache_num_hits_per_model{model="tiny",' not in scraped  # not enabled


def test_tokens_per_minute_count_usage_and_refuse_when_spent(
    setup: tuple[RemoteServer, dict[str, str]],
) -> None:
    server, secrets = setup
    headers = {"Authorization": f"Bearer {secrets['metered']}"}
    body = {"model": "tiny", "prompt": "Hello world", "max_tokens": 30, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    spent = 0
    with httpx.Client(timeout=60) as client:
        while spent <= TOKENS_PER_MINUTE:  # admitted while the minute's budget lasts
            reply = client.post(server.url("/v1/completions"), json=body, headers=headers)
            assert reply.status_code == 200, reply.text
            spent += reply.json()["usage"]["total_tokens"]
        refused = client.post(server.url("/v1/completions"), json=body, headers=headers)
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert refused.headers["ratelimit-policy"] == f'"tokens";q={TOKENS_PER_MINUTE};w=60'
    # The debt is paid back at the budget's rate: the wait says when.
    debt_s = (spent - TOKENS_PER_MINUTE) * 60 / TOKENS_PER_MINUTE
    assert abs(int(refused.headers["retry-after"]) - debt_s) <= 3


def test_a_key_restricted_to_some_models_lists_only_those(
    setup: tuple[RemoteServer, dict[str, str]],
) -> None:
    server, secrets = setup
    every = server.openai(secrets["free"])
    assert [model.id for model in every.models.list()] == ["tiny", "tiny_cached"]
    tenant = server.openai(secrets["tenant"])
    assert [model.id for model in tenant.models.list()] == ["tiny"]
    with pytest.raises(openai.PermissionDeniedError):
        tenant.models.retrieve("tiny_cached")
    index = httpx.post(server.url("/v2/repository/index"),
                       headers={"Authorization": f"Bearer {secrets['tenant']}"})  # fmt: skip
    assert index.status_code == 200 and {entry["name"] for entry in index.json()} == {"tiny"}
