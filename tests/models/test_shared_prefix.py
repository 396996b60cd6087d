"""The shared-prefix update (each prompt computed once for its rows) against the per-row update:
hidden states, log-probs, the loss, every gradient leaf and the params after a step, in fp32."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from podsjax.core import grpo
from podsjax.models.shared_prefix import PrefixDecoder
from podsjax.update import algorithms, train_step, update_forward
import podsjax.models as pm

pytestmark = pytest.mark.cpu_mesh

CONFIG = pm.ModelConfig(arch="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True, tie_word_embeddings=False)
P, N, M, LP, T = 3, 6, 4, 7, 6
EOS = 2
COMMON = dict(n=N, m=M, algorithm="pods", learning_rate=1e-3, max_grad_norm=1e6, epsilon=0.1)


@pytest.fixture(scope="module")
def params():
    return pm.init_params(pm.Decoder(CONFIG), jax.random.key(0))


def rollouts(seed=0):
    """Left-padded prompts of 5, 7 and 2 real tokens; completions of 1 to T tokens, ended by
    an EOS that counts, or masked out, or cut off at T."""
    rng = np.random.default_rng(seed)
    prompt_ids = rng.integers(3, 64, (P, LP)).astype(np.int32)
    prompt_mask = np.ones((P, LP), np.int32)
    prompt_mask[0, :2] = 0
    prompt_mask[2, :5] = 0
    prompt_ids[prompt_mask == 0] = 0
    tokens = rng.integers(3, 64, (P, N, T)).astype(np.int32)
    lengths = rng.integers(1, T + 1, (P, N))
    lengths[0, :3] = [1, T, 3]
    mask = np.arange(T) < lengths[..., None]
    for p in range(P):
        for n in range(N):
            if lengths[p, n] < T:
                tokens[p, n, lengths[p, n] - 1:] = EOS
    mask[1, 0, lengths[1, 0] - 1] = lengths[1, 0] == 1  # an EOS the loss leaves out (kept when it is alone)
    rewards = rng.integers(0, 2, (P, N)).astype(np.float32) + rng.normal(0, 0.1, (P, N)).astype(np.float32)
    return prompt_ids, prompt_mask, tokens, mask, rewards


def make_batch(seed=0, **fields):
    return train_step.build_batch(*rollouts(seed), algorithms.AlgorithmConfig(**COMMON, **fields))[0]


def close(a, b, rel=1e-5):
    """fp32 rounding of a computation in another order: within ``rel`` of the larger side's scale."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(float(np.max(np.abs(b))), 1e-6)
    np.testing.assert_allclose(a, b, rtol=0, atol=rel * scale)


def test_prefix_decoder_hidden_states_equal_the_rows_forward(params):
    model = pm.Decoder(CONFIG)
    batch = make_batch()
    t = batch.completion_length
    rows = model.apply({"params": params}, batch.input_ids, attention_mask=batch.attention_mask,
                       logits_slice=slice(-t - 1, -1), return_hidden=True)
    prompts = batch.input_ids[::M, :-t], batch.attention_mask[::M, :-t]
    shared = PrefixDecoder.of(model).apply({"params": params}, *prompts, batch.input_ids[:, -t:],
                                           batch.attention_mask[:, -t:])
    close(shared.hidden_BLD, rows.hidden_BLD)
    assert shared.hidden_BLD.shape == (P * M, T, CONFIG.hidden_size)
    with pytest.raises(ValueError, match="do not split evenly over 2 prompts"):
        PrefixDecoder.of(model).apply({"params": params}, *(x[:2] for x in prompts), batch.input_ids[:5, -t:],
                                      batch.attention_mask[:5, -t:])


def _loss_and_grads(model, trainable, frozen, batch, lora, shared, group_size=M):
    policy, _ = train_step.lora_apply_fn(model) if lora else train_step.full_apply_fn(model)
    config = algorithms.AlgorithmConfig(**COMMON).loss_config

    def loss(weights):
        if shared:
            fn = functools.partial(policy.shared_prefix, weights, frozen)
            logp, _ = train_step.shared_prefix_logprobs(fn, batch, 0.9, group_size)
        else:
            logp, _ = train_step.completion_logprobs(functools.partial(policy, weights, frozen), batch, 0.9)
        old = jax.lax.stop_gradient(logp) - 0.05 * batch.completion_mask  # a ratio off 1, so clipping has a say
        value, _ = grpo.grpo_loss(logp, batch.advantages, batch.completion_mask, config, old_logprobs_BL=old)
        return value, logp

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(trainable)


@pytest.mark.parametrize("lora,remat", [(False, "full"), (False, "none"), (True, "dots")])
def test_log_probs_loss_and_every_gradient_leaf_match_the_rows_update(params, lora, remat):
    model = pm.Decoder(CONFIG, remat=remat)
    batch = make_batch()
    if lora:
        trainable = pm.init_lora(jax.random.key(3), model, pm.LoraConfig(rank=4, alpha=8.0))
        # LoRA B starts at zero, where A's gradient is zero too: move B so every leaf has one.
        trainable = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(4), x.shape), trainable)
        frozen = params
    else:
        trainable, frozen = params, None
    (loss_rows, logp_rows), grads_rows = _loss_and_grads(model, trainable, frozen, batch, lora, shared=False)
    (loss_shared, logp_shared), grads_shared = _loss_and_grads(model, trainable, frozen, batch, lora, shared=True)
    mask = np.asarray(batch.completion_mask) > 0
    close(np.asarray(logp_shared)[mask], np.asarray(logp_rows)[mask])
    assert float(loss_shared) == pytest.approx(float(loss_rows), rel=1e-5, abs=1e-7)
    paths_rows, paths_shared = (jax.tree_util.tree_flatten_with_path(g)[0] for g in (grads_rows, grads_shared))
    assert [p for p, _ in paths_rows] == [p for p, _ in paths_shared]
    for (path, g_rows), (_, g_shared) in zip(paths_rows, paths_shared):
        assert float(jnp.max(jnp.abs(g_rows))) > 0, jax.tree_util.keystr(path)
        close(g_shared, g_rows, rel=2e-5)


def test_groups_cut_by_micro_batch_edges_share_a_prompt_within_each(params):
    # Six rows: a group of four and half of the next. Runs of gcd(6, 4) = 2 rows share a prompt.
    model = pm.Decoder(CONFIG)
    batch = make_batch()
    (_, logp_rows), _ = _loss_and_grads(model, params, None, batch, False, shared=False)
    six = jax.tree.map(lambda x: x[:6] if x.ndim else x, batch)
    (_, logp_six), _ = _loss_and_grads(model, params, None, six, False, shared=True)
    mask = np.asarray(six.completion_mask) > 0
    close(np.asarray(logp_six)[mask], np.asarray(logp_rows)[:6][mask])
    assert update_forward.prompt_rows(rows=6, group_size=4) == 2


def _step(params, batch, lora, shared, **fields):
    model = pm.Decoder(CONFIG)
    config = algorithms.AlgorithmConfig(**COMMON, shared_prefix=shared, **fields)
    optimizer = algorithms.make_optimizer(config)
    policy, reference = train_step.lora_apply_fn(model) if lora else train_step.full_apply_fn(model)
    if lora:
        trainable = pm.init_lora(jax.random.key(3), model, pm.LoraConfig(rank=4, alpha=8.0))
        trainable = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(4), x.shape), trainable)
        frozen = params
    else:
        trainable, frozen = params, (params if config.beta > 0 else None)
    step = train_step.make_train_step(policy, optimizer, config, reference)
    return jax.jit(step)(train_step.init_state(trainable, optimizer), batch, frozen)


@pytest.mark.slow
@pytest.mark.parametrize("lora,fields", [
    (False, dict(beta=0.04, steps_per_generation=2, grad_accum=2)),  # old log-probs recomputed, a KL
    (True, dict(beta=0.04, num_iterations=2)),  # the reference is the base with LoRA off
])
def test_a_train_step_matches_the_rows_update(params, lora, fields):
    batch = make_batch(1, **fields)
    rows_state, rows_metrics = _step(params, batch, lora, False, **fields)
    shared_state, shared_metrics = _step(params, batch, lora, True, **fields)
    for name in ("loss", "grad_norm", "kl_mean", "entropy", "clip_frac_low", "clip_frac_high", "num_tokens"):
        a, b = float(getattr(shared_metrics, name)), float(getattr(rows_metrics, name))
        assert a == pytest.approx(b, rel=2e-5, abs=1e-7), name
    assert float(rows_metrics.kl_mean) > 0
    # Adam's moments hold the gradients leaf by leaf; the params follow where the step is
    # well conditioned (a gradient near 0 turns float noise into a step of up to lr).
    for moment in ("mu", "nu"):
        for a, b in zip(*(jax.tree.leaves(optax.tree_utils.tree_get(s.opt_state, moment))
                          for s in (shared_state, rows_state))):
            close(a, b, rel=5e-5)
    mu = jax.tree.leaves(optax.tree_utils.tree_get(rows_state.opt_state, "mu"))
    for a, b, g in zip(jax.tree.leaves(shared_state.params), jax.tree.leaves(rows_state.params), mu):
        steady = np.abs(np.asarray(g)) > 1e-5 * float(jnp.max(jnp.abs(g)))
        np.testing.assert_allclose(np.asarray(a)[steady], np.asarray(b)[steady], rtol=0, atol=2e-6)
    assert max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(shared_state.params),
                                                                jax.tree.leaves(rows_state.params))) < 2e-3


def test_the_switch_is_validated_and_needs_the_shared_prefix_form(params):
    with pytest.raises(ValueError, match="shared_prefix must be true or false"):
        algorithms.AlgorithmConfig(shared_prefix="yes")
    config = algorithms.AlgorithmConfig(**COMMON, shared_prefix=True)
    policy, reference = train_step.full_apply_fn(pm.Decoder(CONFIG))
    optimizer = algorithms.make_optimizer(config)
    with pytest.raises(ValueError, match="shared_prefix needs the apply_fn in its shared-prefix form"):
        train_step.make_train_step(policy.rows, optimizer, config, reference)
    with pytest.raises(ValueError, match="shared_prefix needs the reference_fn"):
        train_step.make_train_step(policy, optimizer, dataclasses.replace(config, beta=0.04), reference.rows)
    # The per-row form stays the switch for batches laid out otherwise, and takes a plain function.
    train_step.make_train_step(policy.rows, optimizer, dataclasses.replace(config, shared_prefix=False), reference.rows)


@pytest.mark.parametrize("setting", [None, "a", "b", "e"])
def test_the_quick_start_and_the_paper_settings_update_each_prompt_once(tmp_path, setting):
    from experiments import flags

    argv = ["--out", str(tmp_path / "run")] + (["--setting", setting, "--model", str(tmp_path)] if setting else [])
    _, config = flags.parse("gsm8k", argv)
    assert config.algorithm.shared_prefix
    _, config = flags.parse("gsm8k", [*argv, "--algorithm.shared_prefix", "false"])
    assert not config.algorithm.shared_prefix


@pytest.mark.slow
def test_a_sharded_shared_prefix_step_equals_the_single_device_rows_step(params):
    # 3 prompts over a batch axis of 4 devices: the prompt rows do not divide the mesh.
    from podsjax.devices import mesh as mesh_lib

    batch = make_batch(2)
    rows_state, rows_metrics = _step(params, batch, False, False)
    mesh = mesh_lib.make_mesh("data=2,fsdp=2,tensor=2")
    model = pm.Decoder(CONFIG, mesh=mesh)
    sharded = jax.device_put(params, pm.param_shardings(model, mesh))
    config = algorithms.AlgorithmConfig(**COMMON, shared_prefix=True)
    optimizer = algorithms.make_optimizer(config)
    policy, reference = train_step.full_apply_fn(model)
    step = jax.jit(train_step.make_train_step(policy, optimizer, config, reference), donate_argnums=0)
    on_mesh = jax.tree.map(lambda x: jax.device_put(x, mesh_lib.batch_sharding(mesh, x.ndim)), batch)
    state, metrics = step(train_step.init_state(sharded, optimizer), on_mesh, None)
    assert float(metrics.loss) == pytest.approx(float(rows_metrics.loss), rel=2e-5, abs=1e-7)
    assert float(metrics.grad_norm) == pytest.approx(float(rows_metrics.grad_norm), rel=2e-5)
    for a, b in zip(*(jax.tree.leaves(optax.tree_utils.tree_get(s.opt_state, "mu")) for s in (state, rows_state))):
        close(a, b, rel=5e-5)


def _mixed_prompts(batch, row=1, other=M + 1):
    """``batch`` with one row's prompt swapped for another group's: its group's rows no longer share one."""
    prompt = slice(0, batch.input_ids.shape[1] - batch.completion_length)
    return batch.replace(input_ids=batch.input_ids.at[row, prompt].set(batch.input_ids[other, prompt]),
                         attention_mask=batch.attention_mask.at[row, prompt].set(batch.attention_mask[other, prompt]))


def test_mismatched_prompt_groups_counts_groups_whose_rows_hold_other_prompts():
    batch = make_batch()
    assert int(update_forward.mismatched_prompt_groups(batch, M)) == 0  # build_batch's layout
    assert int(update_forward.mismatched_prompt_groups(batch, M, micro_batches=6)) == 0  # runs of gcd(2, 4) rows
    assert int(update_forward.mismatched_prompt_groups(_mixed_prompts(batch), M)) == 1
    # Rows 1 and 3 swapped: one group of four, two of the runs of two that micro-batches of two rows read.
    two_rows = _mixed_prompts(_mixed_prompts(batch), 3, 2 * M)
    assert int(update_forward.mismatched_prompt_groups(two_rows, M)) == 1
    assert int(update_forward.mismatched_prompt_groups(two_rows, M, micro_batches=6)) == 2
    # A group size that does not match the layout: runs of 6 rows span two prompts.
    assert int(update_forward.mismatched_prompt_groups(batch, 6)) == 2
    # Ids under the prompt's padding are never read, so they may differ.
    padded = batch.replace(input_ids=batch.input_ids.at[1, 0].set(9))
    assert int(batch.attention_mask[1, 0]) == 0 and int(update_forward.mismatched_prompt_groups(padded, M)) == 0
    # The same tokens shifted under another padding are another prompt.
    shifted = batch.replace(attention_mask=batch.attention_mask.at[1, 2].set(0))
    assert int(update_forward.mismatched_prompt_groups(shifted, M)) == 1


def _full_step(params, shared):
    """A jitted full fine-tuning step and its initial state."""
    config = algorithms.AlgorithmConfig(**COMMON, shared_prefix=shared)
    optimizer = algorithms.make_optimizer(config)
    policy, reference = train_step.full_apply_fn(pm.Decoder(CONFIG))
    step = train_step.make_train_step(policy, optimizer, config, reference)
    return step, train_step.init_state(params, optimizer)


def test_a_batch_whose_groups_mix_prompts_is_refused_and_leaves_the_state_as_it_was(params):
    step, initial = _full_step(params, True)
    batch = _mixed_prompts(make_batch())
    state, metrics = jax.jit(step)(initial, batch, None)
    assert int(metrics.mismatched_prompt_groups) == 1
    assert int(state.step) == 0 and int(state.skipped_updates) == 0
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match=r"^1 prompt group\(s\) .* different prompts.* shared_prefix=False"):
        train_step.check_prompt_groups(jax.device_get(metrics))
    # build_batch's layout passes, in the same program.
    state, metrics = jax.jit(step)(initial, make_batch(), None)
    assert int(metrics.mismatched_prompt_groups) == 0 and int(state.step) == 1 and int(metrics.skipped) == 0
    train_step.check_prompt_groups(metrics)
    # Called without jit, the step raises before any work.
    with pytest.raises(ValueError, match="--algorithm.shared_prefix false"):
        step(initial, batch, None)


def test_the_per_row_update_trains_on_groups_of_distinct_prompts(params):
    step, initial = _full_step(params, False)
    state, metrics = jax.jit(step)(initial, _mixed_prompts(make_batch()), None)
    assert metrics.mismatched_prompt_groups is None and int(state.step) == 1 and int(metrics.skipped) == 0
    train_step.check_prompt_groups(metrics)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(params)))
