"""Real object-store servers for the repository tests, on free loopback ports: Google
Cloud Storage's JSON API (gcp-storage-emulator, in this process) and Azure Blob Storage
(Azurite, Microsoft's emulator, which `make install` puts under .venv/azurite).

    with GcsEmulator() as gcs:          # gcs.env: STORAGE_EMULATOR_HOST for the server
        gcs.bucket.blob("repo/m/1/model.onnx").upload_from_filename(...)
    with Azurite(tmp_path) as azure:    # azure.env: AZURE_STORAGE_CONNECTION_STRING
        azure.container.upload_blob("repo/m/1/model.onnx", data)
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from tests.utils import HOST, free_ports

_ROOT = Path(__file__).resolve().parent.parent
AZURITE = _ROOT / ".venv" / "azurite" / "node_modules" / ".bin" / "azurite-blob"
# Azurite's documented development account and key (public, the emulator's only one).
AZURE_ACCOUNT = "devstoreaccount1"
AZURE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
BUCKET = "models"


def _wait_for_port(port: int, process: subprocess.Popen[bytes] | None, log: Path | None) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise AssertionError("the store exited:\n" + (log.read_text() if log else ""))
        try:
            socket.create_connection((HOST, port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"nothing listens on {HOST}:{port} after 30 s")


class GcsEmulator:
    """gcp-storage-emulator's server in memory, with an empty bucket ``models``."""

    def __init__(self) -> None:
        from gcp_storage_emulator.server import create_server

        self.port = free_ports(1)[0]
        self._server = create_server(HOST, self.port, in_memory=True, default_bucket=BUCKET)
        self.env = {"STORAGE_EMULATOR_HOST": f"http://{HOST}:{self.port}"}

    def __enter__(self) -> GcsEmulator:
        self._server.start()
        _wait_for_port(self.port, None, None)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:  # fmt: skip
        self._server.stop()

    def client(self) -> Any:
        """A google-cloud-storage client of the emulator (its environment set for it)."""
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        return storage.Client(
            project="test", credentials=AnonymousCredentials(),
            client_options={"api_endpoint": self.env["STORAGE_EMULATOR_HOST"]},
        )  # fmt: skip

    @property
    def bucket(self) -> Any:
        return self.client().bucket(BUCKET)


class Azurite:
    """Azurite's Blob service in memory, with an empty container ``models``."""

    def __init__(self, directory: Path) -> None:
        assert AZURITE.exists(), f"{AZURITE} is missing: run `make install` (it installs it)"
        self.port = free_ports(1)[0]
        self._log = directory / "azurite.log"
        directory.mkdir(parents=True, exist_ok=True)
        self._process: subprocess.Popen[bytes] | None = None
        endpoint = f"http://{HOST}:{self.port}/{AZURE_ACCOUNT}"
        self.connection_string = (
            f"DefaultEndpointsProtocol=http;AccountName={AZURE_ACCOUNT};"
            f"AccountKey={AZURE_KEY};BlobEndpoint={endpoint};"
        )
        self.env = {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string}

    def __enter__(self) -> Azurite:
        with self._log.open("ab") as log:
            self._process = subprocess.Popen(
                [str(AZURITE), "--blobHost", HOST, "--blobPort", str(self.port),
                 "--inMemoryPersistence", "--skipApiVersionCheck", "--silent"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "NODE_NO_WARNINGS": "1"},
            )  # fmt: skip
        _wait_for_port(self.port, self._process, self._log)
        self.service().create_container(BUCKET)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:  # fmt: skip
        if self._process is not None:  # in memory: nothing to close (SIGTERM takes ~10 s)
            self._process.kill()
            self._process.wait()

    def service(self) -> Any:
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient.from_connection_string(self.connection_string)

    @property
    def container(self) -> Any:
        return self.service().get_container_client(BUCKET)
