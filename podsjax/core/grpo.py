"""The GRPO objective as pure functions: advantages, GRPO / GSPO / CISPO losses, TIS and the sampler mismatch.

Everything here is jit/vmap/grad-able and imports nothing else from podsjax. The log-probs the
loss takes come from ``podsjax.core.logprobs``.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Literal, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from podsjax.core import arrays

StdScaling = Literal["group", "batch", "none"]
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "group-token-mean"]
STD_SCALINGS = ("group", "batch", "none")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "group-token-mean")
LossType = Literal["grpo", "gspo", "cispo"]
LOSS_TYPES = ("grpo", "gspo", "cispo")
TisLevel = Literal["token", "sequence"]
TIS_LEVELS = ("token", "sequence")


def group_advantages(rewards_PM: jax.Array, *, eps: float = 1e-4, std_scaling: StdScaling = "group",
                     ddof: int = 1) -> jax.Array:
    """Group-relative advantages a_i = (r_i - mean_group) / (std + eps).

    Call it on the rewards of the *selected* rollouts, so PODS normalizes over
    the subset it trains on.

    Args:
      rewards_PM: [..., M] rewards; the last axis is one group.
      eps: added to the std (the PODS reference code uses 1e-4).
      std_scaling: "group" divides by each group's std, "batch" by the std of
        all rewards, "none" only subtracts the group mean (Dr. GRPO).
      ddof: delta degrees of freedom of the std; 1 matches ``torch.std``,
        which TRL-style GRPO code uses, 0 gives the population std.

    Returns:
      [..., M] float32 advantages. A group whose rewards are all equal gets exactly zero, in
      every scaling mode and for any eps (0 included): the rewards are shifted by the group's
      first value before the mean, so no float32 rounding of the mean is left over. A group
      of one (M = 1) therefore gets 0 too, where the authors' code gets NaN from its ddof-1
      std of one value: a lone rollout carries no group-relative signal.

    Raises:
      ValueError: a NaN or infinite reward, or a group spanning more than float32 holds (unless
        traced: then its advantages are NaN, every group's with "batch", and the update skips them).
      TypeError: complex rewards.
    """
    if std_scaling not in STD_SCALINGS:
        raise ValueError(f"std_scaling must be one of {STD_SCALINGS}; got {std_scaling!r}")
    if not isinstance(eps, jax.core.Tracer):  # a traced eps is the caller's to keep >= 0
        if eps is None or isinstance(eps, (bool, str)) or jnp.ndim(eps) != 0 or not eps >= 0:
            raise ValueError(f"eps must be a number >= 0; got {eps!r}")
    if isinstance(ddof, bool) or not isinstance(ddof, numbers.Integral) or ddof < 0:
        raise ValueError(f"ddof must be an integer >= 0; got {ddof!r}")
    ddof = int(ddof)
    # float64 is shifted before it becomes float32: on the host without x64, by JAX under it
    wide = jnp.asarray(arrays.host_rewards(rewards_PM, per_group=std_scaling != "batch"))
    if jnp.iscomplexobj(wide):  # a cast would keep the real part without a word
        raise TypeError(f"rewards must be real numbers; got dtype {wide.dtype}")
    if not jnp.issubdtype(wide.dtype, jnp.floating) or jnp.finfo(wide.dtype).bits < 32:
        wide = wide.astype(jnp.float32)
    rewards = wide.astype(jnp.float32)
    if rewards.ndim < 1:
        raise ValueError(f"rewards must have a group axis [..., M]; got shape {rewards.shape}")
    if (host := arrays.finite_on_host(rewards, "rewards")) is not None:
        if host.size and (spread := np.ptp(host, axis=-1).max()) > np.finfo(np.float32).max:  # shift: inf
            raise ValueError(f"rewards of one group must differ by less than float32's largest value (3.4e38); "
                             f"one group spans {spread:.3g}")
    # Mean and std are shift-invariant; shifting by one member makes equal rewards
    # exactly 0 before any averaging (mean([7.0] * 7) is not exactly 7.0 in float32).
    shifted = (wide - wide[..., :1]).astype(jnp.float32)
    centered = shifted - jnp.mean(shifted, axis=-1, keepdims=True)
    if std_scaling == "none":
        return centered
    if std_scaling == "group":
        std = _std(shifted, centered, axis=-1, ddof=ddof)
    else:  # shifted by one reward of the batch, for the same reason
        batch = (wide - (jnp.max(wide) if wide.size else 0.0)).astype(jnp.float32)  # a reduction: no sharded slice
        std = _std(batch, batch - jnp.mean(batch), axis=None, ddof=ddof)
        # A traced non-finite reward: NaN, not a NaN variance's 0 (the other groups over eps alone).
        std = jnp.where(jnp.all(jnp.isfinite(rewards)), std, jnp.nan)
    scale = std + eps
    # 0 / 0 (equal rewards with eps = 0) is 0 here, not NaN.
    return centered / jnp.where(scale > 0, scale, jnp.where(scale == 0, 1.0, jnp.nan))  # NaN stays NaN


def _std(values: jax.Array, centered: jax.Array, axis: int | None, ddof: int) -> jax.Array:
    """The std of ``values`` (``centered``: less their mean) with ``ddof``, or ddof 0 where the axis
    holds no more than ``ddof`` values; 0 with gradient 0 (not NaN) where they are all equal."""
    size, keep = (values.shape[-1] if axis is not None else values.size), axis is not None
    # In units of the largest deviation's power of two (exact, so bit for bit the plain std in
    # range): a spread past 1.8e19 overflows float32's square.
    largest = jnp.max(jnp.abs(centered), axis=axis, keepdims=keep) if size else jnp.zeros(())
    unit = jnp.where(largest > 0, jnp.ldexp(jnp.ones_like(largest), jnp.frexp(largest)[1]), 1.0)
    var = jnp.sum((centered / unit) ** 2, axis=axis, keepdims=keep) / max(size - (ddof if size > ddof else 0), 1)
    positive = var > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, var, 1.0)) * unit, 0.0)


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Hyperparameters of the clipped GRPO loss (hashable, so jit can take it static).

    Attributes:
      epsilon: lower clip, the ratio is kept >= 1 - epsilon for negative advantages.
      epsilon_high: upper clip (DAPO's clip-higher); None means epsilon.
      beta: weight of the k3 KL to the reference policy; 0 needs no reference.
      aggregation: "token-mean" averages all tokens of the batch,
        "seq-mean-token-mean" averages per sequence then over sequences
        (the original GRPO), "seq-mean-token-sum-norm" sums tokens and divides
        by a constant B * norm_length (Dr. GRPO), "group-token-mean" averages the
        tokens of each group of ``group_size`` consecutive rows, then over groups (TRL's
        bnpo on micro-batches of one group each, as the PODS authors' 8-GPU trainer).
      norm_length: the constant length of Dr. GRPO's normalizer; None uses the
        padded completion length L of the batch.
      group_size: rows per group for "group-token-mean" (its groups are runs of
        consecutive rows; the batch must hold whole groups).
      loss_type: each token's policy term: "grpo" clips the token's ratio, "gspo" the
        sequence's (:func:`gspo_token_loss`), "cispo" caps a stop-gradient weight on
        REINFORCE (:func:`cispo_token_loss`); each takes every aggregation and the KL.
      tis_cap: truncated importance sampling against the sampler (None: off). Each
        token's policy term is weighted by sg(min(pi_old / pi_sampler, tis_cap)), where
        pi_old is the update program's log-prob of the policy that sampled; the KL term
        is not weighted (as TRL and verl). Needs the sampler's log-probs
        (:func:`tis_weights`).
      tis_level: "token" (one weight per token) or "sequence" (one per sequence: the
        product of its tokens' ratios, truncated).
    """

    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    aggregation: Aggregation = "token-mean"
    norm_length: int | None = None
    group_size: int | None = None
    loss_type: LossType = "grpo"
    tis_cap: float | None = None
    tis_level: TisLevel = "token"

    def __post_init__(self):
        for name in ("epsilon", "epsilon_high", "beta", "tis_cap"):
            value = getattr(self, name)
            if value is None and name in ("epsilon_high", "tis_cap"):  # None: off
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"{name} must be a number; got {value!r}")
            object.__setattr__(self, name, float(value))  # NumPy scalars too, as hashable Python floats
        for name in ("norm_length", "group_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
                raise ValueError(f"{name} must be an integer; got {value!r}")
            object.__setattr__(self, name, None if value is None else int(value))
        for ok, problem in (
                (0 <= self.epsilon < 1, f"epsilon must be in [0, 1) (the ratio is clipped at 1 - it); got {self.epsilon}"),
                (self.epsilon_high is None or self.epsilon_high >= 0, f"epsilon_high must be >= 0; got {self.epsilon_high}"),
                (0 <= self.beta < np.inf, f"beta must be >= 0 and finite; got {self.beta}"),
                (self.aggregation in AGGREGATIONS, f"aggregation must be one of {AGGREGATIONS}; got {self.aggregation!r}"),
                (self.norm_length is None or self.norm_length >= 1, f"norm_length must be >= 1; got {self.norm_length}"),
                (self.aggregation != "group-token-mean" or (self.group_size or 0) >= 1,
                 f"aggregation 'group-token-mean' needs group_size >= 1; got {self.group_size}"),
                (self.loss_type in LOSS_TYPES, f"loss_type must be one of {LOSS_TYPES}; got {self.loss_type!r}"),
                (self.tis_cap is None or self.tis_cap > 0,
                 f"tis_cap must be > 0, or None for no truncated importance sampling; got {self.tis_cap}"),
                (self.tis_level in TIS_LEVELS, f"tis_level must be one of {TIS_LEVELS}; got {self.tis_level!r}")):
            if not ok:
                raise ValueError(problem)

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@flax.struct.dataclass
class LossTerms:
    """``loss = numerator / denominator``, kept apart: summing micro-batches' numerators and dividing
    by the whole batch's denominator gives the big-batch loss exactly."""

    numerator: jax.Array
    denominator: jax.Array


@flax.struct.dataclass
class LossMetrics:
    """Masked-token statistics of one loss evaluation (all scalars)."""

    clip_frac_low: jax.Array  # ratio < 1 - eps with a negative advantage (CISPO: always 0)
    clip_frac_high: jax.Array  # ratio > 1 + eps_high with a positive advantage (CISPO: any capped weight)
    kl_mean: jax.Array
    advantage_mean: jax.Array
    ratio_mean: jax.Array
    num_tokens: jax.Array
    tis_weight_mean: jax.Array  # the TIS weight's token mean (1 without TIS)
    tis_truncated_frac: jax.Array  # tokens whose TIS weight the cap cut


def _groups(rows: int, config: LossConfig) -> int:
    """The number of whole groups of ``config.group_size`` in ``rows`` rows (a ValueError if not whole)."""
    if rows % config.group_size:
        raise ValueError(f"aggregation 'group-token-mean' needs whole groups of {config.group_size} rows; "
                         f"a batch of {rows} rows is not (the rows of each micro-batch must be whole groups)")
    return rows // config.group_size


def _by_group(x_B: jax.Array, groups: int, size: int) -> jax.Array:
    """[B] as [groups, size]; replicated first on a mesh of Explicit axes whose devices do not
    divide the groups, where JAX cannot reshape a sharded axis."""
    return arrays.replicated_unless_divides(x_B, groups).reshape(groups, size)


def loss_denominator(mask_BL: jax.Array, config: LossConfig) -> jax.Array:
    """The normalizer the aggregation mode divides by, for a batch's mask (nonzero: a token counts)."""
    mask = jnp.asarray(mask_BL).astype(bool).astype(jnp.float32)  # as the numerator weighs the tokens
    if config.aggregation == "token-mean":
        return jnp.maximum(jnp.sum(mask), 1.0)
    # At least 1 in every mode, so an empty batch's loss is 0, not 0 / 0.
    if config.aggregation == "group-token-mean":
        return jnp.asarray(max(_groups(mask.shape[0], config), 1), jnp.float32)
    num_seqs = jnp.asarray(max(mask.shape[0], 1) if mask.ndim > 1 else 1, jnp.float32)
    if config.aggregation == "seq-mean-token-mean":
        return num_seqs
    return num_seqs * (config.norm_length or max(mask.shape[-1], 1))


class TokenLoss(NamedTuple):
    """One policy term per token, before the KL, the mask and the aggregation ([B, L] each)."""

    per_token: jax.Array
    ratio: jax.Array  # the importance ratio used (GSPO: the sequence's, on each of its tokens)
    clipped_low: jax.Array  # bool: the lower clip bit
    clipped_high: jax.Array  # bool: the upper clip (CISPO: the cap) bit


def grpo_token_loss(log_ratio_BL: jax.Array, adv_B1: jax.Array, config: LossConfig) -> TokenLoss:
    """-min(r A, clip(r, 1 - eps, 1 + eps_high) A) with r = exp(log_ratio), GRPO's log_ratio = logp - old."""
    ratio = jnp.exp(log_ratio_BL)
    clipped = jnp.clip(ratio, 1.0 - config.epsilon, 1.0 + config.clip_high)
    return TokenLoss(per_token=-jnp.minimum(ratio * adv_B1, clipped * adv_B1), ratio=ratio,
                     clipped_low=(ratio < 1.0 - config.epsilon) & (adv_B1 < 0),
                     clipped_high=(ratio > 1.0 + config.clip_high) & (adv_B1 > 0))


def gspo_token_loss(logp_BL, old_BL, adv_B1, mask_BL, config: LossConfig) -> TokenLoss:
    """GSPO: the clipped surrogate of one ratio per sequence, s = exp(mean_t (logp - old)).

    Every token of a sequence gets -min(s A, clip(s, 1 - eps, 1 + eps_high) A), the gradient
    through s (TRL's ``importance_sampling_level="sequence"``). verl's per-token sg(s) * pi / sg(pi)
    (GSPO-token) has the same value and, as every aggregation weights a sequence's tokens alike,
    the same gradient. ``mask_BL`` (float) is 1 on the tokens that count.
    """
    lengths = jnp.maximum(jnp.sum(mask_BL, axis=-1, keepdims=True), 1.0)
    log_seq_ratio = jnp.sum((logp_BL - old_BL) * mask_BL, axis=-1, keepdims=True) / lengths
    return grpo_token_loss(jnp.broadcast_to(log_seq_ratio, logp_BL.shape), adv_B1, config)


def cispo_token_loss(logp_BL, old_BL, adv_B1, config: LossConfig) -> TokenLoss:
    """CISPO: -sg(min(r, 1 + eps_high)) A logp, REINFORCE weighted by the capped ratio.

    No token loses its gradient: the cap only bounds the weight, MiniMax-M1's 1 + eps_high with no
    lower bound (verl adds 1 - eps_low). TRL caps at ``epsilon_high`` itself (ScaleRL's eps_max,
    suggested 5.0), which is ``epsilon_high=4.0`` here; ``epsilon`` is unused.
    """
    ratio = jnp.exp(logp_BL - old_BL)
    cap = 1.0 + config.clip_high
    capped = jax.lax.stop_gradient(jnp.minimum(ratio, cap))
    return TokenLoss(per_token=-capped * adv_B1 * logp_BL, ratio=ratio,
                     clipped_low=jnp.zeros(ratio.shape, bool), clipped_high=ratio > cap)


def tis_weights(old_BL: jax.Array, sampler_BL: jax.Array, mask_BL: jax.Array, cap: float,
                level: TisLevel = "token") -> tuple[jax.Array, jax.Array]:
    """Truncated importance weights min(pi_old / pi_sampler, cap), stop-gradient, and which were cut.

    ``old_BL`` are the update program's log-probs of the policy that sampled and
    ``sampler_BL`` the sampler's own; both [B, L], ``mask_BL`` 1 on the tokens that count.
    "sequence" gives every token of a sequence the truncated product of its tokens' ratios.
    The ratio is formed in log space and capped there, so a large log-ratio cannot
    overflow. Returns ``(weights_BL, truncated_BL)``.
    """
    if level not in TIS_LEVELS:
        raise ValueError(f"tis_level must be one of {TIS_LEVELS}; got {level!r}")
    if not isinstance(cap, jax.core.Tracer) and (isinstance(cap, (bool, str)) or cap is None or not cap > 0):
        raise ValueError(f"cap must be a number > 0 (the largest weight); got {cap!r}")
    old_BL, sampler_BL, mask_BL = _same_shape(old_BL, sampler_BL, mask_BL)
    log_ratio = jnp.where(mask_BL.astype(bool), old_BL - sampler_BL, 0.0)
    if level == "sequence":
        log_ratio = jnp.broadcast_to(jnp.sum(log_ratio, axis=-1, keepdims=True), log_ratio.shape)
    log_cap = jnp.log(jnp.float32(cap))
    return jax.lax.stop_gradient(jnp.exp(jnp.minimum(log_ratio, log_cap))), log_ratio > log_cap


def _same_shape(logprobs_BL, other_BL, mask_BL) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Two log-probs of the same tokens and their mask, as arrays of one shape."""
    arrays = tuple(jnp.asarray(x) for x in (logprobs_BL, other_BL, mask_BL))
    if len({x.shape for x in arrays}) != 1:
        raise ValueError(f"the two log-probs and the mask must have one shape; got {', '.join(str(x.shape) for x in arrays)}")
    return arrays


class Mismatch(NamedTuple):
    """Sums over the tokens that count of how far the sampler's log-probs are from the update's."""

    abs_logp_diff: jax.Array  # sum of |logp_update - logp_sampler|
    max_ratio: jax.Array  # largest pi_update / pi_sampler of a token (0 with no tokens)
    tokens: jax.Array


def sampler_mismatch(update_BL: jax.Array, sampler_BL: jax.Array, mask_BL: jax.Array) -> Mismatch:
    """The sampler/update mismatch of one batch: the two programs' log-probs of the same tokens
    under the same weights, which differ by precision (bf16 decode over a bf16 cache against
    a rematerialised update) and by filtering the sampler did not apply to its log-probs."""
    update_BL, sampler_BL, mask_BL = _same_shape(update_BL, sampler_BL, mask_BL)
    valid = mask_BL.astype(bool)
    diff = jnp.where(valid, update_BL - sampler_BL, 0.0)
    return jax.lax.stop_gradient(Mismatch(abs_logp_diff=jnp.sum(jnp.abs(diff)),
                                          max_ratio=jnp.exp(jnp.max(jnp.where(valid, diff, -jnp.inf))),
                                          tokens=jnp.sum(valid.astype(jnp.float32))))


def grpo_loss_terms(logprobs_BL: jax.Array, advantages_B: jax.Array, mask_BL: jax.Array, config: LossConfig, *,
                    old_logprobs_BL: jax.Array | None = None, ref_logprobs_BL: jax.Array | None = None,
                    sampler_logprobs_BL: jax.Array | None = None) -> tuple[LossTerms, LossMetrics]:
    """The policy loss with k3 KL, as (numerator, denominator) plus metrics.

    Per token: the ``config.loss_type`` term (GRPO's -min(ratio * A, clip(ratio, 1 - eps,
    1 + eps_high) * A) with ratio = exp(logp - old), or GSPO's or CISPO's)
    + beta * (exp(ref - logp) - (ref - logp) - 1).

    Args:
      logprobs_BL: [B, L] log-probs of the completion tokens under the policy
        being trained (differentiate through these).
      advantages_B: [B] one advantage per sequence.
      mask_BL: [B, L] 1 (or any nonzero value) for completion tokens that count, 0 for padding.
      config: the loss hyperparameters.
      old_logprobs_BL: [B, L] log-probs of the policy that sampled; None means
        the current policy (one update per batch, ratio 1 with the gradient
        of logp).
      ref_logprobs_BL: [B, L] reference log-probs; required iff beta > 0.
      sampler_logprobs_BL: [B, L] the sampler's own log-probs of the tokens; required iff
        ``config.tis_cap`` is set. The TIS weight compares them with ``old_logprobs_BL``
        (or, with none, the current log-probs, which then are the sampling policy's).

    Returns:
      (LossTerms, LossMetrics). Masked positions get exactly zero gradient,
      whatever values they hold. ``old``, ``ref`` and ``sampler`` log-probs carry no
      gradient (passing the current log-probs as ``old`` is the same as None).
    """
    if not isinstance(config, LossConfig):
        raise TypeError(f"config must be a LossConfig (grpo.LossConfig(epsilon=..., ...)); got {type(config).__name__}")
    logprobs_BL, advantages_B, mask_BL = jnp.asarray(logprobs_BL), jnp.asarray(advantages_B), jnp.asarray(mask_BL)
    old_logprobs_BL, ref_logprobs_BL, sampler_logprobs_BL = (
        None if x is None else jax.lax.stop_gradient(jnp.asarray(x))
        for x in (old_logprobs_BL, ref_logprobs_BL, sampler_logprobs_BL))
    if logprobs_BL.ndim != 2:
        raise ValueError(f"logprobs must be [B, L]; got shape {logprobs_BL.shape}")
    if advantages_B.shape != logprobs_BL.shape[:1]:
        raise ValueError(f"advantages must be [B]={logprobs_BL.shape[:1]}; got {advantages_B.shape}")
    for name, other in (("mask", mask_BL), ("old_logprobs", old_logprobs_BL), ("ref_logprobs", ref_logprobs_BL),
                        ("sampler_logprobs", sampler_logprobs_BL)):
        if other is not None and other.shape != logprobs_BL.shape:
            raise ValueError(f"{name} {other.shape} must match logprobs {logprobs_BL.shape}")
    if config.beta > 0 and ref_logprobs_BL is None:
        raise ValueError(f"beta={config.beta} > 0 needs ref_logprobs_BL")
    if config.tis_cap is not None and sampler_logprobs_BL is None:
        raise ValueError(f"tis_cap={config.tis_cap} needs sampler_logprobs_BL (the sampler's log-probs)")
    arrays.finite_on_host(advantages_B, "advantages")  # an eager call's NaN had made the loss NaN

    valid = mask_BL.astype(bool)
    weight = valid.astype(jnp.float32)
    # Padding may hold anything (even inf): zeroed first, neither loss nor gradient sees it.
    logp = jnp.where(valid, logprobs_BL.astype(jnp.float32), 0.0)
    old = jax.lax.stop_gradient(logp) if old_logprobs_BL is None else jnp.where(valid, old_logprobs_BL, 0.0)
    adv = advantages_B.astype(jnp.float32)[:, None]

    if config.loss_type == "gspo":
        policy = gspo_token_loss(logp, old, adv, weight, config)
    elif config.loss_type == "cispo":
        policy = cispo_token_loss(logp, old, adv, config)
    else:
        policy = grpo_token_loss(logp - old, adv, config)
    per_token = policy.per_token
    tis, truncated = jnp.ones_like(logp), jnp.zeros(logp.shape, bool)
    if config.tis_cap is not None:
        sampler = jnp.where(valid, sampler_logprobs_BL, 0.0)
        tis, truncated = tis_weights(old, sampler, weight, config.tis_cap, config.tis_level)
        per_token = per_token * tis

    kl = jnp.zeros_like(logp)
    if ref_logprobs_BL is not None:
        log_ref_ratio = jnp.where(valid, ref_logprobs_BL, 0.0) - logp
        kl = jnp.exp(log_ref_ratio) - log_ref_ratio - 1.0
        per_token = per_token + config.beta * kl if config.beta > 0 else per_token

    per_token = jnp.where(valid, per_token, 0.0)
    if config.aggregation == "seq-mean-token-mean":
        lengths = jnp.maximum(jnp.sum(weight, axis=-1), 1.0)
        numerator = jnp.sum(jnp.sum(per_token, axis=-1) / lengths)
    elif config.aggregation == "group-token-mean":
        groups = _groups(per_token.shape[0], config)
        group_sums = _by_group(jnp.sum(per_token, axis=-1), groups, config.group_size).sum(axis=-1)
        group_tokens = _by_group(jnp.sum(weight, axis=-1), groups, config.group_size).sum(axis=-1)
        numerator = jnp.sum(group_sums / jnp.maximum(group_tokens, 1.0))
    else:
        numerator = jnp.sum(per_token)

    denom_tokens = jnp.maximum(num_tokens := jnp.sum(weight), 1.0)

    def token_mean(x):
        return jax.lax.stop_gradient(jnp.sum(jnp.where(valid, x, 0.0)) / denom_tokens)

    metrics = LossMetrics(
        clip_frac_low=token_mean(policy.clipped_low.astype(jnp.float32)),
        clip_frac_high=token_mean(policy.clipped_high.astype(jnp.float32)),
        kl_mean=token_mean(kl),
        advantage_mean=jnp.sum(advantages_B.astype(jnp.float32)) / max(advantages_B.size, 1),  # 0 when empty
        ratio_mean=token_mean(policy.ratio),
        num_tokens=num_tokens,
        tis_weight_mean=token_mean(tis),
        tis_truncated_frac=token_mean(truncated.astype(jnp.float32)),
    )
    return LossTerms(numerator=numerator, denominator=loss_denominator(mask_BL, config)), metrics


def grpo_loss(
    logprobs_BL: jax.Array,
    advantages_B: jax.Array,
    mask_BL: jax.Array,
    config: LossConfig = LossConfig(),
    *,
    old_logprobs_BL: jax.Array | None = None,
    ref_logprobs_BL: jax.Array | None = None,
    sampler_logprobs_BL: jax.Array | None = None,
) -> tuple[jax.Array, LossMetrics]:
    """The scalar policy loss (GRPO, GSPO or CISPO) and its metrics; see ``grpo_loss_terms``."""
    terms, metrics = grpo_loss_terms(logprobs_BL, advantages_B, mask_BL, config, old_logprobs_BL=old_logprobs_BL,
                                     ref_logprobs_BL=ref_logprobs_BL, sampler_logprobs_BL=sampler_logprobs_BL)
    return terms.numerator / terms.denominator, metrics
