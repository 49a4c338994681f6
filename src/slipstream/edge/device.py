"""``slipstream edge``: a small-footprint server and the fleet agent in one process.

The server is ``slipstream serve``'s (the same front end, batcher and runtime, and the
reload that loads a new version beside the old and swaps in one step) with defaults for a
device: HTTP only (gRPC when asked), every installed model loaded at start, one instance
each unless its config says otherwise. The agent (``edge/agent.py``) is a task in the same
event loop, not a sidecar: one interpreter (no second copy of numpy and the runtime in
memory), and it loads, checks and rolls back through the serving core directly instead
of through an admin API that would then have to be opened on the device. Its network
work and TUF's checks run in a thread, so requests are never held up by a download.

Example::

    settings = edge_server_settings(Path("models"), http_port=8000)
    agent = AgentSettings("http://publisher:8700", Path("models"), "cam-7")
    provision_root(FleetDirs(Path("models/.fleet")), Path("root.json"))
    exit_code = asyncio.run(run_edge(settings, agent))
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from tuf.api.exceptions import UnsignedMetadataError
from tuf.api.metadata import Metadata, Root
from tuf.api.serialization import DeserializationError

from slipstream.config import ServerSettings
from slipstream.edge.agent import AgentSettings, FleetAgent
from slipstream.edge.fleet_client import FleetDirs
from slipstream.server.runner import serve

logger = logging.getLogger(__name__)


class ProvisionError(ValueError):
    """The device has no trusted root to start from; the message says what to pass."""


def edge_server_settings(repository: Path, **overrides: object) -> ServerSettings:
    """``slipstream serve``'s settings with a device's defaults (see the module docstring)."""
    defaults: dict[str, object] = {"model_repository": repository, "grpc_port": 0,
                                   "model_control_mode": "none"}  # fmt: skip
    return ServerSettings.model_validate({**defaults, **overrides})


def provision_root(dirs: FleetDirs, root: Path | None) -> None:
    """Keep ``root`` (the publisher's root.json) as the device's trust anchor, on first
    start; later starts use the stored one (TUF moves it forward by signed rotations).
    ProvisionError, with nothing stored, when ``root`` is not root metadata TUF's client
    would start from, or when the stored one is not."""
    stored = dirs.trusted_root
    if stored.is_file():
        problem = root_problem(stored.read_bytes())
        if problem:
            raise ProvisionError(
                f"the trusted root this device keeps, {stored}, is unusable: {problem}; "
                "delete it and start again with --root and the publisher's "
                "public/metadata/1.root.json"
            )
        if root is not None and root.read_bytes() != stored.read_bytes():
            logger.warning("--root %s differs from the trusted root this device keeps (%s); "
                           "keeping the stored one (TUF rotates roots by signed updates)",
                           root, stored)  # fmt: skip
        return
    if root is None:
        raise ProvisionError(
            "this device trusts no fleet yet: pass --root with the publisher's "
            "public/metadata/1.root.json (copied over a channel you trust)"
        )
    if not root.is_file():
        raise ProvisionError(f"--root {root}: not a file")
    problem = root_problem(root.read_bytes())
    if problem:
        raise ProvisionError(
            f"--root {root}: {problem}; pass the publisher's public/metadata/1.root.json"
        )
    dirs.root.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(root, stored)


def root_problem(data: bytes) -> str:
    """Why ``data`` is not a root TUF's client would start from ("" when it is): it must
    be root metadata signed by its own root keys (a threshold of them), as
    ``tuf.ngclient`` checks the root it is given. An expired root passes: the client
    checks expiry only on the newest root, which it downloads."""
    try:
        metadata = Metadata[Root].from_bytes(data)
    except DeserializationError as exc:
        inner = exc.__cause__
        detail = f"{type(inner).__name__}: {inner}" if inner is not None else str(exc)
        return f"not TUF root metadata ({detail})"
    if not isinstance(metadata.signed, Root):
        return f"{metadata.signed.type} metadata, not root"
    try:
        metadata.signed.verify_delegate(Root.type, metadata.signed_bytes, metadata.signatures)
    except UnsignedMetadataError as exc:
        return f"not signed by its own root keys ({exc})"
    return ""


async def run_edge(settings: ServerSettings, agent: AgentSettings) -> int:
    """Serve until SIGTERM or SIGINT with the fleet agent beside; the exit code. The
    device must have been provisioned (:func:`provision_root`)."""
    fleet = FleetAgent(agent)
    return await serve(settings, companions=[fleet.run])
