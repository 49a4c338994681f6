"""The monitoring files in monitoring/ against the real tools (#16).

* the alert rules pass ``promtool check rules`` and their unit tests (``promtool test
  rules``, synthetic series);
* Debian's ``prometheus`` scrapes a loaded server (a tensor model with drift monitoring
  and a price, and SmolLM2 on llama.cpp), and every query of every dashboard panel
  returns data through Prometheus's HTTP API;
* every metric family the server exports is on a panel or in an alert, or on the
  allow-list below with the reason.

`make install` installs prometheus (promtool with it) from Debian.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
import yaml
from prometheus_client.parser import text_string_to_metric_families

from slipstream.runtime.base import usable_cpu_count
from tests.llm_models import smollm2_gguf
from tests.models import ADD_SUB_WIDTH, build_add_constant, build_add_sub, write_config
from tests.torch_models import export_mlp
from tests.utils import HOST, RemoteServer, free_ports, slipstream_command

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MONITORING = Path(__file__).resolve().parents[2] / "monitoring"
DASHBOARD = json.loads((MONITORING / "grafana-dashboard.json").read_text())
ALERTS = (MONITORING / "alerts.yml").read_text()
# Families exported but on no panel and in no alert, each with the reason.
_TRITON_NAMES = (
    "Triton's name for a slipstream_* series the dashboards show, for Triton's own "
    "dashboards and HPA rules"
)
NOT_SHOWN: dict[str, str] = dict.fromkeys(
    [
        "nv_inference_request_success", "nv_inference_request_failure", "nv_inference_count",
        "nv_inference_exec_count", "nv_inference_pending_request_count",
        "nv_inference_request_duration_us", "nv_inference_queue_duration_us",
        "nv_inference_compute_infer_duration_us",
    ],
    _TRITON_NAMES,
)  # fmt: skip


def tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is not installed: `make install` installs Debian's prometheus"
    return path


def test_the_alert_rules_are_valid_and_their_unit_tests_pass() -> None:
    promtool = tool("promtool")
    for args in (["check", "rules", "alerts.yml"], ["test", "rules", "alerts_test.yml"]):
        done = subprocess.run([promtool, *args], cwd=MONITORING, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "SUCCESS" in done.stdout


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel, the dashboard variables filled in."""
    queries = []
    for panel in DASHBOARD["panels"]:
        for target in panel["targets"]:
            expr = (
                target["expr"]
                .replace("$model", ".*")
                .replace("$__rate_interval", "30s")
                .replace("$__range", "5m")
            )
            queries.append((panel["title"], expr))
    return queries


@pytest.fixture(scope="module")
def scraper(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    prometheus = Prometheus(tmp_path_factory.mktemp("prometheus"))
    try:
        yield prometheus
    finally:
        prometheus.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, scraper: Prometheus) -> Iterator[RemoteServer]:
    repo = tmp_path_factory.mktemp("monitoring-repo")
    keys = repo.parent / "keys.json"
    args = ["--price-per-hour", "1.5", "--cost-window-s", "30", "--auth-file", str(keys),
            "--cache", "local:size=16MB"]  # fmt: skip
    unstarted = RemoteServer(repo, args, log_dir=repo)
    # Prometheus first: its first scrape comes ~5.5 s after it starts (service discovery
    # hands over the targets after 5 s), time spent building the models and the keys,
    # starting the server and sending its traffic. The `prometheus` fixture then waits
    # for scrapes after the traffic.
    scraper.start(unstarted.http_port)
    drift = {"enable": True, "window": 100, "reference_samples": 100}
    build_add_sub(repo, "watched")
    write_config(repo, "watched", {"max_batch_size": 64, "monitoring": {"drift": drift},
                                   "response_cache": {"enable": True}})  # fmt: skip
    # Two versions split 80/20, version 2 also shadowing everything version 1 answers:
    # the rollout panel's weights and shadow comparisons.
    for version, constant in ((1, 1.0), (2, 1.5)):
        build_add_constant(repo, "split", version, constant)
    write_config(repo, "split", {
        "version_policy": {"all": {}},
        "rollout": {"weights": {"1": 80, "2": 20}, "shadow": {"version": "2", "share": 1.0}},
    })  # fmt: skip
    # A torch model on the CPU: its instances' intra-op threads (slipstream_model_cpu_threads).
    (repo / "torch_mlp" / "1").mkdir(parents=True)
    export_mlp(repo / "torch_mlp" / "1" / "model.pt2")
    write_config(repo, "torch_mlp", {"backend": "torch", "trust_pickle": True,
                                     "max_batch_size": 8})  # fmt: skip
    (repo / "smol" / "1").mkdir(parents=True)
    os.link(smollm2_gguf(), repo / "smol" / "1" / "model.gguf")
    write_config(repo, "smol", {"backend": "llama_cpp",
                                "generation": {"num_blocks": 32, "max_num_seqs": 2}})  # fmt: skip
    # The front door and the cache on, so their families are exported too: a key for the
    # traffic, and a tight one that is rate-limited.
    for name, limits in (("monitor", ["--rate", "1000", "--burst", "1000"]),
                         ("tight", ["--rate", "0.1", "--burst", "1"])):  # fmt: skip
        made = subprocess.run(
            [*slipstream_command(), "keys", "create", "--auth-file", str(keys), "--name", name,
             "--role", "admin", *limits], capture_output=True, text=True, check=True,
        )  # fmt: skip
        KEYS[name] = made.stdout.strip()
    with unstarted as running:
        if running.http_port != scraper.target_port:  # a port taken meanwhile: moved
            scraper.stop()
            scraper.start(running.http_port)
        traffic(running)
        scraper.traffic_done_s = time.time()
        yield running


KEYS: dict[str, str] = {}


def auth(name: str = "monitor") -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


def traffic(server: RemoteServer) -> None:
    """Enough of every kind that each panel has a series: V2 inference past two drift
    windows, a failed request, completions (one from a shared prefix)."""
    infer_watched(server, np.random.default_rng(0), requests=15, rows=20, repeat_first=True)
    server.http.post("/v2/models/watched/infer", content=b"{bad", headers=auth())
    server.http.get("/v2/models/watched")  # no key: 401
    for _ in range(3):  # past the tight key's burst: 429
        server.http.get("/v2/models/watched", headers=auth("tight"))
    split = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4],
                         "data": [1.0, 2.0, 3.0, 4.0]}]}  # fmt: skip
    for _ in range(20):
        server.http.post("/v2/models/split/infer", json=split, headers=auth()).raise_for_status()
    for _ in range(2):
        body = {"model": "smol", "prompt": "Once upon a time", "max_tokens": 4}
        reply = server.http.post("/v1/completions", json=body, headers=auth())
        reply.raise_for_status()


class Prometheus:
    """Debian's prometheus, scraping one server every 0.5 s, with the alert rules."""

    def __init__(self, workdir: Path) -> None:
        self._workdir = workdir
        self._process: subprocess.Popen[bytes] | None = None
        self._http = httpx.Client(timeout=10)
        self.target_port = 0
        self.url = ""
        # When the server's traffic ended (seconds since the epoch, as Prometheus stamps).
        self.traffic_done_s = 0.0

    def start(self, target_port: int) -> None:
        (port,) = free_ports(1)
        config = {
            "global": {"scrape_interval": "500ms", "evaluation_interval": "1s"},
            "rule_files": [str(MONITORING / "alerts.yml")],
            "scrape_configs": [{"job_name": "slipstream",
                                "static_configs": [{"targets": [f"{HOST}:{target_port}"]}]}],
        }  # fmt: skip
        (self._workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        argv = [tool("prometheus"), f"--config.file={self._workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self._workdir / f'data-{port}'}",
                f"--web.listen-address={HOST}:{port}"]  # fmt: skip
        with (self._workdir / "prometheus.log").open("wb") as log:
            self._process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        self.target_port, self.url = target_port, f"http://{HOST}:{port}"

    def query(self, expr: str, wait: bool = False) -> list[dict[str, object]]:
        """The result of an instant query; [] when not up yet and ``wait``."""
        try:
            reply = self._http.get(f"{self.url}/api/v1/query", params={"query": expr})
        except httpx.TransportError:
            if wait:
                return []
            raise
        doc = reply.json()
        assert doc["status"] == "success", (expr, doc)
        result: list[dict[str, object]] = doc["data"]["result"]
        return result

    def exited(self) -> bool:
        return self._process is not None and self._process.poll() is not None

    def log_tail(self) -> str:
        return (self._workdir / "prometheus.log").read_text()[-2000:]

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(30)
            self._process = None

    def close(self) -> None:
        self.stop()
        self._http.close()


@pytest.fixture(scope="module")
def prometheus(server: RemoteServer, scraper: Prometheus) -> Prometheus:
    """The Prometheus, once it scraped the server five times after its traffic (rates
    need two samples in their range)."""
    deadline = time.monotonic() + 60
    while True:
        found = scraper.query('up{job="slipstream"}[1m]', wait=True)
        values: Any = found[0]["values"] if found else []
        if sum(1 for at, up in values if at >= scraper.traffic_done_s and up == "1") >= 5:
            return scraper
        assert not scraper.exited(), scraper.log_tail()
        assert time.monotonic() < deadline, "prometheus did not scrape the server"
        time.sleep(0.1)


def test_every_dashboard_query_returns_data_from_a_real_prometheus(
    prometheus: Prometheus,
) -> None:
    empty = [(title, expr) for title, expr in panel_queries() if not prometheus.query(expr)]
    assert not empty, empty


def test_every_exported_metric_family_is_on_a_panel_or_in_an_alert(
    server: RemoteServer,
) -> None:
    text = server.http.get("/metrics").text
    families = {family.name for family in text_string_to_metric_families(text)}
    assert {"slipstream_drift_p_value", "slipstream_llm_kv_cache_blocks_used"} <= families
    shown = " ".join(expr for _, expr in panel_queries()) + ALERTS
    unshown = sorted(
        name for name in families
        if not re.search(rf"\b{name}(_total|_bucket|_sum|_count)?\b", shown)
        and name not in NOT_SHOWN
    )  # fmt: skip
    assert not unshown, f"on no panel and in no alert: {unshown}"


def test_cpu_threads_are_reported_for_torch_models_only(server: RemoteServer) -> None:
    text = server.http.get("/metrics").text
    samples = {
        sample.labels["model"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "slipstream_model_cpu_threads"
        for sample in family.samples
    }
    # One instance with the cores' threads at most, one at least (the governor's floor).
    assert set(samples) == {"torch_mlp"}
    assert 1 <= samples["torch_mlp"] <= usable_cpu_count()


def test_the_built_in_dashboard_draws_its_charts_in_a_real_browser(
    server: RemoteServer, tmp_path: Path
) -> None:
    """Debian's chromium, headless, opens /dashboard (scraping every 0.5 s rather than
    every 2 s): the charts draw from /metrics (a canvas with coloured pixels), a screenshot
    is taken, and no request left for another host (every resource the page loaded is this
    server's)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = tool("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1200",
                 "--disable-dev-shm-usage", "--no-first-run", "--disable-extensions",
                 "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"):  # fmt: skip
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(tool("chromedriver")))
    try:
        driver.get(server.url("/dashboard?every_s=0.5"))
        deadline = time.monotonic() + 60
        while True:
            traffic_step(server)
            drawn = driver.execute_script(
                "const s = window.slipstreamDashboard;"
                "return s ? [s.scrapes, document.querySelectorAll('canvas').length] : [0, 0];"
            )
            if drawn[0] >= 3 and drawn[1] >= 6:
                break
            assert time.monotonic() < deadline, f"charts not drawn: {drawn}"
            time.sleep(0.5)
        painted = driver.execute_script(
            """return [...document.querySelectorAll('canvas')].map((c) => {
                 const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                 let coloured = 0;
                 for (let i = 0; i < d.length; i += 4) {
                   const [r, g, b, a] = [d[i], d[i + 1], d[i + 2], d[i + 3]];
                   if (a > 0 && !(r === g && g === b)) coloured++;   // not white, grey, black
                 }
                 return coloured;
               });"""
        )
        assert sum(1 for pixels in painted if pixels > 50) >= 4, painted
        shot = tmp_path / "dashboard.png"
        assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
        origin = server.url("")
        resources = driver.execute_script(
            "return performance.getEntriesByType('resource').map((e) => e.name);"
        )
        assert resources and all(name.startswith(origin) for name in resources), resources
        assert {n.rsplit("/", 1)[1] for n in resources} >= {"uplot.min.js", "dashboard.js"}
    finally:
        driver.quit()


def traffic_step(server: RemoteServer) -> None:
    """A few requests between scrapes, so rates and quantiles have something to show."""
    infer_watched(server, np.random.default_rng(), requests=3, rows=4)


def infer_watched(
    server: RemoteServer,
    rng: np.random.Generator,
    requests: int,
    rows: int,
    repeat_first: bool = False,
) -> None:
    """V2 inference on `watched` with the stock tritonclient; ``repeat_first`` sends the
    first request twice (the second is a cache hit)."""
    client = httpclient.InferenceServerClient(f"{HOST}:{server.http_port}")
    for index in range(requests):
        inputs = []
        for name in ("INPUT0", "INPUT1"):
            tensor = httpclient.InferInput(name, [rows, ADD_SUB_WIDTH], "FP32")
            tensor.set_data_from_numpy(rng.normal(size=(rows, ADD_SUB_WIDTH)).astype(np.float32))
            inputs.append(tensor)
        for _ in range(2 if repeat_first and index == 0 else 1):
            client.infer("watched", inputs, headers=auth())
    client.close()
