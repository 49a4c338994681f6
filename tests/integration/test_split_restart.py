"""``slipstream serve --frontends 1``: what clients see while a killed engine starts again.

In explicit mode the restarted engine loads the models it had loaded (its journal); until
each is back its requests answer 503 with Retry-After, "loading", as in the other modes,
never "not loaded; load it with POST ..." as if the operator had to act.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.models import ADD_SUB_WIDTH, build_add_sub, write_config
from tests.utils import RemoteServer

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def explicit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    root = tmp_path_factory.mktemp("split_restart")
    repo = root / "models"
    build_add_sub(repo, "slow")
    build_add_sub(repo, "quick")
    # Its warm-up runs 12,000 times: a load that takes a noticeable while, ahead of quick's.
    write_config(repo, "slow", {"model_warmup": [{
        "name": f"long{i}", "batch_size": 1, "count": 1000,
        "inputs": {name: {"data_type": "FP32", "dims": [ADD_SUB_WIDTH], "zero_data": True}
                   for name in ("INPUT0", "INPUT1")},
    } for i in range(12)]})  # fmt: skip
    args = ["--frontends", "1", "--model-control-mode", "explicit", "--load-model", "slow",
            "--load-model", "quick"]  # fmt: skip
    with RemoteServer(repo, args, log_dir=root) as running:
        yield running


def test_a_restarted_engine_answers_loading_with_retry_after_not_not_loaded(
    explicit: RemoteServer,
) -> None:
    body = {"inputs": [
        {"name": n, "shape": [1, ADD_SUB_WIDTH], "datatype": "FP32",
         "data": [1.0] * ADD_SUB_WIDTH} for n in ("INPUT0", "INPUT1")]}  # fmt: skip
    urls = [explicit.url(f"/v2/models/{name}/infer") for name in ("quick", "slow")]
    assert all(httpx.post(url, json=body).status_code == 200 for url in urls)
    pids = explicit.engine_pids()
    os.kill(pids[-1], signal.SIGKILL)
    answers: list[tuple[int, str | None, str]] = []
    deadline = time.monotonic() + 60
    with httpx.Client(timeout=10) as http:
        # Until both answer again: quick's load no longer waits behind slow's (it took
        # its turn after slow's warm-up, answering "not loaded" meanwhile).
        while len(explicit.engine_pids()) == len(pids) or not _both_served(answers):
            assert time.monotonic() < deadline, answers[-5:]
            for url in urls:
                answer = http.post(url, json=body)
                answers.append((answer.status_code, answer.headers.get("retry-after"), answer.text))
            time.sleep(0.01)
    assert {status for status, _, _ in answers} <= {200, 503}, answers
    refused = [(retry, text) for status, retry, text in answers if status == 503]
    assert all(retry is not None for retry, _ in refused), refused
    assert not [text for _, text in refused if "not loaded" in text], refused
    assert any("'slow' is loading" in text for _, text in refused), refused  # seen loading


def _both_served(answers: list[tuple[int, str | None, str]]) -> bool:
    return [status for status, _, _ in answers[-2:]] == [200, 200]
