"""vLLM's request extensions users send most, on both engines, driven as vLLM clients
send them (the openai SDK's ``extra_body``): ``min_p``, ``min_tokens``,
``stop_token_ids``, ``include_stop_str_in_output`` and ``chat_template_kwargs``, with
vLLM's semantics, on completions, chat, responses and the V2 generate route.

Each is checked against a reference, not just accepted: min_p of 1 samples what greedy
decoding picks, and every token a min_p draw keeps is at least min_p times as likely as
the best (its own logprobs say); min_tokens overrides an end forced by logit_bias, and
its tokens are those greedy decoding picks with the ends banned; a stop string in the
min_tokens text does not stop it (vLLM's rule, computed here from the full text); a stop
token id ends the text where the same seed's text of that many tokens ends; the template
variables change the prompt's token count by what the template renders, counted with the
model's own tokenizer.

One server per module: a tiny random Llama on transformers and SmolLM2 on llama.cpp, each
with a chat template that reads ``enable_thinking`` as Qwen3's does (SmolLM2's GGUF is
copied with that template).
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import openai
import pytest

from tests.llm_models import CHAT_TEMPLATE, build_tiny_llama, gguf_with_chat_template, smollm2_gguf
from tests.models import write_config
from tests.utils import RemoteServer

llama_cpp = pytest.importorskip("llama_cpp", reason="the llama extra is not installed")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODELS = ["tiny", "smol"]
PROMPT = "The capital of France is"
MESSAGES: Any = [{"role": "user", "content": "Hi"}]
# What Qwen3's template does with enable_thinking false: an empty thought after the
# generation prompt.
THINK = (
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\n\n</think>\n\n' }}{% endif %}"
)


@dataclass
class Vocab:
    """A served model's vocabulary as its own tokenizer (not the server) sees it."""

    # Token id -> the text logprobs show for it.
    pieces: list[str]
    # The tokens that end a generation (EOS; llama.cpp's end-of-generation tokens).
    ends: list[int]
    template: str
    render: Any  # (messages, **variables) -> prompt token count

    def only_id(self, piece: str) -> int | None:
        """The one token whose text is ``piece``, or None when there are several."""
        found = [token for token, text in enumerate(self.pieces) if text == piece]
        return found[0] if len(found) == 1 else None


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("vllm-fields")
    tiny = build_tiny_llama(base / "hf", chat_template=CHAT_TEMPLATE + THINK)
    smol = gguf_with_chat_template(smollm2_gguf(), base / "smol.gguf", _smol_template() + THINK)
    return {"tiny": tiny, "smol": smol}


def _smol_template() -> str:
    model = llama_cpp.Llama(str(smollm2_gguf()), vocab_only=True, verbose=False)
    return str(model.metadata["tokenizer.chat_template"])


@pytest.fixture(scope="module")
def server(
    files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RemoteServer]:
    repo = tmp_path_factory.mktemp("vllm-fields-repo")
    shutil.copytree(files["tiny"], repo / "tiny" / "1")
    write_config(repo, "tiny", {"backend": "transformers",
                                "generation": {"num_blocks": 64, "block_size": 16}})  # fmt: skip
    (repo / "smol" / "1").mkdir(parents=True)
    files["smol"].rename(repo / "smol" / "1" / "model.gguf")
    # No prefix cache: every request's steps have the same shapes, so two requests that
    # should pick the same tokens do (a reused prefix moves logits by hundredths).
    write_config(repo, "smol", {"backend": "llama_cpp", "generation": {
        "num_blocks": 64, "block_size": 16, "max_model_len": 512, "max_num_seqs": 4,
        "prefix_caching": False}})  # fmt: skip
    with RemoteServer(repo, log_dir=repo) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def vocabs(server: RemoteServer, files: dict[str, Path]) -> dict[str, Vocab]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(files["tiny"])

    def tiny_prompt(messages: Any, **variables: Any) -> int:
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                **variables)  # fmt: skip
        return len(encoded["input_ids"])

    tiny = Vocab(
        [tokenizer.decode([i], skip_special_tokens=True) for i in range(len(tokenizer))],
        [tokenizer.eos_token_id], tokenizer.chat_template, tiny_prompt,
    )  # fmt: skip
    path = Path(server.repository) / "smol" / "1" / "model.gguf"
    model = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(model.model)
    size = llama_cpp.llama_vocab_n_tokens(vocab)
    template = str(model.metadata["tokenizer.chat_template"])

    def smol_prompt(messages: Any, **variables: Any) -> int:
        # As transformers renders a template (the engine's ChatTemplate does the same).
        environment = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        text = environment.from_string(template).render(
            messages=messages, add_generation_prompt=True, **variables
        )
        return len(model.tokenize(text.encode(), add_bos=False, special=True))

    smol = Vocab(
        [model.detokenize([i], special=True).decode("utf-8", errors="replace")
         for i in range(size)],
        [t for t in range(size) if llama_cpp.llama_vocab_is_eog(vocab, t)], template,
        smol_prompt,
    )  # fmt: skip
    return {"tiny": tiny, "smol": smol}


def complete(client: openai.OpenAI, model: str, max_tokens: int = 8, **extra: Any) -> Any:
    """A completion of PROMPT past any end (ignore_eos, unless ``extra`` says), the
    sampling settings and vLLM's fields in ``extra`` (``extra_body``, as vLLM's docs)."""
    standard = {key: extra.pop(key) for key in ("temperature", "seed", "logprobs", "stream",
                                                 "logit_bias") if key in extra}  # fmt: skip
    body = {"ignore_eos": True, **extra}
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens,
                                     extra_body=body, **standard)  # fmt: skip


def streamed(
    client: openai.OpenAI, model: str, max_tokens: int = 8, **extra: Any
) -> tuple[str, str | None]:
    """The text and finish reason of the same completion, streamed."""
    text, reason = "", None
    for chunk in complete(client, model, max_tokens, stream=True, **extra):
        choice = chunk.choices[0]
        text += choice.text
        reason = choice.finish_reason or reason
    return text, reason


# -- min_p ----------------------------------------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
def test_min_p_of_one_samples_what_greedy_decoding_picks(client: openai.OpenAI, model: str) -> None:
    """min_p 1 keeps only tokens as likely as the most likely one: a hot, seeded draw is
    then the greedy text (vLLM: relative to the most likely token, after temperature)."""
    greedy = complete(client, model, temperature=0).choices[0].text
    seeds = (1, 2, 3)
    plain = [complete(client, model, temperature=1.5, seed=s).choices[0].text for s in seeds]
    assert any(text != greedy for text in plain), "these draws are greedy anyway: no test"
    for seed in seeds:
        cut = complete(client, model, temperature=1.5, seed=seed, min_p=1.0)
        assert cut.choices[0].text == greedy
    assert streamed(client, model, temperature=1.5, seed=4, min_p=1.0) == (greedy, "length")


@pytest.mark.parametrize("model", MODELS)
def test_every_token_min_p_keeps_is_at_least_min_p_times_the_best(
    client: openai.OpenAI, model: str
) -> None:
    """The logprobs of a draw at temperature 1 are the distribution min_p cuts: each
    chosen token's probability over the best alternative's is at least min_p."""

    def ratios(**extra: Any) -> list[float]:
        reply = complete(client, model, 12, temperature=1.0, logprobs=1, **extra)
        got = reply.choices[0].logprobs
        return [math.exp(lp - max(top.values()))
                for lp, top in zip(got.token_logprobs, got.top_logprobs, strict=True)]  # fmt: skip

    assert min(min(ratios(seed=seed)) for seed in (5, 6)) < 0.5, "nothing to cut: no test"
    for seed in (5, 6):
        assert min(ratios(seed=seed, min_p=0.5)) >= 0.5 - 1e-4


# -- min_tokens -----------------------------------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
def test_min_tokens_overrides_an_end_forced_early(
    client: openai.OpenAI, vocabs: dict[str, Vocab], model: str
) -> None:
    """An end token biased +100 ends the text at once; with min_tokens 3 the first three
    tokens are what greedy decoding picks with every end banned, and the end comes 4th."""
    ends = vocabs[model].ends
    forced = {str(ends[0]): 100}
    kwargs: Any = {"temperature": 0, "ignore_eos": False, "logit_bias": forced}
    early = complete(client, model, **kwargs)
    assert (early.choices[0].finish_reason, early.usage.completion_tokens) == ("stop", 1)
    banned = complete(client, model, 3, temperature=0, logit_bias={str(e): -100 for e in ends})
    held = complete(client, model, min_tokens=3, **kwargs)
    assert held.choices[0].finish_reason == "stop" and held.usage.completion_tokens == 4
    assert held.choices[0].text == banned.choices[0].text
    assert streamed(client, model, min_tokens=3, **kwargs) == (banned.choices[0].text, "stop")
    # On chat, streamed, the same rule.
    chat = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=8, temperature=0, logit_bias=forced,
        stream=True, stream_options={"include_usage": True}, extra_body={"min_tokens": 2},
    )  # fmt: skip
    chunks = list(chat)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


@pytest.mark.parametrize("model", MODELS)
def test_a_constraint_that_is_complete_ends_the_text_before_min_tokens(
    client: openai.OpenAI, model: str
) -> None:
    """A grammar that allows nothing but its end wins over min_tokens (no more text can
    follow it): the choice, finish_reason stop, as without min_tokens."""
    kwargs: Any = {"temperature": 0, "ignore_eos": False, "min_tokens": 6,
                   "guided_choice": ["yes", "no"]}  # fmt: skip
    reply = complete(client, model, 8, **kwargs).choices[0]
    assert reply.text in ("yes", "no") and reply.finish_reason == "stop"
    assert streamed(client, model, 8, **kwargs) == (reply.text, "stop")


def vllm_stop_cut(full: str, stop: str, protected: int) -> tuple[str, str]:
    """vLLM's text and finish reason for ``full`` (max_tokens' text) with stop string
    ``stop`` where its first ``protected`` characters are min_tokens' text: the first
    occurrence that ends past them cuts the text."""
    at = full.find(stop, max(0, protected - len(stop) + 1))
    return (full, "length") if at == -1 else (full[:at], "stop")


@pytest.mark.parametrize("model", MODELS)
def test_a_stop_string_in_the_min_tokens_text_does_not_stop_it(
    client: openai.OpenAI, model: str
) -> None:
    full = complete(client, model, 12, temperature=0).choices[0].text
    first = complete(client, model, 4, temperature=0).choices[0].text
    assert full.startswith(first)
    stop = first.strip()[:1]
    early = complete(client, model, 12, temperature=0, stop=stop).choices[0]
    assert early.text == full[: full.find(stop)] and early.finish_reason == "stop"
    text, reason = vllm_stop_cut(full, stop, len(first))
    assert text != early.text
    held = complete(client, model, 12, temperature=0, stop=stop, min_tokens=4).choices[0]
    assert (held.text, held.finish_reason) == (text, reason)
    assert streamed(client, model, 12, temperature=0, stop=stop, min_tokens=4) == (text, reason)


# -- stop_token_ids and include_stop_str_in_output ----------------------------------------


@pytest.mark.parametrize("model", MODELS)
def test_a_stop_token_id_ends_the_text_at_that_token(
    client: openai.OpenAI, vocabs: dict[str, Vocab], model: str
) -> None:
    """A seeded draw (its text depends only on the seed): the first token, past the
    first, whose text no earlier token has and one token id alone has, is made a stop
    token. The text ends before it (after it, asked), with finish_reason stop, its token
    counted; past an ignore_eos too."""
    seeded: Any = {"temperature": 1.0, "seed": 7}
    pieces = complete(client, model, 10, logprobs=0, **seeded).choices[0].logprobs.tokens
    vocab = vocabs[model]
    found = next(
        (k, token) for k in range(1, len(pieces))
        if pieces[k] not in pieces[:k] and (token := vocab.only_id(pieces[k])) is not None
    )  # fmt: skip
    k, token = found
    before = complete(client, model, k, **seeded).choices[0].text
    through = complete(client, model, k + 1, **seeded).choices[0].text
    ended = complete(client, model, 10, stop_token_ids=[token], **seeded)
    assert ended.choices[0].finish_reason == "stop"
    assert (ended.choices[0].text, ended.usage.completion_tokens) == (before, k + 1)
    kept = complete(client, model, 10, stop_token_ids=[token], include_stop_str_in_output=True,
                    **seeded).choices[0]  # fmt: skip
    assert (kept.text, kept.finish_reason) == (through, "stop")
    assert streamed(client, model, 10, stop_token_ids=[token], **seeded) == (before, "stop")


@pytest.mark.parametrize("model", MODELS)
def test_include_stop_str_in_output_ends_the_text_after_the_stop_string(
    client: openai.OpenAI, model: str
) -> None:
    seeded: Any = {"temperature": 1.0, "seed": 11}
    full = complete(client, model, 12, **seeded).choices[0].text
    start = next(i for i in range(len(full) // 3, len(full) - 1)
                 if full[i : i + 2].isascii() and full[i : i + 2].isprintable())  # fmt: skip
    stop = full[start : start + 2]
    at = full.find(stop)
    cut = complete(client, model, 12, stop=stop, **seeded).choices[0]
    assert (cut.text, cut.finish_reason) == (full[:at], "stop")
    kept = complete(client, model, 12, stop=stop, include_stop_str_in_output=True, **seeded)
    assert (kept.choices[0].text, kept.choices[0].finish_reason) == (full[: at + 2], "stop")
    assert streamed(client, model, 12, stop=stop, include_stop_str_in_output=True,
                    **seeded) == (full[: at + 2], "stop")  # fmt: skip
    response = client.responses.create(
        model=model, input=PROMPT, max_output_tokens=12, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    said = response.output_text
    stop = said[len(said) // 2 : len(said) // 2 + 1]
    ended = client.responses.create(
        model=model, input=PROMPT, max_output_tokens=12, temperature=0,
        extra_body={"ignore_eos": True, "stop": stop, "include_stop_str_in_output": True},
    )  # fmt: skip
    assert ended.output_text == said[: said.find(stop) + 1]


# -- stop_reason ----------------------------------------------------------------------------


def chat(client: openai.OpenAI, model: str, max_tokens: int = 8, **extra: Any) -> Any:
    """A chat reply to MESSAGES past any end (ignore_eos, unless ``extra`` says)."""
    names = ("temperature", "seed", "logprobs", "stream", "n", "stop", "logit_bias")
    standard = {key: extra.pop(key) for key in names if key in extra}
    return client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=max_tokens,
                                          extra_body={"ignore_eos": True, **extra},
                                          **standard)  # fmt: skip


def ends_of(chunks: Any) -> dict[int, tuple[str, Any]]:
    """Per choice index: (finish_reason, stop_reason) of the chunk that ends the choice."""
    ends = {}
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.finish_reason is not None:
                assert choice.index not in ends, "a choice finished twice"
                ends[choice.index] = (choice.finish_reason, choice.model_extra["stop_reason"])
    return ends


def two_endings(
    vocab: Vocab, first: tuple[str, list[str]], second: tuple[str, list[str]]
) -> tuple[int, str]:
    """For two seeded draws ((text, token pieces) each): a token id the first draws (past
    its first token, its text new and one id's alone) and the second never does, and a
    stop string the second's text holds and the first's never does."""
    (text, pieces), (other, others) = first, second
    token = next(
        token for k in range(1, len(pieces))
        if pieces[k] not in pieces[:k] and pieces[k] not in others
        and (token := vocab.only_id(pieces[k])) is not None
    )  # fmt: skip
    stop = next(
        stop for i in range(len(other) - 1)
        if (stop := other[i : i + 2]).isascii() and stop.isprintable() and stop not in text
    )  # fmt: skip
    return token, stop


@pytest.mark.parametrize("model", MODELS)
def test_stop_reason_names_the_stop_token_id_or_string_that_ended_each_choice(
    client: openai.OpenAI, vocabs: dict[str, Vocab], model: str
) -> None:
    """vLLM's stop_reason, each of n=2 choices its own (choice i draws with seed 7 + i,
    as one choice with that seed does): the first ends on a stop token id (the int), the
    second on a stop string (the str); completions and chat, streamed and not."""
    draws = [complete(client, model, 10, logprobs=0, temperature=1.0, seed=seed).choices[0]
             for seed in (7, 8)]  # fmt: skip
    token, stop = two_endings(vocabs[model], *((d.text, d.logprobs.tokens) for d in draws))
    ended: Any = {"temperature": 1.0, "seed": 7, "n": 2, "stop": [stop],
                  "stop_token_ids": [token]}  # fmt: skip
    reply = complete(client, model, 10, **ended)
    choices = sorted(reply.choices, key=lambda choice: choice.index)
    assert [(c.finish_reason, c.model_extra["stop_reason"]) for c in choices] == [
        ("stop", token), ("stop", stop)
    ]  # fmt: skip
    assert choices[1].text == draws[1].text[: draws[1].text.find(stop)]
    expected = {0: ("stop", token), 1: ("stop", stop)}
    assert ends_of(complete(client, model, 10, stream=True, **ended)) == expected
    # Chat: its own draws, from its own prompt.
    said = [chat(client, model, 10, logprobs=True, temperature=1.0, seed=seed).choices[0]
            for seed in (7, 8)]  # fmt: skip
    token, stop = two_endings(vocabs[model], *(
        (s.message.content, [item.token for item in s.logprobs.content]) for s in said
    ))  # fmt: skip
    ended |= {"stop": [stop], "stop_token_ids": [token]}
    reply = chat(client, model, 10, **ended)
    choices = sorted(reply.choices, key=lambda choice: choice.index)
    assert [(c.finish_reason, c.model_extra["stop_reason"]) for c in choices] == [
        ("stop", token), ("stop", stop)
    ]  # fmt: skip
    expected = {0: ("stop", token), 1: ("stop", stop)}
    assert ends_of(chat(client, model, 10, stream=True, **ended)) == expected


@pytest.mark.parametrize("model", MODELS)
def test_stop_reason_is_null_at_the_end_of_sequence_and_at_max_tokens(
    client: openai.OpenAI, vocabs: dict[str, Vocab], model: str
) -> None:
    """An end-of-sequence token (forced by logit_bias) and max_tokens end a choice with
    ``stop_reason: null``, sent on the chunk that carries finish_reason and only there."""
    forced: Any = {"temperature": 0, "ignore_eos": False,
                   "logit_bias": {str(vocabs[model].ends[0]): 100}}  # fmt: skip
    for reply, reason in ((complete(client, model, **forced), "stop"),
                          (complete(client, model, 4, temperature=0), "length"),
                          (chat(client, model, 4, **forced), "stop")):  # fmt: skip
        choice = reply.choices[0]
        assert choice.finish_reason == reason
        assert "stop_reason" in choice.model_extra and choice.model_extra["stop_reason"] is None
    chunks = list(chat(client, model, 4, temperature=0, stream=True))
    assert ends_of(chunks) == {0: ("length", None)}
    assert all("stop_reason" not in c.model_extra for chunk in chunks[:-1] for c in chunk.choices)
    assert ends_of(complete(client, model, 4, temperature=0, stream=True)) == {0: ("length", None)}


# -- chat_template_kwargs -------------------------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
def test_chat_template_kwargs_are_variables_of_the_template(
    client: openai.OpenAI, vocabs: dict[str, Vocab], model: str
) -> None:
    """enable_thinking false adds the empty thought: the prompt grows by what the template
    renders, as the model's own tokenizer counts it; true (or nothing) adds nothing."""
    vocab = vocabs[model]

    def prompt_tokens(**variables: Any) -> int:
        extra = {"chat_template_kwargs": variables} if variables else {}
        reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1,
                                               extra_body=extra)  # fmt: skip
        assert reply.usage is not None
        return reply.usage.prompt_tokens

    plain, off = prompt_tokens(), prompt_tokens(enable_thinking=False)
    assert plain == vocab.render(MESSAGES)
    assert off == vocab.render(MESSAGES, enable_thinking=False) > plain
    assert prompt_tokens(enable_thinking=True) == plain
    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=1, stream=True,
        stream_options={"include_usage": True},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    usage = list(stream)[-1].usage
    assert usage is not None and usage.prompt_tokens == off
    response = client.responses.create(
        model=model, input="Hi", max_output_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    assert response.usage is not None and response.usage.input_tokens == off


# -- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("route", "extra", "param", "says"),
    [
        ("chat", {"min_p": 1.5}, "min_p", "less than or equal to 1"),
        ("chat", {"min_p": -0.5}, "min_p", "greater than or equal to 0"),
        ("completions", {"min_tokens": -1}, "min_tokens", "greater than or equal to 0"),
        ("completions", {"min_tokens": 5}, "min_tokens", "cannot be combined with max_tokens 4"),
        ("chat", {"min_tokens": 100_000, "max_tokens": None}, "min_tokens", "context length"),
        ("chat", {"stop_token_ids": [99_999_999]}, "stop_token_ids",
         "outside the model's vocabulary"),
        ("completions", {"stop_token_ids": [1, -2]}, "stop_token_ids.1", "greater than"),
        ("chat", {"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools",
         "sets itself"),
        ("chat", {"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs",
         "dictionary"),
        ("responses", {"min_tokens": 5}, "min_tokens", "max_output_tokens 4"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("model", MODELS)
def test_bad_values_are_400s_naming_the_field(
    client: openai.OpenAI, model: str, route: str, extra: dict[str, Any], param: str, says: str
) -> None:
    body = {"max_tokens": 4, **extra}
    limit = body.pop("max_tokens")
    with pytest.raises(openai.BadRequestError) as refused:
        if route == "chat":
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=limit,
                                           extra_body=body)  # fmt: skip
        elif route == "completions":
            client.completions.create(model=model, prompt=PROMPT, max_tokens=limit,
                                      extra_body=body)  # fmt: skip
        else:
            client.responses.create(model=model, input="Hi", max_output_tokens=limit,
                                    extra_body=body)  # fmt: skip
    assert refused.value.param == param, refused.value.body
    assert says in refused.value.message


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("cut", [{"min_p": 0.1}, {}])
def test_a_tiny_repetition_penalty_harms_no_request_beside_it(
    client: openai.OpenAI, model: str, cut: dict[str, float]
) -> None:
    """repetition_penalty 1e-40 divides logits past float32's range (schemathesis found
    it): llama.cpp's step failed every sequence in it, transformers' loop stopped and the
    model answered 503 from then on. Now that request is answered, and so is a greedy
    request decoding beside it, with the text it has alone."""
    alone = complete(client, model, max_tokens=12, temperature=0).choices[0].text
    with ThreadPoolExecutor(2) as pool:
        # Unseeded: transformers draws those rows with torch.multinomial, which the NaN
        # stopped (a seeded row takes the Gumbel noise's argmax).
        odd = pool.submit(complete, client, model, max_tokens=12, temperature=0.8,
                          repetition_penalty=1e-40, **cut)  # fmt: skip
        beside = pool.submit(complete, client, model, max_tokens=12, temperature=0)
        assert odd.result().choices[0].finish_reason == "length"
        assert beside.result().choices[0].text == alone
    assert complete(client, model, max_tokens=12, temperature=0).choices[0].text == alone


# -- the V2 generate route (Triton's vLLM backend takes vLLM's SamplingParams names) -------


def test_the_v2_generate_route_applies_them_as_completions_do(
    server: RemoteServer, client: openai.OpenAI, vocabs: dict[str, Vocab]
) -> None:
    def generate(**parameters: Any) -> Any:
        body = {"text_input": PROMPT, "parameters": {
            "max_tokens": 10, "exclude_input_in_output": True, "return_finish_reason": True,
            "return_num_output_tokens": True, **parameters}}  # fmt: skip
        reply = server.http.post("/v2/models/smol/generate", json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()

    greedy = complete(client, "smol", 10, temperature=0).choices[0].text
    assert generate(temperature=1.5, seed=3, min_p=1.0, ignore_eos=True)["text_output"] == greedy
    end = vocabs["smol"].ends[0]
    held = generate(temperature=0, logit_bias={str(end): 100}, min_tokens=3)
    banned = complete(client, "smol", 3, temperature=0,
                      logit_bias={str(e): -100 for e in vocabs["smol"].ends})  # fmt: skip
    assert held["text_output"] == banned.choices[0].text
    assert (held["finish_reason"], held["num_output_tokens"]) == ("stop", 4)
    seeded: Any = {"temperature": 1.0, "seed": 7, "stop": ["e"], "ignore_eos": True}
    kept = generate(include_stop_str_in_output=True, **seeded)
    expected = complete(client, "smol", 10, include_stop_str_in_output=True, **seeded)
    assert kept["text_output"] == expected.choices[0].text and kept["text_output"].endswith("e")
    for parameters, named in (
        ({"min_tokens": 17}, "parameters.min_tokens: 17 cannot be combined with the default"),
        ({"min_p": 2}, "parameters.min_p"),
        ({"stop_token_ids": [99_999_999]}, "parameters.stop_token_ids: token id 99999999"),
    ):
        reply = server.http.post("/v2/models/smol/generate",
                                 json={"text_input": PROMPT, "parameters": parameters})  # fmt: skip
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"].startswith(named), reply.json()
