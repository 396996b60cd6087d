"""The tiny preset's tokenizer and model, built in-process and saved as a HF checkpoint.

The tokenizer is a byte-level BPE trained on the synthetic problems, the system
prompt and the answer format, under exactly Qwen2's pre-tokenization: transformers
loads every ``qwen2`` checkpoint's tokenizer as ``Qwen2Tokenizer``, which rebuilds
the pre-tokenizer from its own regex, so merges learned under any other split would
tokenize differently after a reload. That split also puts each digit in its own
token, which keeps the arithmetic learnable. With a 512-entry vocabulary every word
of the corpus is one token, so prompts are ~95-112 tokens (~70 of them the system
turn). The chat template is ChatML, as Qwen2's.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp

from podsjax.data import prompts as prompts_lib
from podsjax.models import Decoder, ModelConfig, init_params, save_pretrained
from podsjax.tiny.problems import generate_problems, sft_completion

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, IM_START, IM_END)  # ids 0, 1, 2
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Qwen2's split: single digits (so arithmetic stays learnable), words with their
# leading space, punctuation runs, whitespace.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)
# The tokenizer corpus: enough problems that every template, name and item is seen
# many times; its own stream, so no split's questions are singled out.
_CORPUS_PROBLEMS = 3000
_CORPUS_SEED = 12345


MIN_VOCAB = 260  # 256 bytes + the 3 special tokens
# The tiny Qwen2 policy (random init). Its vocab_size bounds the BPE vocabulary; the
# checkpoint takes the tokenizer's real size. Tied embeddings, as small Qwen2.5 models have.
TINY_MODEL = ModelConfig(
    arch="qwen2", vocab_size=512, hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=32, rope_theta=10000.0, qkv_bias=True, tie_word_embeddings=True,
    max_position_embeddings=1024, bos_token_id=None, eos_token_id=2, pad_token_id=0)


def tiny_model(**changes) -> ModelConfig:
    """:data:`TINY_MODEL` with ``changes`` (a smaller shape for tests, say), checked by :func:`check_tiny_model`."""
    model = dataclasses.replace(TINY_MODEL, **changes)
    check_tiny_model(model)
    return model


def check_tiny_model(model: ModelConfig) -> None:
    """Raises ValueError unless ``model`` is a ModelConfig the tiny tokenizer can serve."""
    if not isinstance(model, ModelConfig):
        raise ValueError(f"the tiny model must be a ModelConfig, got {type(model).__name__}")
    if model.vocab_size < MIN_VOCAB:
        raise ValueError(f"the tiny model's vocab_size must be >= {MIN_VOCAB} (256 bytes + 3 special tokens), "
                         f"got {model.vocab_size}")


def _corpus(task: str = "gsm8k") -> list[str]:
    """The texts BPE is trained on, cut where special tokens cut the real inputs.

    A rendered prompt is ``<|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n{q}
    <|im_end|>\\n<|im_start|>assistant\\n``; special tokens are split out before BPE runs,
    so BPE only ever sees the pieces between them, and the completion is tokenized
    on its own (the sampler emits it after the prompt ids).
    """
    texts = []
    for example in generate_problems(_CORPUS_PROBLEMS, _CORPUS_SEED, "train", task, at_most=True):
        texts += [f"user\n{example.prompt}", sft_completion(example), "\n", "assistant\n"]
    texts += [f"system\n{prompts_lib.DEFAULT_SYSTEM_PROMPT}"] * (_CORPUS_PROBLEMS // 10)
    return texts


def build_tokenizer(vocab_size: int = 512, corpus: list[str] | None = None, task: str = "gsm8k"):
    """Trains the tiny byte-level BPE tokenizer (deterministic) and wraps it for transformers.

    Args:
        vocab_size: upper bound on the vocabulary; read the real size from ``len(tokenizer)``.
        corpus: texts to learn the merges from (default: the tiny preset's problems of ``task``).
        task: the tiny task whose problems make the default corpus.

    Returns:
        A ``transformers.PreTrainedTokenizerFast`` with the ChatML template, EOS
        ``<|im_end|>`` and pad ``<|endoftext|>``.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB} (256 bytes + 3 special tokens), got {vocab_size}")
    core = Tokenizer(models.BPE())
    # Exactly Qwen2's pipeline: transformers rebuilds it for any qwen2 checkpoint
    # (Qwen2Tokenizer ignores the pre-tokenizer in tokenizer.json), so merges must be
    # learned under the same split to tokenize the same way after a reload.
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(_corpus(task) if corpus is None else corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=IM_END, pad_token=PAD)
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_tiny_checkpoint(directory: str | os.PathLike, seed: int = 0, model: ModelConfig = TINY_MODEL,
                          *, task: str = "gsm8k", overwrite: bool = False) -> str:
    """Builds the tiny tokenizer and a randomly initialised Qwen2 model and saves both.

    The directory then loads through the normal code paths:
    ``podsjax.models.from_pretrained(directory)`` and ``podsjax.data.prompts.load_tokenizer(directory)``
    (and transformers' ``AutoModelForCausalLM`` / ``AutoTokenizer``).

    Args:
        directory: the checkpoint directory (created; must be empty unless ``overwrite``).
        seed: the init seed of the weights (the tokenizer does not depend on it).
        model: the model's shape; its vocab_size bounds the tokenizer's vocabulary.
        task: the tiny task the tokenizer is trained on ("gsm8k", "math", "chemistry").
        overwrite: write into a non-empty directory.

    Returns:
        The directory path.

    Raises:
        FileExistsError: ``directory`` is not empty and ``overwrite`` is False.
    """
    check_tiny_model(model)
    directory = os.fspath(directory)
    if os.path.isdir(directory) and os.listdir(directory) and not overwrite:
        raise FileExistsError(f"{directory} exists and is not empty; pass overwrite=True to write into it")
    tokenizer = build_tokenizer(model.vocab_size, task=task)
    decoder = Decoder(dataclasses.replace(model, vocab_size=len(tokenizer)), dtype=jnp.float32,
                      param_dtype=jnp.float32)
    params = init_params(decoder, jax.random.key(seed))
    save_pretrained(decoder, params, directory, overwrite=True)
    tokenizer.save_pretrained(directory)
    return directory
