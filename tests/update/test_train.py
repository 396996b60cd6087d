"""The update step: GA equivalence, LoRA isolation, sharding, non-finite skips, batch assembly."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from podsjax.core import selection
from podsjax.devices import mesh as mesh_lib
from podsjax.update import algorithms, train_step
import podsjax.models as pm
from experiments import paper_settings

pytestmark = pytest.mark.cpu_mesh

CONFIG = pm.ModelConfig(arch="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True, tie_word_embeddings=True)
P, N, M, LP, T = 2, 8, 4, 6, 5


@pytest.fixture(scope="module")
def model_and_params():
    model = pm.Decoder(CONFIG)
    return model, pm.init_params(model, jax.random.key(0))


def random_rollouts(seed, p=P, n=N):
    rng = np.random.default_rng(seed)
    prompt_ids = rng.integers(1, 64, (p, LP)).astype(np.int32)
    prompt_mask = np.ones((p, LP), np.int32)
    prompt_mask[0, :2] = 0  # a left-padded prompt
    tokens = rng.integers(1, 64, (p, n, T)).astype(np.int32)
    lengths = rng.integers(1, T + 1, (p, n))
    mask = np.arange(T) < lengths[..., None]
    rewards = rng.integers(0, 2, (p, n)).astype(np.float32) + rng.normal(0, 0.1, (p, n)).astype(np.float32)
    return prompt_ids, prompt_mask, tokens, mask, rewards


def full_ft(model, config, params, seed=1):
    policy, reference = train_step.full_apply_fn(model)
    optimizer = algorithms.make_optimizer(config)
    state = train_step.init_state(params, optimizer)
    return train_step.make_train_step(policy, optimizer, config, reference), state


def tree_max_diff(a, b):
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.slow
def test_ga_micro_batches_equal_one_big_batch(model_and_params):
    model, params = model_and_params
    prompt_ids, prompt_mask, tokens, mask, rewards = random_rollouts(0)
    # Large max_grad_norm so clipping does not hide a wrong gradient scale; lr big enough to move.
    common = dict(n=N, m=N, learning_rate=1e-2, max_grad_norm=1e6, aggregation="token-mean")
    ga = algorithms.AlgorithmConfig(algorithm="grpo-ga", grad_accum=N // M, **common)
    big = algorithms.AlgorithmConfig(algorithm="grpo", **common)
    assert ga.grad_accum > 1
    batch, _ = train_step.build_batch(prompt_ids, prompt_mask, tokens, mask, rewards, ga)
    batch_big, _ = train_step.build_batch(prompt_ids, prompt_mask, tokens, mask, rewards, big)
    step_ga, state = full_ft(model, ga, params)
    step_big, state_big = full_ft(model, big, params)
    new_ga, m_ga = jax.jit(step_ga)(state, batch, None)
    new_big, m_big = jax.jit(step_big)(state_big, batch_big, None)
    assert float(m_ga.loss) == pytest.approx(float(m_big.loss), abs=1e-6)
    assert float(m_ga.grad_norm) == pytest.approx(float(m_big.grad_norm), rel=1e-5)
    # Adam's first moment after one step is 0.1 x the gradient: the summed micro-batch
    # gradients equal the big batch's, entry by entry.
    mu_ga, mu_big = (optax.tree_utils.tree_get(s.opt_state, "mu") for s in (new_ga, new_big))
    for a, b in zip(jax.tree.leaves(mu_ga), jax.tree.leaves(mu_big)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(b))))
    # The params follow wherever Adam's step is well conditioned: a gradient within a few
    # eps (1e-8) of zero turns float noise into steps of up to lr (1e-2).
    compared = 0
    for new_a, new_b, g in zip(jax.tree.leaves(new_ga.params), jax.tree.leaves(new_big.params),
                               jax.tree.leaves(mu_big)):
        steady = np.abs(np.asarray(g)) > 1e-6  # 0.1 x |gradient| > 100 eps
        np.testing.assert_allclose(np.asarray(new_a)[steady], np.asarray(new_b)[steady], atol=1e-5)
        compared += int(steady.sum())
    assert compared > 0.9 * sum(x.size for x in jax.tree.leaves(params))
    assert tree_max_diff(new_ga.params, params) > 1e-4  # the update really moved the params


@pytest.mark.slow
def test_a_lora_step_trains_the_adapter_alone_and_keeps_the_base_params(model_and_params):
    model, params = model_and_params
    config = paper_settings.method_config("pods", n=N, m=M, learning_rate=1e-2, beta=0.04, schedule="cosine",
                                          total_steps=4)
    lora = pm.init_lora(jax.random.key(3), model, pm.LoraConfig(rank=4, alpha=8.0))
    optimizer = algorithms.make_optimizer(config)
    policy, reference = train_step.lora_apply_fn(model)
    step = jax.jit(train_step.make_train_step(policy, optimizer, config, reference))
    state = train_step.init_state(lora, optimizer)
    batch, idx = train_step.build_batch(*random_rollouts(1), config)
    assert idx.shape == (P, M)
    new_state, metrics = step(state, batch, params)
    new_state, metrics = step(new_state, batch, params)  # B is non-zero now: KL and ratio move
    # The state is the adapter's alone, and the base params were not donated to the step.
    assert jax.tree.structure(new_state.params) == jax.tree.structure(lora)
    assert not any(x.is_deleted() for x in jax.tree.leaves(params))
    # The optimizer holds LoRA moments only, and LoRA B moved away from zero.
    assert {x.shape for x in jax.tree.leaves(new_state.opt_state)} <= {x.shape for x in jax.tree.leaves(lora)} | {()}
    assert tree_max_diff(new_state.params, lora) > 0
    assert float(metrics.kl_mean) > 0 and int(new_state.step) == 2
    # The reported rate is the schedule's at the step the update ran: cosine over 4 steps, step 1.
    assert float(metrics.learning_rate) == pytest.approx(1e-2 * 0.5 * (1 + math.cos(math.pi / 4)))


@pytest.mark.slow
def test_sharded_step_equals_single_device(model_and_params):
    model, params = model_and_params
    # Adam's first step is ~lr * g / |g|, which turns 1e-9 float noise in near-zero
    # gradients into ~lr / 10 differences; lr 1e-3 keeps that under the 1e-5 bound
    # while the loss and gradient norm are compared directly below.
    config = paper_settings.method_config("pods", n=N, m=M, learning_rate=1e-3, max_grad_norm=1e6)
    batch, _ = train_step.build_batch(*random_rollouts(2), config)
    step, state = full_ft(model, config, params)
    ref_state, ref_metrics = jax.jit(step)(state, batch, None)

    mesh = mesh_lib.make_mesh("data=2,fsdp=2,tensor=2")
    sharded_model = pm.Decoder(CONFIG, mesh=mesh)
    shardings = pm.param_shardings(sharded_model, mesh)
    sharded_params = jax.device_put(params, shardings)
    sharded_step, sharded_state = full_ft(sharded_model, config, sharded_params)
    batch_sharded = jax.tree.map(lambda x: jax.device_put(x, mesh_lib.batch_sharding(mesh, x.ndim)), batch)
    out_state, out_metrics = jax.jit(sharded_step, donate_argnums=0)(sharded_state, batch_sharded, None)
    assert tree_max_diff(out_state.params, ref_state.params) <= 1e-5
    assert float(out_metrics.loss) == pytest.approx(float(ref_metrics.loss), abs=1e-5)
    assert float(out_metrics.grad_norm) == pytest.approx(float(ref_metrics.grad_norm), rel=1e-5)
    assert tree_max_diff(out_state.params, params) > 1e-4  # the update really moved the params
    # Params stay sharded as the rules say (the embedding is split over vocab and embed).
    embed = out_state.params["embed"]["embedding"]
    assert embed.sharding.is_equivalent_to(shardings["embed"]["embedding"], embed.ndim)
    assert not embed.sharding.is_fully_replicated


def _floating_dtypes(tree):
    return {str(x.dtype) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}


def test_bf16_full_fine_tune_keeps_fp32_master_weights_and_follows_the_fp32_run():
    # bf16 weights of N(0, 0.02) at lr 5e-6: each AdamW step is far below a bf16 weight's
    # spacing, so a bf16 state loses most updates and a bf16 norm scale of 1 never moves.
    model16 = pm.Decoder(CONFIG, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    params16 = pm.init_params(model16, jax.random.key(0))
    assert _floating_dtypes(params16) == {"bfloat16"}
    start = jax.tree.map(lambda x: x.astype(jnp.float32), params16)  # one start for both runs
    config = algorithms.AlgorithmConfig(algorithm="grpo", n=N, m=N, learning_rate=5e-6)
    batch, _ = train_step.build_batch(*random_rollouts(0), config)

    def twenty_steps(model, params):
        step, state = full_ft(model, config, params)
        step = jax.jit(step)
        for _ in range(20):
            state, _ = step(state, batch, None)
        return state

    state16 = twenty_steps(model16, params16)
    state32 = twenty_steps(pm.Decoder(CONFIG), start)
    assert _floating_dtypes((state16.params, state16.opt_state)) == {"float32"}
    moved16, moved32 = ([np.asarray(x, np.float64) - np.asarray(s, np.float64)
                         for x, s in zip(jax.tree.leaves(state.params), jax.tree.leaves(start))]
                        for state in (state16, state32))
    for a in moved16:
        assert np.mean(a != 0) > 0.99  # every weight moved, norm scales included
    # The bf16-compute run moves the master weights as the fp32 run moves its weights.
    diff = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(moved16, moved32)))
    assert diff <= 0.1 * np.sqrt(sum(np.sum(b**2) for b in moved32))


def test_the_first_state_owns_its_arrays():
    # A step donates its state: had the state kept the caller's fp32 arrays, the first step
    # would delete them (a full fine-tune's frozen base, a LoRA tree used again to sample).
    params = {"w": jnp.ones((2, 2), jnp.float32), "b": jnp.ones((2,), jnp.bfloat16)}
    for master in (jnp.float32, None):
        state = train_step.init_state(params, optax.sgd(0.1), master_dtype=master)
        jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s.params), donate_argnums=0)(state)
        assert not any(x.is_deleted() for x in jax.tree.leaves(params)), master
        np.testing.assert_array_equal(np.asarray(params["w"]), 1.0)


@pytest.mark.slow
def test_non_finite_loss_skips_the_update(model_and_params):
    model, params = model_and_params
    config = paper_settings.method_config("grpo", n=N, m=N, learning_rate=1e-2, schedule="cosine", total_steps=4)
    batch, _ = train_step.build_batch(*random_rollouts(3), config)
    step, state = full_ft(model, config, params)
    bad = batch.replace(advantages=batch.advantages.at[0].set(jnp.nan))
    new_state, metrics = jax.jit(step)(state, bad, None)
    assert int(metrics.skipped) == 1 and int(new_state.skipped_updates) == 1
    assert tree_max_diff(new_state.params, params) == 0.0
    assert all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(new_state.opt_state), jax.tree.leaves(state.opt_state)))
    good_state, good = jax.jit(step)(new_state, batch, None)
    assert int(good.skipped) == 0 and tree_max_diff(good_state.params, params) > 0
    # The schedule follows the updates applied, as optax counts them: the skip did not move it.
    assert float(good.learning_rate) == float(metrics.learning_rate) == pytest.approx(1e-2)
    # A finite loss whose gradient's norm is not finite (its squares pass float32's range) skips too.
    huge = batch.replace(advantages=batch.advantages * 1e25)
    huge_state, huge_metrics = jax.jit(step)(good_state, huge, None)
    assert np.isfinite(float(huge_metrics.loss)) and int(huge_metrics.skipped) == 1
    assert tree_max_diff(huge_state.params, good_state.params) == 0.0
    _, after = jax.jit(step)(good_state, batch, None)
    assert float(after.learning_rate) < 1e-2


@pytest.mark.slow
def test_build_batch_selects_and_normalizes_over_the_subset():
    prompt_ids, prompt_mask, tokens, mask, rewards = random_rollouts(4)
    config = paper_settings.method_config("pods", n=N, m=M)
    batch, idx = train_step.build_batch(prompt_ids, prompt_mask, tokens, mask, rewards, config)
    idx = np.asarray(idx)
    # The rows are the config's rule's choice (max_variance), not any M of them.
    np.testing.assert_array_equal(idx, np.asarray(selection.max_variance(jnp.asarray(rewards), M)))
    for p in range(P):
        rows = slice(p * M, (p + 1) * M)
        chosen = rewards[p, idx[p]]
        expected = (chosen - chosen.mean()) / (chosen.std(ddof=1) + 1e-4)
        np.testing.assert_allclose(np.asarray(batch.advantages[rows]), expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(batch.input_ids[rows, LP:]), tokens[p, idx[p]])
        np.testing.assert_array_equal(np.asarray(batch.input_ids[rows, :LP]), np.repeat(prompt_ids[p : p + 1], M, 0))
        np.testing.assert_array_equal(np.asarray(batch.completion_mask[rows]), mask[p, idx[p]].astype(np.float32))


@pytest.mark.parametrize("scaling, eps", [("none", 1e-4), ("batch", 0.5), ("group", 0.5)])
def test_build_batch_scales_advantages_as_configured(scaling, eps):
    prompt_ids, prompt_mask, tokens, mask, rewards = random_rollouts(5)
    config = paper_settings.method_config("pods", n=N, m=M, std_scaling=scaling, advantage_eps=eps)
    batch, idx = train_step.build_batch(prompt_ids, prompt_mask, tokens, mask, rewards, config)
    chosen = np.take_along_axis(rewards.astype(np.float64), np.asarray(idx), axis=1)
    centred = chosen - chosen.mean(axis=1, keepdims=True)
    scale = {"none": 1.0, "batch": chosen.std(ddof=1) + eps,
             "group": chosen.std(axis=1, ddof=1, keepdims=True) + eps}[scaling]
    np.testing.assert_allclose(np.asarray(batch.advantages), (centred / scale).ravel(), rtol=1e-5, atol=1e-6)


def test_build_batch_refuses_inputs_whose_shapes_disagree_in_one_line():
    # Too short completions had filled rows with int32's minimum; too few prompts had been
    # broadcast over every prompt's rewards; float ids had been truncated.
    config = algorithms.AlgorithmConfig(n=4, m=2, algorithm="pods")
    ids, tokens = jnp.ones((2, 2), jnp.int32), jnp.arange(24, dtype=jnp.int32).reshape(2, 4, 3)
    mask, rewards = jnp.ones((2, 4, 3), bool), jnp.array([[1.0, 0, 1, 0], [0, 0, 1, 1]])
    cases = [((ids, ids, tokens[:, :2], mask[:, :2], rewards), r"completion tokens must be \[P, N, T\] = \[2, 4, T\]"),
             ((ids, ids, tokens[:1], mask[:1], rewards), r"got shape \(1, 4, 3\)"),
             ((ids, ids, tokens + 0.5, mask, rewards), "completion tokens must be integer token ids; got dtype float32"),
             ((ids, ids, tokens, mask[..., :2], rewards), r"the completion mask must have shape \(2, 4, 3\)"),
             ((ids[:1], ids[:1], tokens, mask, rewards), r"prompt ids must be \[P, Lp\] with P = 2"),
             ((ids, ids[:, :1], tokens, mask, rewards), r"the prompt mask must have shape \(2, 2\)"),
             ((ids, ids, tokens, mask, rewards[0]), r"rewards must be \[P, N\]"),
             # A negative id had embedded the table's last rows; 2**32 + 7 had wrapped to 7.
             ((ids.at[1, 0].set(-3), ids, tokens, mask, rewards), r"prompt ids must be token ids in \[0, 2\*\*31\); got -3"),
             ((ids, ids, np.asarray(tokens, np.int64) + 2**32, mask, rewards),
              rf"completion tokens must be token ids in \[0, 2\*\*31\); got {2**32 + 23}")]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            train_step.build_batch(*args, config)
    with pytest.raises(ValueError, match=r"the sampler log-probs must have shape \(2, 4, 3\)"):
        train_step.build_batch(ids, ids, tokens, mask, rewards, config, logprobs_PNT=jnp.zeros((2, 4, 2)))
    batch, idx = train_step.build_batch(ids, ids, tokens, mask, rewards.tolist(), config)  # lists are arrays
    assert batch.input_ids.shape == (4, 5) and idx.shape == (2, 2) and int(batch.input_ids.min()) >= 0


def test_numpy_numbers_are_config_numbers():
    config = algorithms.AlgorithmConfig(n=np.int64(4), m=np.int32(2), algorithm="pods", learning_rate=np.float32(1e-3))
    assert (type(config.n), type(config.m), type(config.learning_rate)) == (int, int, float)
    assert config == algorithms.AlgorithmConfig(n=4, m=2, algorithm="pods", learning_rate=float(np.float32(1e-3)))
    hash(config)  # static under jit


def test_config_validation_errors():
    cases = [
        (dict(algorithm="grpo", n=8, m=4), "m must equal n"),
        (dict(algorithm="grpo-ga", n=16, m=4), "m must equal n \\(split the update into micro-batches"),
        (dict(algorithm="pods", n=4, m=8), "2 <= m <= n"),
        # A group of one had trained nothing for a whole run: loss and gradient 0 at every step.
        (dict(algorithm="pods", n=8, m=1), r"need 2 <= m <= n \(a group of one rollout has advantage 0"),
        (dict(algorithm="grpo", n=1, m=1), "need 2 <= m <= n"),
        (dict(algorithm="pods", n=8, m=4, rule="best"), "unknown selection rule 'best'"),
        (dict(algorithm="ppo"), "algorithm must be one of"),
        (dict(aggregation="sum"), "aggregation must be one of"),
        (dict(n="16", m=16), "n must be an integer; got '16'"),
        (dict(grad_accum=2.0), "grad_accum must be an integer"),
        (dict(learning_rate=float("inf")), "learning_rate must be finite"),
        (dict(beta=float("nan")), "beta must be finite"),
        (dict(temperature="hot"), "temperature must be a number"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-1), "top_k must be >= 0"),
        (dict(top_k=2.5), "top_k must be an integer"),
        (dict(epsilon_high=float("inf")), "epsilon_high must be finite"),
        (dict(weight_decay=-0.1), "weight_decay must be >= 0"),
        (dict(adam_b2=1.0), r"adam_b2 must be in \[0, 1\)"),
        (dict(advantage_eps=-1e-4), "advantage_eps must be >= 0"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            algorithms.AlgorithmConfig(**kwargs)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="unknown method"):
        paper_settings.method_config("dapo")


def test_the_update_takes_log_probs_at_logprob_temperature(model_and_params):
    # The authors' single-GPU trainer samples at 0.9 but takes the loss's log-probs at 1;
    # their 8-GPU trainer divides by the sampling temperature (logprob_temperature null).
    model, params = model_and_params
    common = dict(n=N, m=N, learning_rate=1e-2, max_grad_norm=1e6)
    batch, _ = train_step.build_batch(*random_rollouts(5), algorithms.AlgorithmConfig(algorithm="grpo", **common))

    def metrics(**fields):
        config = algorithms.AlgorithmConfig(algorithm="grpo", **common, **fields)
        step, state = full_ft(model, config, params)
        return jax.jit(step)(state, batch, None)[1]

    at_one = metrics(temperature=0.5, logprob_temperature=1.0)
    sampled_at_one = metrics(temperature=1.0)
    at_half = metrics(temperature=0.5)
    assert float(at_one.grad_norm) == pytest.approx(float(sampled_at_one.grad_norm), rel=1e-6)
    assert float(at_one.entropy) == pytest.approx(float(sampled_at_one.entropy), rel=1e-6)
    assert abs(float(at_half.grad_norm) - float(at_one.grad_norm)) > 1e-3 * float(at_one.grad_norm)
    with pytest.raises(ValueError, match="logprob_temperature must be > 0"):
        algorithms.AlgorithmConfig(logprob_temperature=0.0)
    # A subnormal float32, which XLA flushes to 0 and divides by: refused before anything loads.
    for field in ("temperature", "logprob_temperature"):
        with pytest.raises(ValueError, match=f"{field} must be > 0 \\(and at least 1.175e-38\\).*got 1e-39"):
            algorithms.AlgorithmConfig(**{field: 1e-39})


def test_build_batch_reads_a_nonzero_mask_as_a_real_token():
    # A float mask had been cast: 0.5 trained nothing, 2.0 doubled its token's weight.
    config = algorithms.AlgorithmConfig(n=2, m=2, algorithm="grpo")
    ids, tokens = jnp.ones((1, 2), jnp.int32), jnp.ones((1, 2, 3), jnp.int32)
    mask = jnp.array([[[0.5, 2.0, 0.0], [1.0, 1.0, 1.0]]])
    batch, _ = train_step.build_batch(ids, ids * 3, tokens, mask, jnp.array([[1.0, 0.0]]), config)
    np.testing.assert_array_equal(np.asarray(batch.completion_mask), [[1, 1, 0], [1, 1, 1]])
    np.testing.assert_array_equal(np.asarray(batch.attention_mask), [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
