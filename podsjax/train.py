"""The GRPO / GRPO-GA / GRPO-PODS update: state, batch assembly and the jit step.

What to train (``AlgorithmConfig``, ``method_config``, the optimizer) is ``podsjax.algorithms``.

One PODS step after generation and scoring, as data:

    rewards_PN --select--> idx_PM --gather--> TrainBatch [P*M rows]
    TrainBatch --train_step--> new TrainState, StepMetrics
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import optax

from podsjax import grpo, selection
from podsjax.algorithms import AlgorithmConfig, learning_rate_schedule

# optax >= 0.2.6 moved the global norm; keep older optax working too.
_tree_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm


@flax.struct.dataclass
class TrainState:
    """What the update changes. ``params`` is the trainable tree: full params or LoRA params."""

    params: Any
    opt_state: Any
    step: jax.Array
    skipped_updates: jax.Array


def master_weights(params: Any, dtype: Any = jnp.float32) -> Any:
    """``params`` with every floating leaf narrower than ``dtype`` upcast: the copy AdamW updates.

    A bf16 weight has 8 significant bits: an AdamW step of lr 5e-6 on a weight of 0.02 is
    below half its spacing and rounds away, and optax's moments, born in their params' dtype,
    would be bf16 too. The model still computes in its own ``dtype`` (its modules cast
    their params), so only the stored weights and moments widen.
    """
    dtype = jnp.dtype(dtype)

    def widen(x):
        narrow = jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize < dtype.itemsize
        return x.astype(dtype) if narrow else x

    return jax.tree.map(widen, params)


def init_state(params: Any, optimizer: optax.GradientTransformation, master_dtype: Any = jnp.float32) -> TrainState:
    """The first state: ``params`` as :func:`master_weights` in ``master_dtype`` (None: as given)
    and the optimizer's state born in that dtype."""
    if master_dtype is not None:
        params = master_weights(params, master_dtype)
    return TrainState(
        params=params,
        opt_state=optimizer.init(params),
        step=jnp.zeros((), jnp.int32),
        skipped_updates=jnp.zeros((), jnp.int32),
    )


@flax.struct.dataclass
class TrainBatch:
    """Rows that enter the update (B = P * rows per prompt).

    Attributes:
      input_ids: int32 [B, Lp + T], left-padded prompt followed by the completion.
      attention_mask: int32 [B, Lp + T], 1 on prompt and valid completion tokens.
      completion_mask: float32 [B, T], 1 on completion tokens that count in the loss.
      advantages: float32 [B].
      loss_denominator, advantage_mean: float32 scalars over the whole batch, or None to
        have the step compute them. ``build_batch`` fills them, so the update program holds
        no batch-only collective beside the layer scan's (such pairs deadlock fake CPU
        devices: docs/reliability.md, "Not promised").
    """

    input_ids: jax.Array
    attention_mask: jax.Array
    completion_mask: jax.Array
    advantages: jax.Array
    loss_denominator: jax.Array | None = None
    advantage_mean: jax.Array | None = None

    @property
    def completion_length(self) -> int:
        return self.completion_mask.shape[1]


def build_batch(
    prompt_ids_PL: jax.Array,
    prompt_mask_PL: jax.Array,
    tokens_PNT: jax.Array,
    mask_PNT: jax.Array,
    rewards_PN: jax.Array,
    config: AlgorithmConfig,
    key: jax.Array | None = None,
) -> tuple[TrainBatch, jax.Array]:
    """Selects (PODS), computes group advantages and assembles the update batch.

    Args:
      prompt_ids_PL, prompt_mask_PL: the left-padded prompts [P, Lp].
      tokens_PNT, mask_PNT: completions and their validity [P, N, T].
      rewards_PN: total rewards.
      config: the algorithm.
      key: PRNG key for rules that need one.

    Returns:
      (TrainBatch with P * M rows, prompt-major, and the selected indices [P, M]
      into the N rollouts; GRPO and GRPO-GA keep all of them, as M = N).
    """
    p, n = rewards_PN.shape
    if n != config.n:
        raise ValueError(f"rewards have {n} rollouts per prompt but the config says n={config.n}")
    if config.algorithm == "pods":
        idx_PM = selection.select(config.rule, rewards_PN, config.m, key=key)
    else:
        idx_PM = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (p, n))
    rows = idx_PM.shape[1]
    chosen_PM = jnp.take_along_axis(rewards_PN, idx_PM, axis=1)
    adv_PM = grpo.group_advantages(chosen_PM, eps=config.advantage_eps, std_scaling=config.std_scaling)
    tokens_PMT = jnp.take_along_axis(tokens_PNT, idx_PM[..., None], axis=1)
    mask_PMT = jnp.take_along_axis(mask_PNT, idx_PM[..., None], axis=1).astype(jnp.int32)
    prompt_ids = jnp.repeat(prompt_ids_PL, rows, axis=0)
    prompt_mask = jnp.repeat(prompt_mask_PL, rows, axis=0).astype(jnp.int32)
    t = tokens_PNT.shape[-1]
    completion_mask = mask_PMT.reshape(p * rows, t).astype(jnp.float32)
    advantages = adv_PM.reshape(p * rows)
    batch = TrainBatch(
        input_ids=jnp.concatenate([prompt_ids, tokens_PMT.reshape(p * rows, t)], axis=1).astype(jnp.int32),
        attention_mask=jnp.concatenate([prompt_mask, mask_PMT.reshape(p * rows, t)], axis=1),
        completion_mask=completion_mask,
        advantages=advantages,
        loss_denominator=grpo.loss_denominator(completion_mask, config.loss_config),
        advantage_mean=jnp.mean(advantages),
    )
    return batch, idx_PM


class _TokenSums(NamedTuple):
    """Per-token statistics summed over the micro-batches of one update (each weighted by its tokens)."""

    clip_low: jax.Array
    clip_high: jax.Array
    kl: jax.Array
    entropy: jax.Array
    tokens: jax.Array


@flax.struct.dataclass
class StepMetrics:
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


def completion_logprobs(hidden_fn: Callable, batch: TrainBatch, temperature: float) -> tuple[jax.Array, jax.Array]:
    """Log-probs and entropies [B, T] of the completion tokens under ``hidden_fn``'s policy.

    ``hidden_fn(ids_BL, mask_BL, positions)`` returns ``(hidden_BTD, head_VD)`` for the
    positions in the static slice ``positions``: the LM head then runs only on the
    positions that predict completion tokens, in chunks (``grpo.head_logprobs``).
    """
    t = batch.completion_length
    hidden_BTD, head_VD = hidden_fn(batch.input_ids, batch.attention_mask, slice(-t - 1, -1))
    return grpo.head_logprobs(hidden_BTD, head_VD, batch.input_ids[:, -t:], temperature=temperature)


def _split(batch: TrainBatch, k: int) -> TrainBatch:
    """[B, ...] -> [k, B/k, ...], so micro-batch i is rows i*B/k .. (i+1)*B/k-1."""
    return jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)


def make_train_step(
    apply_fn: Callable,
    optimizer: optax.GradientTransformation,
    config: AlgorithmConfig,
    reference_fn: Callable | None = None,
):
    """Builds the pure update ``step(state, batch, frozen) -> (state, StepMetrics)``.

    Args:
      apply_fn: ``apply_fn(trainable, frozen, ids_BL, mask_BL, positions) -> (hidden_BTD, head_VD)``:
        the policy's final hidden states at the positions in the static slice
        ``positions`` of the length axis, and its LM head matrix (see
        ``Decoder(..., return_hidden=True)``). For LoRA, ``trainable`` is the LoRA tree
        and ``frozen`` the base params; for full fine-tuning ``trainable`` is the params.
      optimizer: the optax transformation whose state is in ``TrainState``.
      config: the algorithm.
      reference_fn: ``reference_fn(frozen, ids_BL, mask_BL, positions) -> (hidden_BTD, head_VD)``
        of the reference policy, needed iff ``config.beta > 0`` (for LoRA: the base with
        LoRA off, so no second copy of the weights).

    Returns:
      The step; jit it at the call site with shardings and ``donate_argnums=0``.
      Micro-batches run in a ``lax.scan``; each adds its loss numerator over the
      whole batch's denominator, so accumulated gradients equal the big-batch
      gradient. A non-finite loss or gradient skips the update and leaves
      params and optimizer state untouched.
    """
    if config.beta > 0 and reference_fn is None:
        raise ValueError(f"beta={config.beta} > 0 needs a reference_fn")
    loss_config = config.loss_config
    k = config.grad_accum
    temperature = config.update_temperature

    def logprobs_of(trainable, frozen, mb: TrainBatch):
        return completion_logprobs(functools.partial(apply_fn, trainable, frozen), mb, temperature)

    def micro_loss(trainable, frozen, mb: TrainBatch, old_BT, ref_BT, denominator):
        logp_BT, entropy_BT = logprobs_of(trainable, frozen, mb)
        terms, metrics = grpo.grpo_loss_terms(
            logp_BT, mb.advantages, mb.completion_mask, loss_config, old_logprobs_BL=old_BT, ref_logprobs_BL=ref_BT
        )
        entropy = jnp.sum(entropy_BT * mb.completion_mask)
        return terms.numerator / denominator, (metrics, entropy)

    def update_once(state: TrainState, batches: TrainBatch, frozen, old_kBT, ref_kBT, denominator, lr,
                    advantage_mean):
        grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

        def accumulate(carry, xs):
            grads, loss, sums = carry
            mb, old_BT, ref_BT = xs
            (mb_loss, (metrics, entropy)), mb_grads = grad_fn(state.params, frozen, mb, old_BT, ref_BT, denominator)
            grads = mb_grads if grads is None else jax.tree.map(jnp.add, grads, mb_grads)
            tokens = metrics.num_tokens
            sums = _TokenSums(clip_low=sums.clip_low + metrics.clip_frac_low * tokens,
                              clip_high=sums.clip_high + metrics.clip_frac_high * tokens,
                              kl=sums.kl + metrics.kl_mean * tokens, entropy=sums.entropy + entropy,
                              tokens=sums.tokens + tokens)
            return (grads, loss + mb_loss, sums), None

        zero = jnp.zeros((), jnp.float32)
        no_sums = _TokenSums(zero, zero, zero, zero, zero)
        if k == 1:
            # One micro-batch: no scan, so no zero-filled accumulator to add into.
            one = jax.tree.map(lambda x: x[0], (batches, old_kBT, ref_kBT))
            (grads, loss, sums), _ = accumulate((None, zero, no_sums), one)
        else:
            init = (jax.tree.map(jnp.zeros_like, state.params), zero, no_sums)
            (grads, loss, sums), _ = jax.lax.scan(accumulate, init, (batches, old_kBT, ref_kBT))
        grad_norm = _tree_norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

        def apply_update(_):
            updates, new_opt = optimizer.update(grads, state.opt_state, state.params)
            return optax.apply_updates(state.params, updates), new_opt

        # A cond, not a where over every leaf: the skip branch costs nothing and the
        # update branch writes params and moments once.
        new_params, new_opt = jax.lax.cond(finite, apply_update, lambda _: (state.params, state.opt_state), None)
        state = state.replace(
            params=new_params,
            opt_state=new_opt,
            step=state.step + 1,
            skipped_updates=state.skipped_updates + (~finite).astype(jnp.int32),
        )
        tokens = jnp.maximum(sums.tokens, 1.0)
        metrics = StepMetrics(
            loss=loss,
            grad_norm=grad_norm,
            learning_rate=lr,
            skipped=(~finite).astype(jnp.int32),
            entropy=sums.entropy / tokens,
            clip_frac_low=sums.clip_low / tokens,
            clip_frac_high=sums.clip_high / tokens,
            kl_mean=sums.kl / tokens,
            advantage_mean=advantage_mean,
            num_tokens=sums.tokens,
        )
        return state, metrics

    schedule = learning_rate_schedule(config)

    def step(state: TrainState, batch: TrainBatch, frozen) -> tuple[TrainState, StepMetrics]:
        b = batch.advantages.shape[0]
        if b % k:
            raise ValueError(f"batch of {b} rows does not split into {k} micro-batches")
        denominator, advantage_mean = batch.loss_denominator, batch.advantage_mean
        if denominator is None:
            denominator = grpo.loss_denominator(batch.completion_mask, loss_config)
        if advantage_mean is None:
            advantage_mean = jnp.mean(batch.advantages)
        batches = _split(batch.replace(loss_denominator=None, advantage_mean=None), k)

        def per_micro(fn):
            return jax.lax.map(lambda mb: jax.lax.stop_gradient(fn(mb)), batches)

        # The policy that sampled, evaluated once before the first update.
        old_kBT = None
        if config.num_iterations > 1:
            old_kBT = per_micro(lambda mb: logprobs_of(state.params, frozen, mb)[0])
        ref_kBT = None
        if config.beta > 0:
            def ref_logprobs(mb):
                return completion_logprobs(functools.partial(reference_fn, frozen), mb, temperature)[0]

            ref_kBT = per_micro(ref_logprobs)
        lr = jnp.asarray(schedule(state.step), jnp.float32)  # the rate of this batch's updates
        metrics = None
        for _ in range(config.num_iterations):
            state, metrics = update_once(state, batches, frozen, old_kBT, ref_kBT, denominator, lr,
                                         advantage_mean)
        return state, metrics

    return step


def _hidden_and_head(model, params, ids, mask, positions, lora=None) -> tuple[jax.Array, jax.Array]:
    """``(hidden_BTD, head_VD)`` of ``model`` at the static slice ``positions``."""
    out = model.apply({"params": params}, ids, attention_mask=mask, lora=lora, logits_slice=positions,
                      return_hidden=True)
    return out.hidden_BLD, out.head_VD


def lora_apply_fn(model) -> tuple[Callable, Callable]:
    """(policy, reference) hidden-state functions for LoRA training on a frozen base."""

    def policy(lora, base, ids, mask, positions=None):
        return _hidden_and_head(model, base, ids, mask, positions, lora)

    def reference(base, ids, mask, positions=None):
        return _hidden_and_head(model, base, ids, mask, positions)

    return policy, reference


def full_apply_fn(model) -> tuple[Callable, Callable]:
    """(policy, reference) hidden-state functions for full fine-tuning; ``frozen`` holds the reference params."""

    def policy(params, reference_params, ids, mask, positions=None):
        del reference_params
        return _hidden_and_head(model, params, ids, mask, positions)

    def reference(reference_params, ids, mask, positions=None):
        return _hidden_and_head(model, reference_params, ids, mask, positions)

    return policy, reference
