"""``slipstream tune``: the cheapest configuration and hardware that meets an SLO.

Only click is imported with the ``slipstream`` CLI; the tuner (bench's load generator,
rich, matplotlib, optuna) loads when the command runs.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from slipstream.cli_params import shapes_option

if TYPE_CHECKING:
    from slipstream.tune.progress import RichTuneProgress

_INSTALL_HINT = "pip install 'slipstream[bench,tune]'"
# Exit codes beside 0: no configuration met the SLO; interrupted (after the report).
EXIT_SLO_UNMET = 3
EXIT_INTERRUPTED = 130


def _finite(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """A click range lets nan (and inf) through; the settings they reach refuse them
    with a traceback, so they are a usage error naming the flag here."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number", ctx, param)
    return value


@click.command("tune")
@click.argument("model_dir", type=click.Path(path_type=Path, file_okay=False))
@click.option("--slo", required=True,
              help="Latency bounds every measured level must meet: FIGURE=MS, comma-"
              "separated; FIGURE is avg_ms, p50_ms, p90_ms, p95_ms or p99_ms.")  # fmt: skip
@click.option("--min-throughput", type=click.FloatRange(min=0, min_open=True),
              callback=_finite, help="Inferences/s a configuration must serve.")  # fmt: skip
@click.option("--max-accuracy-drop", type=click.FloatRange(min=0),
              help="Largest accuracy drop of a model variant, in its gate metric's unit "
              "(as optimize's --max-drop); variants over it are listed, not searched.")  # fmt: skip
@click.option("--validation", type=click.Path(path_type=Path, exists=True, dir_okay=True),
              help="Rows to measure each variant's accuracy drop on (.npz, .npy directory, "
              "V2 JSON) instead of reading optimization.json.")  # fmt: skip
@click.option("--profiles", type=click.Path(path_type=Path, exists=True, dir_okay=False),
              help="Hardware catalogue (YAML); default: this machine's cores.")  # fmt: skip
@click.option("--price-per-hour", type=click.FloatRange(min=0), callback=_finite,
              help="Price of this machine when no --profiles is given.")  # fmt: skip
@click.option("--mode", type=click.Choice(["brute", "quick", "optuna"]), default="quick",
              show_default=True, help="brute: every configuration; quick: hill climbing; "
              "optuna: TPE with early stopping.")  # fmt: skip
@click.option("--trials", type=click.IntRange(min=1),
              help="Most configurations measured [default: all for brute; a fifth of the "
              "space, at least 10, for quick and optuna (optuna may stop before)].")  # fmt: skip
@click.option("--batch-sizes", default="1,4,8,16,32", show_default=True,
              help="max_batch_size values searched.")  # fmt: skip
@click.option("--queue-delays-us", default="0,1000,4000", show_default=True,
              help="dynamic_batching.max_queue_delay_microseconds values searched.")  # fmt: skip
@click.option("--instances", default="1,2", show_default=True,
              help="instance_group count values searched.")  # fmt: skip
@click.option("--threads", default="1,2", show_default=True,
              help="intra_op_thread_count values searched.")  # fmt: skip
@click.option("--backends", default="auto", show_default=True,
              help="Backends each ONNX variant is also served on, comma-separated "
              "(onnxruntime, openvino); auto: every installed one.")  # fmt: skip
@click.option("--remeasure", type=click.IntRange(min=0), default=3, show_default=True,
              help="Measure the best N configurations once more (figures become medians "
              "with a spread).")  # fmt: skip
@click.option("--patience", type=click.IntRange(min=1), default=15, show_default=True,
              help="optuna: stop after this many trials without a better one.")  # fmt: skip
@click.option("--warmup-s", type=click.FloatRange(min=0), callback=_finite, default=0.5,
              show_default=True,
              help="Warm-up per load level (bench's --warmup-s).")  # fmt: skip
@click.option("--window-s", type=click.FloatRange(min=0, min_open=True), callback=_finite,
              default=1.0, show_default=True,
              help="Measurement window (bench's --window-s).")  # fmt: skip
@click.option("--max-windows", type=click.IntRange(min=3), default=6, show_default=True,
              help="Windows per level before giving up on stability.")  # fmt: skip
@click.option("--max-concurrency", type=click.IntRange(min=1), default=64, show_default=True,
              help="Highest concurrency a trial's load sweep reaches.")  # fmt: skip
@click.option("--input-data", type=click.Path(path_type=Path, exists=True),
              help="Requests from a file (bench's --input-data); default random.")  # fmt: skip
@click.option("--shape", "shapes", multiple=True, callback=shapes_option,
              help="Dims of variable-size inputs, NAME:D1,D2 (bench's --shape).")  # fmt: skip
@click.option("--out", "out_dir", type=click.Path(path_type=Path, file_okay=False),
              default=Path("tune-out"), show_default=True,
              help="Directory of tune.json, tune.html and the trials' server logs.")  # fmt: skip
@click.option("--apply", "apply_winner", is_flag=True,
              help="Write the winner as a new version of the model (model file and "
              "config.yaml), which a polling server loads.")  # fmt: skip
@click.option("--seed", type=int, default=0, show_default=True, help="optuna's seed.")
def tune(**options: Any) -> None:
    """Find the cheapest configuration of MODEL_DIR (REPO/NAME) that meets an SLO.

    Each trial serves one configuration with a real `slipstream serve` pinned to a
    hardware profile's cores and measures it with bench's core. Exit code 3 when no
    configuration meets the SLO (the report shows the closest).

    \b
    Examples:
      slipstream tune models/mlp --slo p99_ms=10 --price-per-hour 0.17
      slipstream tune models/minilm --slo p99_ms=80 --profiles catalogue.yaml \\
          --shape input_ids:128 --shape attention_mask:128 --mode optuna \\
          --max-accuracy-drop 0.01 --apply
    """  # fmt: skip
    try:
        from slipstream.bench.core.output import terminal_console
        from slipstream.tune import report
        from slipstream.tune.session import run_tune
    except ImportError as exc:
        raise click.ClickException(f"{exc}; slipstream tune needs: {_INSTALL_HINT}") from None
    tune_options = _tune_options(options)
    console = terminal_console(stderr=True)
    from slipstream.tune.settings import TuneInputError

    try:
        with _LiveProgress(console) as progress:
            result = run_tune(tune_options, progress)
    except TuneInputError as exc:
        raise click.UsageError(str(exc)) from None
    report.print_leaderboard(result, terminal_console())
    for path in report.write_outputs(result, options["out_dir"]):
        click.echo(f"wrote {path}", err=True)
    if options["apply_winner"] and result.winner is not None and not result.interrupted:
        from slipstream.tune.apply import apply_winner
        from slipstream.tune.session import raw_config

        version = apply_winner(result, tune_options.model_dir, raw_config(tune_options.model_dir))
        result.applied_version = version
        report.write_json(result, options["out_dir"] / "tune.json")
        click.echo(f"applied: {tune_options.model_dir / str(version)}", err=True)
    if result.interrupted:
        sys.exit(EXIT_INTERRUPTED)
    if result.winner is None:
        sys.exit(EXIT_SLO_UNMET)


def _tune_options(options: dict[str, Any]) -> Any:
    from slipstream.tune.measure import MeasureSettings
    from slipstream.tune.session import TuneOptions
    from slipstream.tune.settings import (
        TuneInputError,
        int_list,
        load_catalogue,
        parse_slo,
        this_machine,
    )

    try:
        if options["profiles"] is not None and options["price_per_hour"] is not None:
            raise TuneInputError("--price-per-hour: give prices in the --profiles catalogue")
        catalogue = (
            load_catalogue(options["profiles"])
            if options["profiles"] is not None
            else this_machine(options["price_per_hour"])
        )
        if options["validation"] is not None and options["max_accuracy_drop"] is None:
            raise TuneInputError("--validation: give --max-accuracy-drop too")
        return TuneOptions(
            model_dir=options["model_dir"],
            slo=parse_slo(options["slo"], options["min_throughput"]),
            catalogue=catalogue,
            work_dir=options["out_dir"] / "trials",
            mode=options["mode"],
            trials=options["trials"],
            max_accuracy_drop=options["max_accuracy_drop"],
            validation=options["validation"],
            batch_sizes=int_list(options["batch_sizes"], "--batch-sizes", minimum=1),
            queue_delays_us=int_list(options["queue_delays_us"], "--queue-delays-us"),
            instances=int_list(options["instances"], "--instances", minimum=1),
            threads=int_list(options["threads"], "--threads", minimum=1),
            backends=tuple(b.strip() for b in options["backends"].split(",") if b.strip()),
            remeasure_top=options["remeasure"],
            patience=options["patience"],
            seed=options["seed"],
            measure=MeasureSettings(
                url="",
                model="",
                warmup_s=options["warmup_s"],
                window_s=options["window_s"],
                max_windows=options["max_windows"],
                max_concurrency=options["max_concurrency"],
                input_data=str(options["input_data"]) if options["input_data"] else None,
                shapes=options["shapes"],
            ),
        )
    except TuneInputError as exc:
        raise click.UsageError(str(exc)) from None


def _LiveProgress(console: Any) -> RichTuneProgress:
    from slipstream.tune.progress import RichTuneProgress

    return RichTuneProgress(console)
