"""What one update reports: per-optimizer-step sums and their summary, :class:`StepMetrics`."""

from __future__ import annotations

from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from podsjax.update.update_forward import mismatched_prompts_error


class _TokenSums(NamedTuple):
    """Per-token statistics of one optimizer step, summed over its micro-batches (each weighted by its tokens)."""

    clip_low: jax.Array
    clip_high: jax.Array
    kl: jax.Array
    entropy: jax.Array
    tis_weight: jax.Array
    tis_truncated: jax.Array
    tokens: jax.Array
    mismatch_abs: jax.Array  # sum of |logp_update - logp_sampler|
    mismatch_max: jax.Array  # the largest token ratio pi_update / pi_sampler


class _UpdateMetrics(NamedTuple):
    loss: jax.Array
    grad_norm: jax.Array
    learning_rate: jax.Array
    skipped: jax.Array
    sums: _TokenSums


@flax.struct.dataclass
class StepMetrics:
    """One generated batch's update, over its ``num_iterations x steps_per_generation`` optimizer
    steps: loss and grad norm are means over the applied ones, the token statistics
    token-weighted means,
    ``skipped`` counts the skipped ones and ``learning_rate`` is the last one's.
    ``num_tokens`` counts the batch's trained tokens once. The optional fields are None
    unless their option is on (``tis_cap``, ``log_mismatch``).
    """

    loss: jax.Array
    grad_norm: jax.Array
    learning_rate: jax.Array
    skipped: jax.Array
    entropy: jax.Array
    clip_frac_low: jax.Array
    clip_frac_high: jax.Array
    kl_mean: jax.Array
    advantage_mean: jax.Array
    num_tokens: jax.Array
    tis_weight_mean: jax.Array | None = None
    tis_truncated_frac: jax.Array | None = None
    # mean |logp_update - logp_sampler| before any update of the batch: over every trained token,
    # or with old_logprobs='sampler' and several mini-batches over the first mini-batch's
    mismatch_logp_abs: jax.Array | None = None
    mismatch_ratio_max: jax.Array | None = None  # the largest token ratio pi_update / pi_sampler, same tokens
    # with shared_prefix: groups whose rows hold different prompts; when > 0 the state is unchanged
    mismatched_prompt_groups: jax.Array | None = None


def check_prompt_groups(metrics: StepMetrics) -> None:
    """Raises ValueError when the step's batch had groups of rows with different prompts.

    The shared-prefix step cannot raise under jit: it leaves the state as it was and
    counts such groups in ``metrics.mismatched_prompt_groups``. Call this where the
    metrics are read (the loop's ``Trainer`` does, every step).
    """
    count = metrics.mismatched_prompt_groups
    if count is not None and int(count) > 0:
        raise mismatched_prompts_error(int(count))


def _summarize(per_update: _UpdateMetrics, before_updates: int, iterations: int, advantage_mean) -> StepMetrics:
    """StepMetrics from every optimizer step's metrics ([U] each). The first ``before_updates``
    measured the mismatch against log-probs taken before any update of the batch: the first
    pass's mini-batches when those were computed up front, else only the first step's.
    Loss and grad norm are means over the steps that were applied (non-finite when none was)."""
    sums = per_update.sums
    tokens = jnp.sum(sums.tokens)
    per_token = jnp.maximum(tokens, 1.0)
    first_tokens = jnp.maximum(jnp.sum(sums.tokens[:before_updates]), 1.0)
    applied = per_update.skipped == 0

    def applied_mean(x):
        return jnp.where(jnp.any(applied), jnp.sum(jnp.where(applied, x, 0.0)) / jnp.maximum(jnp.sum(applied), 1),
                         jnp.mean(x))

    return StepMetrics(
        loss=applied_mean(per_update.loss),
        grad_norm=applied_mean(per_update.grad_norm),
        learning_rate=per_update.learning_rate[-1],
        skipped=jnp.sum(per_update.skipped),
        entropy=jnp.sum(sums.entropy) / per_token,
        clip_frac_low=jnp.sum(sums.clip_low) / per_token,
        clip_frac_high=jnp.sum(sums.clip_high) / per_token,
        kl_mean=jnp.sum(sums.kl) / per_token,
        advantage_mean=advantage_mean,
        num_tokens=tokens / iterations,
        tis_weight_mean=jnp.sum(sums.tis_weight) / per_token,
        tis_truncated_frac=jnp.sum(sums.tis_truncated) / per_token,
        mismatch_logp_abs=jnp.sum(sums.mismatch_abs[:before_updates]) / first_tokens,
        mismatch_ratio_max=jnp.max(sums.mismatch_max[:before_updates]),
    )
