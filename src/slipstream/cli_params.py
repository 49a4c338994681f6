"""Option parsing shared by the tool commands (profile, bench, optimize)."""

from __future__ import annotations

import click


def parse_shape(text: str) -> tuple[str, tuple[int, ...], str | None]:
    """``name:d1,d2[:DATATYPE]`` -> (name, dims after the batch dim, datatype or None)."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or not parts[0]:
        raise click.BadParameter(
            f"{text!r}: expected NAME:D1,D2 (dims after the batch dim), e.g. input_ids:128",
            param_hint="--shape",
        )
    try:
        dims = tuple(int(d) for d in parts[1].split(",") if d.strip())
    except ValueError:
        dims = (0,)
    if not dims or any(d < 1 for d in dims):
        raise click.BadParameter(f"{text!r}: dims must be positive integers", param_hint="--shape")
    return parts[0], dims, parts[2].upper() if len(parts) == 3 else None


def shapes_option(
    _ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]
) -> dict[str, list[int]]:
    """Callback for a repeatable ``--shape NAME:D1,D2`` (no datatype part)."""
    shapes = {}
    for text in values:
        name, dims, datatype = parse_shape(text)
        if datatype is not None:
            raise click.BadParameter(
                f"{text!r}: a datatype is only taken by `slipstream profile`", param_hint="--shape"
            )
        shapes[name] = list(dims)
    return shapes


def batch_sizes_option(_ctx: click.Context, _param: click.Parameter, value: str) -> list[int]:
    """Callback for ``--batch-sizes 1,2,4``: distinct positive integers, ascending."""
    try:
        sizes = sorted({int(item) for item in value.split(",") if item.strip()})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        raise click.BadParameter(f"{value!r}: expected positive integers like 1,2,4,8")
    return sizes
