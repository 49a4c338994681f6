"""``cascade:`` in a model's config.yaml: a model that is a chain of other models.

The first stage answers every request; the rows of a request whose confidence (read
from one of the stage's outputs through a small rule) is below the stage's threshold
are sent on to the next stage, local or remote (any V2 HTTP endpoint: another
Slipstream, Triton, KServe). A cascade has no model file of its own; its inputs and
outputs are its first stage's.

Example (``REPO/digits_cascade/config.yaml``)::

    cascade:
      stages:
        - model: digits_small
          confidence: {output: probabilities, rule: max_probability, threshold: 0.9}
        - model: digits
          # or a remote stage: url: https://big.example.com, api_key_env: BIG_KEY
      on_stage_failure: answer   # or fail
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from slipstream.config.base import Strict as _Strict
from slipstream.names import MODEL_NAME_RULE, model_name_problem

# How a row's confidence is read from a stage's output (the last axis of each row):
# max_probability: the largest value (a softmax's top class probability);
# margin: the largest value minus the second largest (top-1 minus top-2);
# value: the output holds the confidence itself, one number per row ([B] or [B, 1]).
CONFIDENCE_RULES = ("max_probability", "margin", "value")


class ConfidenceRule(_Strict):
    """``confidence:`` of a stage: rows below ``threshold`` go on to the next stage."""

    output: str = Field(min_length=1, description="the stage's output the confidence is read from")
    rule: Literal["max_probability", "margin", "value"] = Field(
        "max_probability",
        description="max_probability: the top value of the row; margin: top-1 minus "
        "top-2; value: the output is the confidence ([B] or [B, 1])",
    )
    softmax: bool = Field(
        False, description="apply a softmax to the output first (it holds logits)"
    )
    threshold: float = Field(
        description="a row whose confidence is below this is escalated to the next stage "
        "(`slipstream cascade calibrate` picks it from labelled data)",
    )


class CascadeStage(_Strict):
    """One stage: a model of this server's repository, or a model behind a V2 URL."""

    model: str = Field(min_length=1, description="the model's name (here or at `url`)")
    version: str = Field(
        "", pattern=r"^([1-9][0-9]*)?$", description="a version number; empty: the default"
    )
    name: str = Field(
        "",
        description="how responses and metrics name the stage; default: the model's name "
        "(a remote stage: <model>@<host:port>)",
    )
    url: str = Field(
        "",
        description="a remote stage: the V2 HTTP endpoint's base URL "
        "(http[s]://host:port[/prefix]); empty: a model of this server",
    )
    api_key_env: str = Field(
        "",
        description="a remote stage: the environment variable holding its API key, sent "
        "as Authorization: Bearer <key> (keys stay out of config files)",
    )
    timeout_s: float = Field(10.0, gt=0, description="a remote stage: one call's time limit")
    max_connections: int = Field(
        32, ge=1, le=1024, description="a remote stage: pooled keep-alive connections at most"
    )
    confidence: ConfidenceRule | None = Field(
        None, description="when this stage's answer stands; required on every stage but the last"
    )

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str) -> str:
        if not url:
            return url
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"expected http[s]://host:port[/prefix], got {url!r}")
        if parts.query or parts.fragment:
            raise ValueError(f"{url!r}: a base URL takes no query or fragment")
        return url.rstrip("/")

    @model_validator(mode="after")
    def _check_model(self) -> CascadeStage:
        if not self.url:
            problem = model_name_problem(self.model)
            if problem is not None:
                raise ValueError(f"model: {self.model[:64]!r} {problem}; {MODEL_NAME_RULE}")
            if self.api_key_env:
                raise ValueError("api_key_env applies to a remote stage (with url) only")
        if not self.name:
            self.name = f"{self.model}@{urlsplit(self.url).netloc}" if self.url else self.model
        return self

    @property
    def remote(self) -> bool:
        return bool(self.url)


class CascadeConfig(_Strict):
    """``cascade:`` in config.yaml: the stages, in order, and what a failed stage does."""

    stages: list[CascadeStage] = Field(
        min_length=2,
        description="the first answers every request; each next one the rows "
        "the one before was not confident about",
    )
    on_stage_failure: Literal["answer", "fail"] = Field(
        "answer",
        description="a stage after the first fails (a remote one is unreachable, say): "
        "answer: return the previous stage's answer, marked cascade_fallback; fail: "
        "answer 503 naming the stage",
    )

    @model_validator(mode="after")
    def _check_stages(self) -> CascadeConfig:
        for index, stage in enumerate(self.stages[:-1]):
            if stage.confidence is None:
                raise ValueError(
                    f"stages[{index}] ({stage.name}): needs confidence: {{output, rule, "
                    "threshold}} (every stage but the last decides which rows go on)"
                )
        if self.stages[-1].confidence is not None:
            raise ValueError(
                f"stages[{len(self.stages) - 1}] ({self.stages[-1].name}): the last stage "
                "answers every row it gets; remove its confidence"
            )
        names = [stage.name for stage in self.stages]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"stage names must differ; set name: on the stages {duplicates}")
        return self
