"""The tiny preset's byte-level BPE tokenizer on a short fixed corpus, for tests that need any tokenizer.

``podsjax.tiny.build_tokenizer`` trains it (Qwen2's pre-tokenizer, ChatML, EOS
``<|im_end|>``, pad ``<|endoftext|>``); this corpus keeps it fast and independent of the
tiny tasks. Tests save it beside their tiny model with ``save_tiny_tokenizer(tmp_path)``
and load it back with ``AutoTokenizer`` or ``podsjax.data.prompts.load_tokenizer``. Nothing
touches the network, and the same corpus gives the same vocabulary every time.
"""

from __future__ import annotations

import os

from podsjax.tiny.build import CHATML_TEMPLATE, IM_END, PAD, build_tokenizer  # noqa: F401 - tests import these

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


def save_tiny_tokenizer(directory, vocab_size: int = 512, chat_template: str | None = CHATML_TEMPLATE) -> str:
    """Builds the tokenizer and saves it to ``directory`` (created if needed); returns the path.

    ``chat_template=None`` gives a base-model tokenizer (no template)."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size, corpus=_CORPUS * 4)
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(directory)
    return directory
