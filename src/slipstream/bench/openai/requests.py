"""The requests of an OpenAI-mode run: prompts of a chosen length, max_tokens, bodies.

No tokenizer is needed (or downloaded): a synthetic prompt is a run of common English
words, each a single token in the byte-level BPE vocabularies of Llama, GPT-2 and
SmolLM (a leading space included), so a prompt of N words is about N tokens. A chat
template adds its own few tokens; the server's ``usage.prompt_tokens`` is what the
report shows. Words are drawn at random per request, so no two prompts share a prefix
and a prefix cache cannot shortcut the prefill.

>>> import numpy as np
>>> len(synthetic_prompt(5, np.random.default_rng(0)).split())
5
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from slipstream.bench.openai.settings import OpenAIBenchSettings, OpenAIProtocol

# Tokens per word of _WORDS (with its leading space) in the vocabularies named above.
TOKENS_PER_WORD = 1.0
_WORD_TEXT = (
    "the of and to in is was for on are with as his they be at one have this from or had "
    "by word but what some we can out other were all there when up use your how said an "
    "each she which do their time if will way about many then them write would like so "
    "these her long make thing see him two has look more day could go come did number "
    "sound no most people my over know water than call first who may down side been now "
    "find any new work part take get place made live where after back little only round "
    "man year came show every good me give our under name very through just form great "
    "think say help low line turn cause much mean before move right boy old too same tell "
    "does set three want air well also play small end put home read hand port large spell "
    "add even land here must big high such follow act why ask men change went light kind "
    "off need house picture try us again animal point mother world near build self earth"
)
_WORDS = _WORD_TEXT.split()


@dataclass(frozen=True)
class GenerationRequest:
    """One request of the run, encoded once and sent at every load level."""

    # Position in the run's request list.
    index: int
    # Text, or token ids (completions only).
    prompt: str | list[int]
    # max_tokens sent with it.
    max_tokens: int
    # The JSON body, streamed with usage included.
    body: bytes


def synthetic_prompt(num_tokens: int, rng: np.random.Generator) -> str:
    """About ``num_tokens`` tokens of random common words (see the module docstring)."""
    count = max(1, round(num_tokens / TOKENS_PER_WORD))
    picks = rng.integers(0, len(_WORDS), size=count)
    return " ".join(_WORDS[i] for i in picks)


def read_prompts(path: Path) -> list[str]:
    """One prompt per non-empty line; a line starting with ``"`` is a JSON string."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"--prompts {path}: cannot read it: {exc.strerror or exc}") from None
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if line.startswith('"'):
            try:
                decoded = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise ValueError(
                    f"--prompts {path}, line {number}: starts with a quote but is not a "
                    f"JSON string: {exc}"
                ) from None
            if not isinstance(decoded, str):
                raise ValueError(f"--prompts {path}, line {number}: expected a JSON string")
            line = decoded
        prompts.append(line)
    if not prompts:
        raise ValueError(f"--prompts {path}: the file holds no prompt (one per line)")
    return prompts


def request_body(
    protocol: OpenAIProtocol,
    model: str,
    prompt: str | list[int],
    max_tokens: int,
    ignore_eos: bool,
    response_format: dict[str, Any] | None = None,
) -> bytes:
    """A streamed request with usage included; greedy, like vLLM's benchmark."""
    body: dict[str, object] = {"model": model}
    if protocol == "openai-chat":
        if not isinstance(prompt, str):
            raise ValueError("prompts: token-id prompts need --protocol openai-completions")
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body |= {
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    if response_format is not None:
        body["response_format"] = response_format
    return orjson.dumps(body)


def build_requests(
    settings: OpenAIBenchSettings, prompts: Sequence[str | list[int]] | None = None
) -> list[GenerationRequest]:
    """``settings.num_requests`` requests, the same for a given seed.

    Prompts come from ``prompts`` (texts, or token ids for completions; used in turn),
    else from ``settings.prompts_path``, else are synthesised at
    ``settings.prompt_tokens``. ValueError names a bad file or prompt.
    """
    rng = np.random.default_rng(settings.seed)
    count = settings.num_requests
    texts: list[str | list[int]]
    if prompts is None and settings.prompts_path is not None:
        prompts = read_prompts(settings.prompts_path)
    if prompts is not None:
        if not prompts:
            raise ValueError("prompts: expected at least one prompt")
        texts = [prompts[i % len(prompts)] for i in range(count)]
    else:
        texts = [synthetic_prompt(n, rng) for n in settings.prompt_tokens.draw(rng, count)]
    max_tokens = settings.output_tokens.draw(rng, count)
    return [
        GenerationRequest(
            index=i,
            prompt=text,
            max_tokens=limit,
            body=request_body(
                settings.protocol,
                settings.model,
                text,
                limit,
                settings.ignore_eos,
                settings.response_format,
            ),
        )
        for i, (text, limit) in enumerate(zip(texts, max_tokens, strict=True))
    ]
