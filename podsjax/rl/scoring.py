"""A step's rollouts scored on every host, and the reward scalars a step logs."""

from __future__ import annotations

import numpy as np

from podsjax.data import datasets as data_lib
from podsjax.data import prompts as prompts_lib
from podsjax.devices import hosts
from podsjax.rl.dynamic_sampling import zero_variance
from podsjax.rl.step_data import Scored


def score_rollouts(tokenizer, scorer, rewards, examples, n: int, start: int, tokens, mask, truncated) -> Scored:
    """Scores this process's rollout rows (global rows ``start`` on) and gathers every host's.

    Returns the whole step's per-row rewards, lengths and truncation flags, and the scorer's
    failure counts summed over hosts.
    """
    end = start + len(tokens)
    completions = prompts_lib.decode_completions(tokenizer, tokens, mask)
    columns = {name: values[start:end] for name, values in data_lib.reward_columns(examples, n).items()}
    scores = scorer.score(completions, rewards, **columns)
    rows = {"total": np.asarray(scores.total_B, np.float32), "length": mask.sum(1).astype(np.int32),
            "truncated": np.asarray(truncated, np.float32),
            **{f"reward/{k}": np.asarray(v, np.float32) for k, v in scores.per_function.items()}}
    scored = hosts.gather_rows(start, rows, len(examples) * n)
    counts = {k: v for k, v in scores.metrics.items() if k.endswith(("timeouts", "crashes", "errors", "restarts"))}
    return Scored(scored.pop("total"), scored.pop("length"), scored.pop("truncated"), per_function=scored,
                  failures={k: float(v) for k, v in hosts.sum_over_processes(counts).items()})


def reward_stats(scored: Scored, rewards_PN: np.ndarray, selected_PN: np.ndarray) -> dict[str, float]:
    """The step's reward scalars: over all rollouts, over the selected ones, and per reward function.

    ``reward/zero_std_groups`` is the fraction of groups whose n rewards all agree (no
    advantage anywhere), ``reward/zero_std_groups_selected`` the same over the m each kept.
    """
    out = {"reward/mean": float(rewards_PN.mean()), "reward/std": float(rewards_PN.std()),
           "reward/selected_mean": float(rewards_PN[selected_PN].mean()),
           "reward/selected_std": float(rewards_PN[selected_PN].std()),
           "reward/zero_std_groups": float(np.mean(zero_variance(rewards_PN))),
           # each group keeps the same count m, so the kept rewards are [P, m]
           "reward/zero_std_groups_selected": float(np.mean(zero_variance(
               rewards_PN[selected_PN].reshape(len(rewards_PN), -1))))}
    for name, values in scored.per_function.items():
        values_PN = values.reshape(rewards_PN.shape)
        out[name] = float(values_PN.mean())
        out[f"{name}_selected"] = float(values_PN[selected_PN].mean())
    out.update({name: float(count) for name, count in scored.failures.items()})
    return out


def length_stats(scored: Scored) -> dict[str, float]:
    """Completion lengths of every rollout of the step, as TRL and verl report them."""
    length, truncated = scored.length, scored.truncated > 0
    terminated = length[~truncated]
    return {"completion/length_mean": float(length.mean()), "completion/length_min": float(length.min()),
            "completion/length_max": float(length.max()), "completion/truncated_frac": float(truncated.mean()),
            "completion/terminated_length_mean": float(terminated.mean()) if terminated.size else float("nan")}
