"""Verifiable rewards, scored on the host.

Every reward function has one signature::

    fn(completions: list[str], **columns) -> list[float]

``completions`` holds B decoded completions and each dataset column arrives as a
list of B values; the gold answer is in ``answer``. Functions ignore columns they
do not use (``**_``). Combine them with weights through ``WeightedReward`` and
score with ``score_rewards`` (in process) or ``RewardPool.score`` (worker
processes, per-item timeouts, crash recovery).
"""

from podsjax.rewards.chemistry_grader import chemistry_accuracy, extract_chemistry_answer, parse_quantity
from podsjax.rewards.combine import (
    TASK_REWARD_NAMES,
    RewardScores,
    WeightedReward,
    as_weighted,
    default_rewards,
    get_reward,
    register_reward,
    score_rewards,
)
from podsjax.rewards.format import (
    follows_format,
    format_correct,
    format_reward,
    format_score,
    format_score_reward,
    strict_format_reward,
    tag_count_reward,
)
from podsjax.rewards.gsm8k_grader import extract_gsm8k_answer, gsm8k_accuracy, parse_gsm8k_gold
from podsjax.rewards.mathverify import math_accuracy, math_gold
from podsjax.rewards.pool import PoolConfig, RewardPool, RewardPoolError
from podsjax.rewards.text import extract_answer_tag, last_boxed

__all__ = [
    "TASK_REWARD_NAMES",
    "PoolConfig",
    "RewardPool",
    "RewardPoolError",
    "RewardScores",
    "WeightedReward",
    "as_weighted",
    "chemistry_accuracy",
    "default_rewards",
    "extract_answer_tag",
    "extract_chemistry_answer",
    "extract_gsm8k_answer",
    "follows_format",
    "format_correct",
    "format_reward",
    "format_score",
    "format_score_reward",
    "get_reward",
    "gsm8k_accuracy",
    "last_boxed",
    "math_accuracy",
    "math_gold",
    "parse_gsm8k_gold",
    "parse_quantity",
    "register_reward",
    "score_rewards",
    "strict_format_reward",
    "tag_count_reward",
]
