"""``slipstream export``: a model as a self-contained bundle; ``export verify`` checks one.

Only click is imported with the ``slipstream`` CLI; the exporter (optimize's passes,
onnxruntime's tools, OpenVINO) loads when the command runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

_TARGETS = ("edge", "mobile", "openvino")
_METRICS = ("top1", "agreement", "cosine", "mae", "maxae")


class _ExportGroup(click.Group):
    """``export [OPTIONS] MODEL_DIR`` builds; ``export verify BUNDLE`` checks."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        # Anything but a subcommand's name (or --help) is the build's arguments.
        if args and args[0] not in self.commands and args[0] != "--help":
            args = ["build", *args]
        return super().parse_args(ctx, args)


@click.group("export", cls=_ExportGroup)
def export() -> None:
    """Write a model as a self-contained bundle for a target, or verify a bundle.

    \b
    Targets:
      edge      INT8 ONNX (optimize's int8-dynamic pass and accuracy gate)
      mobile    the INT8 model in ONNX Runtime's .ort format, with the reduced
                operator config of a minimal ONNX Runtime build
      openvino  OpenVINO IR (model.xml + model.bin; needs slipstream[openvino])

    A bundle is a model repository entry as it is: config.yaml, the version directory,
    sample inputs with their expected outputs (.npz), and manifest.json (every file's
    size and SHA-256, the accuracy gate's figures, the runtime releases it was made with).

    \b
    Examples:
      slipstream export --target mobile models/minilm -o bundles/minilm \\
          --validation val.npz --calibration cal.npz
      slipstream export verify bundles/minilm --run
      slipstream serve --model-repository bundles
    """  # fmt: skip


@export.command("build")
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("--target", type=click.Choice(_TARGETS), required=True,
              help="edge (INT8 ONNX), mobile (INT8 .ort + operator config) or openvino "
              "(IR).")  # fmt: skip
@click.option("-o", "--out", type=click.Path(path_type=Path), required=True,
              help="The bundle directory to write; its name is the model's name when "
              "served.")  # fmt: skip
@click.option("--validation", type=click.Path(path_type=Path, exists=True), required=True,
              help="Rows the accuracy gate compares the bundle's model with the original on "
              "(.npz, .npy directory or V2 JSON); its first rows become the samples.")  # fmt: skip
@click.option("--calibration", type=click.Path(path_type=Path, exists=True),
              help="Rows the int8 search judges candidates on [default: the first rows of "
              "--validation, at most 128 and half of them].")  # fmt: skip
@click.option("--version", "version", type=click.IntRange(min=1),
              help="The version exported [default: the newest].")  # fmt: skip
@click.option("--metric", type=click.Choice(_METRICS),
              help="Gate metric [default: top1 with labels, agreement for classifiers, cosine "
              "for embeddings].")  # fmt: skip
@click.option("--max-drop", type=float, help="Largest accepted drop (optimize's --max-drop).")
@click.option("--output", "output_name", help="Model output the gate compares [default: first].")
@click.option("--op-types", default="MatMul,Gather", show_default=True,
              help="edge, mobile: op types the int8 pass quantizes.")  # fmt: skip
@click.option("--samples", type=click.IntRange(min=1), default=4, show_default=True,
              help="Validation rows shipped as sample inputs.")  # fmt: skip
@click.option("--mobile-platform", type=click.Choice(["arm", "amd64"]), default="arm",
              show_default=True,
              help="mobile: the CPU ONNX Runtime's converter optimizes for.")  # fmt: skip
@click.option("--ir-fp32", is_flag=True,
              help="openvino: keep the IR's weights in FP32 [default: FP16, half the "
              "size].")  # fmt: skip
@click.option("--overwrite", is_flag=True, help="Replace an existing bundle directory.")
def build(**options: Any) -> None:
    """Write MODEL_DIR (REPO/NAME) as a bundle for --target into -o OUT."""
    from slipstream.edge.export import ExportRequest, export_bundle
    from slipstream.edge.targets import ExportError, TargetOptions
    from slipstream.optimize import PassSettings

    op_types = tuple(t.strip() for t in options["op_types"].split(",") if t.strip())
    request = ExportRequest(
        model_dir=options["model_dir"],
        target=options["target"],
        out=options["out"],
        options=TargetOptions(
            validation=options["validation"],
            calibration=options["calibration"],
            metric=options["metric"],
            max_drop=options["max_drop"],
            output_name=options["output_name"],
            settings=PassSettings(int8_op_types=op_types, activation_scales="run"),
            mobile_platform=options["mobile_platform"],
            ir_fp16_weights=not options["ir_fp32"],
        ),
        version=options["version"],
        sample_rows=options["samples"],
        overwrite=options["overwrite"],
    )
    try:
        result = export_bundle(request)
    except ExportError as exc:
        raise click.ClickException(str(exc)) from None
    except ModuleNotFoundError as exc:
        # optimize's passes read and write ONNX with the onnx package.
        raise click.ClickException(
            f"slipstream export needs {exc.name}: pip install {exc.name}"
        ) from None
    manifest = result.manifest
    size = manifest.size
    click.echo(
        f"wrote {result.bundle}: {manifest.target} bundle of {manifest.name} version "
        f"{manifest.version} (backend {manifest.backend}), {len(manifest.files)} files"
    )
    click.echo(
        f"model {size['model_bytes'] / 1e6:.1f} MB, {100 * size['ratio']:.1f}% of the source "
        f"model's {size['source_model_bytes'] / 1e6:.1f} MB"
    )
    click.echo(result.gate.summary)


@export.command("verify")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--run", is_flag=True,
              help="Also run the sample inputs on the bundle's model here and compare the "
              "outputs with the shipped ones.")  # fmt: skip
def verify(bundle: Path, run: bool) -> None:
    """Check every file of BUNDLE against its manifest.json (presence, size, SHA-256).

    Exit code 1 names each missing, truncated or changed file.

    \b
    Example:
      slipstream export verify bundles/minilm --run
    """  # fmt: skip
    from slipstream.edge.manifest import BundleError, verify_bundle

    try:
        report = verify_bundle(bundle)
    except BundleError as exc:
        raise click.ClickException(str(exc)) from None
    for path in report.unlisted:
        click.echo(f"note: {path} is not in the manifest (not checked)", err=True)
    click.echo(f"{bundle}: {len(report.checked)} files match manifest.json (size and sha256)")
    if run:
        from slipstream.edge.export import check_samples
        from slipstream.runtime.base import BackendUnavailable

        try:
            problems = check_samples(bundle)
        except BackendUnavailable as exc:
            raise click.ClickException(str(exc)) from None
        if problems:
            raise click.ClickException("; ".join(problems))
        rows = report.manifest.samples.rows
        click.echo(f"{bundle}: the {rows} sample rows give the shipped outputs")
