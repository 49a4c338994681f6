"""A bundle's own check: its sample inputs must give its shipped sample outputs.

Light on purpose (numpy, the repository layout, the runtime): the device agent imports it
without optimize's passes. Example::

    problems = check_samples(Path("bundles/digits"))   # [] when every output matches
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from slipstream.config import ConfigError
from slipstream.datatypes import is_float
from slipstream.edge.manifest import Manifest, read_manifest
from slipstream.repository.layout import model_file, read_config, read_model_directory
from slipstream.runtime import get_backend

# Outputs may differ this much between runs of one model file (threads, instruction sets).
RTOL = 1e-4
ATOL = 1e-5


def read_samples(
    bundle: Path, manifest: Manifest
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The sample inputs and the outputs the bundle's model gave for them."""
    with np.load(bundle / manifest.samples.inputs) as stored:
        inputs = {name: stored[name] for name in stored.files}
    with np.load(bundle / manifest.samples.outputs) as stored:
        expected = {name: stored[name] for name in stored.files}
    return inputs, expected


def compare_samples(
    expected: dict[str, np.ndarray],
    got: dict[str, np.ndarray],
    where: str,
    rtol: float = RTOL,
    atol: float = ATOL,
) -> list[str]:
    """A problem per output of ``got`` that differs from ``expected`` beyond the tolerance
    (integer outputs must be equal); ``where`` says what answered."""
    problems = []
    for name, want in expected.items():
        if name not in got:
            problems.append(f"output {name!r}: missing from what {where} answers")
            continue
        if got[name].shape != want.shape:
            problems.append(
                f"output {name!r}: {where} answers shape {list(got[name].shape)}, the samples "
                f"{list(want.shape)}"
            )
            continue
        if is_float(want.dtype) or want.dtype.kind == "c":
            close = np.allclose(got[name], want, rtol=rtol, atol=atol)
        else:
            close = bool(np.array_equal(got[name], want))
        if not close:
            worst = float(np.max(np.abs(got[name].astype(np.float64) - want)))
            problems.append(
                f"output {name!r} differs from what {where} answers by up to {worst:.3g} "
                f"(rtol {rtol:g}, atol {atol:g})"
            )
    return problems


def check_samples(bundle: Path, rtol: float = RTOL, atol: float = ATOL) -> list[str]:
    """Run the bundle's sample inputs on its model here; a problem per output that differs
    from the shipped outputs beyond the tolerance (integer outputs must be equal)."""
    manifest = read_manifest(bundle)
    try:
        config = read_config(read_model_directory(bundle))
        path = model_file(bundle / str(manifest.version), config)
    except ConfigError as exc:
        return [str(exc)]
    inputs, expected = read_samples(bundle, manifest)
    model = get_backend(manifest.backend).load(path, config.parameters, 1)
    try:
        got = model.run(inputs, list(expected))
    finally:
        model.close()
    where = f"{path.name} here"
    return [
        f"{manifest.samples.outputs}: {problem}"
        for problem in compare_samples(expected, got, where, rtol, atol)
    ]
