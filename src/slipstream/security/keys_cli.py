"""``slipstream keys``: the API keys file of ``slipstream serve --auth-file``."""

from __future__ import annotations

from pathlib import Path

import click


@click.group()
def keys() -> None:
    """API keys of `slipstream serve --auth-file`: create, list, revoke.

    \b
    Example:
      slipstream keys create --auth-file keys.json --name ci --role infer --models mlp
      curl -H "Authorization: Bearer <key>" localhost:8000/v2/models/mlp
    """  # fmt: skip


_AUTH_FILE = click.option(
    "--auth-file", type=click.Path(path_type=Path), required=True, help="The keys file."
)


@keys.command("create")
@_AUTH_FILE
@click.option("--name", required=True, help="What logs and metrics call the key; unique.")
@click.option(
    "--role",
    type=click.Choice(["infer", "admin"]),
    default="infer",
    show_default=True,
    help="infer: inference, metadata, OpenAI routes; admin: also repository load/unload, "
    "model config and statistics.",
)
@click.option("--models", default=None, help="Comma-separated models the key may use; default all.")
@click.option("--rate", type=float, default=0.0, help="Requests per second; 0: unlimited.")
@click.option("--burst", type=int, default=0, help="Requests at once beyond --rate; 0: the rate.")
@click.option("--concurrency", type=int, default=0, help="Requests in flight; 0: unlimited.")
@click.option(
    "--tokens-per-minute", type=int, default=0, help="Generated + prompt tokens; 0: unlimited."
)
def create_key(
    auth_file: Path,
    name: str,
    role: str,
    models: str | None,
    rate: float,
    burst: int,
    concurrency: int,
    tokens_per_minute: int,
) -> None:
    """Create a key: prints it once; the file keeps only its hash."""
    from slipstream.security.keys import KeyLimits, KeyRing, KeysFileError, limits_problem

    limits = KeyLimits(rate, burst, concurrency, tokens_per_minute)
    if (problem := limits_problem(limits)) is not None:
        raise click.BadParameter(problem)
    try:
        ring = KeyRing.load(auth_file, missing_ok=True)
        wanted = None if models is None else [m.strip() for m in models.split(",") if m.strip()]
        secret, _ = ring.create(name, "admin" if role == "admin" else "infer", wanted, limits)
        ring.save()
    except KeysFileError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(secret)
    click.echo(f"key {name!r} ({role}) added to {auth_file}; it is shown only now", err=True)


@keys.command("list")
@_AUTH_FILE
def list_keys(auth_file: Path) -> None:
    """List the keys' names, roles, models and limits (never the keys)."""
    from slipstream.security.keys import KeyRing, KeysFileError

    try:
        ring = KeyRing.load(auth_file)
    except KeysFileError as exc:
        raise click.ClickException(str(exc)) from None
    for key in ring.keys:
        models = ",".join(sorted(key.models)) if key.models is not None else "*"
        limits = key.limits
        click.echo(f"{key.name}\t{key.role}\tmodels={models}\trate={limits.requests_per_s:g}"
                   f"\tburst={limits.burst}\tconcurrency={limits.max_concurrent}"
                   f"\ttokens_per_minute={limits.tokens_per_minute}")  # fmt: skip


@keys.command("revoke")
@_AUTH_FILE
@click.option("--name", required=True, help="The key to remove.")
def revoke_key(auth_file: Path, name: str) -> None:
    """Remove a key (running servers read the change within a second)."""
    from slipstream.security.keys import KeyRing, KeysFileError

    try:
        ring = KeyRing.load(auth_file)
        ring.revoke(name)
        ring.save()
    except KeysFileError as exc:
        raise click.ClickException(str(exc)) from None
