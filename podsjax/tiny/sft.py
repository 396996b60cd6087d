"""Supervised warm-up pieces: SFT batches, the prefix-shared loss, the step, greedy evaluation.

Every warm-up sequence starts with the same system prompt, so its tokens (the longest
common prefix of all prompts) run once per step and their KV cache is shared by the
batch: the loss and gradients equal those of the full sequences (the tests check it),
at about half the cost.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from podsjax import rewards as rewards_lib
from podsjax.data import prompts as prompts_lib
from podsjax.data.datasets import Example, reward_columns
from podsjax.models import Decoder, init_cache, prefill
from podsjax.rewards.combine import TASK_ACCURACY
from podsjax.sampler import sampling
from podsjax.tiny.problems import sft_completion


def evaluate_greedy(model: Decoder, params: Any, tokenizer, examples: Sequence[Example], *,
                    max_new_tokens: int, batch_size: int = 64, max_prompt_length: int = 512,
                    task: str = "gsm8k", generator: sampling.Generator | None = None) -> dict[str, Any]:
    """Greedy accuracy (the task's reward) and format rate, through the RL loop's prompt and sampler path.

    Prompts, padding, EOS ids and decoding are the RL loop's evaluation's
    (``podsjax.data.prompts``): every generate call gets exactly ``batch_size`` rows (the last
    prompt repeated, the copies not scored), so the sampler compiles once.

    Args:
        model, params: the policy.
        tokenizer: its tokenizer (chat template).
        examples: problems with gold answers.
        max_new_tokens: completion budget.
        batch_size: prompts per generate call.
        max_prompt_length: longer prompts are dropped, as in the loop.
        task: whose accuracy reward scores the completions ("gsm8k", "math", "chemistry").
        generator: ``model``'s :class:`podsjax.sampler.sampling.Generator`; pass the same one to
            every evaluation to compile once (default: a new one, which compiles).

    Returns:
        {"accuracy": float, "format": float, "completions": list[str]} over the kept examples.
    """
    eos = prompts_lib.eos_token_ids(tokenizer)
    generator = generator or sampling.Generator(model)
    completions, kept_examples = [], []
    for start in range(0, len(examples), batch_size):
        chunk = list(examples[start:start + batch_size])
        batch = prompts_lib.prepare_prompts(tokenizer, [e.prompt for e in chunk], max_prompt_length=max_prompt_length)
        if not len(batch.kept_P):
            continue
        ids, mask = batch.padded_rows(batch_size)
        rollouts = generator.generate(params, ids, mask, jax.random.key(0), num_samples=1,
                                      max_new_tokens=max_new_tokens, temperature=0.0, eos_token_ids=eos,
                                      pad_token_id=batch.pad_id)
        texts = prompts_lib.decode_completions(tokenizer, np.asarray(rollouts.tokens), np.asarray(rollouts.mask))
        completions.extend(texts[: len(batch.kept_P)])
        kept_examples.extend(chunk[i] for i in batch.kept_P)
    if not completions:
        return {"accuracy": 0.0, "format": 0.0, "completions": []}
    accuracy = TASK_ACCURACY[task](completions, **reward_columns(kept_examples))
    formatted = rewards_lib.format_reward(completions)
    return {"accuracy": float(np.mean(accuracy)), "format": float(np.mean(formatted)), "completions": completions}


@dataclasses.dataclass(frozen=True)
class SftData:
    """Tokenized warm-up sequences, split into the prefix every prompt shares and the rest.

    Attributes:
        prefix_ids: int32 [L0], the shared leading tokens (the system turn).
        suffix_ids: int32 [B, L], each sequence's remaining prompt and completion,
            right-padded with the pad id.
        suffix_mask: int32 [B, L], 1 on real tokens.
        loss_mask: float32 [B, L], 1 where the *next* token is a completion token
            (the logit at position t predicts token t + 1).
    """

    prefix_ids: np.ndarray
    suffix_ids: np.ndarray
    suffix_mask: np.ndarray
    loss_mask: np.ndarray


def tokenize_sft(tokenizer, examples: Sequence[Example], multiple: int = 8) -> SftData:
    """Tokenizes prompt + PODS-format completion + EOS, as the loop would see them.

    The prompt is tokenized the way ``podsjax.data.prompts.tokenize_prompts`` does it, and
    the completion separately, because the sampler emits completion tokens after
    the prompt ids (a joint tokenization could merge across the boundary).

    Args:
        tokenizer: the tiny tokenizer.
        examples: problems with ``columns["solution"]``.
        multiple: the suffix width is rounded up to this.
    """
    texts = prompts_lib.build_prompts(tokenizer, [e.prompt for e in examples])
    add_special = not prompts_lib.has_chat_template(tokenizer)
    prompt_ids = tokenizer(texts, add_special_tokens=add_special)["input_ids"]
    completion_ids = tokenizer([sft_completion(e) for e in examples], add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    first = prompt_ids[0]
    shared = len(first)
    for ids in prompt_ids[1:]:
        limit = min(shared, len(ids))
        shared = next((i for i in range(limit) if ids[i] != first[i]), limit)
    # Keep at least one prompt token in every suffix, so each row's first completion
    # token is predicted from a logit inside the suffix.
    shared = min(shared, min(len(ids) for ids in prompt_ids) - 1)
    rows = [(p[shared:], c + [eos]) for p, c in zip(prompt_ids, completion_ids)]
    width = -(-max(len(p) + len(c) for p, c in rows) // multiple) * multiple
    pad = prompts_lib.pad_token_id(tokenizer)
    suffix_ids = np.full((len(rows), width), pad, np.int32)
    suffix_mask = np.zeros((len(rows), width), np.int32)
    loss_mask = np.zeros((len(rows), width), np.float32)
    for r, (prompt, completion) in enumerate(rows):
        total = len(prompt) + len(completion)
        suffix_ids[r, :total] = prompt + completion
        suffix_mask[r, :total] = 1
        loss_mask[r, len(prompt) - 1:total - 1] = 1.0
    return SftData(np.asarray(first[:shared], np.int32), suffix_ids, suffix_mask, loss_mask)


def sft_loss(model: Decoder, params: Any, prefix_ids_L0: jax.Array, suffix_ids_BL: jax.Array,
             suffix_mask_BL: jax.Array, loss_mask_BL: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy over completion tokens.

    The shared prefix is run once (batch 1) into a KV cache that every row then
    continues from; gradients flow through the cache into the prefix's computation.
    """
    b, length = suffix_ids_BL.shape
    prefix_length = prefix_ids_L0.shape[0]
    cache = init_cache(model.config, 1, prefix_length + length, dtype=jnp.float32)
    _, cache = prefill(model, params, prefix_ids_L0[None], jnp.ones((1, prefix_length), jnp.int32), cache)
    logits_BLV = model.apply({"params": params}, suffix_ids_BL, suffix_mask_BL, cache=cache.repeat(b)).logits_BLV
    logprobs_BLV = jax.nn.log_softmax(logits_BLV[:, :-1].astype(jnp.float32), axis=-1)
    nll_BL = -jnp.take_along_axis(logprobs_BLV, suffix_ids_BL[:, 1:, None], axis=-1)[..., 0]
    weights_BL = loss_mask_BL[:, :-1]
    return jnp.sum(nll_BL * weights_BL) / jnp.maximum(jnp.sum(weights_BL), 1.0)


def make_sft_step(model: Decoder, optimizer: optax.GradientTransformation) -> Callable:
    """The jitted update ``step(params, opt_state, prefix, ids, mask, loss_mask) -> (params, opt_state, loss)``."""

    def step(params, opt_state, prefix_ids_L0, suffix_ids_BL, suffix_mask_BL, loss_mask_BL):
        loss, grads = jax.value_and_grad(lambda p: sft_loss(model, p, prefix_ids_L0, suffix_ids_BL, suffix_mask_BL,
                                                             loss_mask_BL))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def make_sft_optimizer(lr: float, steps: int, warmup_steps: int, weight_decay: float) -> optax.GradientTransformation:
    """Clipped AdamW: linear warm-up to ``lr``, then cosine decay to ``lr / 10`` at ``steps``."""
    warmup = max(min(warmup_steps, steps - 1), 1)
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), end_value=lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=weight_decay))
