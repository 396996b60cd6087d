"""pass@k against every k-subset and hand values; maj@k's votes, ties and blocks; the tasks' answer keys."""

import itertools
import math
from fractions import Fraction

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from podsjax import rl
from podsjax.rl.pass_at_k import (NO_ANSWER, answer_id, answer_ids, chemistry_answer_key, gsm8k_answer_key, maj_at_k, math_answer_key, pass_at_k, pass_at_k_per_problem, task_answer_key)

PROPERTY = settings(max_examples=150, deadline=None)


@st.composite
def samples_and_k(draw, values=st.booleans()):
    """[R, E] per-sample values (R <= 8, E <= 4) and a k from 1 to R."""
    repeats, problems = draw(st.integers(1, 8)), draw(st.integers(1, 4))
    values_RE = draw(hnp.arrays(object, (repeats, problems), elements=values))
    return values_RE, draw(st.integers(1, repeats))


def subset_pass_at_k(correct_RE, k):
    """The fraction of k-subsets of each problem's samples holding a correct one, averaged over problems."""
    repeats, problems = correct_RE.shape
    per_problem = []
    for e in range(problems):
        subsets = list(itertools.combinations(range(repeats), k))
        per_problem.append(sum(any(correct_RE[i, e] for i in subset) for subset in subsets) / len(subsets))
    return float(np.mean(per_problem))


@PROPERTY
@given(samples_and_k())
def test_pass_at_k_is_the_chance_that_a_k_subset_holds_a_correct_sample(case):
    correct_RE, k = case
    correct_RE = correct_RE.astype(bool)
    assert pass_at_k(correct_RE.astype(float), k) == pytest.approx(subset_pass_at_k(correct_RE, k), abs=1e-12)


@PROPERTY
@given(samples_and_k())
def test_pass_at_1_is_the_mean_accuracy(case):
    correct_RE, _ = case
    assert pass_at_k(correct_RE.astype(float), 1) == pytest.approx(correct_RE.astype(float).mean(), abs=1e-12)


def test_pass_at_k_hand_values():
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10; k=1: c/n; c=0: 0; fewer than k wrong: 1.
    assert pass_at_k_per_problem(5, np.array([2]), 2) == pytest.approx([0.7], abs=1e-15)
    assert pass_at_k_per_problem(5, np.array([2, 0, 5, 4]), 1) == pytest.approx([0.4, 0.0, 1.0, 0.8], abs=1e-15)
    assert pass_at_k_per_problem(5, np.array([3, 4]), 3) == pytest.approx([1.0, 1.0], abs=0)
    # Two problems, 4 samples: c = 1 and 3. pass@2 = mean(1 - C(3,2)/C(4,2), 1 - 0) = mean(0.5, 1).
    correct_RE = np.array([[1, 0], [0, 1], [0, 1], [0, 1]], float)
    assert pass_at_k(correct_RE, 2) == pytest.approx(0.75, abs=1e-15)
    assert pass_at_k(np.zeros((3, 0)), 2) == 0.0  # no problems


def test_pass_at_k_stays_exact_where_the_binomials_are_huge():
    n, c, k = 1000, 37, 500
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k_per_problem(n, np.array([c]), k)[0] == pytest.approx(float(exact), rel=1e-12)


def test_a_score_counts_as_correct_from_one_half():
    assert pass_at_k(np.array([[0.49], [0.5]]), 1) == 0.5


@pytest.mark.parametrize("call,message", [
    (lambda: pass_at_k(np.ones((3, 2)), 0), "k must be an integer from 1 to the 3 samples"),
    (lambda: pass_at_k(np.ones((3, 2)), 4), "k must be an integer from 1 to the 3 samples"),
    (lambda: pass_at_k(np.ones((3, 2)), 2.0), "k must be an integer"),
    (lambda: pass_at_k(np.ones((3, 2)), True), "k must be an integer"),
    (lambda: pass_at_k(np.ones(3), 1), r"correct_RE must be \[samples, problems\]"),
    (lambda: pass_at_k_per_problem(3, np.array([4]), 1), "correct counts must be from 0 to 3"),
    (lambda: maj_at_k(np.zeros((3, 2), int), np.ones((3, 1)), 1), "must have one shape"),
    (lambda: maj_at_k(np.zeros((3, 2)), np.ones((3, 2)), 1), "integer answer ids"),
    (lambda: maj_at_k(np.zeros((3, 2), int), np.ones((3, 2)), 5), "k must be an integer from 1 to the 3"),
])
def test_bad_input_is_one_clear_line(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def block_majority(answers, correct):
    """The rule written another way: the answers with the most votes, the earliest of them, its first grade."""
    voted = [(i, a) for i, a in enumerate(answers) if a != NO_ANSWER]
    if not voted:
        return False
    counts = {a: sum(1 for _, b in voted if b == a) for _, a in voted}
    most = max(counts.values())
    first_index = min(i for i, a in voted if counts[a] == most)
    return bool(correct[first_index] >= 0.5)


@PROPERTY
@given(samples_and_k(values=st.tuples(st.integers(-1, 3), st.booleans())))
def test_maj_at_k_matches_the_rule_block_by_block(case):
    pairs_RE, k = case
    answers_RE = np.vectorize(lambda p: p[0], otypes=[np.int64])(pairs_RE)
    correct_RE = np.vectorize(lambda p: float(p[1]), otypes=[float])(pairs_RE)
    repeats, problems = answers_RE.shape
    expected = np.mean([block_majority(answers_RE[b * k:(b + 1) * k, e], correct_RE[b * k:(b + 1) * k, e])
                        for b in range(repeats // k) for e in range(problems)])
    assert maj_at_k(answers_RE, correct_RE, k) == pytest.approx(expected, abs=1e-12)


@PROPERTY
@given(samples_and_k(values=st.tuples(st.integers(0, 3), st.booleans())))
def test_maj_at_1_is_the_mean_accuracy_when_every_answer_reads(case):
    pairs_RE, _ = case
    answers_RE = np.vectorize(lambda p: p[0], otypes=[np.int64])(pairs_RE)
    correct_RE = np.vectorize(lambda p: float(p[1]), otypes=[float])(pairs_RE)
    assert maj_at_k(answers_RE, correct_RE, 1) == pytest.approx(correct_RE.mean(), abs=1e-12)


def test_maj_at_k_hand_values():
    A, B, C, X = 10, 20, 30, NO_ANSWER
    # One problem, k = 4: B outvotes A 2 to 1, and B is right.
    assert maj_at_k(np.array([[A], [B], [B], [X]]), np.array([[0], [1], [1], [0]], float), 4) == 1.0
    # A tie of 2 and 2 goes to A, which appears first, and A is wrong.
    assert maj_at_k(np.array([[A], [B], [B], [A]]), np.array([[0], [1], [1], [0]], float), 4) == 0.0
    # Unreadable answers do not vote, however many: the lone C wins.
    assert maj_at_k(np.array([[X], [X], [C], [X]]), np.array([[0], [0], [1], [0]], float), 4) == 1.0
    # Nobody votes: wrong, whatever the grades say.
    assert maj_at_k(np.array([[X], [X]]), np.array([[1], [1]], float), 2) == 0.0
    # The winner's grade is its first completion's: the later A graded right does not count.
    assert maj_at_k(np.array([[A], [A]]), np.array([[0], [1]], float), 2) == 0.0
    # R = 5, k = 2: blocks (0, 1) and (2, 3); pass 4 is left over. Block 0: A (tie, first), right;
    # block 1: B, wrong. Problem 2: C everywhere, right. Mean of (1, 0, 1, 1).
    answers_RE = np.array([[A, C], [B, C], [B, C], [B, C], [A, C]])
    correct_RE = np.array([[1, 1], [0, 1], [0, 1], [0, 1], [1, 1]], float)
    assert maj_at_k(answers_RE, correct_RE, 2) == 0.75
    assert maj_at_k(answers_RE, correct_RE, 5) == 0.5  # one block: B 3 to 2 (wrong), C (right)
    assert maj_at_k(np.zeros((3, 0), int), np.zeros((3, 0)), 2) == 0.0


@pytest.mark.parametrize("key,same,different", [
    (gsm8k_answer_key, ["<answer>18</answer>", "so 18.00", "<answer>1,8 then 18.0</answer>", "#### 18 dollars"],
     ["<answer>17</answer>", "-18"]),
    (math_answer_key, [r"<answer>\dfrac{1}{2}</answer>", r"thus \boxed{\frac12}", r"<answer>$0.5$</answer>",
                       r"<answer>x \boxed{\frac{1}{2}}</answer>"],
     [r"\boxed{\frac{2}{4}}", r"<answer>\frac{1}{3}</answer>"]),
    (chemistry_answer_key, ["<answer>3.52</answer>", r"\boxed{3.520}", r"<answer>3.52 \mathrm{~J}</answer>",
                            "<answer>3.5200000001</answer>"],
     ["<answer>3.53</answer>", "<answer>-3.52</answer>"]),
    (chemistry_answer_key, ["<answer>0</answer>", "<answer>-0</answer>", r"\boxed{0.0}"], ["<answer>1e-9</answer>"]),
])
def test_answer_keys_agree_on_equal_answers_and_only_those(key, same, different):
    keys = {key(text) for text in same}
    assert len(keys) == 1 and None not in keys, keys
    assert all(key(text) not in keys for text in different)


@pytest.mark.parametrize("key,text", [
    (gsm8k_answer_key, "no number here"),
    (gsm8k_answer_key, "<answer>none</answer> 5"),  # a tag without a number is not rescued
    (math_answer_key, "the answer is 5"),  # no tag and no box
    (math_answer_key, "<answer> $ $ </answer>"),
    (chemistry_answer_key, "about 3.52 J"),  # no tag and no box
])
def test_answer_keys_read_nothing_where_the_rewards_read_nothing(key, text):
    assert key(text) is None and answer_id(key(text)) == NO_ANSWER


def test_answer_ids_are_stable_31_bit_and_split_answers():
    ids = answer_ids(["<answer>18</answer>", "18.0", "<answer>7</answer>", "nothing"], gsm8k_answer_key)
    assert ids.dtype == np.int32 and ids[0] == ids[1] != ids[2] and ids[3] == NO_ANSWER
    assert 0 <= ids[:3].min() and ids[:3].max() < 2**31
    assert answer_id("18") == int(ids[0])  # the same id in every process: no salted hash()
    assert task_answer_key("gsm8k") is gsm8k_answer_key
    with pytest.raises(ValueError, match="needs an answer key for task 'poetry'"):
        task_answer_key("poetry")


def test_eval_k_is_checked_against_the_passes():
    run = dict(out_dir="unused", max_steps=1, eval_repeats=4, eval_temperature=0.9)
    assert rl.RunConfig(**run).eval_k == ()
    assert rl.RunConfig(**run, eval_k=[1, 4]).eval_k == (1, 4)  # a YAML list arrives as a list
    for eval_k, message in [((5,), r"each k must be an integer from 1 to eval_repeats \(4\); got 5"),
                            ((0,), "got 0"), ((2.0,), "got 2.0"), ((True,), "got True"),
                            ((2, 2), "repeats a k"), ("2", "must be a list of integers")]:
        with pytest.raises(ValueError, match=message):
            rl.RunConfig(**run, eval_k=eval_k)


def test_eval_scalars_add_pass_and_maj_at_k_from_the_metric():
    values_RE = {"accuracy": np.array([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]]),
                 "strict_format": np.array([[1.0, 1.0], [1.0, 1.0], [0.0, 1.0]]),
                 "answer_id": np.array([[5, 6], [7, 6], [5, 8]])}
    plain = rl.eval_scalars(values_RE, rl.EVAL_METRICS["accuracy"], (1, 2, 3))
    assert plain["eval/pass_at_1"] == pytest.approx(plain["eval/accuracy"], abs=1e-15)
    # Problem 1 (c = 2 of 3) leaves one wrong sample, fewer than 2: 1. Problem 2 (c = 1): 1 - C(2,2)/C(3,2).
    assert plain["eval/pass_at_2"] == pytest.approx((1 + (1 - 1 / 3)) / 2, abs=1e-15)
    assert plain["eval/pass_at_3"] == 1.0
    assert plain["eval/maj_at_3"] == 0.5  # problem 1: 5 twice, right; problem 2: 6 twice, wrong
    assert plain["eval/maj_at_1"] == pytest.approx(0.5, abs=1e-15)
    # With the format in the metric, the third pass of problem 1 no longer counts.
    both = rl.eval_scalars(values_RE, rl.EVAL_METRICS["accuracy_and_format"], (3,))
    assert both["eval/pass_at_3"] == 1.0 and both["eval/maj_at_3"] == 0.5
    assert "eval/pass_at_1" not in rl.eval_scalars(values_RE, rl.EVAL_METRICS["accuracy"])
    with pytest.raises(ValueError, match="needs each completion's answer id"):
        rl.eval_scalars({k: v for k, v in values_RE.items() if k != "answer_id"}, ("accuracy",), (1,))


@pytest.mark.parametrize("k,counts,message", [(1.5, [1, 2], "k must be an integer; got 1.5"),
                                              (2, [1.5, 2.0], "correct counts must be integers; got dtype float64")])
def test_a_fractional_k_or_count_is_refused(k, counts, message):
    # Both had computed: a pass@1.5, and 1.5 correct cut to 1.
    with pytest.raises(ValueError, match=message):
        pass_at_k_per_problem(4, np.asarray(counts), k)
