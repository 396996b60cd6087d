"""A reward batch is a list per completion, a reward past float32 fails its item, and the pool's timers are bounded."""

import numpy as np
import pytest

from podsjax.rewards import (chemistry_accuracy, extract_answer_tag, extract_chemistry_answer, extract_gsm8k_answer,
                             follows_format, format_correct, format_score, gsm8k_accuracy, last_boxed, parse_quantity)
from podsjax.rewards.authors import release_format_reward, release_tag_count_reward
from podsjax.rewards.combine import as_batch, get_reward, score_rewards
from podsjax.rewards.pool_workers import MAX_SECONDS, PoolConfig


def constant(values):
    def reward(completions, **columns):
        return list(values)
    return reward



@pytest.mark.parametrize("completions,columns,what", [
    ("hello", {}, "completions must be a list with one entry per completion; got a str"),
    (["a", "b"], {"answer": "42"}, "column 'answer' must be a list with one entry per completion; got a str"),
    (["a"], {"answer": {"x": 1}}, "column 'answer' must be a list with one entry per completion; got a dict"),
    (["a", "b"], {"answer": {"4", "2"}}, "got a set"),
])
def test_one_text_where_a_list_belongs_is_refused(completions, columns, what):
    # "hello" had been scored as five one-letter completions; answer "42" graded against "4" and "2".
    with pytest.raises(TypeError, match=what):
        score_rewards(completions, constant([1.0] * 5), **columns)
    with pytest.raises(TypeError, match=what):
        as_batch(completions, columns)  # what RewardPool.score checks with


@pytest.mark.parametrize("value,weight", [(1e308, 1.0), (1e30, 1e10), (-1e39, 1.0)])
def test_a_reward_past_float32_scores_zero_and_counts_as_an_error(value, weight):
    # A finite 1e308 had passed the NaN/inf guard and become a total of inf.
    scores = score_rewards(["a", "b"], [(constant([value, 1.0]), weight)])
    assert scores.total_B.tolist() == [0.0, weight] and scores.failed_B.tolist() == [True, False]
    assert scores.metrics["reward/errors"] == 1.0 and np.isfinite(scores.per_function["reward"]).all()


@pytest.mark.parametrize("changes,message", [
    (dict(timeout_s=float("inf")), "timeout_s must be a number of seconds, > 0 and at most"),
    (dict(timeout_s=MAX_SECONDS * 2), "timeout_s must be a number of seconds"),
    (dict(timeout_s="5"), "timeout_s must be a number of seconds"),
    (dict(batch_timeout_s=float("nan")), "batch_timeout_s must be a number of seconds"),
    (dict(kill_grace_s=-1), "kill_grace_s must be a number of seconds, >= 0"),
    (dict(preload="sympy"), "preload must be a list of module names"),
    (dict(output_budget_bytes=-1), "output_budget_bytes must be None or an int >= 0"),
    (dict(max_workers=True), "max_workers must be a positive int"),
])
def test_pool_settings_out_of_range_are_one_line(changes, message):
    # timeout_s=inf had overflowed each worker's timer, and every reward then scored 0.
    with pytest.raises(ValueError, match=message):
        PoolConfig(**{"max_workers": 2, **changes})
    PoolConfig(max_workers=2, kill_grace_s=0, batch_timeout_s=None, output_budget_bytes=None, max_memory_mb=None)


@pytest.mark.parametrize("returned", ["abc", [1j, 2.0], 3.0, [[1.0], [2.0]]])
def test_a_reward_that_returns_no_list_of_numbers_is_named(returned):
    # "abc" (three completions) had scored as a failure deep in NumPy, naming no reward.
    with pytest.raises(TypeError, match="reward 'reward' must return a list of numbers, one per completion"):
        score_rewards(["a", "b"], returning(returned))


def returning(value):
    def reward(completions, **columns):
        return value
    return reward


@pytest.mark.parametrize("weight", [None, "abc", "2", True, float("inf")])
def test_a_reward_weight_that_is_no_finite_number_is_one_line(weight):
    from podsjax.rewards.combine import WeightedReward

    with pytest.raises(ValueError, match="reward weight must be a finite number"):
        WeightedReward(constant([1.0]), weight)
    assert WeightedReward(constant([1.0]), np.float32(0.5)).weight == 0.5


_BUILT_IN_REWARDS = ["gsm8k_accuracy", "math_accuracy", "chemistry_accuracy", "format", "format_score", "tag_count",
                     "strict_format", "authors_gsm8k_accuracy", "authors_math_accuracy", "llama_gsm8k_accuracy",
                     "llama_math_accuracy", "r1_accuracy", "r1_format", "r1_tag_count"]


@pytest.mark.parametrize("reward", [get_reward(name) for name in _BUILT_IN_REWARDS]
                         + [release_format_reward, release_tag_count_reward], ids=lambda f: f.__name__)
def test_a_built_in_reward_called_on_no_text_names_it_in_one_line(reward):
    # None had failed inside a str method ('NoneType' object has no attribute 'rfind'), one
    # text had been scored per character, and a short column had been zipped short.
    columns = {"answer": ["1", "2"], "solution": ["\\boxed{1}", "\\boxed{2}"]}
    with pytest.raises(TypeError, match=rf"{reward.__name__}: completion 1 must be decoded text \(str\); got NoneType"):
        reward(["<answer>1</answer>", None], **columns)
    with pytest.raises(TypeError, match=rf"{reward.__name__}: completions must be a list with one entry per "
                                        r"completion; got a (str|NoneType)"):
        reward("<answer>1</answer>", **columns)
    assert len(reward(["<answer>1</answer>", "<answer>2</answer>"], **columns)) == 2


@pytest.mark.parametrize("function", [extract_answer_tag, last_boxed, follows_format, format_score, format_correct,
                                      extract_gsm8k_answer, parse_quantity, extract_chemistry_answer])
def test_a_text_helper_given_none_says_so(function):
    with pytest.raises(TypeError, match="the text must be decoded text \\(str\\); got NoneType"):
        function(None)


@pytest.mark.parametrize("reward", [gsm8k_accuracy, chemistry_accuracy])
def test_an_accuracy_without_its_gold_column_says_so(reward):
    with pytest.raises(ValueError, match=f"{reward.__name__} needs an 'answer' column"):
        reward(["<answer>1</answer>"])
    with pytest.raises(ValueError, match=f"{reward.__name__}: column 'answer' has 2 entries for 1 completions"):
        reward(["<answer>1</answer>"], answer=["1", "2"])
