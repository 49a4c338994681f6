"""``slipstream fleet`` (the publisher) and ``slipstream edge`` (a device).

Only click is imported with the ``slipstream`` CLI; ``tuf`` (``slipstream[fleet]``) and
the server load when a command runs.
"""

from __future__ import annotations

import logging
import socket
import sys
from pathlib import Path
from typing import Any

import click

_REPO = click.option("--repo", type=click.Path(path_type=Path), required=True,
                     help="The fleet repository directory (DIR/public is served).")  # fmt: skip
_KEYS = click.option("--keys", type=click.Path(path_type=Path),
                     help="Directory of the private keys [default: DIR/keys]; keep it off "
                     "the served tree, ideally off the serving host.")  # fmt: skip
_LOG_LEVEL = click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
                          default="info", show_default=True, help="Logging level.")  # fmt: skip


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip


def _need_tuf() -> None:
    try:
        import tuf  # noqa: F401
    except ModuleNotFoundError:
        raise click.ClickException(
            "fleet updates need The Update Framework: pip install 'slipstream[fleet]'"
        ) from None


@click.group("fleet")
def fleet() -> None:
    """Publish edge bundles to devices through a TUF repository (signed, versioned,
    expiring metadata: devices refuse unsigned, changed, expired and replayed files).

    \b
    Example:
      slipstream fleet init --repo fleet          # keys in fleet/keys (0600)
      slipstream fleet publish bundles/digits --repo fleet
      slipstream fleet serve --repo fleet --port 8700
      slipstream edge --fleet http://publisher:8700 --repository models \\
          --root fleet/public/metadata/1.root.json       # on each device
      curl publisher:8700/v2/fleet/devices
    """  # fmt: skip


@fleet.command("init")
@_REPO
@_KEYS
def init(repo: Path, keys: Path | None) -> None:
    """Make the root, targets, snapshot and timestamp keys and the first metadata.

    Give devices DIR/public/metadata/1.root.json (their --root) over a channel you trust.

    \b
    Example:
      slipstream fleet init --repo fleet
    """  # fmt: skip
    _need_tuf()
    from slipstream.edge.fleet_repo import FleetPaths, FleetRepoError, init_repository

    paths = FleetPaths.of(repo, keys)
    try:
        init_repository(paths)
    except FleetRepoError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"fleet repository {repo}: private keys in {paths.keys} (0600)")
    click.echo(f"serve {paths.public}; give devices {paths.metadata / '1.root.json'} as --root")


@fleet.command("publish")
@click.argument("bundle", type=click.Path(path_type=Path))
@_REPO
@_KEYS
def publish(bundle: Path, repo: Path, keys: Path | None) -> None:
    """Sign BUNDLE (a directory slipstream export wrote) into the repository as its
    model's newest version; devices install it on their next poll.

    \b
    Example:
      slipstream fleet publish bundles/digits --repo fleet
    """  # fmt: skip
    _need_tuf()
    from slipstream.edge.fleet_repo import FleetPaths, FleetRepoError, publish_bundle
    from slipstream.edge.manifest import BundleError

    try:
        result = publish_bundle(FleetPaths.of(repo, keys), bundle)
    except BundleError as exc:
        raise click.ClickException(f"{exc}; not published") from None
    except FleetRepoError as exc:
        raise click.ClickException(str(exc)) from None
    entry = result.entry
    click.echo(
        f"published {entry.name} version {entry.version} ({result.bundle_bytes / 1e6:.1f} MB) "
        f"as target {entry.target}: targets v{result.targets_version}, timestamp "
        f"v{result.timestamp_version}"
    )


@fleet.command("refresh")
@_REPO
@_KEYS
def refresh(repo: Path, keys: Path | None) -> None:
    """Sign the targets, snapshot and timestamp again with renewed expiry (the timestamp
    lasts a day: run this daily, e.g. from cron, when nothing is published), and a new
    root version once the root has less than 30 days left (it lasts a year).

    \b
    Example:
      slipstream fleet refresh --repo fleet
    """  # fmt: skip
    _need_tuf()
    from slipstream.edge.fleet_repo import FleetPaths, FleetRepoError, refresh_metadata

    try:
        version = refresh_metadata(FleetPaths.of(repo, keys))
    except FleetRepoError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"{repo}: timestamp v{version} signed")


@fleet.command("serve")
@_REPO
@click.option("--host", default="0.0.0.0", show_default=True, help="Address to bind.")
@click.option("--port", type=click.IntRange(1, 65535), default=8700, show_default=True,
              help="HTTP port.")  # fmt: skip
@_LOG_LEVEL
def serve_repo(repo: Path, host: str, port: int, log_level: str) -> None:
    """Serve DIR/public over HTTP and take the devices' reports (GET /v2/fleet/devices).

    \b
    Example:
      slipstream fleet serve --repo fleet --port 8700
    """  # fmt: skip
    from slipstream.edge.fleet_repo import FleetPaths
    from slipstream.edge.fleet_server import run_fleet_server

    _logging(log_level)
    sys.exit(run_fleet_server(FleetPaths.of(repo), host, port))


@click.command("edge")
@click.option("--fleet", "fleet_url", required=True,
              help="The fleet repository's URL (metadata/ and targets/ under it).")  # fmt: skip
@click.option("--repository", type=click.Path(path_type=Path), required=True,
              help="The device's model repository (created when missing).")  # fmt: skip
@click.option("--root", type=click.Path(path_type=Path),
              help="The publisher's root.json: needed on the first start only.")  # fmt: skip
@click.option("--device-id", default=socket.gethostname, show_default="the host name",
              help="This device's name in the publisher's list.")  # fmt: skip
@click.option("--report-url", default="", help="Where to POST reports [default: --fleet].")
@click.option("--poll-s", type=click.FloatRange(min=0.1), default=60.0, show_default=True,
              help="Seconds between polls; after failures, doubled each time.")  # fmt: skip
@click.option("--max-backoff-s", type=click.FloatRange(min=0.1), default=900.0,
              show_default=True, help="Longest wait between failed polls.")  # fmt: skip
@click.option("--model", "models", multiple=True,
              help="Follow only these models [default: every published one].")  # fmt: skip
@click.option("--host", default="0.0.0.0", show_default=True, help="Address to bind.")
@click.option("--http-port", type=int, default=8000, show_default=True, help="HTTP port.")
@click.option("--grpc-port", type=int, default=0, show_default=True,
              help="gRPC port (0: off, the small-footprint default).")  # fmt: skip
@_LOG_LEVEL
def edge(**options: Any) -> None:
    """Serve a device's models and keep them at the fleet's newest signed bundles.

    Each poll downloads newer bundles through TUF, checks them (signatures, hashes,
    expiry, versions; the bundle's manifest and its own sample inputs), loads the new
    version beside the old and switches without dropping a request, rolls back when
    the check on the server fails, and reports to the publisher. Offline, the device
    serves what it has and retries with backoff.

    \b
    Example:
      slipstream edge --fleet http://publisher:8700 --repository models \\
          --root root.json --device-id cam-7
    """  # fmt: skip
    _need_tuf()
    from pydantic import ValidationError

    from slipstream.config import format_validation_error
    from slipstream.edge.agent import AgentSettings
    from slipstream.edge.device import (
        ProvisionError,
        edge_server_settings,
        provision_root,
        run_edge,
    )
    from slipstream.edge.fleet_client import FleetDirs

    repository: Path = options["repository"]
    try:
        provision_root(FleetDirs(repository / ".fleet"), options["root"])
        repository.mkdir(parents=True, exist_ok=True)
        settings = edge_server_settings(
            repository, host=options["host"], http_port=options["http_port"],
            grpc_port=options["grpc_port"], log_level=options["log_level"],
        )  # fmt: skip
    except ProvisionError as exc:
        raise click.ClickException(str(exc)) from None
    except ValidationError as exc:
        raise click.BadParameter(format_validation_error("option", exc)) from None
    agent = AgentSettings(
        fleet_url=options["fleet_url"], repository=repository, device_id=options["device_id"],
        report_url=options["report_url"], poll_s=options["poll_s"],
        max_backoff_s=options["max_backoff_s"], models=tuple(options["models"]),
    )  # fmt: skip
    _logging(options["log_level"])
    try:
        import uvloop

        sys.exit(uvloop.run(run_edge(settings, agent)))
    except ImportError:  # pragma: no cover - uvloop is absent on Windows
        import asyncio

        sys.exit(asyncio.run(run_edge(settings, agent)))
