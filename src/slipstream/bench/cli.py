"""``slipstream bench``: load-test any Open Inference Protocol server, perf_analyzer style.

Only click is imported with the ``slipstream`` CLI; the load generator and its extra
dependencies (rich, psutil, matplotlib) load when the command runs, so ``slipstream
serve`` works without the ``bench`` extra.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click
from pydantic import ValidationError

from slipstream.bench.settings import BenchSettings
from slipstream.cli_params import shapes_option

_INSTALL_HINT = "pip install 'slipstream[bench]'"


def _help(field: str) -> str:
    info = BenchSettings.model_fields[field]
    description = info.description or ""
    if info.default in (None, "") or info.default_factory is not None or info.is_required():
        return description
    return f"{description} [default: {info.default}]"


def _int_list(_ctx: click.Context, _param: click.Parameter, value: str | None) -> list[int]:
    if not value:
        return []
    try:
        return [int(item) for item in value.split(",") if item.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected integers like 1,8,64") from None


def _float_list(_ctx: click.Context, _param: click.Parameter, value: str | None) -> list[float]:
    if not value:
        return []
    try:
        return [float(item) for item in value.split(",") if item.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected numbers like 100,500") from None


_FILE = click.Path(path_type=Path, dir_okay=False)


@click.command("bench")
@click.argument("url")
@click.option("--model", "-m", required=True, help=_help("model"))
@click.option("--model-version", default="", help=_help("model_version"))
@click.option(
    "--protocol",
    "-i",
    type=click.Choice(["http", "http-binary", "grpc"]),
    default="http",
    help=_help("protocol"),
)
@click.option("--concurrency", callback=_int_list, help=_help("concurrency"))
@click.option("--request-rate", callback=_float_list, help=_help("request_rate"))
@click.option(
    "--distribution",
    type=click.Choice(["constant", "poisson"]),
    default="constant",
    help=_help("distribution"),
)
@click.option("--batch-size", "-b", type=int, default=1, help=_help("batch_size"))
@click.option("--shape", "shapes", multiple=True, callback=shapes_option, help=_help("shapes"))
@click.option("--input-data", type=click.Path(path_type=Path), help=_help("input_data"))
@click.option("--warmup-s", type=float, default=1.0, help=_help("warmup_s"))
@click.option("--window-s", type=float, default=2.0, help=_help("window_s"))
@click.option("--stability-pct", type=float, default=10.0, help=_help("stability_pct"))
@click.option("--max-windows", type=int, default=10, help=_help("max_windows"))
@click.option("--duration", "duration_s", type=float, help=_help("duration_s"))
@click.option("--workers", type=int, default=0, help=_help("workers"))
@click.option("--max-inflight", type=int, default=256, help=_help("max_inflight"))
@click.option("--timeout-s", type=float, default=30.0, help=_help("timeout_s"))
@click.option("--seed", type=int, default=0, help=_help("seed"))
@click.option("--server-pid", type=int, help=_help("server_pid"))
@click.option("--price-per-hour", type=float, help=_help("price_per_hour"))
@click.option("--json", "json_path", type=_FILE, help=_help("json_path"))
@click.option("--csv", "csv_path", type=_FILE, help=_help("csv_path"))
@click.option("--report", "report_path", type=_FILE, help=_help("report_path"))
def bench(**options: Any) -> None:
    """Measure throughput and latency of MODEL on the server at URL, load level by level.

    \b
    Examples:
      slipstream bench http://localhost:8000 -m mlp --concurrency 1,8,64
      slipstream bench localhost:8001 -m mlp --protocol grpc --request-rate 100,500 \\
          --distribution poisson --json out.json --report out.html
      slipstream bench http://localhost:8000 -m minilm --shape input_ids:128 \\
          --shape attention_mask:128 --batch-size 8 --server-pid $(pgrep -f "slipstream serve")
    """  # fmt: skip
    try:
        settings = BenchSettings(**options)
    except ValidationError as exc:
        messages = "; ".join(
            str(problem["msg"]).removeprefix("Value error, ") for problem in exc.errors()
        )
        raise click.UsageError(messages) from None
    try:
        from slipstream.bench.errors import BenchError
        from slipstream.bench.report import RichProgress, print_tables, terminal_console
        from slipstream.bench.runner import run_bench
    except ImportError as exc:
        raise click.ClickException(f"{exc}; slipstream bench needs: {_INSTALL_HINT}") from None
    try:
        with RichProgress(terminal_console(stderr=True)) as progress:
            result = run_bench(settings, progress)
    except BenchError as exc:
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    print_tables(result, terminal_console())
    _write_outputs(settings, result)
    if all(level.requests == 0 for level in result.levels):
        raise click.ClickException(
            "every request failed; see the errors above (wrong --model-version, inputs the "
            "model refuses, or an overloaded server)"
        )


def _write_outputs(settings: BenchSettings, result: Any) -> None:
    from slipstream.bench.report import write_csv, write_json

    if settings.json_path is not None:
        write_json(result, settings.json_path)
        click.echo(f"wrote {settings.json_path}", err=True)
    if settings.csv_path is not None:
        write_csv(result, settings.csv_path)
        click.echo(f"wrote {settings.csv_path}", err=True)
    if settings.report_path is not None:
        try:
            from slipstream.bench.charts import write_report

            write_report(result, settings.report_path)
        except ImportError as exc:
            raise click.ClickException(f"{exc}; --report needs: {_INSTALL_HINT}") from None
        click.echo(f"wrote {settings.report_path}", err=True)
