"""``slipstream profile``: the in-process runtime ceiling of one model, per batch size.

rich, psutil and matplotlib are imported when the command runs, not when the
``slipstream`` CLI starts, so ``slipstream --help`` works without the bench extra.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from slipstream.cli_params import batch_sizes_option, parse_shape
from slipstream.runtime import BACKEND_NAMES

if TYPE_CHECKING:
    import numpy as np
    from rich.console import Console
    from rich.table import Table

    from slipstream.config import ModelConfig
    from slipstream.profile.results import BatchProfile, OpTime, ProfileResult

_INSTALL_HINT = "pip install 'slipstream[bench]'"
# Node names are paths ("/encoder/layer.5/output/dense/MatMul"): their end tells most.
_NODE_NAME_WIDTH = 40


def _check_report(_ctx: click.Context, _param: click.Parameter, value: Path | None) -> Path | None:
    """Refuse a report that cannot be written before spending the profile's time."""
    import importlib.util

    from slipstream.profile.results import REPORT_SUFFIXES

    if value is not None and value.suffix.lower() not in REPORT_SUFFIXES:
        raise click.BadParameter(f"{value}: expected a .html or .png file name")
    if value is not None and importlib.util.find_spec("matplotlib") is None:
        raise click.BadParameter(f"charts need matplotlib: {_INSTALL_HINT}")
    return value


def resolve_model(path: Path, backend: str | None) -> tuple[Path, str | None, ModelConfig | None]:
    """A model file as given, or a repository model directory's newest version's file;
    and its model's config where it is in a repository (``REPO/<model>/<version>/file``),
    which the model is then loaded and configured with, as the server does."""
    from slipstream.config import ConfigError
    from slipstream.repository.layout import (
        model_file,
        read_config,
        read_model_directory,
        version_number,
    )

    in_repository = version_number(path.parent.name) is not None and path.is_file()
    if not path.is_dir() and not in_repository:
        return path, backend, None
    try:
        directory = read_model_directory(path if path.is_dir() else path.parent.parent)
        if path.is_dir() and not directory.versions:
            raise ConfigError(f"{path}: no version directories (1/, 2/, ...) with a model file")
        config = read_config(directory)
        file = model_file(path / str(directory.versions[-1]), config) if path.is_dir() else path
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="MODEL_FILE") from None
    return file, backend or config.backend or None, config


def _load_npz(path: Path) -> dict[str, np.ndarray]:
    from slipstream.tensors import TensorFileError, read_tensor_file

    try:
        [arrays] = read_tensor_file(path)
    except TensorFileError as exc:
        raise click.BadParameter(str(exc), param_hint="--input-data") from None
    except ValueError:  # several requests: profile feeds one set of arrays
        raise click.BadParameter(
            f"{path}: holds several requests; give one set of arrays (.npz, .npy files, "
            "or one V2 request)",
            param_hint="--input-data",
        ) from None
    return arrays


@click.command()
@click.argument("model_file", type=click.Path(exists=True, path_type=Path))
@click.option(
    "--backend",
    type=click.Choice(BACKEND_NAMES),
    help="Runtime backend. [default: by file type: .onnx onnxruntime, .pt/.pt2 torch, "
    ".joblib sklearn]",
)
@click.option(
    "--batch-sizes",
    default="1,2,4,8,16,32,64",
    show_default=True,
    callback=batch_sizes_option,
    help="Comma-separated batch sizes to time.",
)
@click.option(
    "--shape",
    "shapes",
    multiple=True,
    metavar="NAME:D1,D2[:DATATYPE]",
    help="Dims after the batch dim for an input with variable dims, e.g. input_ids:128. "
    "DATATYPE (default FP32) only for models that declare no inputs. Repeatable.",
)
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Intra-op threads; 1 makes every figure per core.",
)
@click.option(
    "--seconds",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="Timed seconds per batch size, after the warm-up runs.",
)
@click.option(
    "--warmup-runs",
    type=click.IntRange(min=0),
    default=2,
    show_default=True,
    help="Untimed runs before each batch size.",
)
@click.option(
    "--top-ops",
    type=click.IntRange(min=0),
    default=10,
    show_default=True,
    help="Operators (and nodes) to list from ONNX Runtime's profiler.",
)
@click.option(
    "--sequence-length",
    type=click.IntRange(min=1),
    default=20,
    show_default=True,
    help="Stateful models (sequence_batching): runs per sequence; each row of a batch is "
    "its own sequence, with the controls and state the server gives it.",
)
@click.option("--no-op-profile", is_flag=True, help="Skip the ONNX Runtime operator profile.")
@click.option(
    "--input-data",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A .npz of real inputs by name; rows are taken or tiled to each batch size.",
)
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Write figures as JSON.")
@click.option(
    "--csv", "csv_path", type=click.Path(path_type=Path), help="Write one CSV row per batch size."
)
@click.option(
    "--report",
    type=click.Path(path_type=Path),
    callback=_check_report,
    help="Write charts: an .html page (charts embedded) or a .png image.",
)
def profile(**options: Any) -> None:
    """Profile a model in-process: latency and throughput per batch size, memory, top ops.

    No server runs: this is the raw runtime's ceiling that a server can approach.
    MODEL_FILE is a model file or a repository model directory (its newest version).
    A model in a repository is loaded as the server loads it: its config's parameters,
    then the completed config handed to it (a Python model's initialize; finalize at
    the end). A stateful model's runs are sequences (--sequence-length).
    Integer inputs get random values in [0, 1000) (masks ones, token-type ids zeros);
    pass --input-data for real data.

    \b
    Examples:
      slipstream profile models/mlp/1/model.onnx --json mlp.json --report mlp.html
      taskset -c 0 slipstream profile models/minilm \\
          --shape input_ids:128 --shape attention_mask:128 --batch-sizes 1,8,32
    """  # fmt: skip
    console, progress = _consoles()
    path, backend, config = resolve_model(options["model_file"], options["backend"])
    progress.print(
        f"Profiling {path}: batch sizes {','.join(map(str, options['batch_sizes']))}, "
        f"{options['seconds']:g} s each, {options['threads']} intra-op thread(s)",
        highlight=False,
        soft_wrap=True,
    )
    result = _run_profile(path, backend, config, options, progress)
    print_result(result, console)
    from slipstream.profile.results import write_csv, write_json, write_report

    for key, write in (
        ("json_path", write_json),
        ("csv_path", write_csv),
        ("report", write_report),
    ):
        if options[key] is not None:
            write(result, options[key])
            progress.print(f"wrote {options[key]}", highlight=False, soft_wrap=True)


def _consoles() -> tuple[Console, Console]:
    """Consoles for the result (stdout) and for progress (stderr)."""
    try:
        from rich.console import Console
    except ModuleNotFoundError:
        raise click.ClickException(f"slipstream profile needs rich: {_INSTALL_HINT}") from None
    return Console(), Console(stderr=True)


def _run_profile(
    path: Path,
    backend: str | None,
    config: ModelConfig | None,
    options: dict[str, Any],
    progress: Console,
) -> ProfileResult:
    from slipstream.profile.measure import ProfileError, profile_model
    from slipstream.runtime.base import BackendUnavailable

    parsed = [parse_shape(text) for text in options["shapes"]]
    input_data = _load_npz(options["input_data"]) if options["input_data"] else None
    try:
        return profile_model(
            path,
            options["batch_sizes"],
            shapes={name: dims for name, dims, _ in parsed},
            threads=options["threads"],
            seconds=options["seconds"],
            backend=backend,
            datatypes={name: datatype for name, _, datatype in parsed if datatype},
            input_data=input_data,
            top_ops=options["top_ops"],
            op_profile=not options["no_op_profile"],
            warmup_runs=options["warmup_runs"],
            config=config,
            sequence_length=options["sequence_length"],
            on_batch=lambda batch: progress.print(
                _progress_line(batch), highlight=False, soft_wrap=True
            ),
        )
    except ModuleNotFoundError as exc:  # psutil
        raise click.ClickException(
            f"slipstream profile needs {exc.name}: {_INSTALL_HINT}"
        ) from None
    except (ProfileError, BackendUnavailable, ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from None


def _progress_line(batch: BatchProfile) -> str:
    if batch.status != "ok":
        return f"  batch {batch.batch_size}: {batch.status.replace('_', ' ')} ({batch.reason})"
    return (
        f"  batch {batch.batch_size}: p50 {batch.p50_ms:.3f} ms, "
        f"{batch.throughput_infer_per_s:,.1f} infer/s ({batch.runs} runs)"
    )


def print_result(result: ProfileResult, console: Console) -> None:
    """The profile as rich tables: batches (best marked), memory, top operators."""
    from rich.table import Table

    from slipstream.profile.results import (
        batch_cells,
        has_gpu,
        memory_line,
        op_profile_line,
        summary_line,
    )

    console.print(
        f"[bold]{result.model_path}[/bold]: {summary_line(result)}", highlight=False, soft_wrap=True
    )
    for item in result.inputs:
        console.print(
            f"  input {item.name} {item.datatype} {list(item.shape)}: {item.source}",
            highlight=False,
            soft_wrap=True,
        )
    gpu = has_gpu(result)
    table = Table("batch", "runs", "p50 ms", "p90 ms", "p99 ms", "infer/s", "infer/s@p50",
                  *(["GPU%"] if gpu else []), "", box=None)  # fmt: skip
    for batch in result.batches:
        best = batch.batch_size == result.best_batch_size and batch.status == "ok"
        mark = "<- best" if best else batch.reason
        table.add_row(*batch_cells(batch, gpu), mark, style="bold green" if best else None)
    console.print(table)
    console.print(memory_line(result), highlight=False, soft_wrap=True)
    if result.op_profile is not None:
        console.print(op_profile_line(result.op_profile), highlight=False, soft_wrap=True)
        runs = max(1, result.op_profile.runs)
        console.print(_ops_table(result.op_profile.top_ops, "op type", runs))
        console.print(_ops_table(result.op_profile.top_nodes, "node", runs))
    for note in result.notes:
        console.print(f"note: {note}", highlight=False, soft_wrap=True)


def _ops_table(ops: tuple[OpTime, ...], first: str, runs: int) -> Table:
    from rich.table import Table

    by_node = first == "node"
    table = Table(box=None)
    # As wide as the longest (shortened) name, so rich does not cut it further.
    width = max((len(_tail(op.name, _NODE_NAME_WIDTH)) for op in ops), default=len(first))
    table.add_column(first, min_width=width, no_wrap=True)
    for column in (["op type"] if by_node else []) + ["ms/run", "share", "calls/run"]:
        table.add_column(column)
    for op in ops:
        names = [_tail(op.name, _NODE_NAME_WIDTH), op.op_type] if by_node else [op.name]
        table.add_row(*names, f"{op.ms_per_run:.3f}", f"{op.share:.1%}", f"{op.calls / runs:g}")
    return table


def _tail(text: str, width: int) -> str:
    return text if len(text) <= width else "…" + text[-(width - 1) :]
