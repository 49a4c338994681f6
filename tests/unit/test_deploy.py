"""Issue #17, part 2: every manifest under deploy/ is valid offline, and agrees with the
code it runs (routes, CLI options, the job stream's names, the image's user and ports).

Kubernetes' own kinds are validated by ``kubernetes-validate`` against the JSON schemas
of Kubernetes ``K8S_VERSION`` it ships (strict: an unknown field fails). The custom
resources (ServiceMonitor, KEDA ScaledObject, KServe ClusterServingRuntime and
InferenceService) have no schema here: their required fields and references are checked
structurally, field by field, below. ``kubectl apply --dry-run=client`` needs an API
server for discovery, so it is not used.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from slipstream.cli import main as cli
from slipstream.jobs.queue import GROUP, STREAM
from slipstream.server.router import known_routes

kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.33.0"
BUILT_IN = {"v1", "apps/v1", "autoscaling/v2"}


def documents() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted(DEPLOY.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") != "Kustomization":
                found.append((path.relative_to(DEPLOY).as_posix(), doc))
    return found


DOCS = documents()


def named(kind: str, name: str) -> dict[str, Any]:
    return next(d for _, d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name)


def test_every_kind_is_known_and_every_file_is_in_a_test() -> None:
    kinds = {(doc["apiVersion"], doc["kind"]) for _, doc in DOCS}
    assert kinds == {
        ("v1", "PersistentVolumeClaim"), ("apps/v1", "Deployment"), ("v1", "Service"),
        ("autoscaling/v2", "HorizontalPodAutoscaler"),
        ("monitoring.coreos.com/v1", "ServiceMonitor"), ("keda.sh/v1alpha1", "ScaledObject"),
        ("serving.kserve.io/v1alpha1", "ClusterServingRuntime"),
        ("serving.kserve.io/v1beta1", "InferenceService"),
    }  # fmt: skip


@pytest.mark.parametrize(
    ("where", "doc"),
    [(w, d) for w, d in DOCS if d["apiVersion"] in BUILT_IN],
    ids=[f"{w}:{d['kind']}" for w, d in DOCS if d["apiVersion"] in BUILT_IN],
)
def test_built_in_kinds_validate_against_the_kubernetes_schema(where: str, doc: Any) -> None:
    assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True) == "1.33"


def test_the_validator_catches_a_wrong_manifest() -> None:
    deployment = named("Deployment", "slipstream")
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "http"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def containers() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for where, doc in DOCS:
        spec = doc.get("spec", {})
        pods = [spec.get("template", {}).get("spec", {}), spec]
        for pod in pods:
            found += [(where, c) for c in pod.get("containers", [])]
    return found


@pytest.mark.parametrize(("where", "container"), containers(), ids=lambda v: str(v)[:40])
def test_every_container_runs_a_real_command_line(where: str, container: Any) -> None:
    args = [re.sub(r"\$\((\w+)\)", "redis://redis:6379", arg) for arg in container["args"]]
    command = cli.commands[args[0]]
    # Parsing checks every option exists and takes its value's type; the path options
    # are checked for existence only when a command runs.
    with click.Context(command) as ctx:
        command.parse_args(ctx, list(args[1:]))
    assert container["image"].startswith("slipstream:")
    with pytest.raises(click.NoSuchOption), click.Context(command) as ctx:
        command.parse_args(ctx, [*args[1:], "--no-such-option"])


def test_probes_ask_health_routes_the_server_has() -> None:
    routes = {template for method, template in known_routes() if method == "GET"}
    server = named("Deployment", "slipstream")["spec"]["template"]["spec"]
    probes = [server["containers"][0][p]["httpGet"]["path"]
              for p in ("startupProbe", "livenessProbe", "readinessProbe")]  # fmt: skip
    assert probes == ["/v2/health/live", "/v2/health/live", "/v2/health/ready"]
    assert set(probes) <= routes


def test_a_pod_is_given_time_to_drain_before_it_is_killed() -> None:
    for name in ("slipstream", "slipstream-worker"):
        pod = named("Deployment", name)["spec"]["template"]["spec"]
        args = pod["containers"][0]["args"]
        drain_s = float(args[args.index("--shutdown-timeout-s") + 1])
        pre_stop = pod["containers"][0].get("lifecycle", {}).get("preStop", {})
        wait_s = float(pre_stop["exec"]["command"][1]) if pre_stop else 0.0
        assert pod["terminationGracePeriodSeconds"] >= drain_s + wait_s + 5, name
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["containers"][0]["resources"]["requests"]["cpu"]


def test_service_monitor_and_autoscalers_point_at_what_exists() -> None:
    server = named("Deployment", "slipstream")
    labels = server["spec"]["template"]["metadata"]["labels"]
    service = named("Service", "slipstream")
    assert service["spec"]["selector"] == labels
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    container = server["spec"]["template"]["spec"]["containers"][0]
    container_ports = {p["name"] for p in container["ports"]}
    assert {p["targetPort"] for p in ports.values()} <= container_ports
    monitor = named("ServiceMonitor", "slipstream")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert [(e["port"], e["path"]) for e in monitor["spec"]["endpoints"]] == [("http", "/metrics")]
    hpa = named("HorizontalPodAutoscaler", "slipstream")["spec"]
    assert hpa["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "slipstream",
    }
    assert hpa["metrics"][0]["resource"]["name"] == "cpu"


def test_keda_scales_the_workers_on_the_job_stream_slipstream_writes() -> None:
    scaled = named("ScaledObject", "slipstream-worker")["spec"]
    assert named("Deployment", scaled["scaleTargetRef"]["name"])
    trigger = scaled["triggers"][0]
    assert trigger["type"] == "redis-streams"
    assert trigger["metadata"]["stream"] == STREAM
    assert trigger["metadata"]["consumerGroup"] == GROUP
    assert all(isinstance(v, str) for v in trigger["metadata"].values())  # KEDA: strings
    inflight = named("ScaledObject", "slipstream")["spec"]
    assert inflight["triggers"][0]["type"] == "prometheus"
    assert "slipstream_pending_requests" in inflight["triggers"][0]["metadata"]["query"]


def test_kserve_runtime_serves_v2_on_port_8080_and_the_service_uses_it_with_a_canary() -> None:
    runtime = named("ClusterServingRuntime", "slipstream")["spec"]
    container = runtime["containers"][0]
    assert container["name"] == "kserve-container"
    args = container["args"]
    assert args[args.index("--model-repository") + 1] == "/mnt/models"
    assert args[args.index("--http-port") + 1] == "8080"
    assert [p["containerPort"] for p in container["ports"]] == [8080]
    assert "v2" in runtime["protocolVersions"]
    formats = {f["name"] for f in runtime["supportedModelFormats"]}
    service = named("InferenceService", "mlp")["spec"]["predictor"]
    assert service["model"]["runtime"] == "slipstream"
    assert service["model"]["modelFormat"]["name"] in formats
    assert service["model"]["protocolVersion"] == "v2"
    assert 0 < service["canaryTrafficPercent"] < 100
    assert service["model"]["storageUri"]


def test_the_image_runs_as_a_non_root_user_on_python_slim_and_exposes_the_ports() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    bases = re.findall(r"^FROM (\S+)", text, re.M)
    assert bases and all(b.startswith("python:") and b.endswith("-slim") for b in bases)
    user = re.findall(r"^USER (\S+)", text, re.M)[-1]
    assert user.split(":")[0] not in ("0", "root")
    assert re.search(r"^EXPOSE 8000 8001$", text, re.M)


def test_kustomize_renders_the_directory_offline() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    rendered = subprocess.run([kubectl, "kustomize", str(DEPLOY / "kubernetes")],
                              capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    kinds = [d["kind"] for d in yaml.safe_load_all(rendered.stdout)]
    assert sorted(kinds) == sorted(["PersistentVolumeClaim", "Deployment", "Deployment",
        "Service", "HorizontalPodAutoscaler", "ServiceMonitor", "ScaledObject"])  # fmt: skip


def test_scale_to_zero_manifests_wake_on_traffic_and_are_ready_at_once() -> None:
    """KServe's serverless InferenceService and KEDA's worker ScaledObject both go to zero
    replicas, and what wakes them is what Slipstream serves: requests (Knative's
    concurrency) and unread jobs of the stream the server writes; the pods' readiness is
    asked every second, so a woken pod serves as soon as it is ready."""
    serverless = named("InferenceService", "mlp-serverless")
    annotations = serverless["metadata"]["annotations"]
    assert annotations["serving.kserve.io/deploymentMode"] == "Serverless"
    predictor = serverless["spec"]["predictor"]
    assert predictor["minReplicas"] == 0 < predictor["maxReplicas"]
    assert predictor["scaleMetric"] == "concurrency" and predictor["scaleTarget"] > 0
    assert predictor["model"]["runtime"] == "slipstream"
    runtime = named("ClusterServingRuntime", "slipstream")["spec"]["containers"][0]
    assert runtime["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert runtime["readinessProbe"]["periodSeconds"] == 1
    server = named("Deployment", "slipstream")["spec"]["template"]["spec"]["containers"][0]
    assert server["readinessProbe"]["periodSeconds"] == 1
    from_zero = named("ScaledObject", "slipstream-worker-from-zero")["spec"]
    assert from_zero["minReplicaCount"] == 0 and from_zero["cooldownPeriod"] >= 60
    assert named("Deployment", from_zero["scaleTargetRef"]["name"])
    trigger = from_zero["triggers"][0]["metadata"]
    assert (trigger["stream"], trigger["consumerGroup"]) == (STREAM, GROUP)
    assert int(trigger["lagCount"]) > 0 and trigger["activationLagCount"] == "0"
    for each in from_zero["triggers"]:
        assert each["type"] == "redis-streams" and each["metadata"]["stream"] == STREAM
        assert all(isinstance(v, str) for v in each["metadata"].values())  # KEDA: strings


def keda_redis_streams_counts(metadata: dict[str, str]) -> str:
    """What KEDA's redis-streams trigger counts, by its own rule (``Validate`` in
    kedacore/keda pkg/scalers/redis_streams_scaler.go): with a consumerGroup, the group's
    lag (XINFO GROUPS) when lagCount is set, else its pending entries (XPENDING); without
    one, the stream's length (XLEN). The trigger is active above activationLagCount."""
    if "consumerGroup" not in metadata:
        return "length"
    return "lag" if int(metadata.get("lagCount", "0")) else "pending"


def test_scale_to_zero_keeps_a_worker_while_any_job_is_unfinished() -> None:
    """The lag counts only jobs no worker has read; a worker reads 128 at once, so jobs
    held by a killed worker (or by the last one when it is scaled in) are pending at lag
    0. Some trigger must count them, or no worker ever starts to take them over."""
    from_zero = named("ScaledObject", "slipstream-worker-from-zero")["spec"]
    counted = set()
    for trigger in from_zero["triggers"]:
        metadata = trigger["metadata"]
        assert metadata.get("consumerGroup", GROUP) == GROUP
        assert metadata.get("activationLagCount", "0") == "0"  # active at 1 job
        counted.add(keda_redis_streams_counts(metadata))
    # Workers delete an entry when its job ends: its length is every unfinished job.
    assert "length" in counted or {"lag", "pending"} <= counted, counted
