"""The GRPO / GRPO-GA / GRPO-PODS update: state, batch assembly and the jit step.

What to train (``AlgorithmConfig``, ``method_config``, the optimizer) is ``podsjax.update.algorithms``.
The batch is built in ``podsjax.update.train_batch`` and the metrics summed in ``podsjax.update.step_metrics``;
both are re-exported here with the update's forward (``podsjax.update.update_forward``).

One PODS step after generation and scoring, as data:

    rewards_PN --select--> idx_PM --gather--> TrainBatch [P*M rows]
    TrainBatch --train_step--> new TrainState, StepMetrics
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax

from podsjax.core import grpo
from podsjax.update.algorithms import AlgorithmConfig, learning_rate_schedule
from podsjax.update.step_metrics import StepMetrics, _TokenSums, _UpdateMetrics, _summarize, check_prompt_groups
from podsjax.update.train_batch import TrainBatch, _split, build_batch, mini_batch_denominators
from podsjax.update.update_forward import (HiddenFn, completion_logprobs, full_apply_fn, lora_apply_fn, mismatched_prompt_groups, mismatched_prompts_error, shared_prefix_logprobs)

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
    and the optimizer's state born in that dtype. The state owns its arrays: a step that
    donates it leaves the caller's ``params`` (a full fine-tune's frozen base, a LoRA tree)
    alive."""
    given = params
    if master_dtype is not None:
        params = master_weights(params, master_dtype)
    params = jax.tree.map(lambda new, old: jnp.copy(new) if new is old else new, params, given)
    return TrainState(
        params=params,
        opt_state=optimizer.init(params),
        step=jnp.zeros((), jnp.int32),
        skipped_updates=jnp.zeros((), jnp.int32),
    )


def _injected_rate(opt_state):
    """The learning rate an ``optax.inject_hyperparams`` optimizer's state holds, or None."""
    kinds = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)
    for node in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, kinds)):
        if isinstance(node, kinds) and "learning_rate" in node.hyperparams:
            return node.hyperparams["learning_rate"]
    return None


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
        With ``config.shared_prefix`` it is a :class:`HiddenFn` (``lora_apply_fn`` and
        ``full_apply_fn`` return them), and the batch's rows come in groups of ``config.m``
        that share a prompt, as ``build_batch`` lays them out: each micro-batch then
        computes each of its prompts once. A batch laid out otherwise is not trained on:
        the step leaves the state as it was and counts the groups in
        ``StepMetrics.mismatched_prompt_groups`` (``check_prompt_groups`` raises on them;
        called without jit, the step raises at once).
      optimizer: the optax transformation whose state is in ``TrainState``. ``StepMetrics.learning_rate``
        reports the rate it holds when made with ``optax.inject_hyperparams``, else the rate of
        ``config``'s schedule, which is ``make_optimizer(config)``'s (it cannot see another's).
      config: the algorithm.
      reference_fn: ``reference_fn(frozen, ids_BL, mask_BL, positions) -> (hidden_BTD, head_VD)``
        of the reference policy, needed iff ``config.beta > 0`` (for LoRA: the base with
        LoRA off, so no second copy of the weights); a :class:`HiddenFn` too with
        ``config.shared_prefix``.

    Returns:
      The step; jit it at the call site with shardings and ``donate_argnums=0``. It takes
      ``num_iterations`` passes over the batch, each of ``steps_per_generation`` optimizer
      steps on consecutive mini-batches of rows (a ``lax.scan`` when more than one). Each
      step's micro-batches (``grad_accum``) run in a ``lax.scan`` and add their loss
      numerators over the mini-batch's denominator, so accumulated gradients equal the
      mini-batch gradient. The ratio's old policy is the sampler's (``old_logprobs=
      "sampler"``) or, with more than one step, the update program's, computed before the
      first. A non-finite loss or gradient skips that optimizer step and leaves params and
      optimizer state untouched (and counts in ``skipped``).
    """
    if config.beta > 0 and reference_fn is None:
        raise ValueError(f"beta={config.beta} > 0 needs a reference_fn")
    loss_config = config.loss_config
    k, steps = config.grad_accum, config.steps_per_generation
    temperature = config.update_temperature
    sampler_old = config.old_logprobs == "sampler"
    recompute_old = not sampler_old and config.updates_per_step > 1
    tis = config.tis_cap is not None

    if config.shared_prefix:
        for name, fn in (("apply_fn", apply_fn), ("reference_fn", reference_fn if config.beta > 0 else None)):
            if fn is not None and not callable(getattr(fn, "shared_prefix", None)):
                raise ValueError(f"shared_prefix needs the {name} in its shared-prefix form too (a HiddenFn, as "
                                 "train.lora_apply_fn and train.full_apply_fn return), or shared_prefix=False")

    def forward_logprobs(hidden_fn, weights: tuple, mb: TrainBatch):
        """``hidden_fn``'s log-probs and entropies of ``mb``'s completions, ``weights`` its first arguments."""
        if config.shared_prefix:
            return shared_prefix_logprobs(functools.partial(hidden_fn.shared_prefix, *weights), mb, temperature,
                                          config.m)
        return completion_logprobs(functools.partial(hidden_fn, *weights), mb, temperature)

    def logprobs_of(trainable, frozen, mb: TrainBatch):
        return forward_logprobs(apply_fn, (trainable, frozen), mb)

    def micro_loss(trainable, frozen, mb: TrainBatch, old_BT, ref_BT, denominator):
        logp_BT, entropy_BT = logprobs_of(trainable, frozen, mb)
        terms, metrics = grpo.grpo_loss_terms(
            logp_BT, mb.advantages, mb.completion_mask, loss_config, old_logprobs_BL=old_BT, ref_logprobs_BL=ref_BT,
            sampler_logprobs_BL=mb.sampler_logprobs if tis else None)
        mismatch = None
        if config.log_mismatch:  # the update program's log-probs of the policy that sampled
            update_old = old_BT if recompute_old else jax.lax.stop_gradient(logp_BT)
            mismatch = grpo.sampler_mismatch(update_old, mb.sampler_logprobs, mb.completion_mask)
        entropy = jnp.sum(entropy_BT * mb.completion_mask)
        return terms.numerator / denominator, (metrics, entropy, mismatch)

    def update_once(state: TrainState, batches: TrainBatch, frozen, old_kBT, ref_kBT, denominator, prompts_match):
        grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

        def accumulate(carry, xs):
            grads, loss, sums = carry
            mb, old_BT, ref_BT = xs
            (mb_loss, (metrics, entropy, mismatch)), mb_grads = grad_fn(state.params, frozen, mb, old_BT, ref_BT,
                                                                        denominator)
            grads = mb_grads if grads is None else jax.tree.map(jnp.add, grads, mb_grads)
            tokens = metrics.num_tokens
            if mismatch is not None:
                mismatch_abs, mismatch_max = sums.mismatch_abs + mismatch.abs_logp_diff, jnp.maximum(
                    sums.mismatch_max, mismatch.max_ratio)
            else:
                mismatch_abs, mismatch_max = sums.mismatch_abs, sums.mismatch_max
            sums = _TokenSums(clip_low=sums.clip_low + metrics.clip_frac_low * tokens,
                              clip_high=sums.clip_high + metrics.clip_frac_high * tokens,
                              kl=sums.kl + metrics.kl_mean * tokens, entropy=sums.entropy + entropy,
                              tis_weight=sums.tis_weight + metrics.tis_weight_mean * tokens,
                              tis_truncated=sums.tis_truncated + metrics.tis_truncated_frac * tokens,
                              tokens=sums.tokens + tokens, mismatch_abs=mismatch_abs, mismatch_max=mismatch_max)
            return (grads, loss + mb_loss, sums), None

        zero = jnp.zeros((), jnp.float32)
        no_sums = _TokenSums(*(zero,) * len(_TokenSums._fields))
        if k == 1:
            # One micro-batch: no scan, so no zero-filled accumulator to add into.
            one = jax.tree.map(lambda x: x[0], (batches, old_kBT, ref_kBT))
            (grads, loss, sums), _ = accumulate((None, zero, no_sums), one)
        else:
            init = (jax.tree.map(jnp.zeros_like, state.params), zero, no_sums)
            (grads, loss, sums), _ = jax.lax.scan(accumulate, init, (batches, old_kBT, ref_kBT))
        grad_norm = _tree_norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        apply = finite & prompts_match

        def apply_update(_):
            updates, new_opt = optimizer.update(grads, state.opt_state, state.params)
            return optax.apply_updates(state.params, updates), new_opt

        # A cond, not a where over every leaf: the skip branch costs nothing and the
        # update branch writes params and moments once.
        new_params, new_opt = jax.lax.cond(apply, apply_update, lambda _: (state.params, state.opt_state), None)
        # The rate of this optimizer step: an optimizer's own where it holds one (optax.inject_hyperparams),
        # else the config's schedule, which counts the updates applied, not the skipped.
        injected = _injected_rate(new_opt)
        lr = jnp.asarray(schedule(state.step - state.skipped_updates) if injected is None else injected, jnp.float32)
        skipped = (~apply).astype(jnp.int32)
        # A batch of mismatched prompt groups leaves the whole state as it was, counters too.
        counted = jnp.asarray(prompts_match, jnp.int32)
        state = state.replace(params=new_params, opt_state=new_opt, step=state.step + counted,
                              skipped_updates=state.skipped_updates + skipped * counted)
        return state, _UpdateMetrics(loss=loss, grad_norm=grad_norm, learning_rate=lr, skipped=skipped, sums=sums)

    schedule = learning_rate_schedule(config)

    def step(state: TrainState, batch: TrainBatch, frozen) -> tuple[TrainState, StepMetrics]:
        b = batch.advantages.shape[0]
        if b % (steps * k):
            raise ValueError(f"batch of {b} rows does not split into steps_per_generation {steps} mini-batches of "
                             f"grad_accum {k} micro-batches")
        if config.sampler_logprobs and batch.sampler_logprobs is None:
            raise ValueError(f"{config.sampler_logprobs_reason} needs the batch's sampler_logprobs (build_batch "
                             "keeps them from the rollouts' log-probs)")
        denominators, advantage_mean = batch.loss_denominator, batch.advantage_mean
        if denominators is None:
            denominators = mini_batch_denominators(batch.completion_mask, config)
        elif denominators.size != steps:
            raise ValueError(f"loss_denominator has {denominators.size} values; the update takes one per "
                             f"optimizer step's mini-batch, steps_per_generation={steps}")
        denominators = jnp.reshape(denominators, (steps,))
        if advantage_mean is None:
            advantage_mean = jnp.mean(batch.advantages)
        mismatched = None
        if config.shared_prefix:
            mismatched = mismatched_prompt_groups(batch, config.m, steps * k)
            if not isinstance(mismatched, jax.core.Tracer) and int(mismatched):  # called without jit
                raise mismatched_prompts_error(int(mismatched))
            # The update waits for the count: its batch-wide sum must not run beside the layer
            # scan's collectives, a pair that can deadlock fake CPU devices (docs/reliability.md).
            mismatched, state, batch, frozen = jax.lax.optimization_barrier((mismatched, state, batch, frozen))
        prompts_match = True if mismatched is None else mismatched == 0
        batches = _split(batch.replace(loss_denominator=None, advantage_mean=None), steps * k)

        def per_micro(fn):
            return jax.lax.map(lambda mb: jax.lax.stop_gradient(fn(mb)), batches)

        old = None  # the policy that sampled: [steps * k, rows, T]
        if sampler_old:
            old = batches.sampler_logprobs
        elif recompute_old:  # evaluated once, before the first update
            old = per_micro(lambda mb: logprobs_of(state.params, frozen, mb)[0])
        ref = None
        if config.beta > 0:
            def ref_logprobs(mb):
                return forward_logprobs(reference_fn, (frozen,), mb)[0]

            ref = per_micro(ref_logprobs)
        # [steps, k, ...]: optimizer step s takes micro-batches s*k .. s*k + k - 1.
        batches, old, ref = jax.tree.map(lambda x: x.reshape(steps, k, *x.shape[1:]), (batches, old, ref))
        xs = (batches, old, ref, denominators)

        def mini_step(st, x):
            mb, old_k, ref_k, denominator = x
            return update_once(st, mb, frozen, old_k, ref_k, denominator, prompts_match)

        passes = []
        for _ in range(config.num_iterations):
            if steps == 1:  # no scan around a single step
                state, metrics = mini_step(state, jax.tree.map(lambda x: x[0], xs))
                metrics = jax.tree.map(lambda x: x[None], metrics)
            else:
                state, metrics = jax.lax.scan(mini_step, state, xs)
            passes.append(metrics)
        per_update = jax.tree.map(lambda *xs: jnp.concatenate(xs), *passes)
        # Mismatch before any update: every first-pass mini-batch where the update's log-probs
        # of the sampling policy were computed up front, else the first step's alone.
        metrics = _summarize(per_update, steps if recompute_old else 1, config.num_iterations, advantage_mean)
        if not tis:
            metrics = metrics.replace(tis_weight_mean=None, tis_truncated_frac=None)
        if not config.log_mismatch:
            metrics = metrics.replace(mismatch_logp_abs=None, mismatch_ratio_max=None)
        return state, metrics.replace(mismatched_prompt_groups=mismatched)

    return step
