"""The ``slipstream`` command line.

Example::

    slipstream serve --model-repository ./models --http-port 8000 --grpc-port 8001
"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path
from typing import Any

import click
from pydantic import ValidationError
from pydantic_core import PydanticUndefined

from slipstream import __version__
from slipstream.config import ServerSettings
from slipstream.repository.remote import is_remote


def _help(field: str) -> str:
    description = ServerSettings.model_fields[field].description or ""
    default = ServerSettings.model_fields[field].default
    if default in (None, PydanticUndefined) or callable(default) or field == "model_repository":
        return description  # PydanticUndefined: a default_factory's (an empty list)
    return f"{description} [default: {default}]"


def _option_problems(error: ValidationError) -> str:
    """What is wrong with the options, each problem under its flag's name (not the
    settings field behind it); one that concerns several flags names them itself."""
    flags = {p.name: p.opts[-1] for p in click.get_current_context().command.params}
    problems = []
    for problem in error.errors():
        message = problem["msg"].removeprefix("Value error, ")
        field = str(problem["loc"][0]) if problem["loc"] else ""
        problems.append(f"{flags.get(field, field)}: {message}" if field else message)
    return "; ".join(problems)


def _default(field: str) -> Any:
    return ServerSettings.model_fields[field].default


def _tool(name: str) -> click.Command | None:
    """The command of a tool beside the serving path (None: no tool of that name),
    imported when asked for: `slipstream serve` starts without importing the tools
    (~0.1 s of imports at every server start)."""
    command: click.Command
    if name == "bench":
        from slipstream.bench.cli import bench as command
    elif name == "profile":
        from slipstream.profile.cli import profile as command
    elif name == "optimize":
        from slipstream.optimize.cli import optimize as command
    elif name == "tune":
        from slipstream.tune.cli import tune as command
    elif name == "export":
        from slipstream.edge.cli import export as command
    elif name == "cascade":
        from slipstream.calibrate import cascade as command
    elif name == "fleet":
        from slipstream.edge.fleet_cli import fleet as command
    elif name == "edge":
        from slipstream.edge.fleet_cli import edge as command
    elif name == "keys":
        from slipstream.security.keys_cli import keys as command
    else:
        return None
    return command


_TOOLS = ("bench", "profile", "optimize", "tune", "export", "cascade", "fleet", "edge", "keys")


class _Commands(click.Group):
    """The commands defined here, and the tools, each imported when it is run or listed."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *_TOOLS])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return super().get_command(ctx, cmd_name) or _tool(cmd_name)


@click.group(cls=_Commands)
@click.version_option(__version__, prog_name="slipstream")
def main() -> None:
    """Slipstream: profile, optimize and serve models over the Open Inference Protocol."""


@main.command()
@click.option(
    "--model-repository",
    # A string, not a click.Path: "s3://bucket" would become "s3:/bucket".
    type=str,
    required=True,
    help=_help("model_repository"),
)
@click.option(
    "--repository-cache",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help=_help("repository_cache"),
)
@click.option("--host", default="0.0.0.0", help=_help("host"))
@click.option("--http-port", type=int, default=8000, help=_help("http_port"))
@click.option("--grpc-port", type=int, default=8001, help=_help("grpc_port"))
@click.option(
    "--model-control-mode",
    type=click.Choice(["none", "explicit", "poll"]),
    default="none",
    help=_help("model_control_mode"),
)
@click.option("--load-model", "load_models", multiple=True, help=_help("load_models"))
@click.option("--trust-pickle", is_flag=True, default=False, help=_help("trust_pickle"))
@click.option("--allow-client-shm", is_flag=True, default=False, help=_help("allow_client_shm"))
@click.option(
    "--repository-poll-secs", type=float, default=15.0, help=_help("repository_poll_secs")
)
@click.option(
    "--max-request-bytes", type=int, default=64 * 1024 * 1024, help=_help("max_request_bytes")
)
@click.option(
    "--max-buffered-body-bytes", type=int, default=None, help=_help("max_buffered_body_bytes")
)
@click.option("--shutdown-timeout-s", type=float, default=30.0, help=_help("shutdown_timeout_s"))
@click.option(
    "--idle-unload-seconds",
    type=float,
    default=_default("idle_unload_seconds"),
    help=_help("idle_unload_seconds"),
)
@click.option(
    "--load-wait-s", type=float, default=_default("load_wait_s"), help=_help("load_wait_s")
)
@click.option(
    "--max-header-bytes",
    type=int,
    default=_default("max_header_bytes"),
    help=_help("max_header_bytes"),
)
@click.option(
    "--max-header-count",
    type=int,
    default=_default("max_header_count"),
    help=_help("max_header_count"),
)
@click.option(
    "--header-timeout-s",
    type=float,
    default=_default("header_timeout_s"),
    help=_help("header_timeout_s"),
)
@click.option(
    "--body-timeout-s", type=float, default=_default("body_timeout_s"), help=_help("body_timeout_s")
)
@click.option(
    "--min-body-rate-bytes-s",
    type=float,
    default=_default("min_body_rate_bytes_s"),
    help=_help("min_body_rate_bytes_s"),
)
@click.option(
    "--send-timeout-s", type=float, default=_default("send_timeout_s"), help=_help("send_timeout_s")
)
@click.option(
    "--keep-alive-timeout-s",
    type=float,
    default=_default("keep_alive_timeout_s"),
    help=_help("keep_alive_timeout_s"),
)
@click.option("--price-per-hour", type=float, default=None, help=_help("price_per_hour"))
@click.option(
    "--cost-window-s", type=float, default=_default("cost_window_s"), help=_help("cost_window_s")
)
@click.option(
    "--max-connections",
    type=int,
    default=_default("max_connections"),
    help=_help("max_connections"),
)
@click.option(
    "--grpc-max-message-bytes", type=int, default=None, help=_help("grpc_max_message_bytes")
)
@click.option(
    "--grpc-max-concurrent-streams",
    type=int,
    default=_default("grpc_max_concurrent_streams"),
    help=_help("grpc_max_concurrent_streams"),
)
@click.option(
    "--strict-readiness/--no-strict-readiness", default=True, help=_help("strict_readiness")
)
@click.option("--auth-file", type=click.Path(path_type=Path), default=None, help=_help("auth_file"))
@click.option("--metrics-need-key/--metrics-open", default=False, help=_help("metrics_need_key"))
@click.option("--rate-limit-store", default="memory", help=_help("rate_limit_store"))
@click.option("--rollout-store", default="", help=_help("rollout_store"))
@click.option(
    "--rate-limit-fail-closed/--rate-limit-fail-open",
    default=False,
    help=_help("rate_limit_fail_closed"),
)
@click.option("--access-log", is_flag=True, default=False, help=_help("access_log"))
@click.option("--trace-config", "trace_config", multiple=True, help=_help("trace_config"))
@click.option(
    "--trace-startup",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help=_help("trace_startup"),
)
@click.option("--cache", default="", help=_help("cache"))
@click.option(
    "--ray",
    "on_ray",
    is_flag=True,
    default=False,
    help="Serve each model as a Ray Serve application (ray_serve: in its config.yaml "
    "scales it) on a local Ray cluster, or RAY_ADDRESS's: over HTTP(S) only (V2, KServe V1, "
    "and OpenAI's generation routes; no gRPC, embeddings or scoring: docs/scale-out.md).",
)
@click.option("--jobs-redis", default="", help=_help("jobs_redis"))
@click.option("--jobs-max-pending", type=int, default=_default("jobs_max_pending"),
              help=_help("jobs_max_pending"))  # fmt: skip
@click.option("--files-dir", type=click.Path(path_type=Path), default=None, help=_help("files_dir"))
@click.option("--batch-concurrency", type=int, default=_default("batch_concurrency"),
              help=_help("batch_concurrency"))  # fmt: skip
@click.option("--tls-cert", type=click.Path(path_type=Path), default=None, help=_help("tls_cert"))
@click.option("--tls-key", type=click.Path(path_type=Path), default=None, help=_help("tls_key"))
@click.option(
    "--tls-client-ca", type=click.Path(path_type=Path), default=None, help=_help("tls_client_ca")
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    help=_help("log_level"),
)
@click.option("--frontends", type=int, default=0, help=_help("frontends"))
@click.option(
    "--engines",
    type=click.Choice(["single", "per-device"]),
    default="single",
    help=_help("engines"),
)
@click.option("--frontend-hold-us", type=int, default=1000, help=_help("frontend_hold_us"))
@click.option(
    "--cpu-scheduling",
    type=click.Choice(["batch", "default"]),
    default="batch",
    help=_help("cpu_scheduling"),
)
def serve(**options: Any) -> None:
    """Serve every model of a repository over V2 HTTP and gRPC.

    \b
    Example:
      slipstream serve --model-repository ./models --http-port 8000 --grpc-port 8001
      curl localhost:8000/v2/models/digits
    """  # fmt: skip
    options["load_models"] = list(options["load_models"])
    on_ray = options.pop("on_ray")
    repository = options.pop("model_repository")
    try:
        settings = ServerSettings(model_repository=Path(repository), **options)
    except ValidationError as exc:
        raise click.UsageError(_option_problems(exc)) from None
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if is_remote(repository):
        settings = _copy_remote(settings, repository, on_ray)
    elif not settings.model_repository.is_dir():
        raise click.BadParameter(
            f"{settings.model_repository} is not a directory", param_hint="--model-repository"
        )
    if on_ray:
        if settings.frontends or settings.engines != "single":
            raise click.BadParameter(
                "--frontends and --engines split one server into processes; under --ray, "
                "Ray Serve runs the replicas: leave them out",
                param_hint="--frontends/--engines",
            )
        from slipstream.rayserve.app import run as run_on_ray

        sys.exit(run_on_ray(settings))
    if settings.engines == "per-device" and not settings.frontends:
        settings = settings.model_copy(update={"frontends": 1})
    if settings.frontends:
        from slipstream.server.split import serve_split as run_server
    else:
        from slipstream.server.runner import serve as run_server

    try:
        import uvloop

        exit_code = uvloop.run(run_server(settings))
    except ImportError:  # pragma: no cover - uvloop is absent on Windows
        exit_code = asyncio.run(run_server(settings))
    sys.exit(exit_code)


def _copy_remote(settings: ServerSettings, url: str, on_ray: bool) -> ServerSettings:
    """The settings serving the local copy of the repository at ``url`` (made now,
    followed every --repository-poll-secs unless models never change)."""
    from slipstream.repository.remote import RepositoryError, open_mirror

    if on_ray:
        raise click.BadParameter(
            "an object store's repository is copied to this host only, where Ray Serve may place "
            "replicas on others: give --ray a directory every node can read",
            param_hint="--model-repository",
        )
    follow = None if settings.model_control_mode == "none" else settings.repository_poll_secs
    try:
        mirror = open_mirror(url, settings.repository_cache, follow)
    except RepositoryError as exc:
        raise click.BadParameter(str(exc), param_hint="--model-repository") from None
    return settings.model_copy(update={"model_repository": mirror.directory})


def _worker_help(field: str) -> str:
    from slipstream.jobs.settings import WorkerSettings

    info = WorkerSettings.model_fields[field]
    default = info.default
    if field in ("redis", "model_repository", "consumer"):
        return info.description or ""
    return f"{info.description} [default: {default}]"


@main.command()
@click.option("--redis", required=True, help=_worker_help("redis"))
@click.option("--repository", "--model-repository", "model_repository", required=True,
              type=click.Path(file_okay=False, path_type=Path),
              help=_worker_help("model_repository"))  # fmt: skip
@click.option("--consumer", default=None, help=_worker_help("consumer"))
@click.option("--prefetch", type=int, default=64, help=_worker_help("prefetch"))
@click.option("--rounds", type=int, default=2, help=_worker_help("rounds"))
@click.option("--max-attempts", type=int, default=3, help=_worker_help("max_attempts"))
@click.option("--reclaim-after-s", type=float, default=60.0, help=_worker_help("reclaim_after_s"))
@click.option("--result-ttl-s", type=int, default=3600, help=_worker_help("result_ttl_s"))
@click.option("--trust-pickle", is_flag=True, default=False, help=_worker_help("trust_pickle"))
@click.option("--metrics-port", type=int, default=0, help=_worker_help("metrics_port"))
@click.option("--shutdown-timeout-s", type=float, default=30.0,
              help=_worker_help("shutdown_timeout_s"))  # fmt: skip
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default="info", help=_worker_help("log_level"))  # fmt: skip
def worker(**options: Any) -> None:
    """Run the asynchronous jobs of a Redis stream (servers started with --jobs-redis).

    \b
    Example:
      slipstream worker --redis redis://localhost:6379 --repository ./models
    Any number of workers, on any hosts, share the stream: each job runs once.
    """  # fmt: skip
    from slipstream.jobs.settings import WorkerSettings

    if options["consumer"] is None:
        del options["consumer"]
    try:
        settings = WorkerSettings(**options)
    except ValidationError as exc:
        raise click.UsageError(_option_problems(exc)) from None
    if not settings.model_repository.is_dir():
        raise click.BadParameter(
            f"{settings.model_repository} is not a directory", param_hint="--repository"
        )
    logging.basicConfig(level=settings.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    from slipstream.server.worker import run_worker

    try:
        import uvloop

        exit_code = uvloop.run(run_worker(settings))
    except ImportError:  # pragma: no cover - uvloop is absent on Windows
        exit_code = asyncio.run(run_worker(settings))
    sys.exit(exit_code)


@main.group()
def monitor() -> None:
    """Model monitoring: drift references."""


@monitor.command("reference")
@click.argument("model")
@click.option("--data", type=click.Path(exists=True, path_type=Path), required=True,
              help="Known-good samples: .npz, a directory of .npy files, or V2 JSON "
              "requests; arrays named like the model's inputs or outputs, "
              "batch first.")  # fmt: skip
@click.option("--model-repository", type=click.Path(file_okay=False, path_type=Path),
              default=Path("models"), show_default=True)  # fmt: skip
@click.option("--version", "version", type=int, default=None,
              help="Version directory to write to; default: the newest.")  # fmt: skip
def reference(model: str, data: Path, model_repository: Path, version: int | None) -> None:
    """Write MODEL's drift reference (drift_reference.npz in its version directory).

    The server reads it when it loads the version (a running server in poll mode
    reloads it); without one, a version's first requests become its reference.

    Example: slipstream monitor reference mlp --data validation.npz
    """
    from slipstream.errors import InvalidRequest
    from slipstream.monitor.reference import ReferenceError, pick_version, write_reference
    from slipstream.repository.layout import model_path, read_model_directory
    from slipstream.tensors import TensorFileError, read_tensor_file

    try:
        directory = read_model_directory(model_path(model_repository, model))
        requests = read_tensor_file(data)
    except (InvalidRequest, TensorFileError, OSError) as exc:
        raise click.ClickException(str(getattr(exc, "message", exc))) from exc
    try:
        target, arrays = write_reference(directory, pick_version(directory, version), requests,
                                         data)  # fmt: skip
    except ReferenceError as exc:
        raise click.ClickException(str(exc)) from exc
    rows = ", ".join(f"{name} {len(array)} rows" for name, array in arrays.items())
    click.echo(f"wrote {target}: {rows}")


@monitor.command("report")
@click.argument("model")
@click.option("--url", default="http://127.0.0.1:8000", show_default=True,
              help="The server's HTTP address.")  # fmt: skip
@click.option("--version", "version", default="", help="Model version; default: the newest.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("drift.html"), show_default=True)  # fmt: skip
@click.option("--all-features", is_flag=True, help="Draw every feature, not only drifted ones.")
def report(model: str, url: str, version: str, out: Path, all_features: bool) -> None:
    """Write MODEL's last drift window as an HTML page: the tests of every feature, and
    the reference's and the window's histograms of the drifted ones.

    Example: slipstream monitor report mlp --url http://127.0.0.1:8000 --out drift.html
    """
    import httpx

    from slipstream.drift_report import drift_page

    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/drift"
    try:
        reply = httpx.get(url.rstrip("/") + path, timeout=30)
    except httpx.HTTPError as exc:
        raise click.ClickException(f"{url}: {exc}") from exc
    if reply.status_code != 200:
        raise click.ClickException(f"{path}: {reply.status_code} {reply.text}")
    try:
        out.write_text(drift_page(reply.json(), all_features))
    except OSError as exc:  # a directory that does not exist, one not writable
        why = f"cannot write {out}: {exc.strerror}"
        raise click.BadParameter(why, param_hint="--out") from exc
    click.echo(f"wrote {out}")


_SERVER_URL = click.option("--url", default="http://127.0.0.1:8000", show_default=True,
                           help="The server's HTTP address.")  # fmt: skip
_API_KEY = click.option("--api-key", envvar="SLIPSTREAM_API_KEY", default="",
                        help="An admin key, when the server has --auth-file.")  # fmt: skip


@main.group()
def rollout() -> None:
    """Canary rollouts of a new model version on a running server (admin API)."""


def _rollout_call(url: str, model: str, body: dict[str, Any] | None, api_key: str) -> None:
    from slipstream.rollout_client import RolloutClientError, format_status, rollout_request

    try:
        click.echo(format_status(rollout_request(url, model, body, api_key)))
    except RolloutClientError as exc:
        raise click.ClickException(str(exc)) from None


@rollout.command("start")
@click.argument("model")
@click.option("--candidate", required=True, help="The version rolled out.")
@click.option("--baseline", default="", help="Compared against [default: what serves now].")
@click.option("--steps", default="5,25,50,100", show_default=True,
              help="Candidate traffic percent of each step.")  # fmt: skip
@click.option("--interval", default="60s", show_default=True, help="Analysis window per step.")
@click.option("--failure-limit", type=int, default=1, show_default=True,
              help="Failed windows before rolling back.")  # fmt: skip
@click.option("--min-requests", type=int, default=20, show_default=True,
              help="Candidate requests a window needs to be judged.")  # fmt: skip
@click.option("--max-error-rate-increase", type=float, default=0.01, show_default=True,
              help="Candidate error rate minus the baseline's, at most.")  # fmt: skip
@click.option("--max-p99-ratio", type=float, default=1.5, show_default=True,
              help="Candidate p99 / baseline p99, at most.")  # fmt: skip
@click.option("--min-p99-delta-ms", type=click.FloatRange(min=0), default=2.0, show_default=True,
              help="A p99 at most this much slower passes, whatever the ratio.")  # fmt: skip
@click.option("--shadow-share", type=float, default=0.0, show_default=True,
              help="Share of the baseline's requests also mirrored to the candidate.")  # fmt: skip
@_SERVER_URL
@_API_KEY
def rollout_start(model: str, url: str, api_key: str, **options: Any) -> None:
    """Start a progressive rollout: each step's window compares candidate and baseline.

    \b
    Example:
      slipstream rollout start mlp --candidate 3 --steps 5,25,50,100 --interval 60s
    """
    from slipstream.rollout_client import parse_duration

    try:
        steps = [float(s) for s in options.pop("steps").split(",") if s.strip()]
        interval_s = parse_duration(options.pop("interval"))
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    body = {"action": "start", "steps": steps, "interval_s": interval_s, **options}
    if not body["baseline"]:
        del body["baseline"]
    _rollout_call(url, model, body, api_key)


@rollout.command("status")
@click.argument("model")
@_SERVER_URL
@_API_KEY
def rollout_status(model: str, url: str, api_key: str) -> None:
    """Print the rollout's state, weights, last verdict and history."""
    _rollout_call(url, model, None, api_key)


def _rollout_action(action: str) -> None:
    @rollout.command(action, help=f"{action.title()} the model's rollout.")
    @click.argument("model")
    @_SERVER_URL
    @_API_KEY
    def command(model: str, url: str, api_key: str) -> None:
        _rollout_call(url, model, {"action": action}, api_key)


for _action in ("pause", "resume", "promote", "abort"):
    _rollout_action(_action)
