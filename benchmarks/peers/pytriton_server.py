"""Triton (via PyTriton) serving one ONNX model through ONNX Runtime, for comparison.

Runs in its own venv (PyTriton pins numpy<2); `benchmarks/serving.py` creates it under
`.bench-venvs/pytriton`. Triton's own HTTP front end, dynamic batcher and Python backend
do the serving; the bound function runs one ORT call per batch Triton forms.

Example:
    taskset -c 0 .bench-venvs/pytriton/bin/python benchmarks/peers/pytriton_server.py \
        --model models/mlp/1/model.onnx --name mlp --http-port 8010
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import sysconfig
from typing import Any


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _ensure_libpython_on_path() -> None:
    """Re-exec with LD_LIBRARY_PATH naming this interpreter's lib directory.

    Triton's Python backend stub links libpython; without this it picks up the system
    one (or none) and the model never loads. The loader reads LD_LIBRARY_PATH only at
    process start, hence the re-exec rather than an os.environ update.
    """
    lib_dir = sysconfig.get_config_var("LIBDIR") or ""
    current = os.environ.get("LD_LIBRARY_PATH", "")
    if not lib_dir or lib_dir in current.split(":"):
        return
    os.environ["LD_LIBRARY_PATH"] = f"{lib_dir}:{current}" if current else lib_dir
    os.execv(sys.executable, [sys.executable, *sys.argv])


def _tensor_specs(session: Any) -> tuple[list[Any], list[Any]]:
    """Triton tensor specs from the ORT signature, dropping the leading batch dim."""
    import numpy as np
    from pytriton.model_config import Tensor

    dtypes = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(int32)": np.int32}

    def spec(arg: Any) -> Any:
        shape = tuple(d if isinstance(d, int) else -1 for d in arg.shape[1:])
        return Tensor(name=arg.name, dtype=dtypes[arg.type], shape=shape)

    return [spec(a) for a in session.get_inputs()], [spec(a) for a in session.get_outputs()]


def serve(model_path: str, name: str, http_port: int, max_batch_size: int) -> None:
    import numpy as np
    import onnxruntime as ort
    from pytriton.decorators import batch
    from pytriton.model_config import DynamicBatcher, ModelConfig
    from pytriton.triton import Triton, TritonConfig

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(model_path, options, providers=["CPUExecutionProvider"])
    inputs, outputs = _tensor_specs(session)
    output_names = [o.name for o in outputs]

    @batch  # type: ignore[untyped-decorator]
    def infer(**arrays: np.ndarray) -> dict[str, np.ndarray]:
        results = session.run(output_names, arrays)
        return dict(zip(output_names, results, strict=True))

    config = TritonConfig(
        http_address="127.0.0.1",
        http_port=http_port,
        grpc_address="127.0.0.1",
        grpc_port=_free_port(),
        metrics_port=_free_port(),
        log_verbose=0,
        exit_timeout_secs=3,  # the harness stops it after the load ends; nothing in flight
    )
    model_config = ModelConfig(
        max_batch_size=max_batch_size,
        batcher=DynamicBatcher(max_queue_delay_microseconds=0),
    )
    with Triton(config=config) as triton:
        triton.bind(
            model_name=name,
            infer_func=infer,
            inputs=inputs,
            outputs=outputs,
            config=model_config,
        )
        triton.serve()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="path to model.onnx")
    parser.add_argument("--name", required=True, help="model name to serve it under")
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--max-batch-size", type=int, default=64)
    args = parser.parse_args()
    _ensure_libpython_on_path()
    serve(args.model, args.name, args.http_port, args.max_batch_size)


if __name__ == "__main__":
    main()
