"""LoRA adapters on the llama.cpp engine, served as vLLM serves them: each adapter of a
model's ``generation.lora_modules`` is a model name of its own.

The adapters are built here (random low-rank updates of SmolLM2's attention and MLP
weights, large enough to change its greedy text) and checked against llama-cpp-python's
own ``Llama(lora_path=...)``: an adapter's greedy completion is the reference's token for
token; base requests running beside adapter requests, and prompts the other side left in
the prefix cache, still give the base model's own completion (and the reverse): token for
token with a KV stream per sequence (each group's decode then has the shape of llama.cpp
alone), as a greedy path of the right model in a shared cache (other sequences' cells
change the attention's chunking there: see tests/llama_greedy.py).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from slipstream.security.keys import KeyRing
from tests.llama_greedy import greedy_path
from tests.llm_models import smollm2_gguf
from tests.models import write_config
from tests.utils import RemoteServer

llama_cpp = pytest.importorskip("llama_cpp", reason="the llama extra is not installed")
gguf = pytest.importorskip("gguf")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

MAX_TOKENS = 12
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
]


def build_lora(path: Path, seed: int, rank: int = 8, scale: float = 0.15) -> Path:
    """A LoRA adapter GGUF of SmolLM2: updates of attn_q and ffn_down in every third
    layer (lora_a ``[rank, in]``, lora_b ``[out, rank]`` as numpy writes them; llama.cpp
    reads the reverse), alpha = rank so the update is ``B @ A`` unscaled."""
    reader = gguf.GGUFReader(smollm2_gguf())
    shapes = {tensor.name: [int(n) for n in tensor.shape] for tensor in reader.tensors}
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(rank))
    rng = np.random.default_rng(seed)
    for layer in range(0, 30, 3):
        for part in ("attn_q", "ffn_down"):
            name = f"blk.{layer}.{part}.weight"
            inputs, outputs = shapes[name]
            a = rng.standard_normal((rank, inputs)) * scale
            b = rng.standard_normal((outputs, rank)) * scale
            writer.add_tensor(f"{name}.lora_a", a.astype(np.float32))
            writer.add_tensor(f"{name}.lora_b", b.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {"sql": build_lora(root / "sql.gguf", seed=1),
            "poet": build_lora(root / "poet.gguf", seed=2)}  # fmt: skip


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, adapters: dict[str, Path]
) -> Iterator[tuple[RemoteServer, dict[str, str]]]:
    repo = tmp_path_factory.mktemp("lora-repo")
    modules = {name: f"adapters/{name}.gguf" for name in adapters}
    generation = {
        "smol": {"num_blocks": 64, "block_size": 16, "max_num_seqs": 8,
                 "max_model_len": 512, "lora_modules": modules},
        "smol_streams": {"num_blocks": 64, "block_size": 16, "max_num_seqs": 4,
                         "max_model_len": 256, "kv_streams": "per_sequence",
                         "lora_modules": {f"{name}_streams": path
                                          for name, path in modules.items()}},
    }  # fmt: skip
    for name, settings in generation.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "adapters").mkdir()
        os.link(smollm2_gguf(), repo / name / "1" / "model.gguf")
        for adapter, path in adapters.items():
            os.link(path, repo / name / "adapters" / f"{adapter}.gguf")
        write_config(repo, name, {"backend": "llama_cpp", "generation": settings})
    # An adapter of another shape (ranks that do not match), bytes that are no GGUF, an
    # adapter on the transformers engine: each fails its model's load, nothing else.
    broken = {"wrong_shape": b"", "not_gguf": b"PK\x03\x04 a zip file"}
    for name, content in broken.items():
        (repo / name / "1").mkdir(parents=True)
        os.link(smollm2_gguf(), repo / name / "1" / "model.gguf")
        adapter = repo / name / "bad.gguf"
        if content:
            adapter.write_bytes(content)
        else:
            _write_mismatched(adapter)
        modules = {f"{name}_lora": "bad.gguf"}
        write_config(repo, name, {"backend": "llama_cpp", "generation": {"lora_modules": modules}})
    (repo / "outside" / "1").mkdir(parents=True)
    os.link(smollm2_gguf(), repo / "outside" / "1" / "model.gguf")
    modules = {"outside_lora": "../smol/adapters/sql.gguf"}
    write_config(repo, "outside", {"backend": "llama_cpp", "generation": {"lora_modules": modules}})
    (repo / "hf" / "1").mkdir(parents=True)
    (repo / "hf" / "1" / "config.json").write_text("{}")
    (repo / "hf" / "sql.gguf").write_bytes(b"")
    write_config(repo, "hf", {"backend": "transformers",
                              "generation": {"lora_modules": {"hf_sql": "sql.gguf"}}})  # fmt: skip
    ring = KeyRing.load(repo.parent / "keys.json", missing_ok=True)
    keys = {"all": ring.create("all", "admin")[0],
            "sql_only": ring.create("sql_only", "infer", models=["sql"])[0]}  # fmt: skip
    ring.save()
    # The outside adapter is a broken config.yaml: the V2 lane counts it against readiness.
    args = ["--auth-file", str(repo.parent / "keys.json"), "--no-strict-readiness"]
    with RemoteServer(repo, args, log_dir=repo) as running:
        yield running, keys


@pytest.fixture(scope="module")
def http(served: tuple[RemoteServer, dict[str, str]]) -> Iterator[httpx.Client]:
    server, keys = served
    headers = {"Authorization": f"Bearer {keys['all']}"}
    with httpx.Client(base_url=server.url(""), headers=headers, timeout=120) as client:
        yield client


def _write_mismatched(path: Path) -> None:
    """A LoRA GGUF whose lora_a and lora_b ranks differ: llama.cpp refuses it."""
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 4.0)
    writer.add_tensor("blk.0.attn_q.weight.lora_a", np.zeros((4, 576), np.float32))
    writer.add_tensor("blk.0.attn_q.weight.lora_b", np.zeros((576, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


class Reference:
    """llama.cpp alone (llama-cpp-python's Llama), with one adapter or none, from an empty
    cache each time (flash attention on, as the engine runs)."""

    def __init__(self, adapters: dict[str, Path]) -> None:
        self._adapters = adapters
        self._models: dict[str | None, Any] = {}
        self._texts: dict[tuple[str | None, str], str] = {}

    def model(self, adapter: str | None) -> Any:
        model = self._models.get(adapter)
        if model is None:
            lora = None if adapter is None else str(self._adapters[adapter])
            model = self._models[adapter] = llama_cpp.Llama(
                str(smollm2_gguf()), n_ctx=512, n_threads=1, flash_attn=True,
                logits_all=True, lora_path=lora, verbose=False,
            )  # fmt: skip
        return model

    def ids(self, prompt: str) -> list[int]:
        return [int(t) for t in self.model(None).tokenize(prompt.encode(), add_bos=False,
                                                          special=True)]  # fmt: skip

    def text(self, adapter: str | None, prompt: str) -> str:
        """The greedy completion of ``prompt`` (computed once)."""
        known = self._texts.get((adapter, prompt))
        if known is None:
            known = self._texts[adapter, prompt] = self._text(adapter, prompt)
        return known

    def _text(self, adapter: str | None, prompt: str) -> str:
        model = self.model(adapter)
        model.reset()
        out: list[int] = []
        for token in model.generate(self.ids(prompt), top_k=1, temp=0.0, reset=False):
            out.append(int(token))
            if len(out) == MAX_TOKENS:
                break
        return str(model.detokenize(out).decode("utf-8", errors="replace"))

    def check(self, adapter: str | None, prompt: str, text: str, exact: bool) -> None:
        """``text`` is the greedy completion (``exact``), or a greedy path of the model."""
        if exact:
            assert text == self.text(adapter, prompt), adapter
        else:
            greedy_path(self.model(adapter), self.ids(prompt), text, MAX_TOKENS)


@pytest.fixture(scope="module")
def reference(adapters: dict[str, Path]) -> Reference:
    return Reference(adapters)


def _complete(http: httpx.Client, model: str, prompt: str) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["text"])


async def _complete_all(server: RemoteServer, key: str, jobs: list[tuple[str, str]],
                        stagger_s: float = 0.0) -> list[str]:  # fmt: skip
    """Each (model, prompt) sent at once (or ``stagger_s`` apart), the texts in order."""
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=server.url(""), headers=headers,
                                 timeout=120) as client:  # fmt: skip

        async def one(index: int, model: str, prompt: str) -> str:
            await asyncio.sleep(index * stagger_s)
            body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                    "temperature": 0, "ignore_eos": True}  # fmt: skip
            reply = await client.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            return str(reply.json()["choices"][0]["text"])

        return list(await asyncio.gather(*(one(i, m, p) for i, (m, p) in enumerate(jobs))))


def test_an_adapter_is_a_model_of_its_own_name(http: httpx.Client, reference: Reference) -> None:
    prompt = PROMPTS[0]
    base = _complete(http, "smol", prompt)
    assert base == reference.text(None, prompt)
    for adapter in ("sql", "poet"):
        text = _complete(http, adapter, prompt)
        assert text == reference.text(adapter, prompt)
        assert text != base
    assert _complete(http, "sql_streams", prompt) == reference.text("sql", prompt)


def test_the_listing_names_each_adapter_and_its_parent(http: httpx.Client) -> None:
    cards = {card["id"]: card for card in http.get("/v1/models").json()["data"]}
    assert {"smol", "sql", "poet", "smol_streams", "sql_streams"} <= set(cards)
    assert cards["sql"]["parent"] == "smol" and cards["sql"]["root"] == "adapters/sql.gguf"
    assert cards["sql_streams"]["parent"] == "smol_streams"
    assert "parent" not in cards["smol"]
    card = http.get("/v1/models/poet").json()
    assert (card["id"], card["parent"], card["root"]) == ("poet", "smol", "adapters/poet.gguf")


# (model served, adapter of the reference, the model's KV layout is a stream per sequence)
SHARED = [("smol", None, False), ("sql", "sql", False), ("poet", "poet", False)]
STREAMS = [("smol_streams", None, True), ("sql_streams", "sql", True),
           ("poet_streams", "poet", True)]  # fmt: skip


@pytest.mark.parametrize("models", [SHARED, STREAMS], ids=["shared", "streams"])
def test_base_and_adapters_side_by_side_keep_their_own_outputs(
    served: tuple[RemoteServer, dict[str, str]],
    reference: Reference,
    models: list[tuple[str, str | None, bool]],
) -> None:
    """A sequence of each adapter and of the base at once (each decoded in its own
    batch), started together and staggered into each other's decoding; the same prompt
    to each, so a prefix reused across adapters would show too."""
    server, keys = served
    prompt = PROMPTS[1]
    for stagger_s in (0.0, 0.05):
        jobs = [(model, prompt) for model, _, _ in models]
        texts = asyncio.run(_complete_all(server, keys["all"], jobs, stagger_s))
        for (_, adapter, exact), text in zip(models, texts, strict=True):
            reference.check(adapter, prompt, text, exact)


@pytest.mark.parametrize("models", [SHARED, STREAMS], ids=["shared", "streams"])
def test_a_prefix_cached_under_one_adapter_is_not_reused_by_another(
    http: httpx.Client, reference: Reference, models: list[tuple[str, str | None, bool]]
) -> None:
    # A long prompt (a stream copies a prefix of 16 tokens or more), sent to one side and
    # then the other: each must read it whole, as llama.cpp alone does.
    (base, _, exact), (adapter, reference_adapter, _) = models[:2]
    first = "Here is a long story about the sea and the ships that sail on it. " * 3
    second = first.replace("sea", "mountains")
    order = [(adapter, reference_adapter, first), (base, None, first),
             (base, None, second), (adapter, reference_adapter, second)]  # fmt: skip
    for model, used, prompt in order:
        reference.check(used, prompt, _complete(http, model, prompt), exact)


def test_unknown_names_and_keys(served: tuple[RemoteServer, dict[str, str]],
                                http: httpx.Client) -> None:  # fmt: skip
    _server, keys = served
    body = {"model": "nosuch", "prompt": "Hi", "max_tokens": 2}
    missing = http.post("/v1/completions", json=body)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"
    # A key limited to the adapter sees and uses it, not its model.
    limited = {"Authorization": f"Bearer {keys['sql_only']}"}
    listed = http.get("/v1/models", headers=limited).json()["data"]
    assert [(card["id"], card["parent"]) for card in listed] == [("sql", "smol")]
    body = {"model": "sql", "prompt": "Hi", "max_tokens": 2}
    assert http.post("/v1/completions", json=body, headers=limited).status_code == 200
    body["model"] = "smol"
    assert http.post("/v1/completions", json=body, headers=limited).status_code == 403


def test_a_bad_adapter_fails_its_models_load_only(http: httpx.Client) -> None:
    index = {entry["name"]: entry for entry in http.post("/v2/repository/index", json={}).json()}
    broken = ("wrong_shape", "not_gguf", "hf", "outside")
    reasons = {name: index[name].get("reason", "") for name in broken}
    assert all(index[name]["state"] == "UNAVAILABLE" for name in reasons), index
    wrong_shape = "generation.lora_modules.wrong_shape_lora: llama.cpp could not load"
    assert wrong_shape in reasons["wrong_shape"]
    assert "generation.lora_modules.not_gguf_lora" in reasons["not_gguf"]
    assert "not a GGUF file" in reasons["not_gguf"]
    assert "generation.lora_modules: the transformers engine cannot apply LoRA" in reasons["hf"]
    assert (
        "generation.lora_modules.outside_lora: '../smol/adapters/sql.gguf' resolves to"
        in (reasons["outside"])
    )
    cards = {card["id"] for card in http.get("/v1/models").json()["data"]}
    assert not cards & {"wrong_shape", "wrong_shape_lora", "not_gguf_lora", "hf_sql",
                        "outside_lora"}  # fmt: skip
    body = {"model": "wrong_shape_lora", "prompt": "Hi", "max_tokens": 2}
    assert http.post("/v1/completions", json=body).status_code == 404
    assert index["smol"]["state"] == "READY"
