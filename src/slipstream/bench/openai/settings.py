"""What one OpenAI-mode run of ``slipstream bench`` measures: validated settings.

The OpenAI mode (``--protocol openai-chat`` or ``openai-completions``) benchmarks a
generative model the way vLLM's ``benchmark_serving.py`` does: a fixed number of
streamed requests, sent at a Poisson rate or by a fixed number of users, each measured
for time to first token, time per output token, inter-token latency and end to end.
The field descriptions are the CLI's ``--help`` text.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from slipstream.bench.core.levels import Distribution
from slipstream.bench.core.settings import LoadSettings

if TYPE_CHECKING:  # numpy loads when a run starts, not with the CLI
    import numpy as np

OpenAIProtocol = Literal["openai-chat", "openai-completions"]
# The service-level objectives --goodput takes, as vLLM's benchmark_serving names them:
# time to first token, time per output token, end-to-end latency.
SLO_METRICS = ("ttft", "tpot", "e2el")


class TokenRange(BaseModel):
    """A length in tokens drawn per request: uniform in [mean - spread, mean + spread].

    >>> TokenRange.parse("128,32").bounds()
    (96, 160)
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    mean: int = Field(ge=1, description="Mean length in tokens.")
    spread: int = Field(0, ge=0, description="Lengths lie within mean +- spread.")

    @model_validator(mode="after")
    def _check(self) -> TokenRange:
        if self.spread >= self.mean:
            raise ValueError(
                f"a token range {self.mean},{self.spread} reaches 0 tokens: the spread must "
                "be smaller than the mean"
            )
        return self

    @classmethod
    def parse(cls, text: str) -> TokenRange:
        """``MEAN`` or ``MEAN,SPREAD``; ValueError names the expected form."""
        parts = [part.strip() for part in text.split(",")]
        if len(parts) > 2 or not all(part.isdigit() for part in parts):
            raise ValueError(f"{text!r}: expected MEAN or MEAN,SPREAD in tokens, like 128,32")
        return cls(mean=int(parts[0]), spread=int(parts[1]) if len(parts) == 2 else 0)

    @classmethod
    def of(cls, value: int | str | TokenRange) -> TokenRange:
        """A range from a mean, a ``MEAN,SPREAD`` string, or a range."""
        if isinstance(value, TokenRange):
            return value
        if isinstance(value, str):
            return cls.parse(value)
        return cls(mean=value)

    def bounds(self) -> tuple[int, int]:
        return self.mean - self.spread, self.mean + self.spread

    def draw(self, rng: np.random.Generator, count: int) -> list[int]:
        """``count`` lengths, each uniform over the range's integers."""
        low, high = self.bounds()
        return [int(n) for n in rng.integers(low, high + 1, size=count)]


def parse_goodput(values: list[str] | tuple[str, ...]) -> dict[str, float]:
    """``["ttft:500 tpot:50"]`` or ``["ttft:500", "tpot:50"]`` -> {"ttft": 500.0, ...}.

    >>> parse_goodput(["ttft:500,tpot:50", "e2el:3000"])
    {'ttft': 500.0, 'tpot': 50.0, 'e2el': 3000.0}
    """
    slos: dict[str, float] = {}
    for value in values:
        for item in re.split(r"[\s,]+", value.strip()):
            if not item:
                continue
            name, _, limit = item.partition(":")
            try:
                slos[name] = float(limit)
            except ValueError:
                raise ValueError(
                    f"--goodput {item!r}: expected METRIC:MILLISECONDS like ttft:500"
                ) from None
    return slos


class OpenAIBenchSettings(LoadSettings):
    """Every option of ``slipstream bench`` in OpenAI mode."""

    protocol: OpenAIProtocol = Field(
        "openai-chat",
        description="openai-chat: streamed /v1/chat/completions; openai-completions: "
        "streamed /v1/completions.",
    )
    distribution: Distribution = Field("poisson", description="Open loop: gaps between arrivals.")
    timeout_s: float = Field(300.0, gt=0, description="Per-request timeout, whole stream.")
    num_requests: int = Field(100, ge=1, description="OpenAI modes: requests sent per load level.")
    prompt_tokens: TokenRange = Field(
        default_factory=lambda: TokenRange(mean=256),
        description="OpenAI modes: prompt length in tokens, MEAN or MEAN,SPREAD (uniform "
        "in MEAN +- SPREAD). Synthetic prompts of common English words, about one token "
        "each; the server's usage counts are reported. [default: 256]",
    )
    output_tokens: TokenRange = Field(
        default_factory=lambda: TokenRange(mean=128),
        description="OpenAI modes: max_tokens per request, MEAN or MEAN,SPREAD. [default: 128]",
    )
    prompts_path: Path | None = Field(
        None,
        description="OpenAI modes: prompts from a file, one per line (a line starting "
        'with " is a JSON string, for prompts with newlines), used in turn; replaces '
        "--prompt-tokens.",
    )
    ignore_eos: bool = Field(
        False,
        description="OpenAI modes: ask for exactly max_tokens tokens (vLLM's ignore_eos "
        "extension), so output lengths do not depend on what the model says.",
    )
    response_format: dict[str, Any] | None = Field(
        None,
        description="OpenAI modes: constrain every reply (structured outputs), to measure "
        "what it costs: 'json_object', or a file holding a JSON schema (sent as "
        "json_schema, strict).",
    )
    goodput: dict[str, float] = Field(
        default_factory=dict,
        description="OpenAI modes: SLOs in ms, like 'ttft:500 tpot:50' (metrics ttft, "
        "tpot, e2el); goodput counts the requests per second meeting all of them.",
    )

    @field_validator("response_format", mode="before")
    @classmethod
    def _response_format(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        if value == "json_object":
            return {"type": "json_object"}
        try:
            schema = json.loads(Path(value).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"expected 'json_object' or a JSON schema file, got {value!r}: {exc}"
            ) from None
        return {"type": "json_schema",
                "json_schema": {"name": "bench", "schema": schema, "strict": True}}  # fmt: skip

    @field_validator("prompt_tokens", "output_tokens", mode="before")
    @classmethod
    def _token_range(cls, value: Any) -> Any:
        if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
            return TokenRange.of(value)
        return value

    @field_validator("goodput", mode="before")
    @classmethod
    def _goodput(cls, value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return parse_goodput(list(value))
        return value

    @model_validator(mode="after")
    def _check(self) -> OpenAIBenchSettings:
        for name, limit_ms in self.goodput.items():
            if name not in SLO_METRICS:
                raise ValueError(
                    f"--goodput {name}:{limit_ms:g}: unknown metric {name!r}; expected one of "
                    + ", ".join(SLO_METRICS)
                )
            if limit_ms <= 0:
                raise ValueError(f"--goodput {name}:{limit_ms:g}: the limit must be > 0 ms")
        return self

    @property
    def path(self) -> str:
        """The route requests go to, below the URL's path prefix."""
        return "/v1/chat/completions" if self.protocol == "openai-chat" else "/v1/completions"
