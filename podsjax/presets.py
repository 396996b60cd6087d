"""The paper's experimental settings (a-f) as named presets.

Settings a-d are the single-accelerator runs (LoRA r=64, alpha=64 on every
projection, constant lr 5e-6, one prompt per step, 6 h budget); e-f are the
8-accelerator full fine-tunes (bf16, cosine lr 2e-5 with 10% warm-up, one epoch
of GSM8K train, eval every 120 s). Each setting gives per-method rollout counts:
GRPO n = m = 16 and PODS n = 64, m = 16 for a-d; GRPO-GA n = 32 with 16
accumulation steps against PODS n = 128, m = 32 with 4 for e-f.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Setting:
    """One column of the paper's setup table."""

    name: str
    model: str  # Hugging Face Hub name of the checkpoint to fetch beforehand
    task: str
    lora_rank: int | None  # None = full fine-tune
    dtype: str
    algorithm: dict[str, dict[str, Any]]  # method -> AlgorithmConfig overrides
    common: dict[str, Any]  # AlgorithmConfig fields shared by the methods
    run: dict[str, Any]  # RunConfig fields
    mesh: str = "1"


_SINGLE_COMMON = dict(learning_rate=5e-6, schedule="constant", adam_b1=0.9, adam_b2=0.99, weight_decay=0.1,
                      max_grad_norm=0.1, temperature=0.9, beta=0.0)
_SINGLE_METHODS = {
    "grpo": dict(algorithm="grpo", n=16, m=16),
    "grpo-ga": dict(algorithm="grpo-ga", n=64, m=16),
    "pods": dict(algorithm="pods", n=64, m=16, rule="max_variance"),
}
_SINGLE_RUN = dict(prompts_per_step=1, max_prompt_length=512, max_new_tokens=512, time_budget_s=6 * 3600.0,
                   checkpoint_every_s=1800.0, eval_every_s=1800.0)
_MULTI_COMMON = dict(learning_rate=2e-5, schedule="cosine", warmup_ratio=0.1, temperature=0.9, beta=0.0,
                     max_grad_norm=1.0, weight_decay=0.0)
_MULTI_METHODS = {
    "grpo-ga": dict(algorithm="grpo-ga", n=32, m=2, grad_accum=1),  # 16 micro-batches of 2
    "grpo": dict(algorithm="grpo", n=32, m=32, grad_accum=16),
    "pods": dict(algorithm="pods", n=128, m=32, rule="max_variance", grad_accum=4),
}
_MULTI_RUN = dict(prompts_per_step=8, max_prompt_length=512, max_new_tokens=1024, eval_every_s=120.0,
                  checkpoint_every_s=1800.0, time_budget_s=None)

SETTINGS: dict[str, Setting] = {
    "a": Setting("a", "Qwen/Qwen2.5-3B-Instruct", "gsm8k", 64, "bfloat16", _SINGLE_METHODS, _SINGLE_COMMON,
                 _SINGLE_RUN),
    "b": Setting("b", "Qwen/Qwen2.5-3B-Instruct", "math", 64, "bfloat16", _SINGLE_METHODS, _SINGLE_COMMON,
                 _SINGLE_RUN),
    "c": Setting("c", "meta-llama/Llama-3.2-3B-Instruct", "gsm8k", 64, "bfloat16", _SINGLE_METHODS,
                 {**_SINGLE_COMMON, "beta": 0.04}, _SINGLE_RUN),
    "d": Setting("d", "meta-llama/Llama-3.2-3B-Instruct", "math", 64, "bfloat16", _SINGLE_METHODS,
                 {**_SINGLE_COMMON, "beta": 0.04}, _SINGLE_RUN),
    "e": Setting("e", "Qwen/Qwen2.5-3B-Instruct", "gsm8k", None, "bfloat16", _MULTI_METHODS, _MULTI_COMMON,
                 _MULTI_RUN, mesh="8"),
    "f": Setting("f", "Qwen/Qwen2.5-7B-Instruct", "gsm8k", None, "bfloat16", _MULTI_METHODS, _MULTI_COMMON,
                 _MULTI_RUN, mesh="8"),
}


def get_setting(name: str) -> Setting:
    try:
        return SETTINGS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown setting {name!r}; choose one of {', '.join(SETTINGS)}") from None
