"""The GRPO objective: hand-computed values, a float64 NumPy reference, gradients."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from podsjax.core import grpo, logprobs
from podsjax.core.grpo import LossConfig

LOSS = jax.jit(grpo.grpo_loss, static_argnums=3)


# --- advantages ----------------------------------------------------------------


def test_group_advantages_by_hand():
    rewards = jnp.array([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    # Group 0: mean 0.5, deviations +-0.5; sample variance 4 * 0.25 / 3 = 1/3,
    # std = 0.57735027, so a = +-0.5 / (0.57735027 + 1e-4) = +-0.86587543.
    adv = np.asarray(grpo.group_advantages(rewards, eps=1e-4))
    np.testing.assert_allclose(adv[0], [0.86587543, -0.86587543, -0.86587543, 0.86587543], rtol=1e-6)
    # Group 1 has zero variance: zero advantages, not 0/0.
    assert np.array_equal(adv[1], np.zeros(4))
    # ddof=0: population std 0.5, a = +-0.5 / 0.5001 = +-0.99980004.
    pop = np.asarray(grpo.group_advantages(rewards[:1], eps=1e-4, ddof=0))
    np.testing.assert_allclose(pop, [[0.99980004, -0.99980004, -0.99980004, 0.99980004]], rtol=1e-6)


def test_group_advantages_batch_and_none_scaling():
    rewards = jnp.array([[1.0, 0.0], [3.0, 3.0]])
    # "none": only the group mean is removed (Dr. GRPO).
    assert np.asarray(grpo.group_advantages(rewards, std_scaling="none")).tolist() == [[0.5, -0.5], [0.0, 0.0]]
    # "batch": std of all four rewards [1, 0, 3, 3] with ddof=1: mean 1.75,
    # squared deviations 0.5625 + 3.0625 + 1.5625 + 1.5625 = 6.75, var 2.25, std 1.5;
    # group 0 -> +-0.5 / 1.5001 = +-0.33331111.
    adv = np.asarray(grpo.group_advantages(rewards, std_scaling="batch", eps=1e-4))
    np.testing.assert_allclose(adv, [[0.33331111, -0.33331111], [0.0, 0.0]], rtol=1e-6)
    with pytest.raises(ValueError, match="std_scaling must be one of"):
        grpo.group_advantages(rewards, std_scaling="global")


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=16, max_size=16),
       m=st.integers(1, 64), eps=st.sampled_from([0.0, 1e-4]), ddof=st.sampled_from([0, 1]))
def test_equal_rewards_give_exactly_zero_advantages(values, m, eps, ddof):
    # Known cases: -2.5 with m=3 gave 7e-4 and 7.0 with m=7 gave -4.7e-3 (float32 mean rounding).
    # Sixteen equal-reward groups an example, beside one with variance: each compile (one a
    # shape) checks sixteen values.
    equal = np.repeat(np.asarray(values, np.float32)[:, None], m, axis=1)
    rewards = jnp.asarray(np.concatenate([equal, np.arange(m, dtype=np.float32)[None]]))
    for scaling in grpo.STD_SCALINGS:
        adv = np.asarray(grpo.group_advantages(rewards, eps=eps, std_scaling=scaling, ddof=ddof))
        assert np.all(adv[:-1] == 0.0), (scaling, adv[:-1][adv[:-1] != 0.0])
        assert np.all(np.isfinite(adv))


@pytest.mark.parametrize("value,m", [(-2.5, 3), (7.0, 7)])
def test_equal_rewards_get_exactly_zero(value, m):
    adv = jax.jit(grpo.group_advantages)(jnp.full((2, m), value))
    assert np.all(np.asarray(adv) == 0.0)


def test_a_group_of_one_gets_zero_advantage_not_nan():
    # The authors' code divides by a ddof-1 std of one value (NaN); a lone rollout has no group signal.
    for eps in (0.0, 1e-4):
        adv = np.asarray(grpo.group_advantages(jnp.array([[3.0], [-1.0]]), eps=eps))
        assert adv.tolist() == [[0.0], [0.0]]


def test_a_non_finite_reward_is_refused_eagerly_and_never_rescales_the_other_groups():
    rewards = jnp.array([[1.0, jnp.nan, 1.0, 0.0], [0.0, 1.0, 0.0, 1.0]])
    for bad, text in ((jnp.nan, "nan"), (jnp.inf, "inf"), (-jnp.inf, "-inf")):
        with pytest.raises(ValueError, match=rf"rewards must be finite; got {text} at \[0, 1\]"):
            grpo.group_advantages(rewards.at[0, 1].set(bad))
    # Traced, the batch's std is NaN and so is every advantage: it had been taken as 0, and
    # the clean group divided by eps alone (+-5000).
    batch = np.asarray(jax.jit(lambda r: grpo.group_advantages(r, std_scaling="batch"))(rewards))
    assert np.isnan(batch).all()
    group = np.asarray(jax.jit(grpo.group_advantages)(rewards))
    assert np.isnan(group[0]).all()
    np.testing.assert_allclose(group[1], np.asarray(grpo.group_advantages(rewards[1:]))[0])


# --- token log-probs -----------------------------------------------------------


def log_softmax_f64(logits, temperature):
    x = logits.astype(np.float64) / temperature
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_token_logprobs_and_entropy_match_float64_numpy():
    rng = np.random.default_rng(0)
    logits = (rng.normal(size=(3, 5, 50)) * 4).astype(np.float32)
    targets = rng.integers(0, 50, (3, 5))
    for temperature in (1.0, 0.7):
        ref = log_softmax_f64(logits, temperature)
        jitted = jax.jit(logprobs.token_logprobs, static_argnames="temperature")
        got = np.asarray(jitted(logits, targets, temperature=temperature))
        np.testing.assert_allclose(got, np.take_along_axis(ref, targets[..., None], -1)[..., 0], atol=1e-5, rtol=0)
        entropy = -(np.exp(ref) * ref).sum(-1)
        got_entropy = np.asarray(logprobs.token_entropy(logits, temperature=temperature))
        np.testing.assert_allclose(got_entropy, entropy, atol=1e-5)
    # bf16 logits are upcast before the reduction
    got_bf16 = logprobs.token_logprobs(jnp.asarray(logits, jnp.bfloat16), targets)
    assert got_bf16.dtype == jnp.float32


@pytest.mark.parametrize("temperature", [1e-20, 1e-37])
def test_a_tiny_temperature_gives_the_greedy_limit_not_nan(temperature):
    # logits / T had overflowed to +-inf before the logsumexp: inf - inf, NaN log-probs.
    logits = jnp.array([[[3.0, -2.0, 1.0, 0.5], [-1.0, 4.0, 2.0, -30.0]]])
    top = jnp.argmax(logits, axis=-1)
    for logp in (logprobs.token_logprobs(logits, top, temperature=temperature),
                 logprobs.head_logprobs(logits, jnp.eye(4), top, temperature=temperature)[0]):
        assert np.asarray(logp).tolist() == [[0.0, 0.0]]
    others = logprobs.token_logprobs(logits, jnp.array([[1, 3]]), temperature=temperature)
    assert np.all(np.asarray(others) < -1e18) and not np.isnan(np.asarray(others)).any()
    assert np.asarray(logprobs.token_entropy(logits, temperature=temperature)).tolist() == [[0.0, 0.0]]


def test_entropy_of_filtered_logits_is_the_kept_tokens_entropy_with_finite_gradients():
    # top-k / top-p filtering (decoding.filter_logits) leaves -inf logits: 0 * -inf had given NaN.
    kept = jnp.array([[2.0, 1.0, 0.5]])
    filtered = jnp.concatenate([kept, jnp.full((1, 2), -jnp.inf)], axis=-1)
    np.testing.assert_allclose(logprobs.token_entropy(filtered), logprobs.token_entropy(kept), rtol=1e-6)
    grad = jax.grad(lambda x: logprobs.token_entropy(x).sum())(filtered)
    np.testing.assert_allclose(grad[:, :3], jax.grad(lambda x: logprobs.token_entropy(x).sum())(kept), rtol=1e-5)
    assert np.all(np.asarray(grad[:, 3:]) == 0.0)


def test_a_token_beside_an_infinite_logit_has_log_prob_minus_infinity():
    # Its limit: the infinite logit takes all the mass (unshifted, inf - inf had made it NaN).
    out = logprobs.token_logprobs(jnp.array([[jnp.inf, 0.0, -1.0]]), jnp.array([1]))
    assert float(out[0]) == -math.inf


def test_token_logprobs_does_not_materialize_a_log_softmax():
    b, l, v = 4, 64, 8192
    logits_bytes = b * l * v * 4
    compiled = (
        jax.jit(logprobs.token_logprobs)
        .lower(jax.ShapeDtypeStruct((b, l, v), jnp.float32), jax.ShapeDtypeStruct((b, l), jnp.int32))
        .compile()
    )
    analysis = compiled.memory_analysis()
    if analysis is None:
        pytest.skip("this backend reports no memory analysis")
    # A full [B, L, V] temporary (softmax, log-softmax, scaled copy) would need logits_bytes.
    assert analysis.temp_size_in_bytes < logits_bytes // 4, analysis.temp_size_in_bytes


# --- the clipped loss ----------------------------------------------------------


def hand_example():
    # Seq 0: A=+1, ratios [1.5, 1.0]; seq 1: A=-1, ratios [0.5, (masked)].
    logp = jnp.log(jnp.array([[1.5, 1.0], [0.5, jnp.inf]]))  # the masked slot holds garbage
    old = jnp.zeros((2, 2))
    adv = jnp.array([1.0, -1.0])
    mask = jnp.array([[1, 1], [1, 0]])
    return logp, old, adv, mask


@pytest.mark.parametrize(
    "aggregation,expected",
    [
        # per-token losses: -min(1.5, 1.2) = -1.2, -1.0, -min(-0.5, -0.8) = +0.8
        ("token-mean", (-1.2 - 1.0 + 0.8) / 3),  # -0.46667
        ("seq-mean-token-mean", ((-1.2 - 1.0) / 2 + 0.8 / 1) / 2),  # -0.15
        ("seq-mean-token-sum-norm", (-1.2 - 1.0 + 0.8) / (2 * 2)),  # -0.35, normalizer B * L
    ],
)
def test_loss_by_hand(aggregation, expected):
    logp, old, adv, mask = hand_example()
    loss, metrics = LOSS(logp, adv, mask, LossConfig(epsilon=0.2, aggregation=aggregation), old_logprobs_BL=old)
    assert float(loss) == pytest.approx(expected, abs=1e-6)
    # clipped low: seq 1 token 0 (ratio 0.5 < 0.8, A<0); high: seq 0 token 0 (1.5 > 1.2, A>0).
    assert float(metrics.clip_frac_low) == pytest.approx(1 / 3)
    assert float(metrics.clip_frac_high) == pytest.approx(1 / 3)
    assert float(metrics.advantage_mean) == 0.0
    assert float(metrics.num_tokens) == 3
    # The mean over rows (not tokens), with a sign: [1, -1] above could not tell.
    lopsided = LOSS(logp, jnp.array([1.0, 0.5]), mask, LossConfig(aggregation=aggregation), old_logprobs_BL=old)[1]
    assert float(lopsided.advantage_mean) == 0.75


def test_group_token_mean_by_hand_on_two_groups_of_different_lengths():
    # On policy (ratio 1) each token's loss is -A. Group 0: rows of 1 and 3 tokens, A = 1 and
    # -1: -1 + 3 = 2 over 4 tokens = 0.5. Group 1: rows of 2 and 1 tokens, A = 0.5 and 2:
    # -1 - 2 = -3 over 3 tokens = -1. The mean over the two groups: -0.25; one token mean
    # over the batch would be (2 - 3) / 7.
    mask = jnp.array([[1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0]], jnp.float32)
    adv = jnp.array([1.0, -1.0, 0.5, 2.0])
    logp = jnp.full((4, 3), -1.0)
    config = LossConfig(aggregation="group-token-mean", group_size=2)

    def loss_fn(lp):
        return grpo.grpo_loss(lp, adv, mask, config)[0]

    loss, grad = jax.value_and_grad(loss_fn)(logp)
    assert float(loss) == pytest.approx(-0.25, abs=1e-6)
    assert float(grpo.grpo_loss(logp, adv, mask, LossConfig())[0]) == pytest.approx(-1 / 7, abs=1e-6)
    # d loss / d logp of a token: -A / (its group's tokens x 2 groups).
    expected = np.array([[-1 / 8, 0, 0], [1 / 8, 1 / 8, 1 / 8], [-1 / 12, -1 / 12, 0], [-1 / 3, 0, 0]])
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-6, atol=1e-7)
    # One group a micro-batch (as the authors' trainer): numerators 0.5 and -1 over 2 groups.
    terms = [grpo.grpo_loss_terms(logp[s], adv[s], mask[s], config)[0] for s in (slice(0, 2), slice(2, 4))]
    assert [float(t.numerator) for t in terms] == pytest.approx([0.5, -1.0])
    assert float(grpo.loss_denominator(mask, config)) == 2.0 and float(terms[0].denominator) == 1.0


def test_kl_by_hand_and_zero_at_reference():
    logp = jnp.log(jnp.array([[1.5]]))
    ref = jnp.zeros((1, 1))
    adv, mask = jnp.array([0.0]), jnp.ones((1, 1))
    # d = ref - logp = -log 1.5; k3 = e^d - d - 1 = 2/3 + 0.4054651 - 1 = 0.0721318
    loss, metrics = LOSS(logp, adv, mask, LossConfig(beta=0.5), ref_logprobs_BL=ref)
    assert float(metrics.kl_mean) == pytest.approx(0.0721318, abs=1e-6)
    assert float(loss) == pytest.approx(0.5 * 0.0721318, abs=1e-6)  # A=0: only the KL term

    rng = np.random.default_rng(1)
    same = jnp.asarray(rng.normal(size=(3, 4)), jnp.float32)
    adv3, mask3 = jnp.asarray(rng.normal(size=3), jnp.float32), jnp.ones((3, 4))
    with_kl, m_kl = LOSS(same, adv3, mask3, LossConfig(beta=0.3), ref_logprobs_BL=same)
    without, _ = LOSS(same, adv3, mask3, LossConfig(beta=0.0))
    assert float(m_kl.kl_mean) == 0.0
    assert float(with_kl) == float(without)


def groups_for(aggregation, rows):
    """group-token-mean's rows per group in these tests: pairs where the rows pair up, else one group."""
    return (2 if rows % 2 == 0 else rows) if aggregation == "group-token-mean" else None


def numpy_loss_f64(logp, old, ref, adv, mask, eps, eps_high, beta, aggregation, group_size=None, norm_length=None):
    logp, old, ref = (np.where(mask > 0, x, 0.0).astype(np.float64) for x in (logp, old, ref))
    adv = adv.astype(np.float64)[:, None]
    ratio = np.exp(logp - old)
    pg = -np.minimum(ratio * adv, np.clip(ratio, 1 - eps, 1 + eps_high) * adv)
    d = ref - logp
    per_token = (pg + beta * (np.exp(d) - d - 1)) * mask
    if aggregation == "token-mean":
        return per_token.sum() / mask.sum()
    if aggregation == "seq-mean-token-mean":
        return np.mean(per_token.sum(-1) / np.maximum(mask.sum(-1), 1))
    if aggregation == "group-token-mean":
        groups = [slice(start, start + group_size) for start in range(0, len(mask), group_size)]
        return np.mean([per_token[g].sum() / max(mask[g].sum(), 1) for g in groups])
    return per_token.sum() / (mask.shape[0] * (norm_length or mask.shape[1]))


@pytest.mark.parametrize("aggregation", [*grpo.AGGREGATIONS, "seq-mean-token-sum-norm:12"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_matches_float64_numpy(aggregation, beta):
    aggregation, _, norm_length = aggregation.partition(":")  # Dr. GRPO's constant length, when given
    norm_length = int(norm_length) if norm_length else None
    rng = np.random.default_rng(2)
    b, l = 6, 9
    old = rng.normal(-2, 1, (b, l)).astype(np.float32)
    logp = (old + rng.normal(0, 0.3, (b, l))).astype(np.float32)
    ref = (old + rng.normal(0, 0.3, (b, l))).astype(np.float32)
    adv = rng.normal(size=b).astype(np.float32)
    mask = (np.arange(l)[None] < rng.integers(1, l + 1, b)[:, None]).astype(np.float32)
    config = LossConfig(epsilon=0.2, epsilon_high=0.28, beta=beta, aggregation=aggregation,
                        group_size=groups_for(aggregation, b), norm_length=norm_length)
    loss, _ = LOSS(logp, adv, mask, config, old_logprobs_BL=old, ref_logprobs_BL=ref)
    expected = numpy_loss_f64(logp, old, ref, adv, mask, 0.2, 0.28, beta, aggregation, config.group_size,
                              norm_length)
    assert float(loss) == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_masked_tokens_get_exactly_zero_gradient():
    rng = np.random.default_rng(3)
    mask = np.array([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]], np.float32)
    logp = rng.normal(-1, 0.5, mask.shape).astype(np.float32)
    logp[mask == 0] = np.inf  # garbage in padding must not leak into loss or grads
    old = np.where(mask > 0, logp - 0.1, np.nan).astype(np.float32)
    ref = np.where(mask > 0, logp + 0.1, -np.inf).astype(np.float32)
    adv = jnp.array([1.0, -2.0, 0.5])
    for aggregation in grpo.AGGREGATIONS:
        config = LossConfig(beta=0.1, aggregation=aggregation, group_size=groups_for(aggregation, 3))

        def loss_fn(lp):
            return grpo.grpo_loss(lp, adv, mask, config, old_logprobs_BL=old, ref_logprobs_BL=ref)[0]

        loss, grad = jax.value_and_grad(loss_fn)(jnp.asarray(logp))
        grad = np.asarray(grad)
        assert np.isfinite(float(loss))
        assert np.all(grad[mask == 0] == 0.0)
        assert np.all(np.isfinite(grad)) and np.all(grad[mask > 0] != 0.0)


def test_zero_variance_group_gives_zero_advantage_and_finite_loss():
    adv = grpo.group_advantages(jnp.ones((1, 4)))[0]
    assert np.array_equal(np.asarray(adv), np.zeros(4))
    logp = jnp.full((4, 3), -1.0)
    loss, grads = jax.value_and_grad(lambda lp: grpo.grpo_loss(lp, adv, jnp.ones((4, 3)))[0])(logp)
    assert float(loss) == 0.0 and np.all(np.asarray(grads) == 0.0)


def test_clipping_is_active_exactly_outside_the_trust_region():
    eps, eps_high = 0.2, 0.28
    ratios = np.array([0.5, 0.79, 0.81, 1.0, 1.2, 1.27, 1.29, 1.6], np.float32)
    for sign in (1.0, -1.0):
        old = np.zeros((1, len(ratios)), np.float32)
        adv = jnp.array([sign])
        config = LossConfig(epsilon=eps, epsilon_high=eps_high)

        def loss_fn(lp):
            return grpo.grpo_loss(lp, adv, jnp.ones_like(lp), config, old_logprobs_BL=old)

        grad, metrics = jax.grad(loss_fn, has_aux=True)(jnp.log(ratios)[None])
        clipped = (ratios > 1 + eps_high) if sign > 0 else (ratios < 1 - eps)
        assert np.array_equal(np.asarray(grad)[0] == 0.0, clipped), sign
        frac_high, frac_low = float(metrics.clip_frac_high), float(metrics.clip_frac_low)
        assert (frac_high, frac_low) == pytest.approx((clipped.mean(), 0.0) if sign > 0 else (0.0, clipped.mean()))


def test_split_batch_terms_sum_to_the_whole_batch_loss():
    # Gradient accumulation: numerators of micro-batches over the whole batch's
    # denominator reproduce the big-batch loss for every aggregation mode.
    rng = np.random.default_rng(4)
    logp = rng.normal(-1, 0.3, (8, 5)).astype(np.float32)
    old = (logp + rng.normal(0, 0.2, logp.shape)).astype(np.float32)
    adv = rng.normal(size=8).astype(np.float32)
    mask = (np.arange(5)[None] < rng.integers(1, 6, 8)[:, None]).astype(np.float32)
    for aggregation in grpo.AGGREGATIONS:
        config = LossConfig(aggregation=aggregation, group_size=groups_for(aggregation, 8))
        whole, _ = grpo.grpo_loss(logp, adv, mask, config, old_logprobs_BL=old)
        # Micro-batches of whole groups for group-token-mean.
        split = 2 if aggregation == "group-token-mean" else 3
        numerator = sum(
            float(grpo.grpo_loss_terms(logp[s], adv[s], mask[s], config, old_logprobs_BL=old[s])[0].numerator)
            for s in (slice(0, split), slice(split, 8))
        )
        assert numerator / float(grpo.loss_denominator(mask, config)) == pytest.approx(float(whole), rel=1e-6)


def test_on_policy_ratio_is_one_with_the_policy_gradient():
    # old=None: ratio 1, loss = -mean(A) per token, grad = -A / num_tokens.
    logp = jnp.array([[-1.0, -2.0], [-0.5, -0.1]])
    adv = jnp.array([2.0, -1.0])
    loss, grad = jax.value_and_grad(lambda lp: grpo.grpo_loss(lp, adv, jnp.ones((2, 2)))[0])(logp)
    assert float(loss) == pytest.approx(-(2 + 2 - 1 - 1) / 4)
    np.testing.assert_allclose(np.asarray(grad), [[-0.5, -0.5], [0.25, 0.25]], rtol=1e-6)


def test_old_and_ref_log_probs_carry_no_gradient():
    # TRL's one-step convention passes old = logp without a stop-gradient: the same loss as None.
    logp = jnp.array([[-1.0, -2.0, -0.3], [-0.5, -0.1, -0.7]])
    adv, mask = jnp.array([2.0, -1.0]), jnp.ones((2, 3))
    config = LossConfig(beta=0.1)

    def loss(lp, old_from_logp):
        old = lp if old_from_logp else None
        return grpo.grpo_loss(lp, adv, mask, config, old_logprobs_BL=old, ref_logprobs_BL=lp * 0.5)[0]

    reference = jax.grad(lambda lp: grpo.grpo_loss(lp, adv, mask, config,
                                                   ref_logprobs_BL=jax.lax.stop_gradient(lp * 0.5))[0])(logp)
    for old_from_logp in (False, True):
        np.testing.assert_allclose(np.asarray(jax.grad(loss)(logp, old_from_logp)), np.asarray(reference), rtol=1e-6)


def test_a_mask_of_weights_other_than_one_counts_each_token_once():
    logp = -jax.random.uniform(jax.random.key(3), (4, 3))
    adv, mask = jnp.arange(4.0), jnp.ones((4, 3))
    for aggregation in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        config = LossConfig(aggregation=aggregation)
        assert float(grpo.grpo_loss(logp, adv, 0.5 * mask, config)[0]) == pytest.approx(
            float(grpo.grpo_loss(logp, adv, mask, config)[0]), rel=1e-6), aggregation


def test_equal_rewards_have_a_finite_advantage_gradient():
    for rewards in (jnp.full((2, 4), 3.0), jnp.ones((3, 1))):
        for scaling in ("group", "batch"):
            grad = jax.grad(lambda r: jnp.sum(grpo.group_advantages(r, std_scaling=scaling) * jnp.arange(r.size)
                                              .reshape(r.shape)))(rewards)
            assert np.isfinite(np.asarray(grad)).all(), (rewards.shape, scaling)


def test_traced_hyperparameters_work_where_they_can_and_say_so_where_not():
    r = jnp.array([[1.0, 0.0, 2.0]])
    np.testing.assert_allclose(np.asarray(jax.jit(lambda r, e: grpo.group_advantages(r, eps=e))(r, 1e-4)),
                               np.asarray(grpo.group_advantages(r, eps=1e-4)), rtol=1e-6)
    logits, targets = jax.random.normal(jax.random.key(0), (2, 3, 5)), jnp.zeros((2, 3), jnp.int32)
    traced = jax.jit(lambda lg, t: logprobs.token_logprobs(lg, targets, temperature=t))(logits, 0.7)
    eager = logprobs.token_logprobs(logits, targets, temperature=0.7)
    np.testing.assert_allclose(np.asarray(traced), np.asarray(eager), rtol=1e-6)
    hidden, head = jnp.ones((2, 3, 4)), jnp.ones((5, 4))
    with pytest.raises(TypeError, match="head_logprobs takes temperature as a Python number"):
        jax.jit(lambda t: logprobs.head_logprobs(hidden, head, targets, temperature=t))(0.7)


def test_inputs_as_lists_give_the_arrays_loss():
    logp, adv, mask = [[-1.0, -2.0], [-0.5, -0.1]], [2.0, -1.0], [[1, 1], [1, 0]]
    assert float(grpo.grpo_loss(logp, adv, mask)[0]) == pytest.approx(
        float(grpo.grpo_loss(jnp.asarray(logp), jnp.asarray(adv), jnp.asarray(mask))[0]))


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="aggregation must be one of"):
        LossConfig(aggregation="mean")
    for epsilon in (-0.1, 1.0, 1.5):  # 1.5 had turned the lower clip off
        with pytest.raises(ValueError, match=r"epsilon must be in \[0, 1\)"):
            LossConfig(epsilon=epsilon)
    with pytest.raises(ValueError, match="'group-token-mean' needs group_size >= 1; got None"):
        LossConfig(aggregation="group-token-mean")
    with pytest.raises(ValueError, match="beta must be >= 0 and finite; got inf"):  # had given an inf loss
        LossConfig(beta=float("inf"))
    with pytest.raises(ValueError, match="needs whole groups of 2 rows; a batch of 3 rows is not"):
        grpo.grpo_loss(jnp.zeros((3, 2)), jnp.zeros(3), jnp.ones((3, 2)),
                       LossConfig(aggregation="group-token-mean", group_size=2))
    with pytest.raises(ValueError, match="beta=0.1 > 0 needs ref_logprobs_BL"):
        grpo.grpo_loss(jnp.zeros((2, 3)), jnp.zeros(2), jnp.ones((2, 3)), LossConfig(beta=0.1))
    with pytest.raises(ValueError, match=r"advantages must be \[B\]"):
        grpo.grpo_loss(jnp.zeros((2, 3)), jnp.zeros(3), jnp.ones((2, 3)))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        logprobs.token_logprobs(jnp.zeros((1, 2, 3)), jnp.zeros((1, 2), jnp.int32), temperature=0.0)
    with pytest.raises(ValueError, match="group_size must be an integer; got 2.0"):
        LossConfig(aggregation="group-token-mean", group_size=2.0)
    with pytest.raises(ValueError, match="epsilon must be a number; got '0.2'"):
        LossConfig(epsilon="0.2")
    for name in ("epsilon", "beta"):  # None is "off" only for the optional ones
        with pytest.raises(ValueError, match=f"{name} must be a number; got None"):
            LossConfig(**{name: None})
    assert LossConfig(epsilon_high=None, tis_cap=None).clip_high == 0.2
    with pytest.raises(ValueError, match="ddof must be an integer >= 0; got -1"):
        grpo.group_advantages(jnp.zeros((1, 3)), ddof=-1)
    hidden, head = jnp.ones((2, 6, 4)), jnp.ones((5, 4))
    for h, w, t in ((hidden, head, jnp.zeros((2, 5), jnp.int32)), (hidden[0], head, jnp.zeros((2, 6), jnp.int32)),
                    (hidden, jnp.ones((5, 3)), jnp.zeros((2, 6), jnp.int32))):
        with pytest.raises(ValueError, match=r"head_logprobs wants hidden \[B, T, D\], head \[V, D\] and targets"):
            logprobs.head_logprobs(h, w, t)
    assert math.isclose(LossConfig(epsilon=0.2).clip_high, 0.2)
    # A token id outside the vocabulary gave a NaN (or a clamped token's log-prob) without a word.
    logits = jnp.zeros((1, 2, 3))
    for bad in (3, -4):
        with pytest.raises(ValueError, match=rf"target token id {bad} is outside the vocabulary \[0, 3\)"):
            logprobs.token_logprobs(logits, jnp.array([[0, bad]]))
        with pytest.raises(ValueError, match=rf"target token id {bad} is outside the vocabulary \[0, 3\)"):
            logprobs.head_logprobs(jnp.ones((1, 2, 4)), jnp.ones((3, 4)), jnp.array([[bad, 0]]))
    # An ignore index the caller masks (the eager call had refused what jit took).
    assert np.isfinite(logprobs.token_logprobs(logits, jnp.array([[0, -1]]))).all()
    with pytest.raises(ValueError, match="targets must be integer token ids; got dtype float32"):
        logprobs.token_logprobs(logits, jnp.array([[0.0, 1.0]]))
    assert logprobs.token_logprobs(logits, jnp.array([[0, 2]])).shape == (1, 2)
    # Host ids past int32 (NumPy int64, Python ints) are read before JAX's conversion wraps
    # 2**32 + 1 to 1.
    for wide in (np.array([[0, 2**32 + 1]]), [[0, 2**40]]):
        bad = np.asarray(wide).max()
        with pytest.raises(ValueError, match=rf"target token id {bad} is outside the vocabulary"):
            logprobs.token_logprobs(logits, wide)
        with pytest.raises(ValueError, match=rf"target token id {bad} is outside the vocabulary"):
            logprobs.head_logprobs(jnp.ones((1, 2, 4)), jnp.ones((3, 4)), wide)


def test_chunked_head_matches_full_logits_in_values_and_gradients():
    b, t, d, v = 3, 12, 8, 50
    keys = jax.random.split(jax.random.key(5), 3)
    hidden = jax.random.normal(keys[0], (b, t, d))
    head = jax.random.normal(keys[1], (v, d))
    targets = jax.random.randint(keys[2], (b, t), 0, v)
    targets = targets.at[:, ::3].add(-v)  # ids counted from the end too: the backward pass had dropped them
    weights = jnp.linspace(-1.0, 1.0, b * t).reshape(b, t)

    def full(hidden, head):
        logits = jnp.einsum("btd,vd->btv", hidden, head)
        return (logprobs.token_logprobs(logits, targets, temperature=0.7),
                logprobs.token_entropy(logits, temperature=0.7))

    def chunked(hidden, head):  # 3 x 4 x 50 = 600 elements per chunk: 3 chunks of 4 positions
        return logprobs.head_logprobs(hidden, head, targets, temperature=0.7, max_elements=600)

    assert logprobs.logits_chunk(b, t, v, 600) == 4
    (logp_a, ent_a), (logp_b, ent_b) = jax.jit(full)(hidden, head), jax.jit(chunked)(hidden, head)
    np.testing.assert_allclose(np.asarray(logp_b), np.asarray(logp_a), atol=1e-5)
    np.testing.assert_allclose(np.asarray(ent_b), np.asarray(ent_a), atol=1e-5)
    loss = lambda fn: lambda h, w: jnp.sum(fn(h, w)[0] * weights)  # noqa: E731
    grads_a = jax.jit(jax.grad(loss(full), argnums=(0, 1)))(hidden, head)
    grads_b = jax.jit(jax.grad(loss(chunked), argnums=(0, 1)))(hidden, head)
    for got, ref in zip(grads_b, grads_a):
        assert float(jnp.abs(ref).max()) > 0
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5)


def test_chunked_head_never_holds_all_logits():
    b, t, d, v = 4, 256, 16, 4096  # all logits: 16 MB fp32; a chunk of 8 positions: 0.5 MB
    hidden = jax.ShapeDtypeStruct((b, t, d), jnp.float32)
    head = jax.ShapeDtypeStruct((v, d), jnp.float32)
    targets = jax.ShapeDtypeStruct((b, t), jnp.int32)

    def temp_bytes(max_elements):
        loss = lambda h, w, y: jnp.sum(logprobs.head_logprobs(h, w, y, max_elements=max_elements)[0])  # noqa: E731
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(hidden, head, targets).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    whole, chunked = temp_bytes(b * t * v), temp_bytes(b * 8 * v)
    assert whole >= b * t * v * 4  # one pass keeps at least the [B, T, V] logits
    assert chunked < b * t * v * 4 / 4, (whole, chunked)


def test_a_bf16_head_gradient_is_summed_over_its_chunks_in_fp32():
    # 64 chunks of a bf16 head: summed in bf16 the gradient drifts by several roundings
    # (2.2 % of its largest entry here); summed in fp32 it is rounded once at the end.
    b, t, d, v = 4, 256, 64, 512
    keys = jax.random.split(jax.random.key(0), 3)
    hidden, head = jax.random.normal(keys[0], (b, t, d)), jax.random.normal(keys[1], (v, d)) * 0.05
    targets = jax.random.randint(keys[2], (b, t), 0, v)

    def loss(h, w, max_elements):
        return jnp.sum(logprobs.head_logprobs(h, w, targets, max_elements=max_elements)[0])

    reference = np.asarray(jax.grad(loss, argnums=1)(hidden, head, b * t * v))  # fp32, one chunk
    assert logprobs.logits_chunk(b, t, v, b * 4 * v) == 4
    got = jax.jit(jax.grad(loss, argnums=1), static_argnums=2)(hidden.astype(jnp.bfloat16),
                                                                head.astype(jnp.bfloat16), b * 4 * v)
    assert got.dtype == jnp.bfloat16
    error = np.abs(np.asarray(got, np.float32) - reference).max() / np.abs(reference).max()
    assert error < 0.01, error  # one bf16 rounding is 2^-8 = 0.4 %


def test_advantages_of_a_spread_past_float32s_square_are_not_zero():
    # Squared directly, a spread of 1e20 overflowed the variance to inf: advantages of exactly 0.
    for spread in (1.0, 1e20, 1e30):
        for scaling in ("group", "batch"):
            got = np.asarray(grpo.group_advantages(jnp.asarray([[0.0, spread]]), std_scaling=scaling, eps=0.0))
            np.testing.assert_allclose(got, [[-0.5**0.5, 0.5**0.5]], rtol=1e-4, err_msg=f"{spread} {scaling}")
    grad = jax.grad(lambda r: grpo.group_advantages(r)[0, 1])(jnp.asarray([[0.0, 1.0, 3.0]]))
    eps = 1e-3
    numeric = [(grpo.group_advantages(jnp.asarray([[0.0, 1.0, 3.0]]).at[0, i].add(eps))[0, 1]
                - grpo.group_advantages(jnp.asarray([[0.0, 1.0, 3.0]]).at[0, i].add(-eps))[0, 1]) / (2 * eps)
               for i in range(3)]
    np.testing.assert_allclose(np.asarray(grad)[0], np.asarray(numeric), atol=2e-2)


def test_float64_rewards_under_x64_are_shifted_before_they_become_float32():
    rewards = 1e6 + np.array([[0.0, 0.1, 0.2, 0.3]])  # float32 holds 1e6 + 0.1 as 1000000.125
    centered = rewards - rewards.mean(-1, keepdims=True)
    expected = centered / (centered.std(-1, ddof=1, keepdims=True) + 1e-4)
    jax.config.update("jax_enable_x64", True)
    try:
        for scaling in ("group", "batch"):
            got = grpo.group_advantages(jnp.asarray(rewards), std_scaling=scaling)
            np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, err_msg=scaling)
    finally:
        jax.config.update("jax_enable_x64", False)


def test_numpy_64_bit_rewards_without_x64_are_shifted_on_the_host():
    # Without x64 JAX had rounded 1e8 + k to 1e8 (all advantages 0) and wrapped int64 2**32 + 1
    # to 1 (the advantage of reward 1).
    assert not jax.config.jax_enable_x64
    for rewards in (1e8 + np.array([[0.0, 1.0, 2.0, 3.0]]), np.array([[2**32 + 1, 1, 0, 1]])):
        centered = rewards - rewards.mean(-1, keepdims=True)
        expected = centered / (centered.std(-1, ddof=1, keepdims=True) + 1e-4)
        for scaling in ("group", "batch"):
            got = grpo.group_advantages(rewards, std_scaling=scaling)
            np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, err_msg=scaling)
    # Batch scaling shifts every group alike: its std is over all of them.
    rewards = np.array([[0, 1], [5, 7]])
    centered = rewards - rewards.mean(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(grpo.group_advantages(rewards, std_scaling="batch")),
                               centered / (rewards.std(ddof=1) + 1e-4), rtol=1e-6)
    # An eager loss refuses a NaN advantage, as group_advantages refuses a NaN reward.
    with pytest.raises(ValueError, match=r"advantages must be finite; got nan at \[1\]"):
        grpo.grpo_loss(jnp.zeros((2, 3)), jnp.array([1.0, jnp.nan]), jnp.ones((2, 3)))
    # Integers past 2**53 are shifted as integers (float64 would have made them equal).
    np.testing.assert_allclose(np.asarray(grpo.group_advantages(np.array([[2**53, 2**53 + 1]]))),
                               [[-0.7070, 0.7070]], rtol=1e-4)
    with pytest.raises(TypeError, match="rewards must be real numbers"):
        grpo.group_advantages([[1.0, None, 0.0]])
    # NumPy's bfloat16 is a number; a list of tracers converts under jit.
    assert np.asarray(grpo.group_advantages(np.ones((2, 4), jnp.bfloat16))).tolist() == [[0.0] * 4] * 2
    traced = jax.jit(lambda a, b: grpo.group_advantages([a, b]))(jnp.ones(3), jnp.arange(3.0))
    np.testing.assert_allclose(np.asarray(traced)[1], [-0.9999, 0.0, 0.9999], rtol=1e-4)


def test_batch_scaling_keeps_its_precision_under_a_large_common_offset():
    small = np.array([[0.0, 0.25], [0.5, 0.125]])
    for offset in (0.0, 1e4, 1e6):
        got = np.asarray(grpo.group_advantages(jnp.asarray(small + offset, jnp.float32), std_scaling="batch"))
        centered = small - small.mean(-1, keepdims=True)
        expected = centered / (np.std(small, ddof=1) + 1e-4)
        np.testing.assert_allclose(got, expected, rtol=1e-5, err_msg=f"offset {offset}")


@pytest.mark.parametrize("aggregation", grpo.AGGREGATIONS)
def test_an_empty_batch_has_loss_zero_in_every_aggregation(aggregation):
    config = LossConfig(aggregation=aggregation, group_size=2 if aggregation == "group-token-mean" else None)
    loss, metrics = grpo.grpo_loss(jnp.zeros((0, 3)), jnp.zeros(0), jnp.zeros((0, 3)), config)
    assert float(loss) == 0.0
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(metrics)), metrics  # advantage_mean: NaN


def test_numpy_numbers_are_numbers_and_array_arguments_get_one_line_errors():
    config = LossConfig(epsilon=np.float32(0.25), beta=np.float64(0.1), aggregation="group-token-mean",
                        group_size=np.int64(2))
    assert (config.epsilon, config.beta, config.group_size) == (0.25, pytest.approx(0.1), 2)
    assert type(config.epsilon) is float and type(config.group_size) is int
    hash(config)  # still a static jit argument
    rewards = jnp.array([[0.0, 1.0, 3.0]])
    np.testing.assert_allclose(grpo.group_advantages(rewards, ddof=np.int64(1)), grpo.group_advantages(rewards))
    with pytest.raises(ValueError, match=r"eps must be a number >= 0; got Array\(\["):
        grpo.group_advantages(rewards, eps=jnp.array([1e-4, 1e-4]))


def test_wrong_kinds_of_argument_are_one_line_errors_and_lists_are_arrays():
    # Each had been an AttributeError or TypeError from deep inside JAX, or a silent result.
    lp, mask = jnp.zeros((2, 3)), jnp.ones((2, 3))
    cases = [
        (lambda: grpo.grpo_loss(lp, jnp.zeros(2), mask, {"epsilon": 0.2}), TypeError, "config must be a LossConfig"),
        (lambda: grpo.group_advantages(mask, eps=None), ValueError, "eps must be a number >= 0; got None"),
        (lambda: grpo.group_advantages(mask, eps="1e-4"), ValueError, "eps must be a number >= 0; got '1e-4'"),
        (lambda: grpo.tis_weights(lp, lp[:1], mask, 2.0), ValueError, r"one shape; got \(2, 3\), \(1, 3\), \(2, 3\)"),
        (lambda: grpo.tis_weights(lp, lp, mask, 0.0), ValueError, "cap must be a number > 0"),  # all-zero weights
        (lambda: grpo.tis_weights(lp, lp, mask, -1.0), ValueError, "cap must be a number > 0"),  # NaN weights
        (lambda: grpo.sampler_mismatch(lp, lp[:, :2], mask), ValueError, "must have one shape"),
        (lambda: logprobs.token_logprobs(jnp.zeros((1, 2, 3)), jnp.zeros((1, 2), int), temperature=None), TypeError,
         "temperature must be a number > 0; got None"),
        (lambda: logprobs.token_entropy(jnp.zeros((2, 3)), temperature="1"), TypeError, "got '1'"),
        (lambda: logprobs.token_logprobs(jnp.zeros((1, 2, 3)), jnp.zeros((1, 2), int), temperature=jnp.ones(2)),
         TypeError, "temperature must be a number > 0"),
        (lambda: logprobs.token_entropy(jnp.float32(1)), ValueError, r"vocabulary axis \[..., V\]; got shape \(\)"),
    ]
    for call, kind, message in cases:
        with pytest.raises(kind, match=message):
            call()
    assert logprobs.token_logprobs([[[0.0, 1.0]]], [[1]]).shape == (1, 1)
    assert logprobs.head_logprobs([[[1.0, 0.0]]], [[1.0, 0.0], [0.0, 1.0]], [[1]])[0].shape == (1, 1)
    assert grpo.tis_weights(lp.tolist(), lp, mask.tolist(), 2.0)[0].shape == (2, 3)
    empty = logprobs.head_logprobs(jnp.zeros((2, 0, 4)), jnp.ones((5, 4)), jnp.zeros((2, 0), int))  # T = 0
    assert [x.shape for x in empty] == [(2, 0), (2, 0)]


def test_complex_rewards_and_a_group_past_float32_are_refused():
    # Complex rewards had lost their imaginary part; a group of 3e38 and -3e38 had given inf and NaN.
    with pytest.raises(TypeError, match="rewards must be real numbers; got dtype complex"):
        grpo.group_advantages(np.array([[1 + 1j, 2.0]]))
    with pytest.raises(ValueError, match="one group spans 6e\\+38"):
        grpo.group_advantages(jnp.array([[3e38, -3e38]]))
    wide_but_apart = jnp.array([[3e38, 2e38], [-3e38, -2e38]])  # each group within range: fine
    assert np.isfinite(np.asarray(grpo.group_advantages(wide_but_apart))).all()
