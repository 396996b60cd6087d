"""Off-policy updates: several optimizer steps per generation, the ratio's old policy, TIS and the
sampler/update mismatch, checked against hand computations and step-by-step references."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from podsjax.core import grpo
from podsjax.update import algorithms, train_step, update_forward
import podsjax.models as pm

pytestmark = pytest.mark.cpu_mesh

CONFIG = pm.ModelConfig(arch="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True, tie_word_embeddings=True)
P, N, LP, T = 4, 4, 5, 6
COMMON = dict(algorithm="grpo", n=N, m=N, learning_rate=1e-2, max_grad_norm=1e6, epsilon=0.1)


@pytest.fixture(scope="module")
def model_and_params():
    model = pm.Decoder(CONFIG)
    return model, pm.init_params(model, jax.random.key(0))


def rollouts(seed=0):
    rng = np.random.default_rng(seed)
    prompt_ids = rng.integers(1, 64, (P, LP)).astype(np.int32)
    prompt_mask = np.ones((P, LP), np.int32)
    prompt_mask[1, :2] = 0
    tokens = rng.integers(1, 64, (P, N, T)).astype(np.int32)
    mask = np.arange(T) < rng.integers(2, T + 1, (P, N))[..., None]
    rewards = rng.integers(0, 2, (P, N)).astype(np.float32) + rng.normal(0, 0.1, (P, N)).astype(np.float32)
    return prompt_ids, prompt_mask, tokens, mask, rewards


def policy_logprobs(model, params, batch, temperature=0.9):
    """The update's own log-probs at ``params``, in its default form: each prompt once for its N rows."""
    policy, _ = train_step.full_apply_fn(model)
    prefix = functools.partial(policy.shared_prefix, params, None)
    return update_forward.shared_prefix_logprobs(prefix, batch, temperature, N)[0]


def run_step(model, params, batch, **fields):
    config = algorithms.AlgorithmConfig(**COMMON, **fields)
    policy, reference = train_step.full_apply_fn(model)
    optimizer = algorithms.make_optimizer(config)
    step = train_step.make_train_step(policy, optimizer, config, reference)
    return jax.jit(step)(train_step.init_state(params, optimizer), batch, None)


def batch_with(model, params, config_fields, sampler_shift=None, seed=0):
    """The batch ``build_batch`` makes, carrying the sampler's log-probs: the update's own at the
    start params, shifted by ``sampler_shift`` [P, N, T] where given."""
    config = algorithms.AlgorithmConfig(**COMMON, **config_fields)
    prompt_ids, prompt_mask, tokens, mask, rewards = rollouts(seed)
    plain, _ = train_step.build_batch(prompt_ids, prompt_mask, tokens, mask, rewards,
                                      algorithms.AlgorithmConfig(**COMMON))
    logp = np.asarray(policy_logprobs(model, params, plain)).reshape(P, N, T)
    if sampler_shift is not None:
        logp = logp + sampler_shift
    batch, _ = train_step.build_batch(prompt_ids, prompt_mask, tokens, mask, rewards, config, logprobs_PNT=logp)
    return batch


def max_diff(a, b):
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# -- the pure functions -----------------------------------------------------------------


def test_tis_weights_match_a_hand_computation_per_token_and_per_sequence():
    old = np.array([[-1.0, -2.0, -0.5], [-0.1, -0.2, -9.0]], np.float32)
    sampler = np.array([[-2.0, -1.0, -0.5], [-0.3, -0.1, 0.0]], np.float32)
    mask = np.array([[1, 1, 1], [1, 1, 0]], np.float32)
    w, cut = grpo.tis_weights(old, sampler, mask, cap=2.0)
    ratio = np.exp(old - sampler)
    expected = np.minimum(ratio, 2.0)
    expected[1, 2] = 1.0  # padding: log-ratio 0
    np.testing.assert_allclose(np.asarray(w), expected, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(cut), [[True, False, False], [False, False, False]])
    seq_w, seq_cut = grpo.tis_weights(old, sampler, mask, cap=2.0, level="sequence")
    products = [np.exp(0.0), np.exp(0.2 - 0.1)]  # row 0: 1 - 1 + 0; row 1: 0.2 - 0.1, padding left out
    np.testing.assert_allclose(np.asarray(seq_w), np.repeat(np.minimum(products, 2.0)[:, None], 3, 1), rtol=1e-6)
    assert not np.asarray(seq_cut).any()
    # A padded position's values, however large, neither weigh a sequence nor count as cut.
    for level in ("token", "sequence"):
        pad_w, pad_cut = grpo.tis_weights(np.array([[0.0, 5.0]]), np.zeros((1, 2)), np.array([[1, 0]]), cap=2.0,
                                          level=level)
        np.testing.assert_array_equal(np.asarray(pad_w), [[1.0, 1.0]], err_msg=level)
        assert not np.asarray(pad_cut).any(), level
    huge, _ = grpo.tis_weights(np.array([[500.0]]), np.array([[0.0]]), np.ones((1, 1)), cap=3.0)
    assert float(huge[0, 0]) == pytest.approx(3.0)  # capped in log space: no overflow to inf
    with pytest.raises(ValueError, match="tis_level must be one of"):
        grpo.tis_weights(old, sampler, mask, cap=2.0, level="batch")


def test_the_tis_loss_weights_each_policy_term_as_trl_does_and_not_the_kl():
    rng = np.random.default_rng(0)
    logp = jnp.asarray(rng.normal(-1.0, 0.3, (3, 4)), jnp.float32)
    sampler = logp + jnp.asarray(rng.normal(0, 0.5, (3, 4)), jnp.float32)
    ref = logp + 0.2
    adv = jnp.asarray([1.0, -0.5, 2.0])
    mask = jnp.asarray([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], jnp.float32)
    config = grpo.LossConfig(beta=0.05, tis_cap=1.5)

    def loss(lp):
        return grpo.grpo_loss(lp, adv, mask, config, ref_logprobs_BL=ref, sampler_logprobs_BL=sampler)[0]

    # TRL: per_token = -A * exp(lp - sg(lp)) * min(exp(sg(lp) - sampler), cap) + beta * k3; token mean.
    w = np.minimum(np.exp(np.asarray(logp) - np.asarray(sampler)), 1.5)
    k3_grad = -np.exp(np.asarray(ref) - np.asarray(logp)) + 1.0  # d/dlp of exp(ref - lp) - (ref - lp) - 1
    expected = (-np.asarray(adv)[:, None] * w + 0.05 * k3_grad) * np.asarray(mask) / np.asarray(mask).sum()
    np.testing.assert_allclose(np.asarray(jax.grad(loss)(logp)), expected, rtol=1e-5, atol=1e-7)
    _, metrics = grpo.grpo_loss(logp, adv, mask, config, ref_logprobs_BL=ref, sampler_logprobs_BL=sampler)
    valid = np.asarray(mask) > 0
    assert float(metrics.tis_weight_mean) == pytest.approx(w[valid].mean(), rel=1e-5)
    assert float(metrics.tis_truncated_frac) == pytest.approx((w[valid] == 1.5).mean())
    with pytest.raises(ValueError, match="tis_cap=1.5 needs sampler_logprobs_BL"):
        grpo.grpo_loss(logp, adv, mask, config, ref_logprobs_BL=ref)
    # Per sequence: every token of a row weighs the capped product of its valid tokens' ratios.
    config = grpo.LossConfig(beta=0.05, tis_cap=1.5, tis_level="sequence")
    log_ratio = np.where(np.asarray(mask) > 0, np.asarray(logp) - np.asarray(sampler), 0.0).sum(-1, keepdims=True)
    w_seq = np.minimum(np.exp(log_ratio), 1.5)
    expected = (-np.asarray(adv)[:, None] * w_seq + 0.05 * k3_grad) * np.asarray(mask) / np.asarray(mask).sum()
    np.testing.assert_allclose(np.asarray(jax.grad(loss)(logp)), expected, rtol=1e-5, atol=1e-7)


def test_sampler_mismatch_sums_by_hand():
    update = np.array([[-1.0, -2.0, 5.0], [-0.5, -0.25, -1.0]], np.float32)
    sampler = np.array([[-1.5, -1.0, 0.0], [-0.5, -1.0, -2.0]], np.float32)
    mask = np.array([[1, 1, 0], [1, 1, 1]], np.float32)
    m = grpo.sampler_mismatch(update, sampler, mask)
    assert float(m.abs_logp_diff) == pytest.approx(0.5 + 1.0 + 0.0 + 0.75 + 1.0)
    assert float(m.max_ratio) == pytest.approx(np.exp(1.0))  # the padded 5.0 - 0.0 is left out
    assert float(m.tokens) == 5


# -- the update ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("steps, iterations", [(2, 2), (1, 2)])
def test_mini_batches_equal_steps_taken_one_after_another(model_and_params, steps, iterations):
    """steps_per_generation 2 x num_iterations 2 is four optimizer steps on the two halves, each
    against the start policy's log-probs, as sampler-mode single steps reproduce them (and two
    iterations over one batch: the second step's ratios are against the start policy too)."""
    model, params = model_and_params
    fields = dict(steps_per_generation=steps, num_iterations=iterations)
    batch = batch_with(model, params, {**fields, "log_mismatch": True})
    assert batch.loss_denominator.shape == ((steps,) if steps > 1 else ())  # one per mini-batch
    state, metrics = run_step(model, params, batch, **fields, log_mismatch=True)
    assert int(state.step) == steps * iterations

    half = P * N // steps
    config = algorithms.AlgorithmConfig(**COMMON, old_logprobs="sampler")
    policy, reference = train_step.full_apply_fn(model)
    optimizer = algorithms.make_optimizer(config)
    one_step = jax.jit(train_step.make_train_step(policy, optimizer, config, reference))
    ref_state, losses = train_step.init_state(params, optimizer), []
    for _ in range(iterations):
        for s in range(steps):
            rows = slice(s * half, (s + 1) * half)
            mini = batch.replace(**{name: getattr(batch, name)[rows] for name in
                                    ("input_ids", "attention_mask", "completion_mask", "advantages",
                                     "sampler_logprobs")}, loss_denominator=jnp.reshape(batch.loss_denominator, (steps,))[s])
            ref_state, m = one_step(ref_state, mini, None)
            losses.append(float(m.loss))
    assert max_diff(state.params, ref_state.params) <= 1e-5
    assert max_diff(state.opt_state, ref_state.opt_state) <= 1e-5
    assert float(metrics.loss) == pytest.approx(np.mean(losses), rel=1e-4, abs=1e-6)
    assert len(set(np.round(losses, 6))) > 1  # the later steps saw a moved policy
    # The start policy computed the sampler's log-probs: no mismatch before the first step.
    assert float(metrics.mismatch_logp_abs) <= 1e-6
    assert float(metrics.mismatch_ratio_max) == pytest.approx(1.0, abs=1e-5)
    assert float(metrics.num_tokens) == float(batch.completion_mask.sum())


@pytest.mark.slow
def test_with_the_samplers_old_log_probs_the_mismatch_is_measured_before_any_update(model_and_params):
    # The sampler's log-probs are the start policy's: no mismatch, although the second
    # mini-batch is scored after the first optimizer step has moved the policy.
    model, params = model_and_params
    fields = dict(steps_per_generation=2, old_logprobs="sampler", log_mismatch=True)
    _, metrics = run_step(model, params, batch_with(model, params, fields), **fields)
    assert float(metrics.mismatch_logp_abs) <= 1e-6
    assert float(metrics.mismatch_ratio_max) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.slow
def test_a_skipped_mini_batch_leaves_the_step_figures_of_the_applied_one(model_and_params):
    model, params = model_and_params
    fields = dict(steps_per_generation=2)
    batch = batch_with(model, params, fields)
    half = P * N // 2
    broken = batch.replace(advantages=batch.advantages.at[half:].set(jnp.nan))
    state, metrics = run_step(model, params, broken, **fields)
    assert int(metrics.skipped) == 1 and int(state.skipped_updates) == 1
    first = batch.replace(**{name: getattr(batch, name)[:half] for name in
                             ("input_ids", "attention_mask", "completion_mask", "advantages")},
                          loss_denominator=batch.loss_denominator[0])
    _, alone = run_step(model, params, first)
    assert float(metrics.loss) == pytest.approx(float(alone.loss), rel=1e-5)
    assert float(metrics.grad_norm) == pytest.approx(float(alone.grad_norm), rel=1e-5)


@pytest.mark.slow
def test_tis_and_the_mismatch_see_a_shifted_sampler(model_and_params):
    model, params = model_and_params
    shift = np.zeros((P, N, T), np.float32)
    shift[0, :, :2] = -1.0  # the sampler gave these tokens e times less mass: ratio e > cap 2
    shift[1, :, 0] = 0.3
    batch = batch_with(model, params, dict(tis_cap=2.0, log_mismatch=True), shift)
    plain_state, plain = run_step(model, params, batch.replace(sampler_logprobs=None))
    tis_state, tis = run_step(model, params, batch, tis_cap=2.0, log_mismatch=True)
    mask = np.asarray(batch.completion_mask) > 0
    moved = np.abs(shift.reshape(P * N, T))[mask]
    assert float(tis.mismatch_logp_abs) == pytest.approx(moved.mean(), rel=1e-4)
    assert float(tis.mismatch_ratio_max) == pytest.approx(np.e, rel=1e-4)
    assert float(tis.tis_truncated_frac) == pytest.approx((moved == 1.0).mean(), rel=1e-6)
    assert 1.0 < float(tis.tis_weight_mean) < 2.0
    assert max_diff(tis_state.params, plain_state.params) > 1e-6
    assert plain.tis_weight_mean is None and plain.mismatch_logp_abs is None  # off: not reported
    # The sampler's log-probs equal to the update's: every TIS weight is 1 and none is cut. (The
    # params are no measure of it: the eager and the jitted forward round apart by an ulp, and
    # Adam's first step scales a near-zero gradient's rounding up towards the learning rate.)
    same = batch_with(model, params, dict(tis_cap=2.0, log_mismatch=True))
    _, same_metrics = run_step(model, params, same, tis_cap=2.0, log_mismatch=True)
    assert float(same_metrics.tis_weight_mean) == pytest.approx(1.0, abs=1e-6)
    assert float(same_metrics.mismatch_ratio_max) == pytest.approx(1.0, abs=1e-5)
    assert float(same_metrics.tis_truncated_frac) == 0.0


def test_options_that_need_the_sampler_log_probs_say_so(model_and_params):
    model, params = model_and_params
    prompt_ids, prompt_mask, tokens, mask, rewards = rollouts()
    config = algorithms.AlgorithmConfig(**COMMON, tis_cap=3.0)
    with pytest.raises(ValueError, match="tis_cap=3.0 needs the sampler's log-probs"):
        train_step.build_batch(prompt_ids, prompt_mask, tokens, mask, rewards, config)
    batch, _ = train_step.build_batch(prompt_ids, prompt_mask, tokens, mask, rewards, algorithms.AlgorithmConfig(**COMMON))
    with pytest.raises(ValueError, match="old_logprobs='sampler' needs the batch's sampler_logprobs"):
        run_step(model, params, batch, old_logprobs="sampler")
    with pytest.raises(ValueError, match="loss_denominator has 1 values; .* steps_per_generation=2"):
        run_step(model, params, batch, steps_per_generation=2)
    with pytest.raises(ValueError, match="does not split into steps_per_generation 3"):
        run_step(model, params, batch.replace(loss_denominator=None), steps_per_generation=3)


def test_config_checks_of_the_off_policy_options():
    cases = [
        (dict(steps_per_generation=0), "steps_per_generation must be >= 1; got 0"),
        # 2,000 had traced the unrolled update for minutes before compiling
        (dict(num_iterations=2000), "num_iterations x steps_per_generation must be at most 64 optimizer steps"),
        (dict(num_iterations=8, steps_per_generation=16), "got 8 x 16"),
        (dict(old_logprobs="vllm"), r"old_logprobs must be one of \('recompute', 'sampler'\)"),
        (dict(tis_cap=0.0), "tis_cap must be > 0"),
        (dict(tis_cap=float("inf")), "tis_cap must be finite"),
        (dict(tis_level="geometric"), "tis_level must be one of"),
        (dict(tis_cap=3.0, old_logprobs="sampler"), "with old_logprobs='sampler' the ratio is already"),
        (dict(log_mismatch="yes"), "log_mismatch must be true or false"),
        (dict(dynamic_sampling=1), "dynamic_sampling must be true or false"),
        (dict(max_sampling_rounds=0), "max_sampling_rounds must be >= 1; got 0"),
        (dict(log_mismatch=True, temperature=0.9, logprob_temperature=1.0),
         "log_mismatch compares the sampler's log-probs with the update's, which needs them at one temperature"),
        (dict(tis_cap=3.0, temperature=0.9, logprob_temperature=1.0), "tis_cap=3.0 compares"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            algorithms.AlgorithmConfig(**kwargs)
        assert "\n" not in str(err.value)
    default = algorithms.AlgorithmConfig()
    assert default.updates_per_step == 1 and not default.sampler_logprobs and default.tis_cap is None
    assert algorithms.AlgorithmConfig(num_iterations=2, steps_per_generation=3).updates_per_step == 6


def test_the_step_reports_the_rate_an_injected_optimizer_used(model_and_params):
    # It had reported the config's 1e-2 while the optimizer stepped at 0.5.
    import optax

    model, params = model_and_params
    config = algorithms.AlgorithmConfig(**COMMON)
    batch = batch_with(model, params, {})
    policy, reference = train_step.full_apply_fn(model)
    optimizer = optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)
    step = jax.jit(train_step.make_train_step(policy, optimizer, config, reference))
    _, metrics = step(train_step.init_state(params, optimizer), batch, None)
    assert float(metrics.learning_rate) == 0.5
    _, metrics = run_step(model, params, batch)  # make_optimizer's: the config's schedule
    assert float(metrics.learning_rate) == pytest.approx(COMMON["learning_rate"])
