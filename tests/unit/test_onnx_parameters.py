"""The ONNX Runtime backend's config parameters: a value it would misread is refused."""

from __future__ import annotations

import pytest

from slipstream.runtime.onnx import session_options


@pytest.mark.parametrize(
    ("parameters", "named"),
    [
        ({"allow_spinning": "yes"}, "parameters.allow_spinning: 'yes'"),
        ({"allow_spinning": "true"}, "parameters.allow_spinning: 'true'"),
        ({"graph_optimization_level": "max"}, "parameters.graph_optimization_level: 'max'"),
    ],
)
def test_a_value_onnx_runtime_would_misread_is_refused_naming_it(
    parameters: dict[str, str], named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        session_options(parameters, 1)


def test_the_values_it_reads_are_taken() -> None:
    for spinning in ("0", "1"):
        options = session_options({"allow_spinning": spinning}, 1)
        assert options.get_session_config_entry("session.intra_op.allow_spinning") == spinning
