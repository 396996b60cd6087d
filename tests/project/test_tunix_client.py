"""PODS inside tunix's GRPOLearner (examples/tunix_pods.py), on tunix's toy model.

The test extra installs google-tunix; under CI its absence is a failure, not a skip.
"""

import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

if not os.environ.get("CI"):
    pytest.importorskip("tunix")

from flax import nnx  # noqa: E402
from tunix.rl import algo_core  # noqa: E402
from tunix.rl import common as tunix_common  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.tests import test_common  # noqa: E402

from examples import tunix_pods  # noqa: E402

PROMPTS = ["input string", "hello world", "My name", "hello there"]
G, M = 8, 4


def batches(size):
    return [{"prompts": np.array(PROMPTS[i:i + size]), "answer": np.array(PROMPTS[i:i + size])}
            for i in range(0, len(PROMPTS), size)]


def subsequence_rows(kept_ids, full_ids):
    """Rows of ``full_ids`` that ``kept_ids`` takes, matched in order (equal rows match the first free one)."""
    rows, start = [], 0
    for kept_row in kept_ids:
        start = next(r for r in range(start, len(full_ids)) if np.array_equal(full_ids[r], kept_row)) + 1
        rows.append(start - 1)
    return np.asarray(rows)


def max_subset_variance(rewards, m):
    return max(np.var(rewards[list(c)]) for c in itertools.combinations(range(len(rewards)), m))


def train_recording(monkeypatch, cluster, batch_size):
    """Trains a PodsGRPOLearner; returns (tunix's full examples and rewards, kept examples, updates)."""
    full, updates = [], []
    original = grpo_learner.GRPOLearner._generate_and_compute_advantage

    def record_full(self, training_input, mode=tunix_pods.rl_cluster_lib.Mode.TRAIN):
        example = original(self, training_input, mode)
        full.append((example, np.asarray(self._scored_rewards)))
        return example

    monkeypatch.setattr(grpo_learner.GRPOLearner, "_generate_and_compute_advantage", record_full)
    update_actor = cluster.update_actor
    cluster.update_actor = lambda train_ds, *args: (updates.append(train_ds), update_actor(train_ds, *args))[1]
    learner = tunix_pods.PodsGRPOLearner(
        rl_cluster=cluster,
        algo_config=grpo_learner.GRPOConfig(num_generations=G, num_iterations=1, beta=0.04),
        reward_fns=tunix_pods.length_reward,
        num_selected=M,
    )
    learner.train(batches(batch_size))
    return full, updates


def test_the_learner_trains_on_the_max_variance_rows_with_tunix_advantages(monkeypatch):
    cluster = tunix_pods.toy_cluster(max_steps=2)
    before = jax.tree.map(jnp.copy, nnx.state(cluster.actor_trainer.model, nnx.Param))
    full, updates = train_recording(monkeypatch, cluster, batch_size=2)

    assert len(full) == 2 and len(updates) == 2
    for (example, rewards), [kept] in zip(full, updates):
        assert example.completion_ids.shape[0] == 2 * G and kept.completion_ids.shape[0] == 2 * M
        ids = np.concatenate([np.asarray(example.prompt_ids), np.asarray(example.completion_ids)], axis=1)
        kept_ids = np.concatenate([np.asarray(kept.prompt_ids), np.asarray(kept.completion_ids)], axis=1)
        rows = subsequence_rows(kept_ids, ids)
        assert (rows // G == np.repeat(np.arange(2), M)).all()  # M rows from each prompt, in order
        kept_rewards = rewards[rows].astype(np.float64)
        for p in range(2):
            group = kept_rewards[p * M:(p + 1) * M]
            best = max_subset_variance(rewards[p * G:(p + 1) * G].astype(np.float64), M)
            assert np.var(group) == pytest.approx(best, abs=1e-9)
        # tunix's own estimator over the kept subset, as if G were M.
        expected = algo_core.compute_advantages(rewards[rows], num_generations=M)
        np.testing.assert_allclose(np.asarray(kept.advantages), expected, rtol=1e-6, atol=1e-6)
        # Every per-row field followed its row.
        np.testing.assert_array_equal(np.asarray(kept.completion_mask), np.asarray(example.completion_mask)[rows])
        np.testing.assert_array_equal(np.asarray(kept.ref_per_token_logps),
                                      np.asarray(example.ref_per_token_logps)[rows])

    after = nnx.state(cluster.actor_trainer.model, nnx.Param)
    changed = jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.any(a != b)), before, after))
    assert any(changed), "the update did not move the policy"


def test_merged_micro_batches_split_back_by_kept_rows(monkeypatch):
    # Rollouts run on 4 prompts at once, the update in 2 micro-batches of 2 prompts: tunix
    # merges them, generates, then splits by 2*G rows each, where PODS left 2*M.
    cluster = tunix_pods.toy_cluster(max_steps=1, mini_batch_size=4, train_micro_batch_size=2,
                                     rollout_micro_batch_size=4)
    full, updates = train_recording(monkeypatch, cluster, batch_size=4)
    assert len(full) == 1 and full[0][0].completion_ids.shape[0] == 4 * G
    assert [[example.completion_ids.shape[0] for example in update] for update in updates] == [[2 * M], [2 * M]]


@pytest.mark.parametrize("mode", ["token-mean", "sequence-mean-token-mean", "sequence-mean-token-scale",
                                  "seq-mean-token-sum", "sequence-mean-token-sum-norm"])
def test_masking_dropped_rows_equals_dropping_them_in_tunix_loss(mode):
    vocab = test_common.MockVocab()
    model = test_common.ToyTransformer(config=test_common.ModelConfig(vocab_size=vocab.GetPieceSize()),
                                       rngs=nnx.Rngs(0))
    config = grpo_learner.GRPOConfig(num_generations=G, beta=0.04, loss_agg_mode=mode)
    config.temperature = 1.0
    rng = np.random.default_rng(0)
    rows_R = 2 * G
    rewards = rng.integers(0, 3, rows_R).astype(np.float32)
    rows, advantages = tunix_pods.pods_rows(jnp.asarray(rewards), "max_variance", G, M)
    completion_mask = jnp.asarray(rng.uniform(size=(rows_R, 5)) < 0.8).at[:, 0].set(True)
    example = tunix_common.TrainExample(
        prompt_ids=jnp.asarray(rng.integers(3, vocab.GetPieceSize(), (rows_R, 4))),
        prompt_mask=jnp.ones((rows_R, 4), bool),
        completion_ids=jnp.asarray(rng.integers(3, vocab.GetPieceSize(), (rows_R, 5))),
        completion_mask=completion_mask,
        advantages=jnp.zeros(rows_R).at[rows].set(advantages),
        ref_per_token_logps=jnp.asarray(-rng.uniform(1, 4, (rows_R, 5)), jnp.float32),
        old_per_token_logps=None,
    )
    keep = jnp.zeros(rows_R, bool).at[rows].set(True)
    masked = example.replace(completion_mask=example.completion_mask & keep[:, None])
    dropped = jax.tree.map(lambda field: field[rows], example).replace(advantages=advantages)
    loss_masked, _ = algo_core.grpo_loss_fn(model, masked, config, pad_id=0, eos_id=2)
    loss_dropped, _ = algo_core.grpo_loss_fn(model, dropped, config, pad_id=0, eos_id=2)
    assert float(loss_dropped) != 0.0
    np.testing.assert_allclose(float(loss_masked), float(loss_dropped), rtol=1e-5)


def test_num_selected_out_of_range_is_one_line_error():
    cluster = tunix_pods.toy_cluster(max_steps=1)
    with pytest.raises(ValueError, match=r"num_selected must be in \[1, num_generations=8\]; got 9"):
        tunix_pods.PodsGRPOLearner(rl_cluster=cluster, algo_config=grpo_learner.GRPOConfig(num_generations=G),
                                   reward_fns=tunix_pods.length_reward, num_selected=9)
