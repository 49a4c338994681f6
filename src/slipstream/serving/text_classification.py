"""Text classification on a V2 model that names a ``tokenizer``: what vLLM's ``/classify``
answers, each input's class probabilities and the likeliest class's name.

A **classifier** answers one row of logits per text from its first output, of shape
``[C]`` with C >= 2 (a transformers ``*ForSequenceClassification`` with ``num_labels``
>= 2, exported), and says so in one of three ways: the output has Triton's
``label_filename``, the transformers ``config.json`` beside the tokenizer file has an
``id2label`` of C classes, or the output is named ``logits`` (as transformers' and
optimum's ONNX exports name it). Any other model with a tokenizer is an embedding model
(or, with one logit, a cross-encoder), refused naming ``model``.

A class's name (``label``) is, the first found: its line of the ``label_filename`` file
(as Triton's classification extension reads it), its ``id2label`` entry, or its index as
a string (``"0"``, ``"1"``...). ``probs`` are the logits' softmax, as vLLM answers
(transformers' ``problem_type`` in config.json: ``multi_label_classification`` takes a
sigmoid per class, ``regression`` the logits as they are), or the raw logits without
``activation``; ``label`` is the class with the highest of them, the first on a tie.

The texts are tokenized as :class:`~slipstream.serving.scoring.Scorer` tokenizes them
(padding nothing, cut at ``truncate_prompt_tokens`` or where the tokenizer file cuts;
token ids are cut the same way) and run as rows of the model's own queue, in pieces of
at most ``max_batch_size`` (:meth:`Embedder.run`), so they batch with other traffic.

    classifier = Classifier(embedder, scorer, service, repository)
    found = await classifier.classify("sentiment", ["great film", "dull"])
    found.labels  # ["positive", "negative"]
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import orjson

from slipstream.config import ConfigError, ModelConfig
from slipstream.errors import InvalidRequest, SlipstreamError
from slipstream.repository.layout import contained_file, model_path
from slipstream.serving.embeddings import (
    Embedder,
    is_cross_encoder,
    text_model_config,
    token_ids,
    tokenize,
)
from slipstream.serving.scoring import Scorer
from slipstream.serving.service import InferenceService

Activation = Literal["softmax", "sigmoid", "none"]
# A file's identity for the cache: (mtime_ns, size), None where it does not exist.
_Stamp = tuple[int, int] | None


@dataclass(frozen=True, slots=True)
class Classified:
    """What :meth:`Classifier.classify` answers."""

    # Each input's class probabilities (the raw logits without activation): [inputs, C].
    probs: np.ndarray
    # Each input's likeliest class's name.
    labels: list[str]
    # Tokens the model ran, all inputs together.
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class ClassNames:
    """What a model's files say of its classes."""

    # Class index -> name, from label_filename or id2label (empty: the indices).
    names: dict[int, str]
    # Where the names came from: "label_filename", "id2label" or "" (none).
    source: str
    # What turns the logits into probabilities (config.json's problem_type).
    activation: Activation


class Classifier:
    """Classifies texts on the V2 models that name a tokenizer; see the module docstring."""

    def __init__(
        self, embedder: Embedder, scorer: Scorer, service: InferenceService, repository: Path
    ) -> None:
        self._embedder = embedder
        self._scorer = scorer
        self._service = service
        self._repository = repository
        # (model, tokenizer, label_filename) -> (the label file, the config.json): their
        # paths resolved once (each resolution costs file-system calls).
        self._paths: dict[tuple[str, str, str], tuple[Path | None, Path]] = {}
        # The class names last read, and the stamps of the two files they were read from:
        # a reload that changes either file is seen on its next request.
        self._read: dict[tuple[str, str, str], tuple[tuple[_Stamp, _Stamp], ClassNames]] = {}

    async def classify(
        self,
        model: str,
        inputs: list[str | list[int]],
        *,
        truncate: int | None = None,
        activation: bool = True,
        route_key: str = "",
    ) -> Classified:
        """Each input's class probabilities and likeliest class. ``inputs``: texts or
        token id lists (already checked non-empty and >= 0); ``truncate``: vLLM's
        ``truncate_prompt_tokens`` (-1 or None: where the tokenizer file cuts).

        InvalidRequest (400) naming ``model`` for a model that is no classifier
        (generative, without a tokenizer, a cross-encoder, an embedding model),
        ``truncate_prompt_tokens`` for a length the model cannot take, ``input`` for an
        id beyond the vocabulary or more tokens than ``max_request_tokens``;
        ModelNotFound (404) naming ``model`` for one not served.
        """
        config = await self._config(model)
        classes = self._known_class_names(model, config)
        if classes is None:
            classes = await asyncio.to_thread(self._class_names, model, config)
        _check_classifier(model, config, classes)
        tokenizer = await self._scorer.tokenizer(model, config, truncate, pair=False)
        rows = await tokenize(sum(len(item) for item in inputs), token_ids, tokenizer, inputs)
        for index, row in enumerate(rows):
            if not row:
                where = "input" if len(rows) == 1 else f"input[{index}]"
                raise InvalidRequest(f"{where}: holds no token once tokenized; send text")
        logits, tokens = await self._embedder.run(model, config, rows, route_key)
        if logits.ndim != 2 or logits.shape[1] < 2 or logits.dtype.kind not in "iuf":
            raise InvalidRequest(
                f"model: {model!r} answers {list(logits.shape[1:])} {logits.dtype} per text, "
                "not a row of two or more numeric class logits; it is not a classifier"
            )
        probs = _activated(logits, classes.activation if activation else "none")
        best = np.argmax(probs, axis=1)
        labels = [classes.names.get(int(i), str(int(i))) for i in best]
        return Classified(probs, labels, tokens)

    async def _config(self, model: str) -> ModelConfig:
        config = await text_model_config(
            self._service, model, "/classify serves text classifiers",
            f"model: {model!r} is not a classifier: its config.yaml names no tokenizer",
        )  # fmt: skip
        if not config.output:
            raise InvalidRequest(f"model: {model!r} is not a classifier: it has no output")
        return config

    def _known_class_names(self, model: str, config: ModelConfig) -> ClassNames | None:
        """The class names read before, if neither file changed since: two stat calls,
        which cost less than the hop to a thread that reading them takes (~100 us); None
        when they must be read."""
        key = (model, config.tokenizer, config.output[0].label_filename)
        paths, found = self._paths.get(key), self._read.get(key)
        if paths is None or found is None or found[0] != (_stamp(paths[0]), _stamp(paths[1])):
            return None
        return found[1]

    def _class_names(self, model: str, config: ModelConfig) -> ClassNames:
        """The model's class names and activation, read again only when a file changed."""
        key = (model, config.tokenizer, config.output[0].label_filename)
        paths = self._paths.get(key)
        if paths is None:
            paths = self._paths[key] = self._resolve(model, config)
        label_file, hf_config = paths
        stamps = (_stamp(label_file), _stamp(hf_config))
        found = self._read.get(key)
        if found is not None and found[0] == stamps:
            return found[1]
        names = _read_class_names(model, label_file, hf_config)
        self._read[key] = (stamps, names)
        return names

    def _resolve(self, model: str, config: ModelConfig) -> tuple[Path | None, Path]:
        """The label file (None without one) and the config.json beside the tokenizer."""
        try:
            directory = model_path(self._repository, model)
            output = config.output[0]
            label_file = (
                contained_file(directory, output.label_filename, "label_filename")
                if output.label_filename
                else None
            )
            beside = str(Path(config.tokenizer).parent / "config.json")
            hf_config = contained_file(directory, beside, "config.json")
        except (ConfigError, SlipstreamError) as exc:
            raise InvalidRequest(f"model: {model!r}: {exc}") from None
        return label_file, hf_config


def _stamp(path: Path | None) -> _Stamp:
    if path is None:
        return None
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_mtime_ns, found.st_size


def _read_class_names(model: str, label_file: Path | None, hf_config: Path) -> ClassNames:
    """Class names from the label file, else from config.json's id2label; the activation
    from config.json's problem_type."""
    settings: dict[str, Any] = {}
    try:
        text = hf_config.read_bytes()
    except OSError:
        text = b""
    if text:
        try:
            loaded = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise InvalidRequest(
                f"model: {model!r}: {hf_config} (beside its tokenizer) is not valid JSON: {exc}"
            ) from None
        settings = loaded if isinstance(loaded, dict) else {}
    activation: Activation = "softmax"
    if settings.get("problem_type") == "multi_label_classification":
        activation = "sigmoid"
    elif settings.get("problem_type") == "regression":
        activation = "none"
    if label_file is not None:
        try:
            lines = label_file.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidRequest(f"model: {model!r}: label_filename {label_file}: {exc}") from None
        return ClassNames(dict(enumerate(lines)), "label_filename", activation)
    id2label = settings.get("id2label")
    if isinstance(id2label, dict):
        names = {int(k): str(v) for k, v in id2label.items() if str(k).isdigit()}
        if names:
            return ClassNames(names, "id2label", activation)
    return ClassNames({}, "", activation)


def _check_classifier(model: str, config: ModelConfig, classes: ClassNames) -> None:
    """A 400 naming ``model`` unless its first output is a row of class logits."""
    output = config.output[0]
    if is_cross_encoder(config):
        raise InvalidRequest(
            f"model: {model!r} is not a classifier but a cross-encoder (one logit per "
            "text): score pairs of texts with /v1/score or /v1/rerank"
        )
    width = output.dims[-1] if output.dims else -1
    named = output.name == "logits" or classes.source == "label_filename"
    if classes.source == "id2label" and (width == -1 or width == len(classes.names)):
        named = True
    if len(output.dims) > 1 or not named:
        raise InvalidRequest(
            f"model: {model!r} is not a classifier but an embedding model: its first output "
            f"{output.name!r} {output.dims} names no classes (a classifier's is a row of "
            "logits named logits, or has a label_filename, or the config.json beside the "
            "tokenizer has an id2label of its width); embed with /v1/embeddings"
        )


def _activated(logits: np.ndarray, activation: Activation) -> np.ndarray:
    """[N, C] probabilities (float64) from [N, C] logits."""
    values = np.asarray(logits, dtype=np.float64)
    if activation == "softmax":  # shifted by each row's largest: exp cannot overflow
        shifted = np.exp(values - values.max(axis=1, keepdims=True))
        return np.asarray(shifted / shifted.sum(axis=1, keepdims=True))
    if activation == "sigmoid":  # as tanh, without exp's overflow for large logits
        return np.asarray(0.5 * (1.0 + np.tanh(0.5 * values)))
    return values
