"""GSPO and CISPO beside GRPO: float64 NumPy values and analytic gradients, identities, clipping."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from podsjax.core import grpo
from podsjax.update import algorithms, train_step
import podsjax.models as pm
from experiments import paper_settings
from podsjax.core.grpo import LossConfig

LOSS = jax.jit(grpo.grpo_loss, static_argnums=3)
EPS, EPS_HIGH, BETA = 0.2, 0.28, 0.04


def loss_and_grad(logp, adv, mask, config, old, ref=None):
    """The jitted loss and its gradient w.r.t. the new log-probs."""

    def loss_fn(lp):
        return grpo.grpo_loss(lp, adv, mask, config, old_logprobs_BL=old, ref_logprobs_BL=ref)

    (loss, metrics), grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(jnp.asarray(logp))
    return float(loss), np.asarray(grad), metrics


def groups_for(aggregation, rows):
    """group-token-mean's rows per group in these tests: pairs where the rows pair up, else one group."""
    return (2 if rows % 2 == 0 else rows) if aggregation == "group-token-mean" else None


def make_config(aggregation, rows, **fields):
    return LossConfig(aggregation=aggregation, group_size=groups_for(aggregation, rows), **fields)


def token_weights(mask, aggregation):
    """d loss / d per-token loss: the aggregation's weight of each token."""
    b, length = mask.shape
    if aggregation == "token-mean":
        return mask / mask.sum()
    if aggregation == "seq-mean-token-mean":
        return mask / (b * np.maximum(mask.sum(-1, keepdims=True), 1.0))
    if aggregation == "group-token-mean":
        g = groups_for(aggregation, b)
        group_tokens = np.repeat(mask.reshape(b // g, g * length).sum(-1), g)[:, None]
        return mask / ((b // g) * np.maximum(group_tokens, 1.0))
    return mask / (b * length)


def numpy_gspo(logp, old, ref, adv, mask, aggregation, beta):
    """Float64 GSPO loss and its analytic gradient w.r.t. logp."""
    logp, old, ref = (np.where(mask > 0, x, 0.0).astype(np.float64) for x in (logp, old, ref))
    a = adv.astype(np.float64)[:, None]
    lengths = np.maximum(mask.sum(-1, keepdims=True), 1.0)
    s = np.exp(((logp - old) * mask).sum(-1, keepdims=True) / lengths)  # [B, 1]
    unclipped, clipped = s * a, np.clip(s, 1 - EPS, 1 + EPS_HIGH) * a
    seq_loss = -np.minimum(unclipped, clipped)
    # d seq_loss / d s: -A where the unclipped branch is the min, 0 where the clip holds it.
    d_seq = np.where(unclipped <= clipped, -a, 0.0)
    d_kl = ref - logp
    kl = np.exp(d_kl) - d_kl - 1
    c = token_weights(mask, aggregation)
    loss = np.sum(c * (seq_loss + beta * kl))
    # Every token of sequence i carries seq_loss_i, and d s_i / d logp_t = s_i m_t / |y_i|.
    grad = c.sum(-1, keepdims=True) * d_seq * s * mask / lengths + c * beta * (1 - np.exp(d_kl))
    return loss, grad


def numpy_cispo(logp, old, ref, adv, mask, aggregation, beta):
    """Float64 CISPO loss and its REINFORCE gradient: the capped weight is a constant."""
    logp, old, ref = (np.where(mask > 0, x, 0.0).astype(np.float64) for x in (logp, old, ref))
    a = adv.astype(np.float64)[:, None]
    weight = np.minimum(np.exp(logp - old), 1 + EPS_HIGH)
    d_kl = ref - logp
    kl = np.exp(d_kl) - d_kl - 1
    c = token_weights(mask, aggregation)
    loss = np.sum(c * (-weight * a * logp + beta * kl))
    grad = c * (-weight * a + beta * (1 - np.exp(d_kl)))
    return loss, grad


def random_batch(seed, b=6, length=7, spread=0.3):
    rng = np.random.default_rng(seed)
    old = rng.normal(-2, 1, (b, length)).astype(np.float32)
    # A shift per row besides the per-token noise, so some whole sequences leave GSPO's clip range.
    logp = (old + rng.normal(0, spread, (b, 1)) + rng.normal(0, spread, (b, length))).astype(np.float32)
    ref = (old + rng.normal(0, 0.3, (b, length))).astype(np.float32)
    adv = rng.normal(size=b).astype(np.float32)
    mask = (np.arange(length)[None] < rng.integers(1, length + 1, b)[:, None]).astype(np.float32)
    return logp, old, ref, adv, mask


REFERENCES = {"gspo": numpy_gspo, "cispo": numpy_cispo}


@pytest.mark.parametrize("loss_type", ["gspo", "cispo"])
@pytest.mark.parametrize("aggregation", grpo.AGGREGATIONS)
@pytest.mark.parametrize("beta", [0.0, BETA])
def test_values_and_gradients_match_float64_numpy(loss_type, aggregation, beta):
    logp, old, ref, adv, mask = random_batch(0)
    config = make_config(aggregation, len(mask), epsilon=EPS, epsilon_high=EPS_HIGH, beta=beta, loss_type=loss_type)
    loss, grad, _ = loss_and_grad(logp, adv, mask, config, old, ref)
    expected_loss, expected_grad = REFERENCES[loss_type](logp, old, ref, adv, mask, aggregation, beta)
    assert loss == pytest.approx(expected_loss, rel=1e-5, abs=1e-6)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-5, atol=1e-7)
    assert np.all(grad[mask == 0] == 0.0)


def test_the_batch_reaches_both_sides_of_the_clips():
    # The comparison above would not test clipping if nothing in its batch were clipped.
    logp, old, _, adv, mask = random_batch(0)
    lengths = mask.sum(-1)
    s = np.exp(((logp - old) * mask).sum(-1) / lengths)
    gspo_clipped = ((s > 1 + EPS_HIGH) & (adv > 0)) | ((s < 1 - EPS) & (adv < 0))
    assert 0 < gspo_clipped.sum() < len(s)
    capped = (np.exp(logp - old) > 1 + EPS_HIGH) & (mask > 0)
    assert 0 < capped.sum() < mask.sum()


@pytest.mark.parametrize("aggregation", grpo.AGGREGATIONS)
def test_gspo_equals_grpo_when_each_sequence_has_one_log_ratio(aggregation):
    # With one log-ratio per sequence (one token each, or equal ratios on every token) the
    # sequence ratio is the token ratio: same loss, same gradient, same metrics.
    rng = np.random.default_rng(1)
    old = rng.normal(-2, 1, (5, 4)).astype(np.float32)
    step = rng.normal(0, 0.3, (5, 1)).astype(np.float32)
    adv = rng.normal(size=5).astype(np.float32)
    for mask in (np.eye(5, 4, dtype=np.float32)[:, ::-1].copy(),  # one token each (the last row: none)
                 (np.arange(4)[None] < np.array([[1], [4], [2], [3], [4]])).astype(np.float32)):
        logp = old + step  # the same log-ratio on every token of a row
        kw = dict(epsilon=EPS, epsilon_high=EPS_HIGH)
        gspo = loss_and_grad(logp, adv, mask, make_config(aggregation, 5, loss_type="gspo", **kw), old)
        plain = loss_and_grad(logp, adv, mask, make_config(aggregation, 5, loss_type="grpo", **kw), old)
        assert gspo[0] == pytest.approx(plain[0], rel=1e-6, abs=1e-7)
        np.testing.assert_allclose(gspo[1], plain[1], rtol=1e-5, atol=1e-8)
        assert float(gspo[2].clip_frac_high) == pytest.approx(float(plain[2].clip_frac_high))
        assert float(gspo[2].clip_frac_low) == pytest.approx(float(plain[2].clip_frac_low))
    assert np.any(np.abs(gspo[1]) > 0)


@pytest.mark.parametrize("aggregation", grpo.AGGREGATIONS)
def test_gspo_equals_the_stop_gradient_token_form(aggregation):
    # verl's GSPO-token ratio sg(s) * pi / sg(pi) has the value s on every token and the
    # gradient of the sequence form under every aggregation (each weights a row's tokens alike).
    logp, old, _, adv, mask = random_batch(2)
    config = make_config(aggregation, len(mask), epsilon=EPS, epsilon_high=EPS_HIGH, loss_type="gspo")
    weights = token_weights(mask, aggregation)

    def token_form(lp):
        lp = jnp.where(mask > 0, lp, 0.0)
        log_s = jnp.sum((lp - old) * mask, -1, keepdims=True) / jnp.maximum(mask.sum(-1, keepdims=True), 1.0)
        log_ratio = jax.lax.stop_gradient(log_s) + lp - jax.lax.stop_gradient(lp)
        return jnp.sum(weights * grpo.grpo_token_loss(log_ratio, jnp.asarray(adv)[:, None], config).per_token)

    expected, expected_grad = jax.value_and_grad(token_form)(jnp.asarray(logp))
    loss, grad, _ = loss_and_grad(logp, adv, mask, config, old)
    assert loss == pytest.approx(float(expected), rel=1e-6, abs=1e-7)
    np.testing.assert_allclose(grad, np.asarray(expected_grad), rtol=1e-5, atol=1e-8)


def test_gspo_clips_the_whole_sequence():
    # Row 0: log-ratios 0.5 and 0.1, s = e^0.3 = 1.3499 > 1.28 with A = +1: the loss of both
    # tokens is -1.28 and neither gets a gradient. Row 1: log-ratios +-0.05, s = 1, A = -2:
    # loss +2 on each token; both carry s, so each gets |y| * (-A) * s / |y| / N = 2 / 4 = 0.5.
    old = np.zeros((2, 2), np.float32)
    logp = np.array([[0.5, 0.1], [0.05, -0.05]], np.float32)
    adv, mask = np.array([1.0, -2.0], np.float32), np.ones((2, 2), np.float32)
    config = LossConfig(epsilon=EPS, epsilon_high=EPS_HIGH, loss_type="gspo")
    loss, grad, metrics = loss_and_grad(logp, adv, mask, config, old)
    assert loss == pytest.approx((2 * -1.28 + 2 * 2.0) / 4, abs=1e-6)
    np.testing.assert_allclose(grad, [[0.0, 0.0], [0.5, 0.5]], atol=1e-6)
    assert float(metrics.clip_frac_high) == pytest.approx(0.5)  # both tokens of row 0
    assert float(metrics.clip_frac_low) == 0.0
    assert float(metrics.ratio_mean) == pytest.approx((2 * np.exp(0.3) + 2 * 1.0) / 4, rel=1e-6)


def test_cispo_caps_the_weight_and_keeps_the_gradient():
    # Ratios [2.0, 1.1] with A = +1 and [0.1] with A = -1 (no lower bound for CISPO).
    # Weights: min(2.0, 1.28) = 1.28, 1.1, 0.1; per token -w * A * logp; gradient -w * A / N.
    old = np.log(np.array([[0.25, 0.5], [0.5, 1.0]], np.float32))
    logp = old + np.log(np.array([[2.0, 1.1], [0.1, 1.0]], np.float32))
    adv = np.array([1.0, -1.0], np.float32)
    mask = np.array([[1, 1], [1, 0]], np.float32)
    config = LossConfig(epsilon=EPS, epsilon_high=EPS_HIGH, loss_type="cispo")
    loss, grad, metrics = loss_and_grad(logp, adv, mask, config, old)
    lp = np.log([0.5, 0.55, 0.05])
    assert loss == pytest.approx((-1.28 * lp[0] - 1.1 * lp[1] + 0.1 * lp[2]) / 3, rel=1e-6)
    # The capped token keeps a gradient (GRPO's clip would zero it), and none flows through the weight.
    np.testing.assert_allclose(grad, [[-1.28 / 3, -1.1 / 3], [0.1 / 3, 0.0]], rtol=1e-6)
    assert float(metrics.clip_frac_high) == pytest.approx(1 / 3)
    assert float(metrics.clip_frac_low) == 0.0


def test_on_policy_cispo_is_reinforce():
    # old=None: every ratio is 1, the weight 1, so loss = -mean(A * logp) and grad = -A / N.
    logp = jnp.array([[-1.0, -2.0], [-0.5, -0.1]])
    adv = jnp.array([2.0, -1.0])
    loss, grad, _ = loss_and_grad(logp, adv, jnp.ones((2, 2)), LossConfig(loss_type="cispo"), None)
    assert loss == pytest.approx(-(2 * -1.0 + 2 * -2.0 - 1 * -0.5 - 1 * -0.1) / 4)
    np.testing.assert_allclose(grad, [[-0.5, -0.5], [0.25, 0.25]], rtol=1e-6)


@pytest.mark.parametrize("aggregation", grpo.AGGREGATIONS)
def test_on_policy_all_three_give_the_same_gradient(aggregation):
    # One update per batch (old=None): every ratio is 1, so the three updates coincide.
    logp, _, ref, adv, mask = random_batch(3)
    grads = {loss_type: loss_and_grad(logp, adv, mask, make_config(aggregation, len(mask), beta=BETA,
                                                                   loss_type=loss_type), None, ref)[1]
             for loss_type in grpo.LOSS_TYPES}
    assert np.any(grads["grpo"] != 0.0)
    for loss_type in ("gspo", "cispo"):
        np.testing.assert_allclose(grads[loss_type], grads["grpo"], rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("loss_type", ["gspo", "cispo"])
def test_split_batch_terms_sum_to_the_whole_batch_loss(loss_type):
    # Gradient accumulation: micro-batch numerators over the whole batch's denominator.
    logp, old, _, adv, mask = random_batch(4, b=8, length=5)
    for aggregation in grpo.AGGREGATIONS:
        config = make_config(aggregation, 8, loss_type=loss_type)
        whole, _ = LOSS(logp, adv, mask, config, old_logprobs_BL=old)
        split = 2 if aggregation == "group-token-mean" else 3  # micro-batches of whole groups
        numerator = sum(
            float(grpo.grpo_loss_terms(logp[s], adv[s], mask[s], config, old_logprobs_BL=old[s])[0].numerator)
            for s in (slice(0, split), slice(split, 8))
        )
        assert numerator / float(grpo.loss_denominator(mask, config)) == pytest.approx(float(whole), rel=1e-6)


@pytest.mark.parametrize("loss_type", ["gspo", "cispo"])
def test_padding_garbage_never_reaches_loss_or_gradient(loss_type):
    logp, old, ref, adv, mask = random_batch(5)
    logp[mask == 0], old[mask == 0], ref[mask == 0] = np.inf, np.nan, -np.inf
    config = LossConfig(beta=0.1, loss_type=loss_type)
    loss, grad, _ = loss_and_grad(logp, adv, mask, config, old, ref)
    assert np.isfinite(loss) and np.all(np.isfinite(grad))
    assert np.all(grad[mask == 0] == 0.0) and np.all(grad[mask > 0] != 0.0)


def test_loss_type_is_validated_and_off_by_default():
    with pytest.raises(ValueError, match=r"loss_type must be one of \('grpo', 'gspo', 'cispo'\); got 'ppo'"):
        LossConfig(loss_type="ppo")
    with pytest.raises(ValueError, match="loss_type must be one of"):
        algorithms.AlgorithmConfig(loss_type="GSPO")
    assert LossConfig().loss_type == "grpo"
    for method in ("grpo", "grpo-ga", "pods"):
        assert paper_settings.method_config(method).loss_config.loss_type == "grpo"
    config = algorithms.AlgorithmConfig(loss_type="cispo", epsilon_high=4.0, aggregation="seq-mean-token-mean")
    assert config.loss_config == LossConfig(epsilon_high=4.0, aggregation="seq-mean-token-mean", loss_type="cispo")


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["gspo", "cispo"])
def test_train_step_micro_batches_equal_one_big_batch(loss_type):
    # Through make_train_step: two updates per batch (so the ratio leaves 1) with the KL,
    # in 2 micro-batches or in one, give the same loss, gradient norm and params.
    config = pm.ModelConfig(arch="qwen2", vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1,
                            num_heads=2, num_kv_heads=1, head_dim=8, tie_word_embeddings=True)
    model = pm.Decoder(config)
    params = pm.init_params(model, jax.random.key(0))
    rng = np.random.default_rng(6)
    n, t = 4, 5
    rollouts = (rng.integers(1, 64, (2, 3)).astype(np.int32), np.ones((2, 3), np.int32),
                rng.integers(1, 64, (2, n, t)).astype(np.int32), np.arange(t) < rng.integers(1, t + 1, (2, n, 1)),
                rng.normal(size=(2, n)).astype(np.float32))
    policy, reference = train_step.full_apply_fn(model)
    common = dict(n=n, m=n, learning_rate=1e-2, max_grad_norm=1e6, num_iterations=2, beta=BETA)

    def run(**fields):
        algo = algorithms.AlgorithmConfig(**common, **fields)
        optimizer = algorithms.make_optimizer(algo)
        batch, _ = train_step.build_batch(*rollouts, algo)
        step = jax.jit(train_step.make_train_step(policy, optimizer, algo, reference))
        return step(train_step.init_state(params, optimizer), batch, params)

    ga_state, ga = run(algorithm="grpo-ga", grad_accum=2, loss_type=loss_type)
    big_state, big = run(algorithm="grpo", loss_type=loss_type)
    _, plain = run(algorithm="grpo", loss_type="grpo")
    assert float(ga.loss) == pytest.approx(float(big.loss), abs=1e-6)
    assert float(ga.grad_norm) == pytest.approx(float(big.grad_norm), rel=1e-5)
    diffs = [float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(ga_state.params),
                                                           jax.tree.leaves(big_state.params))]
    assert max(diffs) <= 1e-5
    assert float(big.loss) != pytest.approx(float(plain.loss), abs=1e-6)  # the loss type reached the step


@pytest.mark.slow
def test_group_token_mean_through_the_train_step_one_group_a_micro_batch():
    # The authors' 8-GPU update: each micro-batch one group (2 prompts, grad_accum 2), its
    # token mean, averaged over the groups. The same as one batch of both groups, and not
    # the batch's token mean when the groups' lengths differ.
    config = pm.ModelConfig(arch="qwen2", vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1,
                            num_heads=2, num_kv_heads=1, head_dim=8, tie_word_embeddings=True)
    model = pm.Decoder(config)
    params = pm.init_params(model, jax.random.key(0))
    rng = np.random.default_rng(7)
    n, t = 4, 5
    lengths = np.array([[[1], [2], [1], [2]], [[5], [4], [5], [3]]])  # 6 tokens, then 17
    rollouts = (rng.integers(1, 64, (2, 3)).astype(np.int32), np.ones((2, 3), np.int32),
                rng.integers(1, 64, (2, n, t)).astype(np.int32), np.arange(t) < lengths,
                rng.normal(size=(2, n)).astype(np.float32))
    policy, _ = train_step.full_apply_fn(model)

    def run(**fields):
        algo = algorithms.AlgorithmConfig(n=n, m=n, learning_rate=1e-2, max_grad_norm=1e6, **fields)
        assert algo.loss_config.group_size == (n if algo.aggregation == "group-token-mean" else None)
        optimizer = algorithms.make_optimizer(algo)
        batch, _ = train_step.build_batch(*rollouts, algo)
        assert float(train_step.mini_batch_denominators(batch.completion_mask, algo)) == (
            2.0 if algo.aggregation == "group-token-mean" else 23.0)
        return jax.jit(train_step.make_train_step(policy, optimizer, algo))(train_step.init_state(params, optimizer), batch,
                                                                            params)[1]

    ga = run(algorithm="grpo-ga", grad_accum=2, aggregation="group-token-mean")
    big = run(algorithm="grpo", aggregation="group-token-mean")
    tokens = run(algorithm="grpo", aggregation="token-mean")
    assert float(ga.loss) == pytest.approx(float(big.loss), abs=1e-6)
    assert float(ga.grad_norm) == pytest.approx(float(big.grad_norm), rel=1e-5)
    assert float(big.grad_norm) != pytest.approx(float(tokens.grad_norm), rel=1e-3)
