"""The GRPO / GRPO-GA / GRPO-PODS update: config, state, batch assembly and the jit step.

One PODS step after generation and scoring, as data:

    rewards_PN --select--> idx_PM --gather--> TrainBatch [P*M rows]
    TrainBatch --train_step--> new TrainState, StepMetrics

m is always the number of rollouts per prompt that the update trains, as in the paper.
GRPO is n = m (no selection); GRPO-GA is n = m as well, with more rollouts per prompt
accumulated over ``grad_accum`` micro-batches; GRPO-PODS generates n and trains the m a
rule selects.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import optax

from podsjax import grpo, paper_settings, selection

ALGORITHMS = ("grpo", "grpo-ga", "pods")
# optax >= 0.2.6 moved the global norm; keep older optax working too.
_tree_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm
SCHEDULES = ("constant", "cosine")


_INT_FIELDS = ("n", "m", "grad_accum", "groups_per_prompt", "num_iterations", "total_steps", "top_k")
_FLOAT_FIELDS = ("beta", "epsilon", "epsilon_high", "temperature", "logprob_temperature", "top_p", "learning_rate",
                 "warmup_ratio", "max_grad_norm", "weight_decay", "adam_b1", "adam_b2", "advantage_eps")


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
    """Everything that decides what one update does (validated, hashable). One comment per field."""

    n: int = 16  # rollouts generated per prompt
    m: int = 16  # rollouts trained per prompt: n for grpo and grpo-ga, the m of n a rule selects for pods
    algorithm: str = "grpo"  # grpo (n = m), grpo-ga (n = m in grad_accum micro-batches) or pods (m of n)
    rule: str = "max_variance"  # pods selection rule: max_variance, max_reward, random, percentile
    grad_accum: int = 1  # micro-batches each update is split into (gradients accumulate over them)
    # groups of n rollouts drawn per prompt each step, each selected and normalized on its own
    # (the authors' 8-GPU trainer draws one per accumulation micro-batch)
    groups_per_prompt: int = 1
    beta: float = 0.0  # k3 KL weight (0: no reference model is evaluated)
    epsilon: float = 0.2  # clip range of the ratio
    epsilon_high: float | None = None  # upper clip range (null: epsilon)
    num_iterations: int = 1  # updates per generated batch (1: the ratio is 1)
    aggregation: str = "token-mean"  # loss aggregation: token-mean, seq-mean-token-mean, seq-mean-token-sum-norm
    # The rollout policy; the update recomputes log-probs unfiltered, at logprob_temperature.
    temperature: float = 0.9  # sampling temperature of the rollouts
    logprob_temperature: float | None = None  # temperature of the update's log-probs (null: temperature)
    top_p: float = 1.0  # nucleus sampling mass kept (1: off)
    top_k: int = 0  # sample among the k most likely tokens (0: off)
    learning_rate: float = 5e-6  # peak learning rate
    schedule: str = "constant"  # learning-rate schedule: constant or cosine
    warmup_ratio: float = 0.0  # cosine: fraction of total_steps spent warming up
    total_steps: int = 1000  # cosine: the schedule's length in updates
    max_grad_norm: float = 0.1  # gradients are clipped to this global norm
    weight_decay: float = 0.1  # AdamW weight decay
    adam_b1: float = 0.9  # AdamW beta1
    adam_b2: float = 0.99  # AdamW beta2
    advantage_eps: float = 1e-4  # added to the group's reward std before dividing
    std_scaling: str = "group"  # advantage scale: group (the group's std), batch or none

    def __post_init__(self):
        def bad(message):
            raise ValueError(f"AlgorithmConfig: {message}")

        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in _INT_FIELDS and (isinstance(value, bool) or not isinstance(value, int)):
                bad(f"{field.name} must be an integer; got {value!r}")
            if field.name in _FLOAT_FIELDS and value is not None:
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    bad(f"{field.name} must be a number; got {value!r}")
                if not math.isfinite(value):  # an inf lr or beta would silently poison every weight
                    bad(f"{field.name} must be finite; got {value}")
        if self.algorithm not in ALGORITHMS:
            bad(f"algorithm must be one of {ALGORITHMS}; got {self.algorithm!r}")
        if not 1 <= self.m <= self.n:
            bad(f"need 1 <= m <= n; got n={self.n}, m={self.m}")
        if self.algorithm in ("grpo", "grpo-ga") and self.m != self.n:
            split = " (split the update into micro-batches with grad_accum)" if self.algorithm == "grpo-ga" else ""
            bad(f"{self.algorithm} trains every rollout, so m must equal n{split}; got n={self.n}, m={self.m}")
        if self.algorithm == "pods":
            selection.get_rule(self.rule)  # unknown names raise, listing the known ones
        if self.grad_accum < 1:
            bad(f"grad_accum must be >= 1; got {self.grad_accum}")
        if self.groups_per_prompt < 1:
            bad(f"groups_per_prompt must be >= 1; got {self.groups_per_prompt}")
        if self.num_iterations < 1:
            bad(f"num_iterations must be >= 1; got {self.num_iterations}")
        if self.schedule not in SCHEDULES:
            bad(f"schedule must be one of {SCHEDULES}; got {self.schedule!r}")
        if not 0 <= self.warmup_ratio < 1:
            bad(f"warmup_ratio must be in [0, 1); got {self.warmup_ratio}")
        if self.total_steps < 1:
            bad(f"total_steps must be >= 1; got {self.total_steps}")
        if not self.learning_rate > 0:
            bad(f"learning_rate must be > 0; got {self.learning_rate}")
        if not self.temperature > 0:
            bad(f"training temperature must be > 0; got {self.temperature}")
        if self.logprob_temperature is not None and not self.logprob_temperature > 0:
            bad(f"logprob_temperature must be > 0, or null for the sampling temperature; got {self.logprob_temperature}")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1]; got {self.top_p}")
        if self.top_k < 0:
            bad(f"top_k must be >= 0 (0: off); got {self.top_k}")
        if not self.max_grad_norm > 0:
            bad(f"max_grad_norm must be > 0; got {self.max_grad_norm}")
        if not self.weight_decay >= 0:
            bad(f"weight_decay must be >= 0; got {self.weight_decay}")
        for name in ("adam_b1", "adam_b2"):
            if not 0 <= getattr(self, name) < 1:
                bad(f"{name} must be in [0, 1); got {getattr(self, name)}")
        if not self.advantage_eps >= 0:
            bad(f"advantage_eps must be >= 0; got {self.advantage_eps}")
        if self.std_scaling not in grpo.STD_SCALINGS:
            bad(f"std_scaling must be one of {grpo.STD_SCALINGS}; got {self.std_scaling!r}")
        self.loss_config  # validates epsilon, beta, aggregation

    @property
    def update_temperature(self) -> float:
        """The temperature the update's log-probs divide by."""
        return self.temperature if self.logprob_temperature is None else self.logprob_temperature

    @property
    def loss_config(self) -> grpo.LossConfig:
        return grpo.LossConfig(
            epsilon=self.epsilon, epsilon_high=self.epsilon_high, beta=self.beta, aggregation=self.aggregation
        )


def method_config(name: str, **overrides) -> AlgorithmConfig:
    """One of the paper's three algorithms with the n / m of its single-GPU GSM8K settings; override any field.

    The sizes are ``paper_settings.GSM8K_METHODS`` (docs/paper_settings.md lists them):
    "grpo" trains every rollout, "grpo-ga" too in ``grad_accum`` micro-batches, "pods"
    the max-variance m of n.
    """
    presets = paper_settings.GSM8K_METHODS
    if name not in presets:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(presets)}")
    return AlgorithmConfig(**{**presets[name], **overrides})


def make_optimizer(config: AlgorithmConfig) -> optax.GradientTransformation:
    """Clip by global norm, then AdamW on the configured schedule."""
    return optax.chain(
        optax.clip_by_global_norm(config.max_grad_norm),
        optax.adamw(
            learning_rate_schedule(config), b1=config.adam_b1, b2=config.adam_b2, weight_decay=config.weight_decay
        ),
    )


def learning_rate_schedule(config: AlgorithmConfig) -> optax.Schedule:
    if config.schedule == "constant":
        return optax.constant_schedule(config.learning_rate)
    warmup = int(config.warmup_ratio * config.total_steps)
    if warmup == 0:
        return optax.cosine_decay_schedule(config.learning_rate, config.total_steps)
    return optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, warmup, config.total_steps)


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
        no batch-only collective that could run beside the layer scan's: XLA's CPU runtime
        can run two independent collectives of one program on a device at once and then
        deadlock with fake host devices.
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
