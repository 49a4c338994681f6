"""Field rules every top-level OpenAI request schema shares.

- ``null`` for an optional field means its default, here as in the nested objects
  (:mod:`slipstream.protocol.openai_base`); a required field (``model``, ``messages``,
  ``prompt``, ``input``) stays required, so ``null`` there is a 400.
- ``chat_template_kwargs`` (vLLM's) may not name what the template's rendering sets
  itself (``messages``, ``tools``...): a 400 naming the key.
- The known extensions of other servers (vLLM's sampling and chat fields) that this
  server does not implement are refused with a 400 naming the field and what to send
  instead, unless the value asks for what the server does anyway
  (``use_beam_search: false``, ``skip_special_tokens: true``): a client that set one
  would otherwise get a different text than it asked for, silently. Fields nobody
  defines stay ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import WithJsonSchema, model_validator

from slipstream.errors import InvalidRequest
from slipstream.protocol.openai_base import _Request


@dataclass(frozen=True, slots=True)
class Unserved:
    """A field another server defines and this one does not implement."""

    # Why it is refused and what to send instead (the 400's message after the name).
    advice: str
    # Values that ask for what this server does anyway (the other server's defaults):
    # accepted. ``null`` always is.
    same: tuple[Any, ...] = ()

    def accepts(self, value: Any) -> bool:
        # True == 1 in Python; a bool must match a bool, a number a number.
        return value is None or any(
            value == same and isinstance(value, bool) == isinstance(same, bool)
            for same in self.same
        )


# vLLM's sampling extensions (its SamplingParams and request fields) that Slipstream does
# not implement; top_k, min_p, min_tokens, stop_token_ids, include_stop_str_in_output,
# repetition_penalty, ignore_eos, seed and the guided_* constraints it does.
# guided_decoding_backend changes no text (every constraint runs on llguidance): it is
# ignored like any unknown field.
VLLM_SAMPLING: Mapping[str, Unserved] = {
    "skip_special_tokens": Unserved(
        "only true is supported: special tokens are never part of the text", (True,)
    ),
    "truncate_prompt_tokens": Unserved(
        "not supported: a prompt is never truncated; shorten it (one longer than the "
        "model's context is a 400)"
    ),
    "use_beam_search": Unserved("not supported: there is no beam search; use n", (False,)),
    "length_penalty": Unserved(
        "not supported: it applies to beam search, which this server does not do", (1, 1.0)
    ),
    "bad_words": Unserved("not supported; set the words' token ids to -100 in logit_bias", ([],)),
    "allowed_token_ids": Unserved(
        "not supported; use logit_bias, or a constraint (guided_choice, guided_regex)"
    ),
    "prompt_logprobs": Unserved("not supported: logprobs are computed for generated tokens"),
    "logits_processors": Unserved("not supported", ([],)),
    "return_tokens_as_token_ids": Unserved("not supported", (False,)),
    "return_token_ids": Unserved("not supported", (False,)),
    "add_special_tokens": Unserved(
        "not supported: the model's tokenizer settings decide; send token ids to control "
        "the prompt's tokens exactly"
    ),
    "structured_outputs": Unserved(
        "not supported; use response_format, guided_json, guided_regex, guided_choice or "
        "guided_grammar"
    ),
    "structural_tag": Unserved("not supported; use response_format json_schema or guided_grammar"),
    "guided_whitespace_pattern": Unserved(
        "not supported: JSON is written compact (', ' and ': ' separators)"
    ),
    "priority": Unserved("not supported: there is no priority scheduling", (0,)),
    "cache_salt": Unserved("not supported"),
    "kv_transfer_params": Unserved("not supported"),
    "vllm_xargs": Unserved("not supported"),
    "mm_processor_kwargs": Unserved("not supported: this server serves text only"),
}

# vLLM's chat-only extensions (chat_template_kwargs is served).
VLLM_CHAT: Mapping[str, Unserved] = {
    "chat_template": Unserved("not supported: the model's own chat template is applied"),
    "add_generation_prompt": Unserved("only true is supported", (True,)),
    "continue_final_message": Unserved("not supported", (False,)),
    "echo": Unserved("not supported on chat; use /v1/completions with echo", (False,)),
    "documents": Unserved("not supported; put the documents in a message"),
}

# vLLM's completions-only extensions.
VLLM_COMPLETION: Mapping[str, Unserved] = {
    "prompt_embeds": Unserved("not supported; send text or token ids in prompt"),
}

# vLLM's embeddings extensions.
VLLM_EMBEDDING: Mapping[str, Unserved] = {
    "truncate_prompt_tokens": Unserved(
        "not supported: each input is truncated where the model's tokenizer file says"
    ),
    "add_special_tokens": VLLM_SAMPLING["add_special_tokens"],
    "priority": VLLM_SAMPLING["priority"],
}


# Names the chat template's rendering sets itself, and transformers' apply_chat_template
# parameters (vLLM refuses chat_template and tokenize): none may be a chat_template_kwargs
# key, which would change how the prompt is made instead of passing a variable.
TEMPLATE_OWN_NAMES = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "chat_template", "tokenize", "bos_token", "eos_token",
    "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens",
})  # fmt: skip

# The documented schema of chat_template_kwargs (chat and responses).
TEMPLATE_KWARGS = WithJsonSchema({
    "anyOf": [{"type": "object",
               "propertyNames": {"not": {"enum": sorted(TEMPLATE_OWN_NAMES)}}},
              {"type": "null"}],
    "description": 'more variables of the chat template (vLLM\'s; e.g. {"enable_thinking": '
                   "false}); the names the rendering sets itself are a 400",
})  # fmt: skip


def check_template_kwargs(variables: Mapping[str, Any] | None) -> None:
    """A 400 naming a ``chat_template_kwargs`` key the rendering sets itself."""
    for key in variables or {}:
        if key in TEMPLATE_OWN_NAMES:
            raise InvalidRequest(
                f"chat_template_kwargs.{key}: a name this server sets itself when it renders "
                "the chat template, not a variable a request may set; send the request's own "
                "field (messages, tools...) instead, or leave it out"
            )


class _Fields(_Request):
    """Base of the top-level OpenAI request schemas: the fields in ``unserved`` are
    refused naming them (see the module docstring); ``null`` is the default, as in every
    request schema (:class:`~slipstream.protocol.openai_base._Request`)."""

    # Field name -> why it is refused, for the known fields this schema does not serve.
    unserved: ClassVar[Mapping[str, Unserved]] = {}

    @model_validator(mode="before")
    @classmethod
    def _unserved(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, rule in cls.unserved.items():
                if name in data and not rule.accepts(data[name]):
                    raise InvalidRequest(f"{name}: {rule.advice}")
        return data
