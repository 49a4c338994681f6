"""Issue #13: TLS on HTTP and gRPC (``--tls-cert/--tls-key``) with client certificates
(``--tls-client-ca``), through the stock clients: tritonclient HTTP and gRPC, and the
openai SDK. The certificates are made here with the ``openssl`` command line.
"""

from __future__ import annotations

import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.models import ADD_SUB_WIDTH, build_add_sub
from tests.utils import HOST, RemoteServer, free_ports, slipstream_command


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ca.pem, server.pem/.key (for 127.0.0.1), client.pem/.key, both signed by the CA."""
    root = tmp_path_factory.mktemp("tls")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=root)  # fmt: skip
    for name, extension in (("server", f"subjectAltName=IP:{HOST}"), ("client", "")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=root)  # fmt: skip
        (root / f"{name}.ext").write_text(extension + "\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "2", "-out", f"{name}.pem",
                 "-extfile", f"{name}.ext", cwd=root)  # fmt: skip
    return root


def client_context(certs: Path, with_certificate: bool = True) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=certs / "ca.pem")
    if with_certificate:
        context.load_cert_chain(certs / "client.pem", certs / "client.key")
    return context


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, certs: Path) -> Iterator[RemoteServer]:
    root = tmp_path_factory.mktemp("tls_repo")
    build_add_sub(root / "repo")
    args = ["--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key"),
            "--tls-client-ca", str(certs / "ca.pem")]  # fmt: skip
    with RemoteServer(root / "repo", args, log_dir=root, wait_for=None) as running:
        url = f"https://{running.http_address}/v2/health/ready"
        deadline = time.monotonic() + 90
        with httpx.Client(verify=client_context(certs), timeout=2) as client:
            while True:
                try:
                    if client.get(url).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, running.log_tail()
                time.sleep(0.1)
        yield running


def add_sub(client: object, module: object) -> np.ndarray:
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = module.InferInput(name, [1, ADD_SUB_WIDTH], "FP32")  # type: ignore[attr-defined]
        tensor.set_data_from_numpy(np.ones((1, ADD_SUB_WIDTH), np.float32))
        inputs.append(tensor)
    return np.asarray(client.infer("add_sub", inputs).as_numpy("OUTPUT0"))  # type: ignore[attr-defined]


def test_stock_clients_over_mutual_tls(server: RemoteServer, certs: Path) -> None:
    http = httpclient.InferenceServerClient(
        server.http_address, ssl=True,
        ssl_options={"ca_certs": str(certs / "ca.pem"), "certfile": str(certs / "client.pem"),
                     "keyfile": str(certs / "client.key")},
    )  # fmt: skip
    assert np.all(add_sub(http, httpclient) == 2)
    http.close()
    grpc = grpcclient.InferenceServerClient(
        server.grpc_address, ssl=True, root_certificates=str(certs / "ca.pem"),
        private_key=str(certs / "client.key"), certificate_chain=str(certs / "client.pem"),
    )  # fmt: skip
    assert np.all(add_sub(grpc, grpcclient) == 2)
    grpc.close()
    with httpx.Client(verify=client_context(certs)) as transport:
        sdk = openai.OpenAI(base_url=f"https://{server.http_address}/v1", api_key="unused",
                            http_client=transport, max_retries=0)  # fmt: skip
        assert sdk.models.list().data == []


def test_plain_http_and_clients_without_a_certificate_are_refused(
    server: RemoteServer, certs: Path
) -> None:
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://{server.http_address}/v2/health/ready", timeout=5)
    with pytest.raises(httpx.TransportError):
        httpx.get(f"https://{server.http_address}/v2/health/ready", timeout=5,
                  verify=client_context(certs, with_certificate=False))  # fmt: skip
    grpc = grpcclient.InferenceServerClient(server.grpc_address)  # plaintext
    with pytest.raises(InferenceServerException, match=r"(?i)unavailable"):
        grpc.is_server_live()
    grpc.close()
    assert "Traceback" not in server.log_text()


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        # The client's key beside the server's certificate: OpenSSL says "key values
        # mismatch", naming neither file.
        (("--tls-cert", "server.pem", "--tls-key", "client.key"), ("server.pem", "client.key")),
        (("--tls-client-ca", "server.csr"), ("server.csr",)),
    ],
)
def test_files_that_do_not_load_stop_the_server_naming_them(
    certs: Path, tmp_path: Path, flags: tuple[str, ...], named: tuple[str, ...]
) -> None:
    build_add_sub(tmp_path / "repo")
    args = {"--tls-cert": "server.pem", "--tls-key": "server.key"}
    args.update(zip(flags[::2], flags[1::2], strict=True))
    http_port, grpc_port = free_ports(2)
    command = [*slipstream_command(), "serve", "--model-repository", str(tmp_path / "repo"),
               "--http-port", str(http_port), "--grpc-port", str(grpc_port)]  # fmt: skip
    for flag, name in args.items():
        command += [flag, str(certs / name)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0
    for name in named:
        assert str(certs / name) in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
