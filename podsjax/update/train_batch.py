"""The update's batch: PODS selection, group advantages and the rows that enter the update.

    rewards_PN --select--> idx_PM --gather--> TrainBatch [P*M rows]
"""

from __future__ import annotations

import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from podsjax.core import grpo, selection
from podsjax.models import token_ids
from podsjax.update.algorithms import AlgorithmConfig


@flax.struct.dataclass
class TrainBatch:
    """Rows that enter the update (B = P * rows per prompt).

    Attributes:
      input_ids: int32 [B, Lp + T], left-padded prompt followed by the completion.
      attention_mask: int32 [B, Lp + T], 1 on prompt and valid completion tokens.
      completion_mask: float32 [B, T], 1 on completion tokens that count in the loss.
      advantages: float32 [B].
      loss_denominator: the loss normalizer of each optimizer step's rows: a float32 scalar
        over the whole batch, or [S] for ``steps_per_generation`` S > 1 (one per
        mini-batch); None to have the step compute it.
      advantage_mean: float32 scalar over the whole batch, or None to have the step compute
        it. ``build_batch`` fills both, so the update program holds no batch-only collective
        beside the layer scan's (such pairs deadlock fake CPU devices: docs/reliability.md,
        "Not promised").
      sampler_logprobs: float32 [B, T], the sampler's log-probs of the completion tokens
        (``Rollouts.logprobs``), or None; needed for TIS, the mismatch metrics and
        ``old_logprobs="sampler"``.
    """

    input_ids: jax.Array
    attention_mask: jax.Array
    completion_mask: jax.Array
    advantages: jax.Array
    loss_denominator: jax.Array | None = None
    advantage_mean: jax.Array | None = None
    sampler_logprobs: jax.Array | None = None

    @property
    def completion_length(self) -> int:
        return self.completion_mask.shape[1]


def _checked(prompt_ids_PL, prompt_mask_PL, tokens_PNT, mask_PNT, rewards_PN, logprobs_PNT):
    """The inputs as arrays, their shapes agreeing ([P, Lp] prompts, [P, N, T] completions,
    [P, N] rewards) and the ids integers: else the gathers below fill, broadcast or truncate
    without a word."""
    for name, ids in (("prompt ids", prompt_ids_PL), ("completion tokens", tokens_PNT)):
        _check_id_range(ids, name)
    arrays = [jnp.asarray(x) for x in (prompt_ids_PL, prompt_mask_PL, tokens_PNT, mask_PNT, rewards_PN)]
    prompt_ids_PL, prompt_mask_PL, tokens_PNT, mask_PNT, rewards_PN = arrays
    if rewards_PN.ndim != 2:
        raise ValueError(f"rewards must be [P, N] (prompts, rollouts); got shape {rewards_PN.shape}")
    p, n = rewards_PN.shape
    if tokens_PNT.ndim != 3 or tokens_PNT.shape[:2] != (p, n):
        raise ValueError(f"completion tokens must be [P, N, T] = [{p}, {n}, T] as the rewards are; "
                         f"got shape {tokens_PNT.shape}")
    expected = {"completion mask": (mask_PNT, tokens_PNT.shape), "prompt mask": (prompt_mask_PL, prompt_ids_PL.shape)}
    if logprobs_PNT is not None:
        expected["sampler log-probs"] = (jnp.asarray(logprobs_PNT), tokens_PNT.shape)
    if prompt_ids_PL.ndim != 2 or prompt_ids_PL.shape[0] != p:
        raise ValueError(f"prompt ids must be [P, Lp] with P = {p} as the rewards; got shape {prompt_ids_PL.shape}")
    for name, (x, shape) in expected.items():
        if x.shape != shape:
            raise ValueError(f"the {name} must have shape {shape}; got {x.shape}")
    for name, x in (("prompt ids", prompt_ids_PL), ("completion tokens", tokens_PNT)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be integer token ids; got dtype {x.dtype}")
    return arrays


def _check_id_range(ids, name: str) -> None:
    """Host ids in [0, 2**31), read before JAX's int32 conversion wraps 2**32 + 7 to 7: a negative
    one would embed the table's last rows without a word (the vocabulary is the Decoder's check)."""
    if not token_ids.concrete(ids):
        return
    ids = np.asarray(ids)
    if ids.size and np.issubdtype(ids.dtype, np.integer) and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        raise ValueError(f"{name} must be token ids in [0, 2**31); got {bad}")


def build_batch(
    prompt_ids_PL: jax.Array,
    prompt_mask_PL: jax.Array,
    tokens_PNT: jax.Array,
    mask_PNT: jax.Array,
    rewards_PN: jax.Array,
    config: AlgorithmConfig,
    key: jax.Array | None = None,
    logprobs_PNT: jax.Array | None = None,
) -> tuple[TrainBatch, jax.Array]:
    """Selects (PODS), computes group advantages and assembles the update batch.

    Args:
      prompt_ids_PL, prompt_mask_PL: the left-padded prompts [P, Lp].
      tokens_PNT, mask_PNT: completions and their validity [P, N, T].
      rewards_PN: total rewards.
      config: the algorithm.
      key: PRNG key for rules that need one.
      logprobs_PNT: the sampler's log-probs of the completion tokens, or None; kept for the
        selected rows when ``config.sampler_logprobs`` says the update needs them.

    Returns:
      (TrainBatch with P * M rows, prompt-major, and the selected indices [P, M]
      into the N rollouts; GRPO and GRPO-GA keep all of them, as M = N).
    """
    prompt_ids_PL, prompt_mask_PL, tokens_PNT, mask_PNT, rewards_PN = _checked(
        prompt_ids_PL, prompt_mask_PL, tokens_PNT, mask_PNT, rewards_PN, logprobs_PNT)
    p, n = rewards_PN.shape
    if n != config.n:
        raise ValueError(f"rewards have {n} rollouts per prompt but the config says n={config.n}")
    if config.sampler_logprobs and logprobs_PNT is None:
        raise ValueError(f"{config.sampler_logprobs_reason} needs the sampler's log-probs: generate with "
                         "return_logprobs=True and pass them as logprobs_PNT")
    if config.algorithm == "pods":
        idx_PM = selection.select(config.rule, rewards_PN, config.m, key=key)
    else:
        idx_PM = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (p, n))
    rows = idx_PM.shape[1]
    chosen_PM = jnp.take_along_axis(rewards_PN, idx_PM, axis=1)
    adv_PM = grpo.group_advantages(chosen_PM, eps=config.advantage_eps, std_scaling=config.std_scaling)
    tokens_PMT = jnp.take_along_axis(tokens_PNT, idx_PM[..., None], axis=1)
    # Nonzero is a real token, as the Decoder reads a mask: a cast would have made 0.5 no token and 2 a double one.
    mask_PMT = (jnp.take_along_axis(mask_PNT, idx_PM[..., None], axis=1) != 0).astype(jnp.int32)
    prompt_ids = jnp.repeat(prompt_ids_PL, rows, axis=0)
    prompt_mask = (jnp.repeat(prompt_mask_PL, rows, axis=0) != 0).astype(jnp.int32)
    t = tokens_PNT.shape[-1]
    completion_mask = mask_PMT.reshape(p * rows, t).astype(jnp.float32)
    advantages = adv_PM.reshape(p * rows)
    sampler_logprobs = None
    if config.sampler_logprobs:
        picked = jnp.take_along_axis(logprobs_PNT.astype(jnp.float32), idx_PM[..., None], axis=1)
        sampler_logprobs = jnp.where(completion_mask > 0, picked.reshape(p * rows, t), 0.0)
    steps = config.steps_per_generation
    if (p * rows) % (steps * config.grad_accum):
        raise ValueError(f"{p * rows} trained rows do not split into steps_per_generation {steps} mini-batches "
                         f"of grad_accum {config.grad_accum} micro-batches")
    batch = TrainBatch(
        input_ids=jnp.concatenate([prompt_ids, tokens_PMT.reshape(p * rows, t)], axis=1).astype(jnp.int32),
        attention_mask=jnp.concatenate([prompt_mask, mask_PMT.reshape(p * rows, t)], axis=1),
        completion_mask=completion_mask,
        advantages=advantages,
        loss_denominator=mini_batch_denominators(completion_mask, config),
        advantage_mean=jnp.mean(advantages),
        sampler_logprobs=sampler_logprobs,
    )
    return batch, idx_PM


def mini_batch_denominators(completion_mask_BT: jax.Array, config: AlgorithmConfig) -> jax.Array:
    """The loss normalizer of each optimizer step's rows: a scalar over the whole batch with
    one step per generation, else one per mini-batch of ``steps_per_generation`` ([S])."""
    steps = config.steps_per_generation
    if steps == 1:
        return grpo.loss_denominator(completion_mask_BT, config.loss_config)
    return jax.vmap(lambda m: grpo.loss_denominator(m, config.loss_config))(_split(completion_mask_BT, steps))

def _split(batch: Any, *counts: int) -> Any:
    """[B, ...] -> [*counts, B / prod(counts), ...]: micro-batch i is a contiguous run of rows."""
    def split(x):
        return x.reshape(*counts, x.shape[0] // math.prod(counts), *x.shape[1:])

    return jax.tree.map(split, batch)
