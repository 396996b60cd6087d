"""Weighted sums of reward functions, a name registry, and in-process scoring.

Every reward function has one signature::

    fn(completions: list[str], **columns) -> list[float]

``completions`` holds B decoded completions; each dataset column arrives as a
list of B values (the gold answer is in ``answer``). A function must accept
(and may ignore) columns it does not use, so write it with ``**_``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import time
from typing import Any, Callable, Mapping, Sequence, Union

import numpy as np

from podsjax.rewards import authors
from podsjax.rewards.chemistry_grader import chemistry_accuracy
from podsjax.rewards.format import format_reward, format_score_reward, strict_format_reward, tag_count_reward
from podsjax.rewards.gsm8k_grader import gsm8k_accuracy
from podsjax.rewards.mathverify import math_accuracy
from podsjax.rewards.text import texts

RewardFn = Callable[..., Sequence[float]]

_REGISTRY: dict[str, RewardFn] = {
    "gsm8k_accuracy": gsm8k_accuracy,
    "math_accuracy": math_accuracy,
    "chemistry_accuracy": chemistry_accuracy,
    "format": format_reward,
    "format_score": format_score_reward,
    "tag_count": tag_count_reward,
    "strict_format": strict_format_reward,
    "authors_gsm8k_accuracy": authors.authors_gsm8k_accuracy,
    "authors_math_accuracy": authors.authors_math_accuracy,
    "llama_gsm8k_accuracy": authors.llama_gsm8k_accuracy,
    "llama_math_accuracy": authors.llama_math_accuracy,
    "r1_accuracy": authors.r1_accuracy,
    "r1_format": authors.r1_format_reward,
    "r1_tag_count": authors.r1_tag_count_reward,
}
# Each task's accuracy reward; the loop reads its breakdown entry "accuracy" as the eval metric.
TASK_ACCURACY: dict[str, RewardFn] = {
    "gsm8k": gsm8k_accuracy,
    "math": math_accuracy,
    "chemistry": chemistry_accuracy,
}
# The families of (accuracy, format, tag count) rewards, by ``format_style``:
# "exact": the task's accuracy, 1 for exactly <think>..</think><answer>..</answer>, 0.25 a tag;
# "score": the same with the authors' soft format score (format.format_score);
# "authors-release": the authors' single-GPU release (settings a, c, d): their grader,
#   and the 0.1-scale format and 0.025-a-tag rewards for wrong answers only;
# "authors-llama": their Llama commit (setting b): their grader with that commit's last
#   number (digits, dots and commas), "score" otherwise;
# "open-r1": the 8-GPU runs (e, f): LaTeX-only math-verify accuracy, newline-exact format and tags.
FORMAT_STYLES = ("exact", "score", "authors-release", "authors-llama", "open-r1")
# Each task's accuracy as the authors' single-GPU code grades it: their grade_answer on GSM8K
# and MATH; chemistry by SciBench's rule (they published no chemistry code).
AUTHORS_ACCURACY: dict[str, RewardFn] = {
    "gsm8k": authors.authors_gsm8k_accuracy,
    "math": authors.authors_math_accuracy,
    "chemistry": chemistry_accuracy,
}
# The same as their Llama commit 0c453d2 grades: its own last-number extractor.
LLAMA_ACCURACY: dict[str, RewardFn] = {
    "gsm8k": authors.llama_gsm8k_accuracy,
    "math": authors.llama_math_accuracy,
    "chemistry": chemistry_accuracy,
}


def _style_rewards(task: str, style: str) -> tuple[RewardFn, RewardFn, RewardFn]:
    if style == "exact":
        return TASK_ACCURACY[task], format_reward, tag_count_reward
    if style == "score":
        return TASK_ACCURACY[task], format_score_reward, tag_count_reward
    if style == "authors-llama":
        return LLAMA_ACCURACY[task], format_score_reward, tag_count_reward
    if style == "authors-release":
        accuracy = AUTHORS_ACCURACY[task]
        return (accuracy, functools.partial(authors.release_format_reward, accuracy=accuracy),
                functools.partial(authors.release_tag_count_reward, accuracy=accuracy))
    return authors.r1_accuracy, authors.r1_format_reward, authors.r1_tag_count_reward


def register_reward(name: str, fn: RewardFn) -> None:
    """Adds ``fn`` to the registry under ``name`` (replacing any previous entry).

    A function used with ``RewardPool`` must be importable by its module and
    name in a fresh process: define it at module level.
    """
    if not callable(fn):
        raise TypeError(f"reward {name!r} is not callable: {fn!r}")
    _REGISTRY[name] = fn


def get_reward(name: str) -> RewardFn:
    """The reward function called ``name``: a registered name, or ``"package.module:function"``.

    A ``module:function`` is imported here, and again by each ``RewardPool`` worker, so it
    must be importable from the working directory or the installed packages.
    """
    if name in _REGISTRY:
        return _REGISTRY[name]
    module_name, colon, attribute = name.partition(":")
    if not colon:
        raise KeyError(f"unknown reward {name!r}; known: {sorted(_REGISTRY)}, or give package.module:function")
    try:
        fn = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise KeyError(f"reward {name!r} cannot be imported ({type(exc).__name__}: {exc})") from None
    if not callable(fn):
        raise KeyError(f"reward {name!r} is not a function")
    return fn


def _fn_name(fn: Callable[..., Any]) -> str:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", type(fn).__name__)


@dataclasses.dataclass(frozen=True)
class WeightedReward:
    """One reward function, its weight in the total, and its name in the breakdown.

    Attributes:
        fn: a reward function (see the module docstring), or a registered name.
        weight: its weight in the total reward; 0 keeps it as a logged metric only.
        name: the key in breakdowns and metrics; defaults to the registered name
            or the function's ``__name__``.
    """

    fn: RewardFn
    weight: float = 1.0
    name: str = ""

    def __post_init__(self):
        registered = self.fn if isinstance(self.fn, str) else ""
        fn = get_reward(registered) if registered else self.fn
        if not callable(fn):
            raise TypeError(f"reward function must be callable, got {fn!r}")
        object.__setattr__(self, "fn", fn)
        if isinstance(self.weight, (bool, str)) or not isinstance(self.weight, (int, float, np.number)) \
                or not math.isfinite(self.weight):  # float("2") would pass, None and "abc" fail inside float()
            raise ValueError(f"reward weight must be a finite number, got {self.weight!r}")
        weight = float(self.weight)
        object.__setattr__(self, "weight", weight)
        object.__setattr__(self, "name", self.name or registered or _fn_name(fn))


RewardsLike = Union[
    WeightedReward,
    RewardFn,
    str,
    Sequence[Union[WeightedReward, RewardFn, str, tuple]],
    Mapping[Union[str, RewardFn], float],
]


def as_weighted(rewards: RewardsLike) -> tuple[WeightedReward, ...]:
    """Normalizes reward specs into a tuple of WeightedReward.

    Accepts a WeightedReward, a function, a registered name, a ``(fn_or_name,
    weight)`` pair, a list of any of these, or a mapping ``{fn_or_name: weight}``.
    Names must be unique.
    """
    if isinstance(rewards, Mapping):
        items = [WeightedReward(fn, weight) for fn, weight in rewards.items()]
    elif isinstance(rewards, (WeightedReward, str)) or callable(rewards):
        items = [rewards if isinstance(rewards, WeightedReward) else WeightedReward(rewards)]
    elif isinstance(rewards, tuple) and len(rewards) == 2 and isinstance(rewards[1], (int, float)):
        items = [WeightedReward(*rewards)]
    else:
        items = []
        for spec in rewards:
            if isinstance(spec, WeightedReward):
                items.append(spec)
            elif isinstance(spec, tuple):
                items.append(WeightedReward(*spec))
            else:
                items.append(WeightedReward(spec))
    if not items:
        raise ValueError("no reward functions given")
    names = [item.name for item in items]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"reward names must be unique; repeated: {duplicates} (set WeightedReward.name)")
    return tuple(items)


# The names default_rewards gives the task's own rewards, also its keyword weights.
TASK_REWARD_NAMES = ("accuracy", "format", "tag_count")


def default_rewards(task: str, *, accuracy: float = 1.0, format: float = 1.0, tag_count: float = 1.0,
                    format_style: str = "exact"):
    """The paper's reward for a task: accuracy + format + tag count, weighted.

    The defaults weigh podsjax's exact format and tag count 1/1/1; each paper setting's
    family and weights are in ``experiments.paper_settings`` (``format_style`` "authors-release",
    "authors-llama" or "open-r1").

    Args:
        task: "gsm8k", "math" or "chemistry".
        accuracy, format, tag_count: the weights.
        format_style: the family of rewards, one of :data:`FORMAT_STYLES`.

    Returns:
        A tuple of WeightedReward for ``score_rewards`` or ``RewardPool.score``, named
        "accuracy", "format" and "tag_count" in breakdowns.
    """
    if task not in TASK_ACCURACY:
        raise ValueError(f"unknown task {task!r}; expected one of {sorted(TASK_ACCURACY)}")
    if format_style not in FORMAT_STYLES:
        raise ValueError(f"unknown format_style {format_style!r}; expected one of {list(FORMAT_STYLES)}")
    functions = _style_rewards(task, format_style)
    weights = (accuracy, format, tag_count)
    return tuple(WeightedReward(f, w, name) for f, w, name in zip(functions, weights, TASK_REWARD_NAMES))


@dataclasses.dataclass(frozen=True)
class RewardScores:
    """Rewards of one batch of completions, in input order.

    Attributes:
        total_B: float32 [B], the weighted sum over reward functions.
        per_function: name -> float32 [B], each function's unweighted values.
        failed_B: bool [B], items where some function timed out, crashed or raised
            (their failing functions count as 0).
        metrics: how the scoring went: item counts ``reward/timeouts``, ``reward/crashes``,
            ``reward/memory_errors``, ``reward/errors``, plus ``reward/restarts`` (workers
            replaced) and ``reward/seconds``. Reward means are the caller's to take, over
            whatever rows it groups (a step's, a selection's, every host's).
    """

    total_B: np.ndarray
    per_function: dict[str, np.ndarray]
    failed_B: np.ndarray
    metrics: dict[str, float]


def as_batch(completions: Sequence[str], columns: Mapping[str, Sequence[Any]]) -> list[str]:
    """The completions as a list of texts, each column one entry per completion
    (:func:`podsjax.rewards.text.texts`): one text or a text column would otherwise be split
    into characters, each scored as an item."""
    return texts(None, completions, columns, missing_ok=False)


def summarize(
    weighted: Sequence[WeightedReward], values_FB: np.ndarray, failed_B: np.ndarray, counts: Mapping[str, int],
    seconds: float,
) -> RewardScores:
    """Builds RewardScores from a [F, B] value matrix; shared by the pool and the in-process path."""
    # A NaN or inf reward would poison the advantages of its whole group: it scores 0 and
    # counts as an error of its item. So does one past float32's range, where rewards are kept.
    with np.errstate(over="ignore"):
        non_finite_FB = ~np.isfinite(values_FB.astype(np.float32))
    if non_finite_FB.any():
        values_FB = np.where(non_finite_FB, 0.0, values_FB)
        failed_B = failed_B | non_finite_FB.any(axis=0)
        counts = {**counts, "errors": counts.get("errors", 0) + int(non_finite_FB.sum())}
    weights_F = np.asarray([w.weight for w in weighted], np.float64)
    with np.errstate(over="ignore"):
        total_B = (weights_F[:, None] * values_FB).sum(axis=0).astype(np.float32)
    overflow_B = ~np.isfinite(total_B)  # finite rewards whose weighted sum is not
    if overflow_B.any():
        total_B = np.where(overflow_B, np.float32(0), total_B)
        values_FB = np.where(overflow_B, 0.0, values_FB)
        failed_B = failed_B | overflow_B
        counts = {**counts, "errors": counts.get("errors", 0) + int(overflow_B.sum())}
    per_function = {w.name: values_FB[f].astype(np.float32) for f, w in enumerate(weighted)}
    metrics = {f"reward/{key}": float(counts.get(key, 0))
               for key in ("timeouts", "crashes", "memory_errors", "errors", "restarts")}
    metrics["reward/seconds"] = float(seconds)
    return RewardScores(total_B, per_function, failed_B.astype(bool), metrics)


def score_rewards(completions: Sequence[str], rewards: RewardsLike, **columns: Sequence[Any]) -> RewardScores:
    """Scores in this process, whole batch per function, with no timeouts.

    For tests, evaluation of trusted output, and cheap rewards. Exceptions
    propagate; use ``RewardPool.score`` for model output in a training run.

    Args:
        completions: [B] decoded completions.
        rewards: reward specs (see ``as_weighted``).
        **columns: dataset columns, each a list of B values.

    Returns:
        RewardScores.
    """
    start = time.perf_counter()
    weighted = as_weighted(rewards)
    completions = as_batch(completions, columns)
    columns = {name: list(column) for name, column in columns.items()}
    values_FB = np.zeros((len(weighted), len(completions)), np.float64)
    for f, w in enumerate(weighted):
        returned = w.fn(completions, **columns)
        try:
            if isinstance(returned, (str, bytes)):
                raise TypeError
            values = np.asarray(list(returned), np.float64)
            if values.ndim != 1:  # a list of lists
                raise ValueError
        except (TypeError, ValueError):
            raise TypeError(f"reward {w.name!r} must return a list of numbers, one per completion; got "
                            f"{repr(returned)[:80]}") from None
        if values.shape != (len(completions),):
            raise ValueError(f"reward {w.name!r} returned {len(values)} values for {len(completions)} completions")
        values_FB[f] = values
    failed_B = np.zeros(len(completions), bool)
    return summarize(weighted, values_FB, failed_B, {}, time.perf_counter() - start)
