"""What an ONNX model's weights take in memory, for its ``memory_usage`` statistics.

An ONNX Runtime session on the CPU holds each of the model's initializers (the graph's
and its subgraphs', sparse ones and ``Constant`` nodes' values, external data included)
as a tensor of its own, so their bytes are a floor under what a loaded instance holds.
What the session allocates besides (its arena, pre-packed copies, the activations of a
run) ONNX Runtime does not tell, and is not counted.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# TensorProto.DataLocation.EXTERNAL: the tensor's bytes are in a file beside the model.
_EXTERNAL = 1


def initializer_bytes(path: Path) -> int | None:
    """The bytes of the model's initializers; None where they cannot be read: ONNX
    Runtime's own ``.ort`` format, or the ``onnx`` package not installed (it is not a
    dependency of the server)."""
    if path.suffix.lower() != ".onnx":
        return None
    try:
        import onnx
    except ImportError:
        return None
    # The graph only: external data is sized from its entries, never read.
    model = onnx.load(str(path), load_external_data=False)
    total = 0
    for graph in _graphs(model.graph):
        for tensor in graph.initializer:
            total += _tensor_bytes(tensor, path.parent)
        for sparse in graph.sparse_initializer:
            total += _tensor_bytes(sparse.values, path.parent)
            total += _tensor_bytes(sparse.indices, path.parent)
        for node in graph.node:
            if node.op_type == "Constant":
                for attribute in node.attribute:
                    if attribute.HasField("t"):
                        total += _tensor_bytes(attribute.t, path.parent)
    return total


def _graphs(graph: Any) -> Iterator[Any]:
    """``graph`` and its subgraphs (If, Loop, Scan bodies)."""
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("g"):
                yield from _graphs(attribute.g)
            for subgraph in attribute.graphs:
                yield from _graphs(subgraph)


def _tensor_bytes(tensor: Any, directory: Path) -> int:
    """One TensorProto's bytes: its raw data, typed fields, or external data's extent."""
    import onnx

    if tensor.data_location == _EXTERNAL:
        entries = {entry.key: entry.value for entry in tensor.external_data}
        if "length" in entries:
            return int(entries["length"])
        try:  # no length: the data runs from its offset to the end of its file
            size: int = (directory / entries.get("location", "")).stat().st_size
        except OSError:
            return 0
        return max(0, size - int(entries.get("offset", 0)))
    if tensor.raw_data:
        return len(tensor.raw_data)
    if tensor.data_type == onnx.TensorProto.STRING:
        return sum(len(value) for value in tensor.string_data)
    try:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    except (KeyError, ValueError):  # UNDEFINED, or a type this onnx does not know
        return 0
    return int(math.prod(tensor.dims)) * int(itemsize)
