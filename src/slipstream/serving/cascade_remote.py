"""A cascade stage behind a V2 HTTP endpoint: another Slipstream, Triton, KServe.

One pooled keep-alive client per stage (httpx), tensors both ways in Triton's binary
extension, the API key as ``Authorization: Bearer``. At load, the model's metadata is
read to check it can stand in for the first stage; per request, any failure (refused
connection, timeout, an error status, a malformed answer) is an
:class:`~slipstream.errors.Unavailable` naming the stage, for the cascade's
``on_stage_failure`` policy to handle.
"""

from __future__ import annotations

import logging
import os

import httpx
import numpy as np

from slipstream.config import CascadeStage, ConfigError
from slipstream.errors import InvalidRequest, Unavailable
from slipstream.protocol import v2_client
from slipstream.types import TensorMetadata

logger = logging.getLogger(__name__)

_HEADER_LENGTH = "inference-header-content-length"
# Longest part of a remote error body quoted in a message.
_QUOTE_CHARS = 300


class RemoteStage:
    """The client of one remote stage; :meth:`close` it when the cascade goes."""

    def __init__(self, stage: CascadeStage) -> None:
        headers = {"User-Agent": "slipstream-cascade"}
        if stage.api_key_env:
            key = os.environ.get(stage.api_key_env, "")
            if not key:
                raise ConfigError(
                    f"stage {stage.name}: api_key_env: the environment variable "
                    f"{stage.api_key_env} is not set; export the remote server's API key in it"
                )
            headers["Authorization"] = f"Bearer {key}"
        self.name = stage.name
        self.url = stage.url
        self._path = f"/v2/models/{stage.model}"
        if stage.version:
            self._path += f"/versions/{stage.version}"
        self._client = httpx.AsyncClient(
            base_url=stage.url,
            headers=headers,
            timeout=stage.timeout_s,
            limits=httpx.Limits(
                max_connections=stage.max_connections,
                max_keepalive_connections=stage.max_connections,
            ),
        )

    async def signature(self) -> tuple[list[TensorMetadata], list[TensorMetadata]]:
        """The remote model's inputs and outputs; ConfigError naming why they cannot be
        read (unreachable, no such model, a refused key)."""
        try:
            reply = await self._client.get(self._path)
        except httpx.HTTPError as exc:
            raise ConfigError(
                f"stage {self.name}: {self.url} is unreachable ({_cause(exc)}); start the "
                "remote server or fix the stage's url"
            ) from None
        if reply.status_code != 200:
            hint = {
                401: "set api_key_env to a valid key",
                403: "the key lacks a role",
                404: "check the stage's model and version",
            }.get(reply.status_code, "")
            raise ConfigError(
                f"stage {self.name}: GET {self.url}{self._path} answered "
                f"{reply.status_code} {_quote(reply.content)}" + (f"; {hint}" if hint else "")
            )
        try:
            inputs = v2_client.decode_metadata_tensors(reply.content, "inputs")
            outputs = v2_client.decode_metadata_tensors(reply.content, "outputs")
        except InvalidRequest as exc:
            raise ConfigError(f"stage {self.name}: {exc.message}") from None
        return inputs, outputs

    async def max_batch_size(self) -> int:
        """The remote model's max_batch_size from its config, 0 where it does not say (a
        server without the config route, or an answer without the field)."""
        try:
            reply = await self._client.get(f"{self._path}/config")
            found = reply.json().get("max_batch_size") if reply.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return 0
        return found if type(found) is int and found > 0 else 0

    async def infer(
        self, inputs: dict[str, np.ndarray], outputs: list[str], timeout_us: int
    ) -> dict[str, np.ndarray]:
        """Run ``inputs`` remotely and return ``outputs``; Unavailable on any failure."""
        body, json_length = v2_client.encode_request(
            inputs, outputs, {"timeout": timeout_us} if timeout_us else None
        )
        try:
            reply = await self._client.post(
                self._path + "/infer",
                content=body,
                headers={
                    "Content-Type": "application/octet-stream",
                    "Inference-Header-Content-Length": str(json_length),
                },
            )
        except httpx.HTTPError as exc:
            raise self._failed(_cause(exc)) from None
        if reply.status_code != 200:
            raise self._failed(f"answered {reply.status_code} {_quote(reply.content)}")
        header = reply.headers.get(_HEADER_LENGTH)
        try:
            found = v2_client.decode_response(
                reply.content, int(header) if header is not None else None
            )
        except (InvalidRequest, ValueError) as exc:
            raise self._failed(f"answered a malformed response: {exc}") from None
        missing = [name for name in outputs if name not in found]
        if missing:
            raise self._failed(f"answered without the outputs {missing}")
        return {name: found[name] for name in outputs}

    def _failed(self, cause: str) -> Unavailable:
        return Unavailable(
            f"cascade stage {self.name} ({self.url}) failed: {cause}", retry_after_s=1
        )

    async def close(self) -> None:
        await self._client.aclose()


def _cause(exc: httpx.HTTPError) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text != type(exc).__name__ else text


def _quote(body: bytes) -> str:
    text = body[:_QUOTE_CHARS].decode("utf-8", errors="replace")
    return repr(text) if text else "(empty body)"
