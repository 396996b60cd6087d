"""A tiny Qwen2 checkpoint (random weights) saved beside the tiny tokenizer, for pipeline tests."""

from __future__ import annotations

import torch
from tiny_tokenizer import save_tiny_tokenizer
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM


def save_tiny_checkpoint(directory, seed: int = 0) -> str:
    """Writes tokenizer files plus a 1-layer, 32-wide Qwen2 model to ``directory``; returns it."""
    path = save_tiny_tokenizer(directory)
    vocab = len(AutoTokenizer.from_pretrained(path, local_files_only=True))
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path
