"""PODS inside tunix's GRPOLearner: generate G rollouts per prompt, train on the m with the
largest reward variance.

Written against google-tunix 0.1.7 (its learner's private hooks change between releases).
What each override works around is in docs/tunix.md. Run it from the root of a clone,
``python -m examples.tunix_pods``, for a few steps on tunix's toy model and mock vocabulary.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner

# tunix.rl.grpo is also called grpo: name ours apart.
from podsjax.core import grpo as pods_grpo
from podsjax.core import selection

TUNIX_EPS = 1e-6  # tunix's own GRPO advantages: (r - mean) / (std(ddof=1) + 1e-6)


@functools.partial(jax.jit, static_argnames=("rule", "n", "m"))
def pods_rows(rewards_R: jax.Array, rule: str, n: int, m: int) -> tuple[jax.Array, jax.Array]:
    """Flat rows to train on, in their original order, and their advantages over the kept subset.

    Args:
      rewards_R: [P*n] rewards, prompt after prompt.

    Returns:
      (int32 rows [P*m], float32 advantages [P*m]).
    """
    rows = selection.select_flat(rule, rewards_R, n, m, in_position_order=True)
    advantages = pods_grpo.group_advantages(rewards_R[rows].reshape(-1, m), eps=TUNIX_EPS, ddof=1)
    return rows, advantages.reshape(-1)


class PodsGRPOLearner(grpo_learner.GRPOLearner):
    """GRPOLearner that trains on ``num_selected`` of each prompt's ``num_generations`` rollouts.

    Evaluation keeps every rollout, as plain GRPO does.
    """

    def __init__(self, *args, num_selected: int, rule: str = "max_variance", **kwargs):
        super().__init__(*args, **kwargs)
        num_generations = self.algo_config.num_generations
        if not 1 <= num_selected <= num_generations:
            raise ValueError(f"num_selected must be in [1, num_generations={num_generations}]; got {num_selected}")
        selection.get_rule(rule)  # an unknown rule fails here, not at the first step
        self.num_selected = num_selected
        self.rule = rule
        self._scored_rewards = None

    def _compute_rewards(self, *args, **kwargs):
        # The TrainExample tunix builds carries advantages only: keep the rewards it scored.
        self._scored_rewards = super()._compute_rewards(*args, **kwargs)
        return self._scored_rewards

    def _generate_and_compute_advantage(self, training_input, mode=rl_cluster_lib.Mode.TRAIN):
        example = super()._generate_and_compute_advantage(training_input, mode)
        if mode != rl_cluster_lib.Mode.TRAIN:
            return example
        rewards_R = np.asarray(self._scored_rewards, np.float32)
        rows, advantages = pods_rows(rewards_R, self.rule, self.algo_config.num_generations, self.num_selected)
        # Every field of a TrainExample is [P*G, ...] (or None): gather the kept rows.
        kept = jax.tree.map(lambda field: field[rows], example)
        return kept.replace(advantages=advantages)

    def _process_accumulated_batches(self, micro_batches, micro_batch_sizes, mode):
        # tunix splits the merged batch back by P*G rows per micro-batch; after selection
        # each holds P*m.
        if mode == rl_cluster_lib.Mode.TRAIN:
            num_generations = self.algo_config.num_generations
            micro_batch_sizes = [size // num_generations * self.num_selected for size in micro_batch_sizes]
        return super()._process_accumulated_batches(
            micro_batches=micro_batches, micro_batch_sizes=micro_batch_sizes, mode=mode)


def toy_cluster(*, max_steps: int, mini_batch_size: int | None = None, train_micro_batch_size: int | None = None,
                rollout_micro_batch_size: int | None = None, beta_reference: bool = True):
    """An RLCluster on tunix's toy transformer and mock vocabulary (both ship in its wheel), one device."""
    import optax
    from flax import nnx
    from jax.sharding import Mesh
    from tunix.rl.rollout import base_rollout
    from tunix.tests import test_common

    vocab = test_common.MockVocab()
    config = test_common.ModelConfig(vocab_size=vocab.GetPieceSize())
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    roles = (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE, rl_cluster_lib.Role.ROLLOUT)
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={role: mesh for role in roles},
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optax.sgd(1e-2),
            eval_every_n_steps=10**6,
            max_steps=max_steps,
            mini_batch_size=mini_batch_size,
            train_micro_batch_size=train_micro_batch_size,
            rollout_micro_batch_size=rollout_micro_batch_size,
        ),
        rollout_config=base_rollout.RolloutConfig(max_tokens_to_generate=6, max_prompt_length=8, kv_cache_size=32),
    )
    return rl_cluster_lib.RLCluster(
        actor=test_common.ToyTransformer(config=config, rngs=nnx.Rngs(0)),
        reference=test_common.ToyTransformer(config=config, rngs=nnx.Rngs(0)) if beta_reference else None,
        tokenizer=vocab,
        cluster_config=cluster_config,
    )


def length_reward(prompts, completions, **kwargs):
    """A toy reward with spread among the toy model's completions: their length in characters, mod 5."""
    return [float(len(completion) % 5) for completion in completions]


def main():
    prompts = ["input string", "hello world", "My name", "hello there"]
    cluster = toy_cluster(max_steps=2)
    learner = PodsGRPOLearner(
        rl_cluster=cluster,
        algo_config=grpo_learner.GRPOConfig(num_generations=8, num_iterations=1, beta=0.04),
        reward_fns=length_reward,
        num_selected=4,
    )
    batches = [{"prompts": np.array(prompts[i:i + 2]), "answer": np.array(prompts[i:i + 2])} for i in (0, 2)]
    learner.train(batches)
    print(f"trained {cluster.actor_trainer.train_steps} steps on 4 of 8 rollouts per prompt")


if __name__ == "__main__":
    main()
