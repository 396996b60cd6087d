"""The jitted programs of one RL step besides generation: the first state, the batch, the update.

The Trainer runs them and ``--dry-run`` (``podsjax.devices.dry_run``) compiles the same ones ahead of
time, on the same state built the same way, so the plan's figures are the run's. The programs
themselves are :mod:`podsjax.update.update_programs` (below the loop, so ``dry_run`` needs no loop
module); this module adds what the loop's :class:`RunConfig` decides: the rows, the prompt
length and the random streams.
"""

from __future__ import annotations

from podsjax.data import prompts as prompts_lib
from podsjax.rl.run_config import RunConfig
from podsjax.update import algorithms
from podsjax.update.update_programs import (LORA_INIT_STREAM, abstract_batch, abstract_state, batch_program, batch_shardings, policy_copy_program, start_weights, state_program, update_program)

# Streams folded into ``jax.random.key(seed)``, so each use of randomness draws its own keys
# (the adapters' LORA_INIT_STREAM, 1, is in podsjax.update.update_programs).
EVAL_STREAM = 2
# A step's rollouts draw from key(seed + ROLLOUT_SEED_OFFSET) folded with the step, and its
# selection from that key folded with SELECTION_STREAM.
ROLLOUT_SEED_OFFSET = 1
SELECTION_STREAM = 7
# Dynamic sampling's later draws of a step fold the step's key with this, then the draw's index.
SAMPLING_ROUND_STREAM = 8


def prompt_rows(run_config: RunConfig, algo: algorithms.AlgorithmConfig) -> int:
    """Prompt rows one step generates for: each prompt once per group (``groups_per_prompt``)."""
    return run_config.prompts_per_step * algo.groups_per_prompt


def padded_prompt_length(run_config: RunConfig) -> int:
    """The longest padded prompt a step can see: the largest prompt bucket."""
    return max(prompts_lib.Bucketing().lengths(run_config.max_prompt_length))
