"""The chat template stored in a GGUF file, rendered as transformers renders it."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any


class ChatTemplate:
    """The GGUF's ``tokenizer.chat_template``, rendered as transformers renders it."""

    def __init__(self, source: str, bos: str, eos: str) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise
        environment.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
        self._template = environment.from_string(source)
        # Templates that render tools read the `tools` variable.
        self.knows_tools = "tools" in source
        self._bos, self._eos = bos, eos

    @classmethod
    def from_model(cls, lib: Any, model: Any, vocab: Any) -> ChatTemplate | None:
        source = lib.llama_model_chat_template(model, None)
        if not source:
            return None

        def text(token: int) -> str:
            if token < 0:
                return ""
            raw = lib.llama_vocab_get_text(vocab, token)
            return raw.decode("utf-8", errors="replace") if raw else ""

        bos = text(lib.llama_vocab_bos(vocab))
        eos = text(lib.llama_vocab_eos(vocab))
        return cls(source.decode("utf-8", errors="replace"), bos, eos)

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text of ``messages``, ready to answer. ``variables``: more of the
        template's variables (vLLM's ``chat_template_kwargs``); the ones set here win."""
        return str(
            self._template.render({
                **(variables or {}), "messages": messages, "tools": tools,
                "add_generation_prompt": True, "bos_token": self._bos, "eos_token": self._eos,
            })
        )  # fmt: skip


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _raise(message: str) -> None:
    raise ValueError(message)
