"""What one RL step carries from phase to phase: a draw, its scores, the step's result."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from podsjax.data import prompts as prompts_lib


@dataclasses.dataclass(frozen=True)
class Draw:
    """One draw of prompts and their rollouts.

    Attributes:
        examples: the P examples drawn, in order.
        prompts: their templated, padded prompt batch.
        skipped: prompts skipped because they did not fit (``PromptSource.draw``).
        ids, prompt_mask: ``prompts``' ids and mask [P, L], placed as generation's rows.
        rollouts: the generator's rollouts of the P prompts, n each.
    """

    examples: list
    prompts: prompts_lib.PromptBatch
    skipped: int
    ids: Any
    prompt_mask: Any
    rollouts: Any


@dataclasses.dataclass(frozen=True)
class Scored:
    """The rewards of every rollout of a draw (all hosts' rows), one entry per row.

    Attributes:
        total: [B] the weighted reward sum.
        length: [B] completion tokens.
        truncated: [B] 1.0 where a completion hit ``max_new_tokens``.
        per_function: ``"reward/<function>"`` -> [B] that function's reward.
        failures: the scorer's failure counts (``"reward/timeouts"`` ...), summed over hosts.
    """

    total: np.ndarray
    length: np.ndarray
    truncated: np.ndarray
    per_function: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    failures: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class StepResult:
    """One RL step, as the loop's hooks receive it.

    Attributes:
        step: RL steps taken, this one included.
        scalars: the step's metrics (``train/*``, ``reward/*``, ``time/*``, ``perf/*`` ...).
        histograms: per-row values to log as histograms (``reward/total``,
            ``train/advantages``); empty unless a log backend draws them.
    """

    step: int
    scalars: dict[str, float]
    histograms: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
