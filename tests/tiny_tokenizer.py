"""A tiny byte-level BPE tokenizer with a ChatML chat template, built locally.

Tests that need a tokenizer (prompts, models, the sampler) save one beside their
tiny model with ``save_tiny_tokenizer(tmp_path)`` and load it back with
``AutoTokenizer`` or ``podsjax.prompts.load_tokenizer``. Nothing touches the
network, and the result is deterministic: the same corpus and settings give the
same vocabulary every time.

Special tokens: ``<|endoftext|>`` (pad, id 0), ``<|im_start|>`` (id 1) and
``<|im_end|>`` (EOS, id 2). Byte-level BPE covers any text, so nothing maps to
an unknown token.
"""

from __future__ import annotations

import os

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, IM_START, IM_END)

# Qwen2-style ChatML: an optional system turn, user/assistant turns, and the
# assistant header when add_generation_prompt is set.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.",
    "<think> 48 / 2 = 24 and 48 + 24 = 72 </think><answer> 72 </answer>",
    "Compute \\frac{1}{2} + \\frac{1}{3} and write the answer in \\boxed{}.",
    "You are a helpful assistant. First think step by step, then give the final answer.",
    "system user assistant question answer think the of and to a in is that it for",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 #### = + - * / ( ) $ , . ? !",
]


def build_tiny_tokenizer(vocab_size: int = 512, chat_template: str | None = CHATML_TEMPLATE):
    """Builds the tokenizer in memory.

    Args:
        vocab_size: upper bound on the vocabulary (259 base entries plus merges);
            read the real size from ``len(tokenizer)``.
        chat_template: a Jinja chat template, or None for a base-model tokenizer.

    Returns:
        A ``transformers.PreTrainedTokenizerFast``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 260:
        raise ValueError(f"vocab_size must be >= 260 (256 bytes + 3 special tokens), got {vocab_size}")
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=IM_END, pad_token=PAD)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def save_tiny_tokenizer(directory, vocab_size: int = 512, chat_template: str | None = CHATML_TEMPLATE) -> str:
    """Builds the tokenizer and saves it to ``directory`` (created if needed); returns the path."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    build_tiny_tokenizer(vocab_size, chat_template).save_pretrained(directory)
    return directory
