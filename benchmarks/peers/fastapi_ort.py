"""A plain FastAPI + uvicorn V2 endpoint calling ONNX Runtime once per request.

The baseline most teams write first: no batching, no binary tensors, one ORT call per
request. It is written to be fast at that (raw body parsed with orjson, ORT called
inline on the event loop, which for a sub-millisecond model beats a thread hop), so the
comparison is against a good plain server, not a strawman. Runs in its own venv
(`.bench-venvs/fastapi`) so FastAPI never becomes a Slipstream dependency.

Example:
    taskset -c 0 .bench-venvs/fastapi/bin/python benchmarks/peers/fastapi_ort.py \
        --model models/mlp/1/model.onnx --name mlp --http-port 8020
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import onnxruntime as ort
import orjson
import uvicorn
from fastapi import FastAPI, HTTPException, Request, Response

_NUMPY_DTYPES = {"FP32": np.float32, "FP64": np.float64, "INT64": np.int64, "INT32": np.int32}
_V2_DTYPES = {np.dtype(v): k for k, v in _NUMPY_DTYPES.items()}


def _decode_inputs(body: bytes) -> dict[str, np.ndarray]:
    try:
        request = orjson.loads(body)
        return {
            spec["name"]: np.asarray(spec["data"], dtype=_NUMPY_DTYPES[spec["datatype"]]).reshape(
                spec["shape"]
            )
            for spec in request["inputs"]
        }
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise HTTPException(status_code=400, detail=f"bad V2 request: {exc}") from exc


def build_app(model_path: str, name: str) -> FastAPI:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(model_path, options, providers=["CPUExecutionProvider"])
    output_names = [o.name for o in session.get_outputs()]
    app = FastAPI()

    @app.get("/v2/health/ready")
    async def ready() -> dict[str, bool]:
        return {"ready": True}

    @app.post("/v2/models/{model_name}/infer")
    async def infer(model_name: str, request: Request) -> Response:
        if model_name != name:
            raise HTTPException(status_code=404, detail=f"unknown model {model_name!r}")
        inputs = _decode_inputs(await request.body())
        results = session.run(output_names, inputs)
        payload: dict[str, Any] = {
            "model_name": name,
            "outputs": [
                {
                    "name": out_name,
                    "datatype": _V2_DTYPES[array.dtype],
                    "shape": list(array.shape),
                    "data": array.ravel().tolist(),
                }
                for out_name, array in zip(output_names, results, strict=True)
            ],
        }
        return Response(orjson.dumps(payload), media_type="application/json")

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="path to model.onnx")
    parser.add_argument("--name", required=True, help="model name to serve it under")
    parser.add_argument("--http-port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(
        build_app(args.model, args.name),
        host="127.0.0.1",
        port=args.http_port,
        log_level="warning",
        access_log=False,
        loop="uvloop",
        http="httptools",
    )


if __name__ == "__main__":
    main()
