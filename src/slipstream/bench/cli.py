"""``slipstream bench``: load-test any Open Inference Protocol server, perf_analyzer style,
or a generative model behind an OpenAI-compatible API (``--protocol openai-chat`` or
``openai-completions``) the way vLLM's benchmark_serving does.

Only click is imported with the ``slipstream`` CLI; the load generator and its extra
dependencies (rich, psutil, matplotlib) load when the command runs, so ``slipstream
serve`` works without the ``bench`` extra.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from click.core import ParameterSource
from pydantic import BaseModel, ValidationError

from slipstream.bench.openai.settings import OpenAIBenchSettings
from slipstream.bench.v2.settings import BenchSettings
from slipstream.cli_params import shapes_option

_INSTALL_HINT = "pip install 'slipstream[bench]'"
Settings = TypeVar("Settings", bound=BaseModel)
Number = TypeVar("Number", int, float)
_OPENAI_PROTOCOLS = ("openai-chat", "openai-completions")
# Options of one mode only: giving one in the other mode is a usage error.
_V2_ONLY = set(BenchSettings.model_fields) - set(OpenAIBenchSettings.model_fields)
_OPENAI_ONLY = set(OpenAIBenchSettings.model_fields) - set(BenchSettings.model_fields)


def _help(field: str, settings: type[BaseModel] | None = None) -> str:
    """A settings field's description and default: the V2 mode's field, else the OpenAI
    mode's (the only ones to have it)."""
    if settings is None:
        v2 = field in BenchSettings.model_fields
        settings = BenchSettings if v2 else OpenAIBenchSettings
    info = settings.model_fields[field]
    description = info.description or ""
    if info.default in (None, "") or info.default_factory is not None or info.is_required():
        return description
    return f"{description} [default: {info.default}]"


def _mode_help(field: str) -> str:
    """Help of an option whose default differs between the V2 and OpenAI modes."""
    v2 = BenchSettings.model_fields[field].default
    openai = OpenAIBenchSettings.model_fields[field].default
    description = BenchSettings.model_fields[field].description or ""
    return f"{description} [default: {v2}; {openai} in OpenAI modes]"


def _number_list(
    kind: Callable[[str], Number], example: str
) -> Callable[[click.Context, click.Parameter, str | None], list[Number]]:
    """A click callback parsing a comma-separated sweep (``example`` shows the form)."""

    def parse(_ctx: click.Context, _param: click.Parameter, value: str | None) -> list[Number]:
        try:
            return [kind(item) for item in (value or "").split(",") if item.strip()]
        except ValueError:
            raise click.BadParameter(f"{value!r}: expected {example}") from None

    return parse


_FILE = click.Path(path_type=Path, dir_okay=False)


@click.command("bench")
@click.argument("url")
@click.option("--model", "-m", required=True, help=_help("model"))
@click.option("--model-version", default="", help=_help("model_version"))
@click.option(
    "--protocol",
    "-i",
    type=click.Choice(["http", "http-binary", "grpc", *_OPENAI_PROTOCOLS]),
    default="http",
    # One option picks the mode: the OpenAI settings' own default does not apply here.
    help=f"{BenchSettings.model_fields['protocol'].description} "
    f"{OpenAIBenchSettings.model_fields['protocol'].description} [default: http]",
)
@click.option(
    "--concurrency", callback=_number_list(int, "integers like 1,8,64"), help=_help("concurrency")
)
@click.option(
    "--request-rate",
    callback=_number_list(float, "numbers like 100,500"),
    help=_help("request_rate"),
)
@click.option(
    "--distribution",
    type=click.Choice(["constant", "poisson"]),
    help=_mode_help("distribution"),
)
@click.option("--batch-size", "-b", type=int, default=1, help=_help("batch_size"))
@click.option("--shape", "shapes", multiple=True, callback=shapes_option, help=_help("shapes"))
@click.option("--input-data", type=click.Path(path_type=Path), help=_help("input_data"))
@click.option("--sequence-length", type=int, default=20, help=_help("sequence_length"))
@click.option(
    "--sequence-ids",
    type=click.Choice(["auto", "int", "string"]),
    default="auto",
    help=_help("sequence_ids"),
)
@click.option("--warmup-s", type=float, default=1.0, help=_help("warmup_s"))
@click.option("--window-s", type=float, default=2.0, help=_help("window_s"))
@click.option("--stability-pct", type=float, default=10.0, help=_help("stability_pct"))
@click.option("--max-windows", type=int, default=10, help=_help("max_windows"))
@click.option("--duration", "duration_s", type=float, help=_help("duration_s"))
@click.option("--workers", type=int, default=0, help=_help("workers"))
@click.option("--max-inflight", type=int, default=256, help=_help("max_inflight"))
@click.option("--timeout-s", type=float, help=_mode_help("timeout_s"))
@click.option("--seed", type=int, default=0, help=_help("seed"))
@click.option("--server-pid", type=int, help=_help("server_pid"))
@click.option("--price-per-hour", type=float, help=_help("price_per_hour"))
@click.option("--json", "json_path", type=_FILE, help=_help("json_path"))
@click.option("--csv", "csv_path", type=_FILE, help=_help("csv_path"))
@click.option("--report", "report_path", type=_FILE, help=_help("report_path"))
@click.option("--num-requests", type=int, default=100, help=_help("num_requests"))
@click.option("--prompt-tokens", default="256", help=_help("prompt_tokens"))
@click.option("--output-tokens", default="128", help=_help("output_tokens"))
@click.option("--prompts", "prompts_path", type=_FILE, help=_help("prompts_path"))
@click.option("--ignore-eos", is_flag=True, help=_help("ignore_eos"))
@click.option("--response-format", help=_help("response_format"))
@click.option("--goodput", multiple=True, help=_help("goodput"))
def bench(**options: Any) -> None:
    """Measure throughput and latency of MODEL on the server at URL, load level by level.

    \b
    Examples:
      slipstream bench http://localhost:8000 -m mlp --concurrency 1,8,64
      slipstream bench localhost:8001 -m mlp --protocol grpc --request-rate 100,500 \\
          --distribution poisson --json out.json --report out.html
      slipstream bench http://localhost:8000 -m accumulate --concurrency 4 \\
          --sequence-length 50
      slipstream bench http://localhost:8000 -m minilm --shape input_ids:128 \\
          --shape attention_mask:128 --batch-size 8 \\
          --server-pid "$(pgrep -f 'serve.*-port 8000' | head -1)"
      slipstream bench http://localhost:8000 -m smollm2 --protocol openai-chat \\
          --request-rate 1,2 --num-requests 50 --prompt-tokens 256,64 \\
          --output-tokens 64 --ignore-eos --goodput "ttft:500 tpot:100" --json llm.json
    """  # fmt: skip
    openai = options["protocol"] in _OPENAI_PROTOCOLS
    given = _given(options)
    wrong = sorted(given & (_V2_ONLY if openai else _OPENAI_ONLY))
    if wrong:
        mode = "OpenAI protocols" if openai else "V2 protocols (http, http-binary, grpc)"
        names = ", ".join(_option_name(name) for name in wrong)
        raise click.UsageError(f"{names}: not used with {mode}; leave it out")
    fields = OpenAIBenchSettings.model_fields if openai else BenchSettings.model_fields
    # None: not given, the mode's own default applies.
    values = {k: v for k, v in options.items() if k in fields and v is not None}
    _run(_validated(OpenAIBenchSettings, values) if openai else _validated(BenchSettings, values))


def _run(settings: BenchSettings | OpenAIBenchSettings) -> None:
    """settings -> run -> tables and files: the same three steps in either mode (each
    mode's runner.run_bench, report.RichProgress, print_tables and write_outputs)."""
    report: Any
    runner: Any
    try:
        from slipstream.bench.core.errors import BenchError
        from slipstream.bench.core.output import terminal_console

        if isinstance(settings, OpenAIBenchSettings):
            from slipstream.bench.openai import report, runner
        else:
            from slipstream.bench.v2 import report, runner
    except ImportError as exc:
        raise click.ClickException(f"{exc}; slipstream bench needs: {_INSTALL_HINT}") from None
    try:
        with report.RichProgress(terminal_console(stderr=True)) as progress:
            result = runner.run_bench(settings, progress)
    except BenchError as exc:
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    report.print_tables(result, terminal_console())
    try:
        report.write_outputs(settings, result, _echo_written)
    except ImportError as exc:
        raise click.ClickException(f"{exc}; --report needs: {_INSTALL_HINT}") from None
    if all(level.requests == 0 for level in result.levels):
        raise click.ClickException(
            f"every request failed; see the errors above ({runner.ALL_FAILED_HINT})"
        )


def _echo_written(path: Path) -> None:
    click.echo(f"wrote {path}", err=True)


def _given(options: dict[str, Any]) -> set[str]:
    """The options given on the command line (not left at their defaults)."""
    context = click.get_current_context()
    return {
        name
        for name in options
        if context.get_parameter_source(name) not in (ParameterSource.DEFAULT, None)
    }


def _option_name(field: str) -> str:
    """The option that sets a settings field, as the command declares it (--json for
    json_path)."""
    params = click.get_current_context().command.params
    return next(max(param.opts, key=len) for param in params if param.name == field)


def _validated(settings: type[Settings], values: dict[str, Any]) -> Settings:
    try:
        return settings(**values)
    except ValidationError as exc:
        messages = []
        for problem in exc.errors():
            message = str(problem["msg"]).removeprefix("Value error, ")
            field = problem["loc"][0] if problem["loc"] else None
            if isinstance(field, str) and field in settings.model_fields:
                message = f"{_option_name(field)}: {message}"
            messages.append(message)
        raise click.UsageError("; ".join(messages)) from None
