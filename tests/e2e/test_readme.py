"""The README's example calls work as pasted against the example repository of `make run`."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.utils import RemoteServer

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def readme_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, re.S)


def test_readme_starts_with_the_two_commands() -> None:
    first = readme_blocks("bash")[0].splitlines()
    assert first[0].startswith("make run ") and first[1].startswith("make test ")


@pytest.fixture(scope="module")
def example_server(
    example_models: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RemoteServer]:
    """`make run`'s server of examples/build_models.py's models (tests/conftest.py)."""
    log_dir = tmp_path_factory.mktemp("readme")
    # smollm2 loads its GGUF file on llama.cpp in about a second.
    with RemoteServer(example_models, log_dir=log_dir, startup_timeout_s=300) as server:
        yield server


def localised(block: str, server: RemoteServer) -> str:
    """The README block pointed at the test server's ports."""
    http_port = server.http_address.rsplit(":", 1)[1]
    grpc_port = server.grpc_address.rsplit(":", 1)[1]
    return block.replace("localhost:8000", f"127.0.0.1:{http_port}").replace(
        "localhost:8001", f"127.0.0.1:{grpc_port}"
    )


@pytest.mark.slow
def test_readme_curl_calls(example_server: RemoteServer) -> None:
    curls = [b for b in readme_blocks("bash") if b.lstrip().startswith("# ") and "curl" in b]
    assert len(curls) == 2
    digits, minilm = (
        json.loads(subprocess.run(["bash", "-c", localised(b, example_server)],
                                  check=True, capture_output=True, text=True).stdout)
        for b in curls
    )  # fmt: skip
    assert digits["outputs"] == [{"name": "label", "datatype": "INT64", "shape": [1], "data": [0]}]
    embedding = np.array(minilm["outputs"][0]["data"])
    assert minilm["outputs"][0]["shape"] == [1, 384]
    assert abs(np.linalg.norm(embedding) - 1.0) < 1e-4


@pytest.mark.slow
def test_readme_python_examples(example_server: RemoteServer) -> None:
    blocks = [b for b in readme_blocks("python") if "tritonclient" in b]
    assert len(blocks) == 2
    workdir = example_server.repository.parent
    printed = [
        subprocess.run([sys.executable, "-c", localised(b, example_server)], cwd=workdir,
                       check=True, capture_output=True, text=True).stdout
        for b in blocks
    ]  # fmt: skip
    assert printed[0].strip() == "digits: [0 1 2 3]"
    assert printed[1].startswith("minilm: (2, 384) cosine ")


@pytest.mark.slow
def test_readme_openai_example(example_server: RemoteServer) -> None:
    blocks = [b for b in readme_blocks("python") if "from openai" in b]
    assert len(blocks) == 2
    basics, features = (
        subprocess.run([sys.executable, "-c", localised(block, example_server)],
                       check=True, capture_output=True, text=True).stdout
        for block in blocks
    )  # fmt: skip
    answer, usage, streamed, width = basics.splitlines()
    assert "Paris" in answer and answer == streamed
    assert "completion_tokens" in usage
    assert width == "384"
    city, call, top, response = features.splitlines()
    assert set(ast.literal_eval(city)) == {"city", "country"}
    name, arguments = call.split(" ", 1)
    assert name == "get_weather" and set(json.loads(arguments)) == {"city"}
    assert len(ast.literal_eval(top)) == 3
    assert "Paris" in response
