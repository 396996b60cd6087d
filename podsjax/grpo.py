"""The GRPO objective as pure functions: advantages, token log-probs, GRPO / GSPO / CISPO losses.

Everything here is jit/vmap/grad-able and imports nothing else from podsjax.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

StdScaling = Literal["group", "batch", "none"]
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
STD_SCALINGS = ("group", "batch", "none")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
LossType = Literal["grpo", "gspo", "cispo"]
LOSS_TYPES = ("grpo", "gspo", "cispo")
TisLevel = Literal["token", "sequence"]
TIS_LEVELS = ("token", "sequence")


def group_advantages(
    rewards_PM: jax.Array,
    *,
    eps: float = 1e-4,
    std_scaling: StdScaling = "group",
    ddof: int = 1,
) -> jax.Array:
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
      [..., M] float32 advantages. A group whose rewards are all equal gets
      exactly zero, in every scaling mode and for any eps (0 included): the
      rewards are shifted by the group's first value before the mean, so equal
      values are exactly 0 and no float32 rounding of the mean is left over.
      A group of one (M = 1) therefore also gets 0, where the authors' code
      gets NaN from its ddof-1 std of one value: a lone rollout carries no
      group-relative signal, and 0 keeps the update finite.
    """
    if std_scaling not in STD_SCALINGS:
        raise ValueError(f"std_scaling must be one of {STD_SCALINGS}; got {std_scaling!r}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0; got {eps}")
    rewards = jnp.asarray(rewards_PM, dtype=jnp.float32)
    if rewards.ndim < 1:
        raise ValueError(f"rewards must have a group axis [..., M]; got shape {rewards.shape}")
    # Mean and std are shift-invariant; shifting by one member makes equal rewards
    # exactly 0 before any averaging (mean([7.0] * 7) is not exactly 7.0 in float32).
    shifted = rewards - rewards[..., :1]
    centered = shifted - jnp.mean(shifted, axis=-1, keepdims=True)
    if std_scaling == "none":
        return centered
    if std_scaling == "group":
        size = rewards.shape[-1]
        std = jnp.std(shifted, axis=-1, keepdims=True, ddof=ddof if size > ddof else 0)
    else:
        std = jnp.std(rewards, ddof=ddof if rewards.size > ddof else 0)
    scale = std + eps
    # 0 / 0 (equal rewards with eps = 0) is 0 here, not NaN.
    return centered / jnp.where(scale > 0, scale, 1.0)


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (log-probs and entropies are of softmax(logits / T)); "
                         f"got {temperature}")


def token_logprobs(logits_BLV: jax.Array, targets_BL: jax.Array, *, temperature: float = 1.0) -> jax.Array:
    """Log-probability of each target token under softmax(logits / temperature).

    Computed as the target's scaled logit minus a logsumexp, in float32. Under
    jit the scaling and the upcast fuse into the logsumexp reduction, so no
    [B, L, V] softmax or log-softmax copy is materialized.

    Args:
      logits_BLV: [..., L, V] logits of any float dtype.
      targets_BL: [..., L] int token ids.
      temperature: > 0; the sampler's temperature, so the ratio compares the
        same distribution the rollouts came from.

    Returns:
      [..., L] float32 log-probs.
    """
    _check_temperature(temperature)
    if logits_BLV.shape[:-1] != targets_BL.shape:
        raise ValueError(f"logits {logits_BLV.shape} and targets {targets_BL.shape} disagree on the leading axes")
    scaled = logits_BLV.astype(jnp.float32) / temperature
    picked = jnp.take_along_axis(scaled, targets_BL[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(scaled, axis=-1)


def token_entropy(logits_BLV: jax.Array, *, temperature: float = 1.0) -> jax.Array:
    """Entropy of softmax(logits / temperature) per position, [..., L] float32.

    H = logsumexp(x) - sum softmax(x) * x, written as reductions so XLA fuses it, with x
    shifted by its maximum first: the two terms then stay small and cancel less.
    """
    _check_temperature(temperature)
    scaled = logits_BLV.astype(jnp.float32) / temperature
    scaled = scaled - jax.lax.stop_gradient(jnp.max(scaled, axis=-1, keepdims=True))
    lse = jax.nn.logsumexp(scaled, axis=-1, keepdims=True)
    return lse[..., 0] - jnp.sum(jnp.exp(scaled - lse) * scaled, axis=-1)


# Largest fp32 logits block [B, chunk, V] the chunked head materialises at once (512 MB).
LOGITS_CHUNK_ELEMENTS = 2**27


def logits_chunk(rows: int, length: int, vocab: int, max_elements: int = LOGITS_CHUNK_ELEMENTS) -> int:
    """The largest divisor of ``length`` whose [rows, chunk, vocab] block fits ``max_elements``."""
    limit = max(1, max_elements // max(1, rows * vocab))
    return max(c for c in range(1, min(limit, length) + 1) if length % c == 0)


def head_logprobs(
    hidden_BTD: jax.Array,
    head_VD: jax.Array,
    targets_BT: jax.Array,
    *,
    temperature: float = 1.0,
    max_elements: int = LOGITS_CHUNK_ELEMENTS,
) -> tuple[jax.Array, jax.Array]:
    """Target log-probs and entropies from hidden states, never holding all logits.

    The LM head runs over chunks of positions, forward and backward (a custom VJP that
    recomputes each chunk's logits), so both keep one [B, chunk, V] fp32 block at a time
    instead of the [B, T, V] logits (5 GB for 16 x 512 tokens of a 152k vocabulary). The
    backward multiplies in the head's dtype with fp32 accumulation: the head is never
    upcast (an fp32 copy of a tied 152k x 1536 head per chunk was 22 GB of traffic in a
    Qwen2.5-1.5B update), and its gradient is summed over the chunks in fp32.

    Args:
      hidden_BTD: final normed hidden states of the positions that predict ``targets``.
      head_VD: the LM head matrix (the embedding when tied).
      targets_BT: int token ids.
      temperature: > 0, as in :func:`token_logprobs`.
      max_elements: logits elements per chunk.

    Returns:
      ``(logprobs_BT, entropy_BT)`` float32; the entropy carries no gradient.
    """
    _check_temperature(temperature)
    b, t, _ = hidden_BTD.shape
    chunk = logits_chunk(b, t, head_VD.shape[0], max_elements)
    return _chunked_head(hidden_BTD, head_VD, targets_BT, float(temperature), chunk)


def _head_logits(h_BCD: jax.Array, head_VD: jax.Array) -> jax.Array:
    return jnp.einsum("bcd,vd->bcv", h_BCD, head_VD.astype(h_BCD.dtype), preferred_element_type=jnp.float32)


def _chunks(x: jax.Array, chunk: int) -> jax.Array:
    """[B, T, ...] -> [T / chunk, B, chunk, ...]."""
    b, t = x.shape[:2]
    return x.reshape(b, t // chunk, chunk, *x.shape[2:]).swapaxes(0, 1)


def _unchunk(x: jax.Array) -> jax.Array:
    n, b, c = x.shape[:3]
    return x.swapaxes(0, 1).reshape(b, n * c, *x.shape[3:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _chunked_head(hidden_BTD, head_VD, targets_BT, temperature: float, chunk: int):
    def block(xs):
        h_BCD, targets_BC = xs
        logits = _head_logits(h_BCD, head_VD)
        logp = token_logprobs(logits, targets_BC, temperature=temperature)
        return logp, token_entropy(logits, temperature=temperature)

    logp, entropy = jax.lax.map(block, (_chunks(hidden_BTD, chunk), _chunks(targets_BT, chunk)))
    return _unchunk(logp), jax.lax.stop_gradient(_unchunk(entropy))


def _chunked_head_fwd(hidden_BTD, head_VD, targets_BT, temperature, chunk):
    return _chunked_head(hidden_BTD, head_VD, targets_BT, temperature, chunk), (hidden_BTD, head_VD, targets_BT)


def _chunked_head_bwd(temperature, chunk, residuals, cotangents):
    hidden_BTD, head_VD, targets_BT = residuals
    g_logp_BT = cotangents[0]  # the entropy carries no gradient
    compute = hidden_BTD.dtype

    def block(d_head, xs):
        h_BCD, targets_BC, g_BC = xs
        scaled = _head_logits(h_BCD, head_VD) / temperature
        probs = jax.nn.softmax(scaled, axis=-1)
        picked = jax.nn.one_hot(targets_BC, scaled.shape[-1], dtype=jnp.float32)
        d_logits = ((picked - probs) * (g_BC[..., None] / temperature)).astype(compute)
        d_h = jnp.einsum("bcv,vd->bcd", d_logits, head_VD.astype(compute), preferred_element_type=jnp.float32)
        d_head = d_head + jnp.einsum("bcv,bcd->vd", d_logits, h_BCD, preferred_element_type=jnp.float32)
        return d_head, d_h.astype(hidden_BTD.dtype)

    xs = (_chunks(hidden_BTD, chunk), _chunks(targets_BT, chunk), _chunks(g_logp_BT.astype(jnp.float32), chunk))
    d_head, d_h = jax.lax.scan(block, jnp.zeros(head_VD.shape, jnp.float32), xs)
    return _unchunk(d_h), d_head.astype(head_VD.dtype), None


_chunked_head.defvjp(_chunked_head_fwd, _chunked_head_bwd)


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
        by a constant B * norm_length (Dr. GRPO).
      norm_length: the constant length of Dr. GRPO's normalizer; None uses the
        padded completion length L of the batch.
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
    loss_type: LossType = "grpo"
    tis_cap: float | None = None
    tis_level: TisLevel = "token"

    def __post_init__(self):
        if not self.epsilon >= 0:
            raise ValueError(f"epsilon must be >= 0; got {self.epsilon}")
        if self.epsilon_high is not None and not self.epsilon_high >= 0:
            raise ValueError(f"epsilon_high must be >= 0; got {self.epsilon_high}")
        if not self.beta >= 0:
            raise ValueError(f"beta must be >= 0; got {self.beta}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}; got {self.aggregation!r}")
        if self.norm_length is not None and self.norm_length < 1:
            raise ValueError(f"norm_length must be >= 1; got {self.norm_length}")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}; got {self.loss_type!r}")
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ValueError(f"tis_cap must be > 0, or None for no truncated importance sampling; got {self.tis_cap}")
        if self.tis_level not in TIS_LEVELS:
            raise ValueError(f"tis_level must be one of {TIS_LEVELS}; got {self.tis_level!r}")

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@flax.struct.dataclass
class LossTerms:
    """What the loss reduces, kept apart so micro-batches can share one normalizer.

    ``loss = numerator / denominator``; summing numerators over micro-batches and
    dividing by the whole batch's denominator gives the big-batch loss exactly.
    """

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


def loss_denominator(mask_BL: jax.Array, config: LossConfig) -> jax.Array:
    """The normalizer the aggregation mode divides by, for a batch's mask."""
    mask = mask_BL.astype(jnp.float32)
    if config.aggregation == "token-mean":
        return jnp.maximum(jnp.sum(mask), 1.0)
    num_seqs = jnp.asarray(mask.shape[0] if mask.ndim > 1 else 1, jnp.float32)
    if config.aggregation == "seq-mean-token-mean":
        return num_seqs
    length = config.norm_length or mask.shape[-1]
    return num_seqs * length


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

    Every token of a sequence gets -min(s A, clip(s, 1 - eps, 1 + eps_high) A), and the
    gradient flows through s, as TRL's ``importance_sampling_level="sequence"``. verl
    writes it per token as sg(s) * pi / sg(pi) (the paper's GSPO-token): the same value
    on each token and, since every aggregation weights a sequence's tokens alike, the
    same gradient. ``mask_BL`` (float) is 1 on the tokens that count.
    """
    lengths = jnp.maximum(jnp.sum(mask_BL, axis=-1, keepdims=True), 1.0)
    log_seq_ratio = jnp.sum((logp_BL - old_BL) * mask_BL, axis=-1, keepdims=True) / lengths
    return grpo_token_loss(jnp.broadcast_to(log_seq_ratio, logp_BL.shape), adv_B1, config)


def cispo_token_loss(logp_BL, old_BL, adv_B1, config: LossConfig) -> TokenLoss:
    """CISPO: -sg(min(r, 1 + eps_high)) A logp, REINFORCE weighted by the capped ratio.

    No token loses its gradient: the cap only bounds the weight. The bound is the
    MiniMax-M1 paper's 1 + eps_high with no lower bound (the paper sets none; verl adds
    1 - eps_low). TRL caps at ``epsilon_high`` itself (ScaleRL's eps_max, suggested 5.0),
    which is ``epsilon_high=4.0`` here; ``epsilon`` is unused.
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
    valid = mask_BL.astype(bool)
    log_ratio = jnp.where(valid, old_BL - sampler_BL, 0.0)
    if level == "sequence":
        log_ratio = jnp.broadcast_to(jnp.sum(log_ratio, axis=-1, keepdims=True), log_ratio.shape)
    log_cap = jnp.log(jnp.float32(cap))
    weights = jnp.exp(jnp.minimum(log_ratio, log_cap))
    return jax.lax.stop_gradient(weights), log_ratio > log_cap


class Mismatch(NamedTuple):
    """Sums over the tokens that count of how far the sampler's log-probs are from the update's."""

    abs_logp_diff: jax.Array  # sum of |logp_update - logp_sampler|
    max_ratio: jax.Array  # largest pi_update / pi_sampler of a token (0 with no tokens)
    tokens: jax.Array


def sampler_mismatch(update_BL: jax.Array, sampler_BL: jax.Array, mask_BL: jax.Array) -> Mismatch:
    """The sampler/update mismatch of one batch: the two programs' log-probs of the same tokens
    under the same weights, which differ by precision (bf16 decode over a bf16 cache against
    a rematerialised update) and by filtering the sampler did not apply to its log-probs."""
    valid = mask_BL.astype(bool)
    diff = jnp.where(valid, update_BL - sampler_BL, 0.0)
    max_log_ratio = jnp.max(jnp.where(valid, diff, -jnp.inf))
    return jax.lax.stop_gradient(Mismatch(abs_logp_diff=jnp.sum(jnp.abs(diff)),
                                          max_ratio=jnp.exp(max_log_ratio),
                                          tokens=jnp.sum(valid.astype(jnp.float32))))


def grpo_loss_terms(
    logprobs_BL: jax.Array,
    advantages_B: jax.Array,
    mask_BL: jax.Array,
    config: LossConfig,
    *,
    old_logprobs_BL: jax.Array | None = None,
    ref_logprobs_BL: jax.Array | None = None,
    sampler_logprobs_BL: jax.Array | None = None,
) -> tuple[LossTerms, LossMetrics]:
    """The policy loss with k3 KL, as (numerator, denominator) plus metrics.

    Per token: the ``config.loss_type`` term (GRPO's -min(ratio * A, clip(ratio, 1 - eps,
    1 + eps_high) * A) with ratio = exp(logp - old), or GSPO's or CISPO's)
    + beta * (exp(ref - logp) - (ref - logp) - 1).

    Args:
      logprobs_BL: [B, L] log-probs of the completion tokens under the policy
        being trained (differentiate through these).
      advantages_B: [B] one advantage per sequence.
      mask_BL: [B, L] 1 for completion tokens that count, 0 for padding.
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
      whatever values they hold.
    """
    if logprobs_BL.ndim != 2:
        raise ValueError(f"logprobs must be [B, L]; got shape {logprobs_BL.shape}")
    if mask_BL.shape != logprobs_BL.shape:
        raise ValueError(f"mask {mask_BL.shape} must match logprobs {logprobs_BL.shape}")
    if advantages_B.shape != logprobs_BL.shape[:1]:
        raise ValueError(f"advantages must be [B]={logprobs_BL.shape[:1]}; got {advantages_B.shape}")
    for name, other in (("old_logprobs", old_logprobs_BL), ("ref_logprobs", ref_logprobs_BL),
                        ("sampler_logprobs", sampler_logprobs_BL)):
        if other is not None and other.shape != logprobs_BL.shape:
            raise ValueError(f"{name} {other.shape} must match logprobs {logprobs_BL.shape}")
    if config.beta > 0 and ref_logprobs_BL is None:
        raise ValueError(f"beta={config.beta} > 0 needs ref_logprobs_BL")
    if config.tis_cap is not None and sampler_logprobs_BL is None:
        raise ValueError(f"tis_cap={config.tis_cap} needs sampler_logprobs_BL (the sampler's log-probs)")

    valid = mask_BL.astype(bool)
    weight = valid.astype(jnp.float32)
    # Padding may hold anything (even inf); zero it *before* the arithmetic so
    # neither the loss nor the gradient ever sees it.
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

    if ref_logprobs_BL is not None:
        log_ref_ratio = jnp.where(valid, ref_logprobs_BL, 0.0) - logp
        kl = jnp.exp(log_ref_ratio) - log_ref_ratio - 1.0
        if config.beta > 0:
            per_token = per_token + config.beta * kl
    else:
        kl = jnp.zeros_like(logp)

    per_token = jnp.where(valid, per_token, 0.0)
    if config.aggregation == "seq-mean-token-mean":
        lengths = jnp.maximum(jnp.sum(weight, axis=-1), 1.0)
        numerator = jnp.sum(jnp.sum(per_token, axis=-1) / lengths)
    else:
        numerator = jnp.sum(per_token)

    num_tokens = jnp.sum(weight)
    denom_tokens = jnp.maximum(num_tokens, 1.0)

    def token_mean(x):
        return jax.lax.stop_gradient(jnp.sum(jnp.where(valid, x, 0.0)) / denom_tokens)

    metrics = LossMetrics(
        clip_frac_low=token_mean(policy.clipped_low.astype(jnp.float32)),
        clip_frac_high=token_mean(policy.clipped_high.astype(jnp.float32)),
        kl_mean=token_mean(kl),
        advantage_mean=jnp.mean(advantages_B.astype(jnp.float32)),
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
