"""Per-request sampling for transformers' continuous batching, priced by what is asked.

transformers' own per-request processors sort the whole vocabulary for every row on
every step (top-k by a full sort, top-p by another, then softmax and multinomial over
the batch): for SmolLM2's 49k-token vocabulary and 20 sequences that measured 230 ms a
step on one core, more than the model's forward pass. These processors do only the work
each row needs, and pick the token themselves, so the engine runs with
``do_sample=False`` and its final step is a cheap argmax over one-hot rows:

- greedy rows (temperature 0 or top_k 1): an argmax;
- temperature: a division, only when some row's temperature is not 1;
- min_p (vLLM's): a softmax of the rows that set it, after temperature;
- top-k: ``torch.topk`` on the rows that set it, never a full sort;
- top-p: a sort of the rows that set it, only;
- seeded rows: the Gumbel-max trick with noise from a generator seeded by the request's
  seed and position, so the text depends only on the seed, never on the batch;
- other sampled rows: softmax and multinomial on those rows.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingLogitsProcessor,
)

from slipstream.llm.constraints import allowed_tokens
from slipstream.llm.engine import SamplingParams, TokenLogprob

# The int32 "pick" argument of a row: these codes, or a non-negative seed key.
_GREEDY = -2
_SAMPLE = -1
# What a processor that no row of the step needs hands the manager as its argument.
_NO_ARGS = torch.empty(0, dtype=torch.int32)


def sampling_kwargs(
    greedy: bool,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int | None,
    min_p: float = 0.0,
) -> dict[str, Any]:
    """The per-request kwargs these processors read (passed to ``add_request``)."""
    if greedy:
        return {"pick": _GREEDY}
    kwargs: dict[str, Any] = {"pick": _SAMPLE, "temperature": float(temperature)}
    if min_p > 0.0:
        kwargs["min_p"] = float(min_p)
    if top_k > 0:
        kwargs["top_k"] = int(top_k)
    if top_p < 1.0:
        kwargs["top_p"] = float(top_p)
    if seed is not None:
        kwargs["seed"] = int(seed)
    return kwargs


class _Step(ContinuousBatchingLogitsProcessor):
    """A processor that skips the steps no row needs it in.

    The manager calls ``prepare_tensor_args`` with the batch's requests and then, on the
    same thread before preparing another batch, ``__call__`` on that batch's scores. The
    first decides on the host, from the requests' kwargs, whether any row needs this
    processor (``active``); when none does it hands back no argument and the second
    returns the scores untouched. An all-greedy batch then costs no kernels, no
    host-device copies of arguments and no device synchronisation (``nonzero``,
    ``.any()``) per processor and step: what transformers' own greedy step does.
    """

    # True until a batch is prepared: a call without one processes every row.
    active = True

    def _floats(self, requests: list[Any], key: str, default: float) -> torch.Tensor:
        """Each request's float ``key`` (``default`` where unset) as int32 bits, the
        manager's argument layout; none, and inactive, when every one is the default."""
        values = [r.state.logit_processor_kwargs.get(key, default) for r in requests]
        self.active = any(value != default for value in values)
        if not self.active:
            return _NO_ARGS
        return torch.tensor(values, dtype=torch.float32).view(torch.int32)


class _Temperature(_Step):
    supported_kwargs = {"temperature": float}  # noqa: RUF012 - transformers' class layout
    ignored_kwargs: tuple[str, ...] = ()

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.copy_(torch.ones_like(int32_tensor, dtype=torch.float32).view(torch.int32))

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        return self._floats(requests_with_new_token, "temperature", 1.0)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        if self.active:
            temperatures = tensor_arg[: scores.size(0)].view(torch.float32)
            scores.div_(temperatures.clamp(min=1e-6).unsqueeze(-1))
        return scores


class _MinP(_Step):
    """vLLM's min_p, after temperature: a token stays when its probability is at least
    min_p times the most likely token's."""

    supported_kwargs = {"min_p": float}  # noqa: RUF012
    ignored_kwargs: tuple[str, ...] = ()

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(0)  # the bits of float32 0.0

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        return self._floats(requests_with_new_token, "min_p", 0.0)  # in [0, 1]

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return scores
        ps = tensor_arg[: scores.size(0)].view(torch.float32)
        rows = torch.nonzero(ps > 0.0).flatten()
        if rows.numel():
            selected = scores[rows]
            probs = selected.softmax(dim=-1)
            floor = probs.max(dim=-1, keepdim=True).values * ps[rows].unsqueeze(-1)
            scores[rows] = selected.masked_fill(probs < floor, -math.inf)
        return scores


class _TopK(_Step):
    supported_kwargs = {"top_k": int}  # noqa: RUF012
    ignored_kwargs: tuple[str, ...] = ()

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(0)

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        values = [r.state.logit_processor_kwargs.get("top_k", 0) for r in requests_with_new_token]
        self.active = any(value > 0 for value in values)
        if not self.active:
            return _NO_ARGS
        return torch.tensor(values, dtype=torch.int32)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return scores
        ks = tensor_arg[: scores.size(0)]
        rows = torch.nonzero((ks > 0) & (ks < scores.size(1))).flatten()
        if rows.numel():
            k = ks[rows].to(torch.int64)
            top = torch.topk(scores[rows], int(k.max())).values
            threshold = top.gather(1, (k - 1).unsqueeze(-1))
            selected = scores[rows]
            scores[rows] = selected.masked_fill(selected < threshold, -math.inf)
        return scores


class _TopP(_Step):
    supported_kwargs = {"top_p": float}  # noqa: RUF012
    ignored_kwargs: tuple[str, ...] = ()

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.copy_(torch.ones_like(int32_tensor, dtype=torch.float32).view(torch.int32))

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        return self._floats(requests_with_new_token, "top_p", 1.0)  # in (0, 1]

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return scores
        ps = tensor_arg[: scores.size(0)].view(torch.float32)
        rows = torch.nonzero(ps < 1.0).flatten()
        if rows.numel():
            selected = scores[rows]
            ordered, order = torch.sort(selected, descending=True, dim=-1)
            cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
            # Drop a token once the ones before it already reach p (the first always stays).
            drop = (cumulative - ordered.softmax(dim=-1)) >= ps[rows].unsqueeze(-1)
            scores[rows] = selected.masked_fill(drop.scatter(1, order, drop), -math.inf)
        return scores


class _Pick(_Step):
    """Chooses each row's token and leaves it the only possible one."""

    supported_kwargs = {"pick": int, "seed": int}  # noqa: RUF012
    ignored_kwargs: tuple[str, ...] = ()

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(_GREEDY)

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        codes = []
        for request in requests_with_new_token:
            kwargs = request.state.logit_processor_kwargs
            code = kwargs.get("pick", _GREEDY)
            seed = kwargs.get("seed")
            if code == _SAMPLE and seed is not None:
                code = _step_key(seed, request.state.generated_len())
            codes.append(code)
        # All greedy: the engine's own argmax picks each row's token from the scores as
        # they are.
        self.active = any(code != _GREEDY for code in codes)
        if not self.active:
            return _NO_ARGS
        return torch.tensor(codes, dtype=torch.int32)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return scores
        codes = tensor_arg[: scores.size(0)]
        picks = torch.argmax(scores, dim=-1)
        sampled = torch.nonzero(codes == _SAMPLE).flatten()
        if sampled.numel():
            probs = torch.softmax(scores[sampled], dim=-1)
            picks[sampled] = torch.multinomial(probs, 1).flatten()
        for row in torch.nonzero(codes >= 0).flatten().tolist():
            generator = torch.Generator().manual_seed(int(codes[row]))
            # Drawn on the host, so a seed gives the same noise on every device.
            uniform = torch.rand(scores.size(1), generator=generator).clamp_(min=1e-20)
            gumbel = torch.log(-torch.log(uniform)).to(scores.device)
            picks[row] = torch.argmax(scores[row] - gumbel)
        scores.fill_(-math.inf)
        scores.scatter_(1, picks.unsqueeze(-1), 0.0)
        return scores


def install(manager: Any, registry: ExtrasRegistry) -> None:
    """Add the processors to a manager built with ``do_sample=False`` (before start)."""
    processors = manager.logit_processor
    steps: list[ContinuousBatchingLogitsProcessor] = [
        _Penalties(registry), _Temperature(), _Logprobs(registry), _Mask(registry),
        _MinP(), _TopK(), _TopP(), _Pick(), _Record(registry),
    ]  # fmt: skip
    for processor in steps:
        processors.logits_processor.append(processor)
        processors.tensors_required += 1
    processors._retrieve_processors_kwargs()
    processors.do_processing = True


def _step_key(seed: int, step: int) -> int:
    """A non-negative int32 from (seed, step): a distinct noise stream per position."""
    mixed = (seed * 0x9E3779B1 + step * 0x85EBCA77 + 0x165667B1) & 0xFFFFFFFF
    return mixed & 0x7FFFFFFF


# -- what only some requests ask for: penalties, bias, logprobs, constraints ---------------


class RequestExtras:
    """One request's penalties, logit bias, logprobs, constraint and min_tokens, and what
    they need to remember across steps. The processors below find it by the id the
    request's ``extras`` kwarg carries (0: none), so the cost falls on the rows that ask
    only. ``ends``: the model's end-of-sequence tokens (min_tokens holds them back)."""

    def __init__(
        self,
        params: SamplingParams,
        prompt: list[int],
        matcher: Any = None,
        ends: frozenset[int] = frozenset(),
    ) -> None:
        self.params = params
        self.prompt = torch.tensor(sorted(set(prompt)), dtype=torch.int64)
        self.matcher = matcher
        # What min_tokens holds back: the stop token ids, and the ends unless ignore_eos.
        held = {*params.stop_token_ids, *(() if params.ignore_eos else ends)}
        self.held = torch.tensor(sorted(held) if params.min_tokens else [], dtype=torch.int64)
        self.generated: list[int] = []
        # Written by the generation thread, taken by the request's coroutine.
        self.logprobs: list[TokenLogprob] = []
        # The last step's log-softmax row, until the chosen token is known.
        self.pending: torch.Tensor | None = None

    @property
    def needed(self) -> bool:
        params = self.params
        return bool(
            params.penalized
            or params.logit_bias
            or params.logprobs is not None
            or self.matcher
            or self.held.numel()
        )

    def held_now(self) -> torch.Tensor | None:
        """The token ids min_tokens holds back at this step, or None."""
        if self.held.numel() and len(self.generated) < self.params.min_tokens:
            return self.held
        return None

    def penalize(self, row: torch.Tensor) -> None:
        params = self.params
        if params.repetition_penalty != 1.0:
            seen = torch.unique(
                torch.cat([self.prompt, torch.tensor(self.generated, dtype=torch.int64)])
            ).to(row.device)
            values = row[seen]
            row[seen] = torch.where(
                values > 0, values / params.repetition_penalty, values * params.repetition_penalty
            )
        if self.generated and (params.frequency_penalty or params.presence_penalty):
            ids, counts = torch.unique(torch.tensor(self.generated), return_counts=True)
            penalty = counts.to(row.device, row.dtype) * params.frequency_penalty
            row[ids.to(row.device)] -= penalty + params.presence_penalty
        for token, bias in params.logit_bias:
            row[token] += bias
        if params.repetition_penalty < 1.0:
            # A tiny penalty multiplies logits past the dtype's range; kept where the
            # temperature's division (by at least 1e-6) stays finite, or the softmax of
            # a batch's draw is NaN and the manager's loop stops for every request.
            limit = torch.finfo(row.dtype).max * 1e-6 if row.dtype != torch.float16 else 6e4
            row.nan_to_num_(nan=-math.inf, posinf=limit, neginf=-math.inf).clamp_(max=limit)

    def take_logprobs(self, count: int) -> list[TokenLogprob]:
        taken, self.logprobs = self.logprobs[:count], self.logprobs[count:]
        return taken


class ExtrasRegistry:
    """Request extras by id, shared by the engine (which adds and drops them) and the
    processors (which read them on the generation thread)."""

    def __init__(self) -> None:
        self._by_id: dict[int, RequestExtras] = {}
        self._next = 1

    def add(self, extras: RequestExtras) -> int:
        key = self._next
        self._next = self._next % 0x7FFFFFFF + 1
        self._by_id[key] = extras
        return key

    def drop(self, key: int) -> None:
        self._by_id.pop(key, None)

    def rows(self, tensor_arg: torch.Tensor, count: int) -> list[tuple[int, RequestExtras]]:
        """(row, extras) of the rows of this step whose request has any."""
        if not self._by_id:
            return []  # no copy of the ids to the host (a device sync on a GPU)
        found = []
        for row, key in enumerate(tensor_arg[:count].tolist()):
            extras = self._by_id.get(key) if key else None
            if extras is not None:
                found.append((row, extras))
        return found


class _ExtrasStep(_Step):
    """Base of the processors that read request extras; the tensor arg is the id."""

    supported_kwargs = {"extras": int}  # noqa: RUF012
    ignored_kwargs: tuple[str, ...] = ()

    def __init__(self, registry: ExtrasRegistry) -> None:
        self.registry = registry

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(0)

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        values = [r.state.logit_processor_kwargs.get("extras", 0) for r in requests_with_new_token]
        self.active = any(values)
        if not self.active:
            return _NO_ARGS
        return torch.tensor(values, dtype=torch.int32)

    def rows(self, tensor_arg: torch.Tensor, count: int) -> list[tuple[int, RequestExtras]]:
        """(row, extras) of this step's rows whose request has any."""
        return self.registry.rows(tensor_arg, count) if self.active else []


class _Penalties(_ExtrasStep):
    """Penalties and logit bias, first, on the model's own logits."""

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        for row, extras in self.rows(tensor_arg, scores.size(0)):
            extras.penalize(scores[row])
        return scores


class _Logprobs(_ExtrasStep):
    """After temperature: the log-softmax of the rows that asked for logprobs."""

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        for row, extras in self.rows(tensor_arg, scores.size(0)):
            if extras.params.logprobs is not None:
                extras.pending = torch.log_softmax(scores[row].double(), dim=-1)
        return scores


class _Mask(_ExtrasStep):
    """Constrained rows: every token the grammar refuses is cut (llguidance's bitmask).
    Rows short of their min_tokens: the end and stop tokens are cut too, unless the
    grammar allows nothing else (it is complete: the text ends)."""

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        for row, extras in self.rows(tensor_arg, scores.size(0)):
            values = scores[row]  # [vocab], a view: cut in place
            held = extras.held_now()
            if held is not None:
                held = held.to(scores.device)
                kept = values[held].clone()
                values[held] = -math.inf
            if extras.matcher is not None:
                allowed = allowed_tokens(extras.matcher, scores.size(1))
                refused = ~torch.from_numpy(allowed).to(scores.device)
                values.masked_fill_(refused, -math.inf)
                if held is not None and not bool(torch.isfinite(values).any()):
                    values[held] = kept.masked_fill(refused[held], -math.inf)
        return scores


class _Record(_ExtrasStep):
    """Last: the chosen token (the one left possible) into history, logprobs, grammar."""

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        for row, extras in self.rows(tensor_arg, scores.size(0)):
            token = int(torch.argmax(scores[row]))
            extras.generated.append(token)
            if extras.matcher is not None:
                extras.matcher.consume_token(token)
            if extras.pending is not None:
                wanted = extras.params.logprobs or 0
                values, ids = torch.topk(extras.pending, wanted) if wanted else (None, None)
                top = (
                    ()
                    if ids is None or values is None
                    else tuple(zip(ids.tolist(), values.tolist(), strict=True))
                )
                extras.logprobs.append(TokenLogprob(token, float(extras.pending[token]), top))
                extras.pending = None
        return scores
