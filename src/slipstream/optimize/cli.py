"""``slipstream optimize``: transform a model, gate it on accuracy, write a new version.

rich is imported when the command runs, so ``slipstream --help`` works without it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

import click

from slipstream.cli_params import batch_sizes_option, shapes_option
from slipstream.optimize.gate import METRIC_NAMES
from slipstream.optimize.passes import ActivationScales, CalibrationMethodName, GraphLevel

if TYPE_CHECKING:
    from rich.console import Console

    from slipstream.optimize.core import OptimizationResult


@click.command()
@click.option(
    "--model",
    type=click.Path(path_type=Path),
    required=True,
    help="An ONNX file, or REPO/NAME (its newest version's model.onnx); for prune and "
    "distill a PyTorch whole module saved with torch.save(module, 'model.pt') "
    "(loaded with weights_only=False: only files you trust).",
)
@click.option(
    "--repository",
    type=click.Path(path_type=Path),
    required=True,
    help="Model repository the new version is written into.",
)
@click.option("--name", required=True, help="Model name (directory) in the repository.")
@click.option(
    "--passes",
    required=True,
    help="Comma-separated passes: prune or distill (PyTorch models), graph, fp16, "
    "int8-dynamic, int8-static. They run in that order whatever order is given.",
)
@click.option(
    "--validation",
    type=click.Path(path_type=Path, exists=True),
    required=True,
    help="Validation rows: .npz, a directory of .npy files, or a V2 JSON request "
    "file; arrays named like the inputs, plus optional 'labels'.",
)
@click.option(
    "--calibration",
    type=click.Path(path_type=Path, exists=True),
    help="Calibration rows for int8-static and the int8-dynamic search [default: the "
    "first rows of --validation, at most 128 and half of them; the gate judges the rest].",
)
@click.option(
    "--train",
    type=click.Path(path_type=Path, exists=True),
    help="Labelled rows (same formats as --validation) prune fine-tunes on and distill "
    "trains the student on [prune without it: no fine-tuning].",
)
@click.option(
    "--student",
    default="mlp-medium",
    show_default=True,
    help="distill: a preset (mlp-tiny, mlp-small, mlp-medium, cnn-small), "
    "package.module:factory called with (input_shape, num_classes), or a .pt module.",
)
@click.option(
    "--prune-ratio",
    type=click.FloatRange(0, 1, min_open=True, max_open=True),
    default=0.5,
    show_default=True,
    help="prune: share of each layer's channels / neurons removed (smallest L1 norm).",
)
@click.option(
    "--epochs",
    type=click.IntRange(min=1),
    default=30,
    show_default=True,
    help="prune fine-tuning / distill training passes over the --train rows.",
)
@click.option(
    "--temperature",
    type=click.FloatRange(0, min_open=True),
    default=4.0,
    show_default=True,
    help="distill: softmax temperature for teacher and student.",
)
@click.option(
    "--alpha",
    type=click.FloatRange(0, 1),
    default=0.7,
    show_default=True,
    help="distill: weight of the teacher (KL) loss; 1 - alpha weighs the label loss.",
)
@click.option(
    "--metric",
    type=click.Choice(METRIC_NAMES),
    help="Gate metric [default: top1 with labels, agreement for classifiers, "
    "cosine for embeddings].",
)
@click.option(
    "--max-drop",
    type=float,
    help="Largest accepted drop: percentage points for top1/agreement (0 to 100), "
    "1-cosine for cosine (0 to 1), absolute error for mae/maxae (>= 0) "
    "[default: 1.0, 1.0, 0.01, 0.01, 0.1].",
)
@click.option("--output", "output_name", help="Model output the gate compares [default: first].")
@click.option(
    "--batch-size",
    "batch_sizes",
    default="1,8",
    callback=batch_sizes_option,
    show_default=True,
    help="Batch sizes the before/after speed profile measures.",
)
@click.option(
    "--shape",
    "shapes",
    multiple=True,
    callback=shapes_option,
    help="NAME:D1,D2 dims after the batch dim of a variable-dim input for the speed "
    "profile's random inputs (repeatable) [default: the profile runs the validation rows].",
)
@click.option(
    "--graph-level",
    type=click.Choice(get_args(GraphLevel)),
    default="basic",
    show_default=True,
    help="graph pass level: basic keeps standard ONNX ops (portable, quantizable); "
    "extended writes ONNX Runtime-only fused ops.",
)
@click.option(
    "--op-types",
    default="MatMul",
    show_default=True,
    help="Comma-separated op types the int8 passes quantize.",
)
@click.option(
    "--per-channel/--no-per-channel",
    default=True,
    show_default=True,
    help="int8-dynamic: one weight scale per output channel.",
)
@click.option(
    "--activation-scales",
    type=click.Choice(get_args(ActivationScales)),
    default="run",
    show_default=True,
    help="int8-dynamic: one activation scale per run (ONNX Runtime's fused "
    "DynamicQuantizeMatMul, fastest; a request's answer moves a little with what the "
    "server batches it with) or per row (answers independent of batch mates; unfused, "
    "about 1.3-1.8x slower).",
)
@click.option(
    "--int8-search/--no-int8-search",
    default=True,
    show_default=True,
    help="int8-dynamic: if plain int8 misses the gate on the calibration rows, try "
    "activation smoothing (SmoothQuant) strengths, then keep the most damaging nodes in "
    "FP32, and keep the fastest candidate that passes there. The choice, the excluded "
    "nodes and every candidate's score go into optimization.json.",
)
@click.option(
    "--calibration-method",
    type=click.Choice(get_args(CalibrationMethodName)),
    default="minmax",
    show_default=True,
    help="int8-static activation range method.",
)
@click.option(
    "--profile-seconds",
    type=float,
    default=0.3,
    show_default=True,
    help="Timed seconds per batch size in the before/after speed profile.",
)
@click.option(
    "--rollout",
    is_flag=True,
    help="Then have the server at --url load the new version and start a canary rollout "
    "of it against the version serving now (the model's config must serve both: "
    "version_policy: {all: {}}, written so when --rollout finds no config.yaml).",
)
@click.option("--url", default="http://127.0.0.1:8000", show_default=True,
              help="--rollout: the server's HTTP address.")  # fmt: skip
@click.option("--api-key", envvar="SLIPSTREAM_API_KEY", default="",
              help="--rollout: an admin key, when the server has --auth-file.")  # fmt: skip
@click.option("--rollout-steps", default="5,25,50,100", show_default=True,
              help="--rollout: candidate traffic percent of each step.")  # fmt: skip
@click.option("--rollout-interval", default="60s", show_default=True,
              help="--rollout: analysis window per step.")  # fmt: skip
def optimize(**options: Any) -> None:
    """Optimize a model, check its accuracy, and write it as a new version.

    \b
    Example:
      slipstream optimize --model models/mlp --repository models --name mlp \\
          --passes graph,int8-dynamic --validation val.npz
      slipstream optimize --model teacher.pt --repository models --name digits \\
          --passes distill --student mlp-tiny --train train.npz --validation val.npz
      slipstream optimize --model models/mlp --repository models --name mlp \\
          --passes int8-dynamic --validation val.npz --rollout --url http://127.0.0.1:8000
    """  # fmt: skip
    from rich.console import Console

    from slipstream.optimize.core import OptimizeError, OptimizeRequest, optimize_model
    from slipstream.optimize.passes import PassSettings

    settings = PassSettings(
        graph_level=options["graph_level"],
        int8_op_types=tuple(t.strip() for t in options["op_types"].split(",") if t.strip()),
        per_channel=options["per_channel"],
        activation_scales=options["activation_scales"],
        int8_search=options["int8_search"],
        calibration_method=options["calibration_method"],
        prune_ratio=options["prune_ratio"],
        student=options["student"],
        epochs=options["epochs"],
        temperature=options["temperature"],
        alpha=options["alpha"],
    )
    request = OptimizeRequest(
        model=options["model"],
        repository=options["repository"],
        name=options["name"],
        passes=options["passes"].split(","),
        validation=options["validation"],
        calibration=options["calibration"],
        train=options["train"],
        metric=options["metric"],
        max_drop=options["max_drop"],
        output_name=options["output_name"],
        settings=settings,
        batch_sizes=options["batch_sizes"],
        shapes=options["shapes"],
        profile_seconds=options["profile_seconds"],
    )
    console = Console(stderr=True)
    plan = _rollout_plan(options, request.repository / request.name) if options["rollout"] else None
    try:
        result = _run_with_progress(request, optimize_model, console)
    except OptimizeError as exc:
        raise click.UsageError(str(exc)) from None
    _report(result, console)
    if not result.gate.passed:
        sys.exit(1)
    if plan is not None and result.version is not None:
        _start_rollout(options, request.name, result.version, plan, console)


def _rollout_plan(options: dict[str, Any], model_dir: Path) -> dict[str, Any]:
    """The rollout --rollout will start, checked before any work; a model without a
    config gets one that serves every version (the baseline stays loaded)."""
    from slipstream.rollout_client import parse_duration

    try:
        steps = [float(s) for s in options["rollout_steps"].split(",") if s.strip()]
        interval_s = parse_duration(options["rollout_interval"])
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    if any((model_dir / name).exists() for name in ("config.yaml", "config.yml")):
        from slipstream.config import ConfigError
        from slipstream.repository.layout import read_config, read_model_directory

        try:
            policy = read_config(read_model_directory(model_dir)).version_policy
        except (ConfigError, OSError) as exc:
            raise click.UsageError(str(exc)) from None
        if len(policy.select([1, 2])) < 2:
            raise click.UsageError(
                f"--rollout: {model_dir}/config.yaml serves only one version, so loading the "
                "new one would retire the baseline; add version_policy: {all: {}}"
            )
    else:
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "config.yaml").write_text(
            "# Written by slipstream optimize --rollout: baseline and candidate both serve.\n"
            "version_policy:\n  all: {}\n"
        )
    return {"action": "start", "steps": steps, "interval_s": interval_s}


def _start_rollout(
    options: dict[str, Any], name: str, version: int, plan: dict[str, Any], console: Console
) -> None:
    from slipstream.rollout_client import (
        RolloutClientError,
        format_status,
        publish_version,
        rollout_request,
    )

    try:
        publish_version(options["url"], name, version, options["api_key"])
        status = rollout_request(
            options["url"], name, {**plan, "candidate": str(version)}, options["api_key"]
        )
    except RolloutClientError as exc:
        raise click.ClickException(f"version {version} written, but no rollout: {exc}") from None
    console.print(format_status(status))


def _run_with_progress(request: Any, run: Any, console: Console) -> OptimizationResult:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), console=console
    ) as progress:
        tasks: dict[str, Any] = {}

        def on_progress(task: str, done: int, total: int) -> None:
            if task not in tasks:
                label = task if "(" in task else f"{task} (rows)"
                tasks[task] = progress.add_task(label, total=total)
            progress.update(tasks[task], completed=done, total=total)

        result: OptimizationResult = run(request, on_progress)
    return result


def _report(result: OptimizationResult, console: Console) -> None:
    from rich.table import Table

    console.print(f"passes: {', '.join(record.name for record in result.passes)}")
    console.print(
        f"size: {result.size_bytes_before / 1e6:.2f} MB -> {result.size_bytes_after / 1e6:.2f} MB"
    )
    if result.speed_before:
        table = Table("batch", "p50 ms before", "p50 ms after", "infer/s before", "infer/s after")
        for before, after in zip(result.speed_before, result.speed_after, strict=True):
            table.add_row(
                str(before.batch_size),
                _fmt(before.p50_ms),
                _fmt(after.p50_ms),
                _fmt(before.throughput_infer_per_s),
                _fmt(after.throughput_infer_per_s),
            )
        console.print(table)
    for note in result.notes:
        console.print(f"note: {note}")
    console.print(result.gate.summary)
    if result.version_dir is not None:
        console.print(f"wrote {result.version_dir / 'model.onnx'} (version {result.version})")
    else:
        console.print("nothing written: the optimized model did not pass the accuracy gate")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
