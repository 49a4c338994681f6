"""Activation smoothing before int8 quantization (SmoothQuant, Xiao et al., 2023).

Dynamic int8 gives each MatMul input one scale for the whole tensor, so a few input
channels far larger than the rest (all-MiniLM-L6-v2's feed-forward inputs reach 28
where the median channel stays near 1.3) leave the others only a few of the 256 levels.
Smoothing divides input channel ``j`` by ``s_j`` and multiplies row ``j`` of the weight by
it, which leaves ``x @ W`` unchanged in FP32::

    s_j = max|x_j| ** alpha / max|W_j,:| ** (1 - alpha)
    x @ W == (x / s) @ (diag(s) @ W)

``alpha`` moves the outliers from the activations (quantized per tensor) into the
weights (quantized per output channel); the best value depends on the model, which is
why ``optimize.int8_search`` tries several on calibration rows. ``max|x_j|`` comes from
those rows too.

The division is a ``Mul`` by ``1 / s`` in front of each group of MatMuls that read the
same tensor (Q, K and V share one). It cannot be folded into the LayerNormalization
before it in a post-LN transformer, whose output also feeds the residual path, so it
costs one elementwise pass over the input (~2-5 % of MiniLM's int8 time at batch 8).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from slipstream.optimize.data import Dataset
from slipstream.optimize.onnx_edit import sort_topologically

__all__ = ["channel_absmax", "smooth_model", "weight_matmuls"]

# Rows per run while recording activations: each recorded MatMul input of MiniLM at
# seq 128 is 16 * 128 * 1536 * 4 bytes = 12.6 MB per run at most.
_RECORD_BATCH_ROWS = 16
# Floor for scales, so an all-zero channel or weight row does not divide by zero.
_MIN_MAGNITUDE = 1e-5


def weight_matmuls(model: onnx.ModelProto) -> dict[str, list[onnx.NodeProto]]:
    """MatMuls with a 2-D constant weight used by no other node, by the tensor they read.

    Only these can be smoothed (and only these does dynamic int8 quantize by default).
    """
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    readers: dict[str, int] = defaultdict(int)
    for node in graph.node:
        for name in node.input:
            readers[name] += 1
    groups: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in graph.node:
        if node.op_type != "MatMul" or len(node.input) != 2:
            continue
        weight = initializers.get(node.input[1])
        if weight is not None and len(weight.dims) == 2 and readers[node.input[1]] == 1:
            groups[node.input[0]].append(node)
    return dict(groups)


def channel_absmax(
    path: Path,
    rows: Dataset,
    on_progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, np.ndarray]:
    """``max|x_j|`` per channel (last dim) of every weight MatMul's input over ``rows``."""
    import onnxruntime as ort

    model = onnx.load(str(path))
    names = list(weight_matmuls(model))
    if not names:
        return {}
    del model.graph.output[:]
    for name in names:
        model.graph.output.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    options = ort.SessionOptions()
    # The recorded tensors are the MatMuls' inputs as the FP32 model computes them; a
    # fusion must not hide one of them.
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    absmax: dict[str, np.ndarray] = {}
    total = rows.num_rows
    for start in range(0, total, _RECORD_BATCH_ROWS):
        stop = min(start + _RECORD_BATCH_ROWS, total)
        outputs = session.run(names, rows.rows(start, stop).inputs)
        for name, value in zip(names, outputs, strict=True):
            value = np.asarray(value)
            largest = np.abs(value.reshape(-1, value.shape[-1])).max(axis=0)  # [K]
            absmax[name] = largest if name not in absmax else np.maximum(absmax[name], largest)
        if on_progress is not None:
            on_progress("recording activation ranges", stop, total)
    return absmax


def smooth_model(
    source: Path, target: Path, absmax: dict[str, np.ndarray], alpha: float
) -> list[str]:
    """Write ``source`` smoothed with ``alpha`` to ``target``; the MatMul nodes smoothed.

    ``absmax`` is :func:`channel_absmax` of ``source`` (or of a model with the same
    weight MatMuls). The FP32 outputs stay the same up to rounding.
    """
    if not 0 <= alpha <= 1:
        raise ValueError(f"smoothing alpha {alpha} is out of range; expected 0 <= alpha <= 1")
    model = onnx.load(str(source))
    graph = model.graph
    initializers = {init.name: init for init in graph.initializer}
    smoothed: list[str] = []
    for tensor, nodes in weight_matmuls(model).items():
        if tensor not in absmax:
            continue
        weights = [numpy_helper.to_array(initializers[node.input[1]]) for node in nodes]
        if any(w.shape[0] != absmax[tensor].shape[0] for w in weights):
            continue  # a broadcast MatMul whose input's last dim is not the weight's rows
        weight_rows = np.max([np.abs(w).max(axis=1) for w in weights], axis=0)  # [K]
        scale = np.maximum(absmax[tensor], _MIN_MAGNITUDE) ** alpha / np.maximum(
            weight_rows, _MIN_MAGNITUDE
        ) ** (1 - alpha)
        scale = scale.astype(np.float32)
        inverse_name = f"{tensor}_smooth_inverse"
        smoothed_name = f"{tensor}_smoothed"
        graph.initializer.append(numpy_helper.from_array(1.0 / scale, inverse_name))
        graph.node.append(
            helper.make_node("Mul", [tensor, inverse_name], [smoothed_name], f"{tensor}_smooth")
        )
        for node, weight in zip(nodes, weights, strict=True):
            scaled = (weight * scale[:, None]).astype(weight.dtype)
            initializers[node.input[1]].CopyFrom(numpy_helper.from_array(scaled, node.input[1]))
            node.input[0] = smoothed_name
            smoothed.append(node.name)
    sort_topologically(graph)
    onnx.save(model, str(target))
    return smoothed
