"""Issue #13: the front door of one real ``slipstream serve --auth-file``.

Every route the router knows (``known_routes``) and every gRPC method of the front end
is tried with no key, an unknown key, a key of the wrong role and a key for another
model: a new route cannot slip through, since it enters these loops by itself (and the
server refuses to start when a route has no access rule). Then the stock clients
(tritonclient HTTP and gRPC, the openai SDK) with their own header options, the
per-key rate limit under a burst of 1,000 requests, and the access log.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import grpc
import httpx
import numpy as np
import openai
import orjson
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from slipstream.protocol.proto import inference_pb2 as pb
from slipstream.security.access import GRPC_METHODS, HTTP_ROUTES, MODEL_IN_BODY
from slipstream.security.keys import KeyLimits, KeyRing
from slipstream.server.router import known_routes
from slipstream.server.v2_grpc import SERVICE_NAME, _GrpcFrontend
from tests.models import ADD_SUB_WIDTH, build_add_sub
from tests.utils import RemoteServer, slipstream_command

# The model the restricted key may use ("ghost" is not in the repository, so an admin
# load or unload of it changes nothing), and one it may not.
ALLOWED, FORBIDDEN = "ghost", "add_sub"
RATE_PER_S, BURST = 20.0, 50


@pytest.fixture(scope="module")
def secrets_(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("front_door")
    ring = KeyRing.load(root / "keys.json", missing_ok=True)
    made = {
        "admin": ring.create("ops", "admin")[0],
        "infer": ring.create("app", "infer")[0],
        "restricted": ring.create("tenant", "admin", models=[ALLOWED])[0],
        "limited": ring.create("metered", "infer", limits=KeyLimits(RATE_PER_S, BURST))[0],
    }
    ring.save()
    made["file"] = str(root / "keys.json")
    return made


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, secrets_: dict[str, str]
) -> Iterator[RemoteServer]:
    root = tmp_path_factory.mktemp("front_door_repo")
    build_add_sub(root / "repo")
    args = ["--auth-file", secrets_["file"], "--access-log",
            "--model-control-mode", "explicit", "--load-model", "add_sub"]  # fmt: skip
    with RemoteServer(root / "repo", args, log_dir=root) as running:
        yield running


def bearer(secret: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"} if secret else {}


def has_model(template: str) -> bool:
    return "{model}" in template or template in MODEL_IN_BODY


# The roles, restated here rather than read from security/access.py, so a wrong
# rule there fails this test: health probes and the document open, /metrics open by
# default; repository, config and statistics need admin; the rest (inference, metadata,
# the OpenAI routes) needs infer. The dashboard shows /metrics (its rule); a drift report
# is monitoring like statistics (admin); shared-memory regions carry inference (infer);
# a rollout changes which version serves, as loading does (admin).
def expected_http_need(template: str) -> str:
    if (
        "/health/" in template
        or template.endswith("/ready")
        or template in ("/openapi.json", "/health")
    ):
        return "open"
    if template == "/metrics" or template.startswith("/dashboard"):
        return "metrics"
    if "/repository/" in template or template.endswith(
        ("/config", "/stats", "/drift", "/rollout", "/logging", "/trace/setting")
    ):
        return "admin"
    return "infer"


def expected_grpc_need(method: str) -> str:
    if method in ("ServerLive", "ServerReady", "ModelReady"):
        return "open"
    if method.startswith("Repository") or method in (
        "ModelConfig",
        "ModelStatistics",
        "LogSettings",
        "TraceSetting",
    ):
        return "admin"
    return "infer"


def grpc_message(method: str) -> Any:
    return pb.ModelInferRequest if method == "ModelStreamInfer" else getattr(pb, f"{method}Request")


def model_field(method: str) -> str:
    """The request's field naming a model, from the message itself ("" when none; a
    shared-memory request's ``name`` is a region's)."""
    if "SharedMemory" in method:
        return ""
    fields = grpc_message(method).DESCRIPTOR.fields_by_name
    return next((name for name in ("model_name", "name") if name in fields), "")


def cases(secrets_: dict[str, str], need: str, model_route: bool) -> list[tuple[str, Any, str]]:
    """(case, key, expected) where expected is 401, 403 or "through" (not refused)."""
    unkeyed = "through" if need in ("open", "metrics") else 401
    return [
        ("no key", None, unkeyed),
        ("unknown key", "ss-not-a-key-of-this-server", unkeyed),
        ("wrong role", secrets_["infer"], 403 if need == "admin" else "through"),
        ("wrong model", secrets_["restricted"],
         403 if model_route and need not in ("open", "metrics") else "through"),
        ("right key", secrets_["restricted"], "through"),
    ]  # fmt: skip


def test_every_route_has_an_access_rule() -> None:
    templates = {template for _, template in known_routes()}
    assert templates == set(HTTP_ROUTES), "a route without a rule in security/access.py"
    for template in templates:
        assert HTTP_ROUTES[template] == expected_http_need(template), template
    methods = set(_GrpcFrontend(cast(Any, None)).method_handlers())
    assert methods == set(GRPC_METHODS), "a gRPC method without a rule in security/access.py"
    for method in methods:
        assert GRPC_METHODS[method] == (expected_grpc_need(method), model_field(method)), method


def test_every_http_route_refuses_missing_unknown_wrong_role_and_wrong_model_keys(
    server: RemoteServer, secrets_: dict[str, str]
) -> None:
    checked = 0
    with httpx.Client(base_url=server.http_url, timeout=30) as client:
        for method, template in known_routes():
            need = expected_http_need(template)
            for case, secret, expected in cases(secrets_, need, has_model(template)):
                model = FORBIDDEN if case == "wrong model" else ALLOWED
                path = template.replace("{model}", model).replace("{version}", "1")
                body = orjson.dumps({"model": model}) if method == "POST" else None
                reply = client.request(method, path, content=body, headers=bearer(secret))
                where = f"{case}: {method} {path} -> {reply.status_code} {reply.text[:200]}"
                if expected == "through":
                    assert reply.status_code not in (401, 403), where
                    continue
                assert reply.status_code == expected, where
                error = reply.json()["error"]
                if path.startswith("/v1/") and not path.endswith(":predict"):  # OpenAI's
                    code = "invalid_api_key" if expected == 401 else "permission_denied"
                    assert error["code"] == code and error["message"], where
                else:
                    assert isinstance(error, str) and error, where
                checked += 1
    assert checked >= 60  # 25 routes; most refuse three or four of the cases


def grpc_call(
    channel: grpc.Channel, method: str, model: str, secret: str | None
) -> grpc.StatusCode:
    """Call ``method`` naming ``model`` with the key; the status code it ends with."""
    field = GRPC_METHODS[method][1]
    message_type = (
        pb.ModelInferRequest if method == "ModelStreamInfer" else getattr(pb, f"{method}Request")
    )
    message = message_type(**({field: model} if field else {}))
    metadata = [("authorization", f"Bearer {secret}")] if secret else []
    path = f"/{SERVICE_NAME}/{method}"
    try:
        if method == "ModelStreamInfer":
            stream = channel.stream_stream(path)
            for _ in stream(iter([message.SerializeToString()]), metadata=metadata, timeout=30):
                pass
        else:
            channel.unary_unary(path)(message.SerializeToString(), metadata=metadata, timeout=30)
    except grpc.RpcError as exc:
        return cast(grpc.StatusCode, exc.code())
    return grpc.StatusCode.OK


def test_every_grpc_method_refuses_missing_unknown_wrong_role_and_wrong_model_keys(
    server: RemoteServer, secrets_: dict[str, str]
) -> None:
    refusal = {401: grpc.StatusCode.UNAUTHENTICATED, 403: grpc.StatusCode.PERMISSION_DENIED}
    with grpc.insecure_channel(server.grpc_address) as channel:
        for method in _GrpcFrontend(cast(Any, None)).method_handlers():
            need = expected_grpc_need(method)
            for case, secret, expected in cases(secrets_, need, bool(model_field(method))):
                model = FORBIDDEN if case == "wrong model" else ALLOWED
                code = grpc_call(channel, method, model, secret)
                where = f"{case}: {method} -> {code}"
                if expected == "through":
                    assert code not in refusal.values(), where
                else:
                    assert code == refusal[cast(int, expected)], where


def add_sub_infer(client: Any, module: Any, **kwargs: Any) -> Any:
    data = np.ones((1, ADD_SUB_WIDTH), np.float32)
    inputs = [module.InferInput(name, [1, ADD_SUB_WIDTH], "FP32") for name in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(data)
    return client.infer("add_sub", inputs, **kwargs)


def test_stock_clients_send_their_keys(server: RemoteServer, secrets_: dict[str, str]) -> None:
    for module, address in ((httpclient, server.http_address), (grpcclient, server.grpc_address)):
        client = module.InferenceServerClient(address)
        result = add_sub_infer(
            client, module, headers={"authorization": f"Bearer {secrets_['infer']}"}
        )
        assert np.all(result.as_numpy("OUTPUT0") == 2)
        with pytest.raises(InferenceServerException, match="API key"):
            add_sub_infer(client, module, headers={"authorization": "Bearer ss-wrong"})
        client.close()
    sdk = server.openai(secrets_["infer"])
    assert sdk.models.list().data == []  # no generative model here; the key is accepted
    wrong = server.openai("ss-wrong")
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_a_burst_of_1000_requests_admits_the_burst_plus_the_rate(
    server: RemoteServer, secrets_: dict[str, str]
) -> None:
    def burst() -> tuple[list[httpx.Response], float]:
        # 32 connections and as many threads. (An AsyncClient given all 1,000 at once
        # spent ~9 ms of CPU a request in its pool, which scans the queued requests at
        # every step: ~10 s of client for a burst the server answers in 0.4 s of CPU.)
        headers = bearer(secrets_["limited"])
        limits = httpx.Limits(max_connections=32)
        with (
            httpx.Client(base_url=server.http_url, limits=limits, timeout=60) as client,
            ThreadPoolExecutor(32) as pool,
        ):
            started = time.monotonic()
            replies = list(pool.map(lambda _: client.get("/v2/models/add_sub", headers=headers),
                                    range(1000)))  # fmt: skip
            return replies, time.monotonic() - started

    replies, elapsed_s = burst()
    statuses = [reply.status_code for reply in replies]
    admitted = statuses.count(200)
    assert statuses.count(429) == 1000 - admitted
    # GCRA: the burst at once, then one every 1/rate s (+1 for the edges of the window).
    assert BURST <= admitted <= BURST + RATE_PER_S * elapsed_s + 1, (admitted, elapsed_s)
    refused = next(reply for reply in replies if reply.status_code == 429)
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.headers["ratelimit-policy"] == f'"requests";q={BURST};w=3'
    assert re.fullmatch(r'"requests";r=0;t=\d+', refused.headers["ratelimit"])
    assert "metered" in refused.json()["error"]

    # gRPC: RESOURCE_EXHAUSTED with the same facts in the trailing metadata.
    with grpc.insecure_channel(server.grpc_address) as channel:
        call = channel.unary_unary(f"/{SERVICE_NAME}/ServerMetadata")
        for _ in range(BURST + 5):
            try:
                call(pb.ServerMetadataRequest().SerializeToString(),
                     metadata=[("authorization", secrets_["limited"])], timeout=30)  # fmt: skip
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                trailers = dict(exc.trailing_metadata())
                assert int(trailers["retry-after"]) >= 1
                assert trailers["ratelimit-policy"].startswith('"requests";q=50')
                break
        else:
            pytest.fail("gRPC was never refused past the burst")
    metrics = httpx.get(server.url("/metrics")).text  # open by default
    assert re.search(
        r'slipstream_rate_limited_total\{key="metered",limit="requests"\} \d+', metrics
    )
    assert secrets_["limited"] not in metrics


def test_the_access_log_has_one_json_line_per_request_and_echoes_request_ids(
    server: RemoteServer, secrets_: dict[str, str]
) -> None:
    headers = {**bearer(secrets_["infer"]), "X-Request-Id": "trace-42"}
    reply = httpx.get(server.url("/v2/models/add_sub"), headers=headers)
    assert reply.status_code == 200 and reply.headers["x-request-id"] == "trace-42"
    generated = httpx.get(server.url("/v2/models/add_sub")).headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", generated)
    with grpc.insecure_channel(server.grpc_address) as channel:
        _, call = channel.unary_unary(f"/{SERVICE_NAME}/ModelMetadata").with_call(
            pb.ModelMetadataRequest(name="add_sub").SerializeToString(),
            metadata=[("authorization", secrets_["infer"]), ("x-request-id", "grpc-7")],
        )
        assert dict(call.trailing_metadata())["x-request-id"] == "grpc-7"
        # Refused for the key's role: the line still names the key.
        with pytest.raises(grpc.RpcError) as refused_grpc:
            channel.unary_unary(f"/{SERVICE_NAME}/RepositoryIndex")(
                pb.RepositoryIndexRequest().SerializeToString(),
                metadata=[("authorization", secrets_["infer"]), ("x-request-id", "grpc-403")],
            )
        assert refused_grpc.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # Refused for the key's role and for the model: the lines still name the key.
    wrong_role = httpx.post(
        server.url("/v2/repository/index"),
        headers={**bearer(secrets_["infer"]), "X-Request-Id": "role-403"},
    )
    wrong_model = httpx.get(
        server.url(f"/v2/models/{FORBIDDEN}"),
        headers={**bearer(secrets_["restricted"]), "X-Request-Id": "model-403"},
    )
    assert (wrong_role.status_code, wrong_model.status_code) == (403, 403)
    rids = ("trace-42", generated, "grpc-7", "grpc-403", "role-403", "model-403")
    deadline = time.monotonic() + 10
    while any(f'"{rid}"' not in server.log_text() for rid in rids):
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.1)
    lines = {}
    for line in server.log_text().splitlines():
        if line.startswith('{"time"'):
            record = orjson.loads(line)
            lines[record["request_id"]] = record
    ok, refused = lines["trace-42"], lines[generated]
    assert ok["key"] == "app" and ok["model"] == "add_sub" and ok["status"] == "200"
    assert ok["protocol"] == "http" and ok["bytes_out"] == len(reply.content)
    assert ok["latency_ms"] >= 0 and ok["time"].endswith("Z")
    assert refused["status"] == "401" and refused["key"] == "-"
    over_grpc = lines["grpc-7"]
    assert over_grpc["protocol"] == "grpc" and over_grpc["method"] == "ModelMetadata"
    assert over_grpc["key"] == "app" and over_grpc["model"] == "add_sub"
    assert over_grpc["status"] == "OK"
    for rid, name, status in (("role-403", "app", "403"), ("model-403", "tenant", "403"),
                              ("grpc-403", "app", "PERMISSION_DENIED")):  # fmt: skip
        assert (lines[rid]["key"], lines[rid]["status"]) == (name, status), lines[rid]
    log = server.log_text()
    assert not any(secret in log for name, secret in secrets_.items() if name != "file")


def test_keys_created_and_revoked_on_disk_take_effect_without_a_restart(
    server: RemoteServer, secrets_: dict[str, str]
) -> None:
    cli = [*slipstream_command(), "keys"]
    made = subprocess.run(
        [*cli, "create", "--auth-file", secrets_["file"], "--name", "late", "--role", "infer"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    late = made.stdout.strip()
    url = server.url("/v2/models/add_sub")

    def status_within(expected: int, secret: str) -> None:
        deadline = time.monotonic() + 10
        while (status := httpx.get(url, headers=bearer(secret)).status_code) != expected:
            assert time.monotonic() < deadline, f"{status} != {expected}: {server.log_tail()}"
            time.sleep(0.1)

    status_within(200, late)
    # Remembered after its first check, a revoked key must still be refused.
    subprocess.run([*cli, "revoke", "--auth-file", secrets_["file"], "--name", "late"],
                   check=True, capture_output=True)  # fmt: skip
    status_within(401, late)
    assert httpx.get(url, headers=bearer(secrets_["infer"])).status_code == 200
    # A keys file broken by hand keeps the keys in use, and says so in the log.
    keys_file = Path(secrets_["file"])
    good = keys_file.read_bytes()
    try:
        keys_file.write_bytes(b"{not json")
        deadline = time.monotonic() + 10
        while "cannot be used" not in server.log_text():
            assert time.monotonic() < deadline, server.log_tail()
            time.sleep(0.1)
        assert httpx.get(url, headers=bearer(secrets_["infer"])).status_code == 200
    finally:
        keys_file.write_bytes(good)


def doubled_slashes(path: str) -> list[str]:
    """``path`` with an empty segment at its start, its end and (when it has two) its
    middle: the routes drop these, so the door must not let them past a route's rule."""
    variants = ["/" + path, path + "//"]
    second = path.find("/", 1)
    if second > 0:
        variants.append(path[:second] + "/" + path[second:])
    return variants


def test_an_extra_slash_gets_no_key_past_its_role_or_model_list(
    server: RemoteServer, secrets_: dict[str, str]
) -> None:
    """Audit defect 1: ``//v2/models/X/infer`` or ``/v1/chat/completions//`` reached the
    route while the key check, matching no rule, asked only for a valid key."""
    keys = (None, secrets_["infer"], secrets_["restricted"], secrets_["admin"])
    checked = 0
    with httpx.Client(base_url=server.http_url, timeout=30) as client:
        for method, template in known_routes():
            for model in (ALLOWED, FORBIDDEN):
                path = template.replace("{model}", model).replace("{version}", "1")
                body = orjson.dumps({"model": model}) if method == "POST" else None
                for variant in doubled_slashes(path):
                    for secret in keys:
                        # The whole URL: httpx reads a relative "//v1/rerank" as the host
                        # "v1" and sends the path "/rerank".
                        reply = client.request(method, server.http_url + variant, content=body,
                                               headers=bearer(secret))  # fmt: skip
                        where = f"{method} {variant} -> {reply.status_code} {reply.text[:200]}"
                        assert reply.status_code == 404, where
                        checked += 1
        # The one optional trailing '/' of a rule is still served (under its rule).
        one = client.get("/v2/models/add_sub/", headers=bearer(secrets_["infer"]))
        assert one.status_code == 200, one.text
        wrong = client.get(f"/v2/models/{FORBIDDEN}/", headers=bearer(secrets_["restricted"]))
        assert wrong.status_code == 403, wrong.text
        # What the audit did with an infer key: unload a model in explicit mode.
        for path in (f"//v2/repository/models/{FORBIDDEN}/unload",
                     f"/v2/repository/models/{FORBIDDEN}/unload//"):  # fmt: skip
            reply = client.post(path, headers=bearer(secrets_["infer"]))
            assert reply.status_code == 404, reply.text
        assert client.get(f"/v2/models/{FORBIDDEN}/ready").status_code == 200
    assert checked > 500


def binary_body(model: str) -> tuple[bytes, dict[str, str]]:
    """A V2 request with its tensors in binary after the JSON part (tritonclient's form)."""
    data = np.ones((1, ADD_SUB_WIDTH), np.float32).tobytes()
    inputs = [{"name": name, "shape": [1, ADD_SUB_WIDTH], "datatype": "FP32",
               "parameters": {"binary_data_size": len(data)}}
              for name in ("INPUT0", "INPUT1")]  # fmt: skip
    head = orjson.dumps({"model": model, "inputs": inputs})
    return head + data + data, {"Inference-Header-Content-Length": str(len(head))}


def test_a_binary_body_names_its_model_to_the_key_check(
    server: RemoteServer, secrets_: dict[str, str]
) -> None:
    """Audit defect 2: POST /v2/jobs with binary tensors read as JSON whole found no
    model, and a key limited to some models was not checked at all."""
    restricted = bearer(secrets_["restricted"])
    with httpx.Client(base_url=server.http_url, timeout=30) as client:
        body, headers = binary_body(FORBIDDEN)
        refused = client.post("/v2/jobs", content=body, headers={**restricted, **headers})
        assert refused.status_code == 403, refused.text
        assert f"may not use model {FORBIDDEN!r}" in refused.json()["error"]
        body, headers = binary_body(ALLOWED)
        allowed = client.post("/v2/jobs", content=body, headers={**restricted, **headers})
        assert allowed.status_code not in (401, 403), allowed.text  # no job queue here: 404
        # A body whose model cannot be read is refused to a key with a model list.
        unread = client.post("/v2/jobs", content=b"\x00garbage", headers=restricted)
        assert unread.status_code == 403 and "names none" in unread.json()["error"]
        nameless = client.post("/v1/embeddings", json={"input": "x"}, headers=restricted)
        assert nameless.status_code == 403, nameless.text
        # An unrestricted key is not refused for that: the route answers its own 400.
        plain = client.post("/v2/jobs", content=b"\x00garbage", headers=bearer(secrets_["admin"]))
        assert plain.status_code not in (401, 403), plain.text
    # The infer route takes its model from the path, binary body or not.
    module_client = httpclient.InferenceServerClient(server.http_address)
    with pytest.raises(InferenceServerException, match="may not use model"):
        add_sub_infer(module_client, httpclient, headers=restricted)
    result = add_sub_infer(module_client, httpclient, headers=bearer(secrets_["infer"]))
    assert np.all(result.as_numpy("OUTPUT0") == 2)
    module_client.close()


def test_a_key_with_a_model_list_sees_only_its_models_in_every_listing(
    server: RemoteServer, secrets_: dict[str, str]
) -> None:
    """Audit defect 4: the gRPC repository index and every model's statistics (HTTP and
    gRPC) listed models the key may not use."""
    restricted, admin = secrets_["restricted"], secrets_["admin"]
    for secret, expected in ((restricted, set()), (admin, {FORBIDDEN})):
        stats = httpx.get(server.url("/v2/models/stats"), headers=bearer(secret)).json()
        assert {entry["name"] for entry in stats["model_stats"]} == expected
        index = httpx.post(server.url("/v2/repository/index"), headers=bearer(secret)).json()
        assert {entry["name"] for entry in index} == expected
        client = grpcclient.InferenceServerClient(server.grpc_address)
        metadata = {"authorization": f"Bearer {secret}"}
        listed = client.get_model_repository_index(headers=metadata).models
        assert {entry.name for entry in listed} == expected
        every = client.get_inference_statistics("", headers=metadata).model_stats
        assert {entry.name for entry in every} == expected
        client.close()
