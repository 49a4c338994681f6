"""The object stores a model repository can live in, as Triton names them: S3 (and
S3-compatible stores: MinIO, Ceph, R2, ...), Google Cloud Storage and Azure Blob Storage.

Each store lists the objects under the repository's prefix (key, a tag that changes
when the object does, size) and fetches one to a file; :mod:`.remote` keeps the local
copy. Each client library is an extra, imported only when its scheme is served:

- ``s3://bucket/path``, ``s3://host:port/bucket/path`` (plain HTTP), or
  ``s3://https://host:port/bucket/path``: boto3 (``slipstream[s3]``), its credentials and
  region (``AWS_ACCESS_KEY_ID``..., ``AWS_PROFILE``, a role; ``AWS_ENDPOINT_URL``).
- ``gs://bucket/path``: google-cloud-storage (``slipstream[gcs]``), Application Default
  Credentials (``GOOGLE_APPLICATION_CREDENTIALS``, a workload identity), or none for a
  public bucket; ``STORAGE_EMULATOR_HOST`` for an emulator.
- ``as://account/container/path``: azure-storage-blob (``slipstream[azure]``), with
  ``AZURE_STORAGE_KEY`` (Triton's variable; ``AZURE_STORAGE_ACCOUNT`` may name the
  account too), or ``AZURE_STORAGE_CONNECTION_STRING`` (which may name another endpoint:
  Azurite, a sovereign cloud), or no credentials for a public container.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger(__name__)

SCHEMES = ("s3://", "gs://", "as://")


class RepositoryError(Exception):
    """The remote repository cannot be read (bad URL, bucket, credentials, endpoint)."""


class Store(Protocol):
    """A repository in an object store: what :class:`.remote.RepositoryMirror` copies."""

    # The key prefix of the repository's root: "" or "path/to/repo/".
    prefix: str

    def __str__(self) -> str:
        """The repository's URL, for messages."""
        ...

    def list(self) -> list[tuple[str, str, int]]:
        """(key, tag, size) of every object under :attr:`prefix`; the tag changes when
        the object does. RepositoryError when the store cannot be listed."""
        ...

    def fetch(self, key: str, target: Path) -> None:
        """Write object ``key`` to the file ``target`` (the caller moves it into place);
        the library's own error on failure."""
        ...


def open_store(url: str) -> Store:
    """The store ``url`` names; RepositoryError naming the expected form otherwise."""
    if url.startswith("gs://"):
        return GcsStore(BucketPath.parse(url, "gs://", "gs://bucket[/path]"))
    if url.startswith("as://"):
        return AzureStore(AzureLocation.parse(url))
    return S3Store(S3Location.parse(url))


def _prefix(path: str) -> str:
    stripped = path.strip("/")
    return f"{stripped}/" if stripped else ""


def _missing_extra(url: str, what: str, extra: str) -> RepositoryError:
    return RepositoryError(
        f"{url}: serving {what} needs its client: pip install 'slipstream[{extra}]'"
    )


@dataclass(frozen=True, slots=True)
class S3Location:
    """Where an S3 repository lies."""

    # The store's endpoint; None for AWS (or boto3's AWS_ENDPOINT_URL).
    endpoint_url: str | None
    bucket: str
    prefix: str

    @classmethod
    def parse(cls, url: str) -> S3Location:
        """Triton's forms of an S3 repository URL.

        >>> S3Location.parse("s3://models/prod")
        S3Location(endpoint_url=None, bucket='models', prefix='prod/')
        >>> S3Location.parse("s3://minio:9000/models")
        S3Location(endpoint_url='http://minio:9000', bucket='models', prefix='')
        >>> S3Location.parse("s3://https://minio.example:443/models/a/b/")
        S3Location(endpoint_url='https://minio.example:443', bucket='models', prefix='a/b/')
        """
        if not url.startswith("s3://"):
            raise RepositoryError(
                f"{url}: expected s3://[host:port/]bucket[/path], gs://bucket[/path] or "
                "as://account/container[/path]"
            )
        rest = url.removeprefix("s3://")
        endpoint = None
        for scheme in ("http://", "https://"):
            if rest.startswith(scheme):
                host, _, rest = rest.removeprefix(scheme).partition("/")
                endpoint = scheme + host
        if endpoint is None:
            first, _, after = rest.partition("/")
            if ":" in first:  # host:port of a store of one's own (Triton: plain HTTP)
                endpoint, rest = f"http://{first}", after
        bucket, _, path = rest.partition("/")
        if not bucket or (endpoint is not None and endpoint.endswith("//")):
            raise RepositoryError(f"{url}: no bucket; expected s3://[host:port/]bucket[/path]")
        return cls(endpoint, bucket, _prefix(path))

    def __str__(self) -> str:
        where = f"{self.endpoint_url}/" if self.endpoint_url else ""
        return f"s3://{where}{self.bucket}/{self.prefix}"


class S3Store:
    """A repository in S3 or an S3-compatible store, through boto3."""

    def __init__(self, location: S3Location, client: Any = None) -> None:
        self.location = location
        self.prefix = location.prefix
        if client is None:
            try:
                import boto3
            except ImportError:
                raise _missing_extra(str(location), "an S3 repository", "s3") from None
            client = boto3.client("s3", endpoint_url=location.endpoint_url)
        self._client = client

    def __str__(self) -> str:
        return str(self.location)

    def list(self) -> list[tuple[str, str, int]]:
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.location.bucket, Prefix=self.prefix
            )
            return [(o["Key"], str(o.get("ETag", "")), int(o["Size"]))
                    for page in pages for o in page.get("Contents", ())]  # fmt: skip
        except Exception as exc:  # botocore's errors: credentials, endpoint, bucket
            raise RepositoryError(f"{self}: cannot list the repository: {exc}") from exc

    def fetch(self, key: str, target: Path) -> None:
        self._client.download_file(self.location.bucket, key, str(target))


@dataclass(frozen=True, slots=True)
class BucketPath:
    """A bucket (or container) and the repository's prefix in it."""

    scheme: str
    bucket: str
    prefix: str

    @classmethod
    def parse(cls, url: str, scheme: str, form: str) -> BucketPath:
        """
        >>> BucketPath.parse("gs://models/prod/", "gs://", "gs://bucket[/path]")
        BucketPath(scheme='gs://', bucket='models', prefix='prod/')
        """
        bucket, _, path = url.removeprefix(scheme).partition("/")
        if not url.startswith(scheme) or not bucket:
            raise RepositoryError(f"{url}: no bucket; expected {form}")
        return cls(scheme, bucket, _prefix(path))

    def __str__(self) -> str:
        return f"{self.scheme}{self.bucket}/{self.prefix}"


class GcsStore:
    """A repository in Google Cloud Storage, through google-cloud-storage."""

    def __init__(self, location: BucketPath, client: Any = None) -> None:
        self.location = location
        self.prefix = location.prefix
        self._client = client if client is not None else self._default_client()

    def _default_client(self) -> Any:
        try:
            from google.auth.exceptions import DefaultCredentialsError
            from google.cloud import storage  # type: ignore[import-untyped]
        except ImportError:
            raise _missing_extra(str(self), "a Google Cloud Storage repository", "gcs") from None
        try:
            return storage.Client()
        except DefaultCredentialsError:
            # No credentials here: a public bucket is still readable.
            logger.info("%s: no Google credentials found; reading the bucket anonymously", self)
            return storage.Client.create_anonymous_client()

    def __str__(self) -> str:
        return str(self.location)

    def list(self) -> list[tuple[str, str, int]]:
        try:
            blobs = self._client.list_blobs(self.location.bucket, prefix=self.prefix)
            # A blob's generation changes with every write of it (its md5 may not).
            return [(b.name, f"{b.generation}:{b.md5_hash}", int(b.size or 0)) for b in blobs]
        except Exception as exc:  # google.api_core's errors: credentials, bucket, network
            raise RepositoryError(f"{self}: cannot list the repository: {exc}") from exc

    def fetch(self, key: str, target: Path) -> None:
        self._client.bucket(self.location.bucket).blob(key).download_to_filename(str(target))


@dataclass(frozen=True, slots=True)
class AzureLocation:
    """Where an Azure Blob Storage repository lies (Triton: as://account/container/path)."""

    account: str
    container: str
    prefix: str

    @classmethod
    def parse(cls, url: str) -> AzureLocation:
        """
        >>> AzureLocation.parse("as://acct/models/prod")
        AzureLocation(account='acct', container='models', prefix='prod/')
        """
        form = "as://account/container[/path]"
        account, _, rest = url.removeprefix("as://").partition("/")
        container, _, path = rest.partition("/")
        if not url.startswith("as://") or not account or not container:
            raise RepositoryError(f"{url}: expected {form}")
        return cls(account, container, _prefix(path))

    def __str__(self) -> str:
        return f"as://{self.account}/{self.container}/{self.prefix}"


class AzureStore:
    """A repository in Azure Blob Storage, through azure-storage-blob."""

    def __init__(self, location: AzureLocation, client: Any = None) -> None:
        self.location = location
        self.prefix = location.prefix
        self._container = client if client is not None else self._default_client()

    def _default_client(self) -> Any:
        try:
            from azure.storage.blob import BlobServiceClient
        except ImportError:
            raise _missing_extra(str(self), "an Azure Blob Storage repository", "azure") from None
        account = self.location.account
        named = os.environ.get("AZURE_STORAGE_ACCOUNT")
        if named and named != account:
            raise RepositoryError(
                f"{self}: AZURE_STORAGE_ACCOUNT names account {named!r}, the URL {account!r}"
            )
        connection = os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
        if connection:
            fields = dict(part.split("=", 1) for part in connection.split(";") if "=" in part)
            if fields.get("AccountName", account) != account:
                raise RepositoryError(
                    f"{self}: AZURE_STORAGE_CONNECTION_STRING is for account "
                    f"{fields['AccountName']!r}, the URL names {account!r}"
                )
            service = BlobServiceClient.from_connection_string(connection)
        else:
            key = os.environ.get("AZURE_STORAGE_KEY")
            credential = {"account_name": account, "account_key": key} if key else None
            service = BlobServiceClient(f"https://{account}.blob.core.windows.net", credential)
        return service.get_container_client(self.location.container)

    def __str__(self) -> str:
        return str(self.location)

    def list(self) -> list[tuple[str, str, int]]:
        try:
            blobs = self._container.list_blobs(name_starts_with=self.prefix)
            return [(b.name, str(b.etag), int(b.size or 0)) for b in blobs]
        except Exception as exc:  # azure.core's errors: credentials, container, network
            raise RepositoryError(f"{self}: cannot list the repository: {exc}") from exc

    def fetch(self, key: str, target: Path) -> None:
        with target.open("wb") as file:
            self._container.download_blob(key).readinto(file)
