"""Rewards: answer extraction, math-verify, format rewards, weighting, and the process pool."""

import json
import math
import os
import re
import signal
import sys
import time
import types
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from podsjax.rewards import (
    RewardPool,
    RewardPoolError,
    WeightedReward,
    as_weighted,
    chemistry_accuracy,
    default_rewards,
    extract_answer_tag,
    extract_gsm8k_answer,
    follows_format,
    format_reward,
    format_score,
    format_score_reward,
    gsm8k_accuracy,
    last_boxed,
    math_accuracy,
    math_gold,
    parse_gsm8k_gold,
    score_rewards,
    tag_count_reward,
)

# ------------------------------------------------------------- pool test rewards
# Module level so that worker processes can import them by name.


def chaos_reward(completions, **_):
    """Misbehaves on a marker word; otherwise returns the completion's last token as a float.

    The pool calls it with one completion at a time.
    """
    (text,) = completions
    if "HANG" in text:
        time.sleep(60)  # blocked outside Python bytecode: only the parent's kill ends it
    if "SPIN" in text:
        while True:  # busy in Python: the worker's CPU-time alarm ends it
            pass
    if "EXIT" in text:
        os._exit(7)
    if "SEGV" in text:
        os.kill(os.getpid(), signal.SIGSEGV)
    if "HOG" in text:
        blob = bytearray(64 * 2**30)  # far past max_memory_mb
        return [float(len(blob))]
    if "RAISE" in text:
        raise RuntimeError("deliberate failure")
    return [float(text.split()[-1])]


def delayed_echo_reward(completions, index, **_):
    """Returns the item's index after a delay that varies by item, so replies arrive out of order."""
    for i in index:
        time.sleep(0.002 * (int(i) % 5))
    return [float(i) for i in index]


def constant_reward(completions, **_):
    return [0.5 for _ in completions]


def non_finite_reward(completions, **_):
    """The completion read as a float: "nan", "inf" and "-inf" give what they say."""
    return [float(text) for text in completions]


@pytest.fixture(scope="module")
def pool():
    # One pool for the module: start-up costs seconds. Short timeouts keep the hang tests quick.
    with RewardPool(max_workers=2, timeout_s=1.0, kill_grace_s=2.0, max_memory_mb=3072) as shared:
        yield shared


# ------------------------------------------------------------------- GSM8K


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>9 * 2 = 18</think><answer>18</answer>", 18),
        ("<answer>18.00</answer>", 18),
        ("<answer>$1,000.</answer>", 1000),
        ("<answer> The total is 5 + 13 = 18 dollars. </answer>", 18),
        ("<answer>-3</answer>", -3),
        ("<answer>\u22123</answer>", -3),  # unicode minus sign
        ("<answer>0.5</answer>", Fraction(1, 2)),
        ("so she makes 18 dollars.\n#### 18\nThen 99 more words 7", 18),
        ("She has 3 apples and eats 1, so 2 are left.", 2),
        ("the range is 10-20", 20),  # a hyphen between numbers is not a minus sign
        ("<answer>first</answer> 42 <answer>12</answer>", 12),  # the last answer tag wins
        ("<think>reasoning</think><answer>14", 14),  # truncated inside the answer
        ("<answer>1,234,567</answer>", 1234567),
        # A minus before a dollar or a space is the answer's sign (it had been dropped: -$5 read as 5).
        ("<answer>-$5</answer>", -5),
        ("<answer>- 5</answer>", -5),
        ("<answer>-\\$5</answer>", -5),
        ("He lost -$5 overall", -5),
        ("<answer>10 - 5</answer>", 5),  # between numbers it is still no sign
        # One number, not its last piece (3.5e2 had read as 2, 3/4 as 4).
        ("<answer>3.5e2</answer>", 350),
        ("<answer>1.2E+3</answer>", 1200),
        ("<answer>3/4</answer>", Fraction(3, 4)),
        ("<answer>\\frac{3}{4}</answer>", Fraction(3, 4)),
        # TeX's unbraced fraction had read as 12; a negative denominator as two numbers.
        ("<answer>\\frac12</answer>", Fraction(1, 2)),
        ("The answer is $\\tfrac 3 4$.", Fraction(3, 4)),
        ("<answer>\\frac{1}{-2}</answer>", Fraction(-1, 2)),
        ("<answer>\\dfrac{-3}{-4}</answer>", Fraction(3, 4)),
        # After ####, the first number is the answer, and the last #### counts.
        ("<answer>#### 18 (3 apples)</answer>", 18),
        ("#### 5 was wrong, so\n#### 18", 18),
        ("<answer>#### 5, no: #### 18 (2 left)</answer>", 18),
    ],
)
def test_extract_gsm8k_answer(text, expected):
    assert extract_gsm8k_answer(text) == Fraction(expected)


@pytest.mark.parametrize(
    "text",
    ["", "no digits here", "<answer></answer> 42", "<answer>unknown</answer> but it is 7", "١٨", "#### none",
     # A last number too long to be an answer (a looping model) is no answer; the one before it had stood in.
     "<answer>18 " + "72" * 35 + "</answer>", "#### " + "1" * 65 + " 18"],
)
def test_extract_gsm8k_answer_none(text):
    assert extract_gsm8k_answer(text) is None


def test_gsm8k_accuracy_numeric_compare_and_gold_forms():
    completions = ["<answer>18.00</answer>", "<answer>$1,000.</answer>", "<answer>17</answer>", "#### 72", "nothing"]
    answers = ["18", "Long solution...\n#### 1,000", 18, 72.0, "5"]
    assert gsm8k_accuracy(completions, answer=answers, question=["q"] * 5) == [1.0, 1.0, 0.0, 1.0, 0.0]


def test_a_leading_dot_decimal_is_read_whole():
    # ".5" was read as 5: right against a gold of 5, wrong against a gold of .5.
    completions = ["<answer>.5</answer>", "<answer>0.5</answer>", "<answer>-.5</answer>", "the answer is .5"]
    assert gsm8k_accuracy(completions, answer=["5", ".5", "-0.5", "0.5"]) == [0.0, 1.0, 1.0, 1.0]


def test_a_gold_without_a_number_is_an_error_whatever_the_completion():
    # It had scored 0 without a word when the completion held no number either.
    for completion in ("<answer>7</answer>", "no number"):
        with pytest.raises(ValueError, match="GSM8K gold answer has no number: 'abc'"):
            gsm8k_accuracy([completion], answer=["abc"])


def test_gsm8k_accuracy_errors():
    with pytest.raises(ValueError, match="gsm8k_accuracy: column 'answer' has 1 entries for 2 completions"):
        gsm8k_accuracy(["a", "b"], answer=["1"])
    with pytest.raises(ValueError, match="no number"):
        parse_gsm8k_gold("#### seven")


def _reference_gsm8k_gold(solution):
    # The extraction in openai/grade-school-math's dataset.py: the regex, then drop commas.
    return re.search(r"#### (\-?[0-9\.\,]+)", solution).group(1).strip().replace(",", "")


@pytest.mark.parametrize("split", ["train", "test"])
def test_every_gsm8k_gold_extracts_to_the_right_number(data_dir, split):
    with open(os.path.join(data_dir, "gsm8k", f"{split}.jsonl")) as handle:
        solutions = [json.loads(line)["answer"] for line in handle]
    references = [_reference_gsm8k_gold(s) for s in solutions]
    assert [parse_gsm8k_gold(s) for s in solutions] == [Fraction(r) for r in references]
    right = [f"<think>...</think><answer>{int(r):,}</answer>" for r in references]
    wrong = [f"<think>...</think><answer>{int(r) + 1}</answer>" for r in references]
    assert gsm8k_accuracy(right, answer=solutions) == [1.0] * len(solutions)
    assert gsm8k_accuracy(wrong, answer=solutions) == [0.0] * len(solutions)


_NO_DIGITS = st.text(alphabet=st.characters(blacklist_categories=("Nd",), blacklist_characters="<>#-.,$"), max_size=30)


@settings(max_examples=200, deadline=None)
@given(
    value=st.integers(min_value=-(10**12), max_value=10**12),
    style=st.sampled_from(["plain", "commas", "dollar", "period", "decimals"]),
    before=_NO_DIGITS,
    after=_NO_DIGITS,
)
def test_fuzz_gsm8k_tagged_answer_round_trips(value, style, before, after):
    text = {
        "plain": f"{value}",
        "commas": f"{value:,}",
        "dollar": f"${value:,}" if value >= 0 else f"-${-value:,}",
        "period": f"{value}.",
        "decimals": f"{value}.00",
    }[style]
    if style == "dollar" and value < 0:
        text = f"-{-value:,}"  # "-$5" is not a form models write; keep the sign on the digits
    completion = f"<think>{before}</think><answer>{before} {text} {after}</answer>"
    assert extract_gsm8k_answer(completion) == value
    assert gsm8k_accuracy([completion], answer=[f"#### {value}"]) == [1.0]


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_fuzz_gsm8k_extractor_never_raises(text):
    result = extract_gsm8k_answer(text)
    assert result is None or isinstance(result, Fraction)
    assert gsm8k_accuracy([text], answer=["7"])[0] in (0.0, 1.0)


# -------------------------------------------------------------------- MATH


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),  # the authors' first-'}' split gave "\\frac{1"
        ("\\boxed{1} then \\boxed{\\sqrt{\\frac{a}{b}}}", "\\sqrt{\\frac{a}{b}}"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces do not nest
        ("answer: \\boxed 5$.", "5"),
        ("\\fbox{3}", "3"),
        ("\\boxed{\\frac{1}{2}", None),  # never closed
        ("no box here", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_math_gold_prefers_answer_then_last_boxed():
    assert math_gold("  \\frac{14}{3} ", "ignored \\boxed{7}") == "\\frac{14}{3}"
    assert math_gold("", "first \\boxed{2}, finally \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    with pytest.raises(ValueError, match="no answer field"):
        math_gold(None, "no box")


def test_math_accuracy_nested_boxed_gold_from_solution():
    solution = ["We get $x = \\boxed{\\frac{1}{2}}$."] * 4
    completions = [
        "<think>...</think><answer>\\frac{1}{2}</answer>",
        "<think>...</think><answer>0.5</answer>",
        "The answer is $\\boxed{\\frac{2}{4}}$",
        "<think>...</think><answer>1</answer>",  # what a gold cut to "\\frac{1" might accept
    ]
    assert math_accuracy(completions, solution=solution) == [1.0, 1.0, 1.0, 0.0]


def test_math_accuracy_tags_and_edge_cases():
    completions = [
        "<answer>\\$36</answer>",  # an escaped dollar is not a math delimiter
        "<answer>3, 5, 7</answer>",
        "<answer>\\text{Evelyn}</answer>",
        "<answer></answer> \\boxed{36}",  # empty tags: the box outside does not count
        "",
    ]
    answers = ["\\$36", "3, 5, 7", "\\text{Evelyn}", "36", "36"]
    assert math_accuracy(completions, answer=answers) == [1.0, 1.0, 1.0, 0.0, 0.0]
    # Prose in the tags is plain text (between delimiters it had been a product of letters), and
    # 7.2e1 is 72 (not 7.2 e); a pmatrix is still LaTeX.
    prose = ["72 dollars", "She has 72 apples left", "7.2e1", "71 dollars", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"]
    golds = ["72", "72", "72", "72", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"]
    assert math_accuracy([f"<answer>{p}</answer>" for p in prose], answer=golds) == [1.0, 1.0, 1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="needs an 'answer' or a 'solution'"):
        math_accuracy(["x"])


def test_every_math500_answer_verifies_and_a_perturbed_one_does_not(data_dir):
    with open(os.path.join(data_dir, "math500", "test.jsonl")) as handle:
        rows = [json.loads(line) for line in handle]
    answers = [row["answer"] for row in rows]
    # The reference solutions end in \boxed{answer}; math-verify must pick that box out of the prose.
    assert math_accuracy([row["solution"] for row in rows], answer=answers) == [1.0] * len(rows)
    tagged = [f"<think>...</think><answer>{a}</answer>" for a in answers]
    assert math_accuracy(tagged, answer=answers) == [1.0] * len(rows)
    perturbed = [f"\\boxed{{{a} + 1}}" for a in answers]
    assert math_accuracy(perturbed, answer=answers) == [0.0] * len(rows)


# ------------------------------------------------------------------ format


@pytest.mark.parametrize(
    "text, formatted, tag_count",
    [
        ("<think>x</think><answer>1</answer>", 1.0, 1.0),
        ("  <think>\nx\n</think>\n<answer>\n1\n</answer>\n", 1.0, 1.0),
        ("<think>x</think><answer> </answer>", 0.0, 1.0),  # blank answer
        ("<think>x</think>chatter<answer>1</answer>", 0.0, 1.0),
        ("<answer>1</answer><think>x</think>", 0.0, 1.0),  # wrong order
        ("<think>x</think><answer>1</answer> trailing", 0.0, 1.0),
        ("<think>x</think><think>y</think><answer>1</answer>", 0.0, 0.5),
        ("<think>x</think>", 0.0, 0.5),
        ("<answer>1</answer>", 0.0, 0.5),
        ("plain text 42", 0.0, 0.0),
        ("", 0.0, 0.0),
    ],
)
def test_format_and_tag_count(text, formatted, tag_count):
    assert format_reward([text]) == [formatted]
    assert follows_format(text) is bool(formatted)
    assert tag_count_reward([text]) == [tag_count]


def test_extract_answer_tag():
    assert extract_answer_tag("a <answer> 1 </answer> b") == " 1 "
    assert extract_answer_tag("no tags") is None
    assert extract_answer_tag("<answer>cut off") == "cut off"


# ------------------------------------------------------------------ combine


def test_weighted_total_and_breakdown():
    completions = ["<think>a</think><answer>18</answer>", "<answer>17</answer>", "18"]
    rewards = [
        WeightedReward(gsm8k_accuracy, 2.0, "acc"),
        WeightedReward(format_reward, 0.5),
        ("tag_count", 0.25),  # a registered name
    ]
    scores = score_rewards(completions, rewards, answer=["18", "18", "18"])
    np.testing.assert_array_equal(scores.per_function["acc"], [1.0, 0.0, 1.0])
    np.testing.assert_array_equal(scores.per_function["format_reward"], [1.0, 0.0, 0.0])
    np.testing.assert_array_equal(scores.per_function["tag_count"], [1.0, 0.5, 0.0])
    np.testing.assert_allclose(scores.total_B, [2.0 + 0.5 + 0.25, 0.125, 2.0], rtol=0, atol=1e-6)
    # Means are the caller's: the scores carry only how the scoring went.
    assert set(scores.metrics) == {"reward/timeouts", "reward/crashes", "reward/memory_errors", "reward/errors",
                                   "reward/restarts", "reward/seconds"}


def test_reward_spec_errors(pool):
    for completions in ([b"<answer>1</answer>"], ["<answer>1</answer>", None]):  # had been a traceback from inside
        for score in (score_rewards, pool.score):
            with pytest.raises(TypeError, match=r"completion \d must be decoded text \(str\); got (bytes|NoneType)"):
                score(completions, gsm8k_accuracy, answer=["1"] * len(completions))
    with pytest.raises(ValueError, match="unique"):
        as_weighted([format_reward, format_reward])
    with pytest.raises(KeyError, match="unknown reward"):
        as_weighted("no_such_reward")
    with pytest.raises(ValueError, match="finite"):
        WeightedReward(format_reward, float("nan"))
    with pytest.raises(ValueError, match="column 'answer' has 1 entries for 2"):
        score_rewards(["a", "b"], gsm8k_accuracy, answer=["1"])
    assert [w.name for w in as_weighted({"format": 1.0, constant_reward: 0.0})] == ["format", "constant_reward"]
    assert [w.name for w in default_rewards("math")] == ["accuracy", "format", "tag_count"]


# --------------------------------------------------------------------- pool


def test_pool_matches_in_process_scoring_and_keeps_order(pool):
    completions = [f"<think>t</think><answer>{i % 7}</answer>" for i in range(40)]
    answers = [str(i % 5) for i in range(40)]
    columns = {"answer": answers, "index": list(range(40))}
    rewards = list(default_rewards("gsm8k")) + [WeightedReward(delayed_echo_reward, 0.0)]
    pooled = pool.score(completions, rewards, **columns)
    local = score_rewards(completions, rewards, **columns)
    np.testing.assert_array_equal(pooled.per_function["delayed_echo_reward"], np.arange(40, dtype=np.float32))
    for name in ("accuracy", "format", "tag_count"):
        np.testing.assert_array_equal(pooled.per_function[name], local.per_function[name])
    np.testing.assert_array_equal(pooled.total_B, local.total_B)
    assert not pooled.failed_B.any()
    assert pooled.metrics["reward/timeouts"] == pooled.metrics["reward/crashes"] == 0


def test_non_finite_rewards_score_zero_and_count_as_errors(pool):
    completions = ["nan", "inf", "-inf", "1.0", "nan"]
    rewards = [WeightedReward(non_finite_reward, 1.0), WeightedReward(constant_reward, 2.0)]
    for scores in (score_rewards(completions, rewards), pool.score(completions, rewards)):
        np.testing.assert_array_equal(scores.per_function["non_finite_reward"], [0.0, 0.0, 0.0, 1.0, 0.0])
        np.testing.assert_array_equal(scores.total_B, [1.0, 1.0, 1.0, 2.0, 1.0])  # finite: the group stays usable
        assert scores.metrics["reward/errors"] == 4
        np.testing.assert_array_equal(scores.failed_B, [True, True, True, False, True])


@pytest.mark.slow
def test_pool_survives_hangs_crashes_and_memory_blowups():
    completions = ["ok 0", "HANG 1", "ok 2", "SPIN 3", "EXIT 4", "ok 5", "SEGV 6", "HOG 7", "RAISE 8", "ok 9"]
    rewards = [WeightedReward(chaos_reward, 1.0), WeightedReward(constant_reward, 2.0)]
    # A pool of its own: SPIN must meet its CPU-time alarm (0.25 s) before the wall-clock kill
    # (2 x 0.25 + 6 s), which holds while its worker gets 4 % of a core (a loaded CI host).
    with RewardPool(max_workers=2, timeout_s=0.25, kill_grace_s=6.0, max_memory_mb=3072) as pool:
        start = time.monotonic()
        scores = pool.score(completions, rewards)
        elapsed = time.monotonic() - start
        assert elapsed < 45, elapsed  # HANG sleeps 60 s: it was killed, not waited for
        np.testing.assert_array_equal(scores.per_function["chaos_reward"], [0, 0, 2, 0, 0, 5, 0, 0, 0, 9])
        # A killed or dead worker loses the whole item; a soft failure only the failing function.
        np.testing.assert_array_equal(scores.per_function["constant_reward"],
                                      [0.5, 0, 0.5, 0.5, 0, 0.5, 0, 0.5, 0.5, 0.5])
        np.testing.assert_array_equal(scores.failed_B, [False, True, False, True, True, False, True, True, True, False])
        assert scores.metrics["reward/timeouts"] == 2  # HANG (killed) and SPIN (CPU alarm)
        assert scores.metrics["reward/crashes"] == 2  # EXIT and SEGV
        assert scores.metrics["reward/memory_errors"] == 1
        assert scores.metrics["reward/errors"] == 1
        assert scores.metrics["reward/restarts"] == 3  # HANG, EXIT, SEGV; SPIN and HOG keep their worker
        # The pool recovered: full strength, and the next call is clean.
        assert pool.num_workers == 2
        again = pool.score(["ok 1", "ok 2", "ok 3"], chaos_reward)
        np.testing.assert_array_equal(again.total_B, [1, 2, 3])
        assert again.metrics["reward/restarts"] == 0


def test_pool_replaces_a_worker_that_died_while_idle(pool):
    victim = pool.worker_pids[0]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and pool._workers[0].process.is_alive():
        time.sleep(0.01)
    scores = pool.score([f"ok {i}" for i in range(6)], chaos_reward)
    np.testing.assert_array_equal(scores.total_B, np.arange(6))
    assert scores.metrics["reward/crashes"] == 0
    assert victim not in pool.worker_pids


def test_pool_adversarial_math_completions_return_numbers_within_the_timeout(pool):
    completions = [
        "<think>big</think><answer>5^{5^{5^{5}}}</answer>",
        "$5^{5^{5^{5}}}$",
        "1" * 1_000_000,
        "{" * 1_000_000,
        "<answer>" * 100_000,
        "\\boxed{\\frac{1}{2}",
        "}}}{{{\\left( \\right",
        "<answer>١٨</answer>",
        "",
        "<think>ok</think><answer>5</answer>",
    ]
    rewards = list(default_rewards("math")) + [WeightedReward(gsm8k_accuracy, 0.0)]
    start = time.monotonic()
    scores = pool.score(completions, rewards, answer=["5"] * len(completions))
    elapsed = time.monotonic() - start
    # Bounded, not fast: at worst every item runs to its wall deadline, two at a time (an
    # unbounded sympy on 5^{5^{5^5}} would take hours).
    deadline = pool.config.timeout_s * len(rewards) + pool.config.kill_grace_s
    assert elapsed < 2 * math.ceil(len(completions) / pool.config.max_workers) * deadline + 10, elapsed
    assert np.isfinite(scores.total_B).all()
    assert scores.per_function["accuracy"][-1] == 1.0 and scores.total_B[-1] == 3.0
    assert (scores.per_function["accuracy"][:-1] == 0.0).all()


def test_pool_reports_a_reward_the_workers_cannot_import_and_recovers(pool):
    # The function pickles here by reference to a module that exists only in this process.
    ghost = types.ModuleType("podsjax_ghost_rewards")
    exec("def ghost_reward(completions, **_):\n    return [1.0 for _ in completions]\n", ghost.__dict__)
    sys.modules[ghost.__name__] = ghost
    try:
        with pytest.raises(RewardPoolError, match="cannot load the reward functions in a worker process"):
            pool.score(["x"], ghost.ghost_reward)
    finally:
        del sys.modules[ghost.__name__]
    scores = pool.score(["ok 4", "ok 5"], chaos_reward)
    np.testing.assert_array_equal(scores.total_B, [4, 5])


def test_pool_rejects_unpicklable_rewards_and_fork(pool):
    with pytest.raises(TypeError, match="cannot be sent to a worker process"):
        pool.score(["x"], WeightedReward(lambda completions, **_: [1.0], name="anonymous"))
    with pytest.raises(ValueError, match="fork is unsafe"):
        RewardPool(1, start_method="fork")
    with pytest.raises(ValueError, match="max_workers"):
        RewardPool(0)
    empty = pool.score([], format_reward)
    assert empty.total_B.shape == (0,)


def test_pool_warnings_are_shown_once_each_and_the_pool_names_keep_their_home():
    from podsjax.rewards import pool as pool_module
    from podsjax.rewards.pool_batch import Warnings
    from podsjax.rewards.pool_fleet import WorkerFleet

    lines = []
    warnings = Warnings(lines.append)
    notes = [("nan", "first NaN"), ("nan", "second NaN"), ("crash", "a crash")]
    warnings.drain(notes)
    warnings.once(("crash", "another crash"))
    assert lines == ["first NaN", "a crash"] and notes == []
    assert issubclass(RewardPool, WorkerFleet) and pool_module.RewardPoolError is RewardPoolError
    assert pool_module.MAX_SERVER_DEATHS == 3 and "sympy" in pool_module.DEFAULT_PRELOAD


# ------------------------------------------------------------ the authors' format score


def authors_format_score(text):
    """utils/data.py of YixuanEvenXu/pods, verbatim in behaviour (the regex this module avoids)."""
    match = re.search(r"<think>.*</think>[ \n]?<answer>.*</answer>", text, flags=re.DOTALL)
    return max(0.0, 1 - 0.01 * (len(text) - len(match.group(0)))) if match else 0.0


@settings(max_examples=500, deadline=None)
@given(st.lists(st.sampled_from(["<think>", "</think>", "<answer>", "</answer>", " ", "\n", "x", "ab"]),
                max_size=14).map("".join))
def test_format_score_matches_the_authors_regex(text):
    assert format_score(text) == pytest.approx(authors_format_score(text), abs=1e-12)


def test_format_score_values_and_linear_time():
    assert format_score("<think>a</think><answer>1</answer>") == 1.0
    assert format_score("<think>a</think>\n<answer>1</answer>" + "x" * 30) == pytest.approx(0.7)
    assert format_score("<think>a</think>\n\n<answer>1</answer>") == 0.0  # at most one space or newline
    assert format_score("x" * 200 + "<think>a</think><answer>1</answer>") == 0.0
    assert format_score_reward(["<answer>1</answer>", "<think></think><answer></answer>"]) == [0.0, 1.0]
    start = time.perf_counter()
    format_score("<think>" + "</think>x" * 200_000 + "</answer>")  # quadratic for the regex
    assert time.perf_counter() - start < 2.0


def test_default_rewards_per_task_and_format_style():
    weighted = default_rewards("chemistry", format=0.01, tag_count=0.01, format_style="score")
    assert [(w.name, w.weight) for w in weighted] == [("accuracy", 1.0), ("format", 0.01), ("tag_count", 0.01)]
    assert weighted[0].fn is chemistry_accuracy and weighted[1].fn is format_score_reward
    assert default_rewards("gsm8k")[1].fn is format_reward  # "exact" by default
    with pytest.raises(ValueError, match="unknown task 'chem'; expected one of"):
        default_rewards("chem")
    with pytest.raises(ValueError, match="unknown format_style 'soft'"):
        default_rewards("math", format_style="soft")


def test_math_verify_timeouts_count_as_timeouts_and_log_nothing(monkeypatch, caplog):
    """math-verify's own timeout: 0 in a batch; alone (as the pool calls it) a TimeoutError the pool counts."""
    import logging

    import math_verify
    from math_verify.errors import TimeoutException

    from podsjax.rewards import worker_process, chemistry_grader, mathverify

    def slow(*args, **kwargs):
        raise TimeoutException()

    monkeypatch.setattr(math_verify, "parse", slow)
    mathverify._parse_gold.cache_clear()
    monkeypatch.setattr(mathverify, "_parse_gold", lambda gold, timeout: ("gold",))
    caplog.set_level(logging.DEBUG)
    hard = r"<answer>\frac{1}{" + "{" * 50 + "}</answer>"
    assert mathverify.math_accuracy([hard, hard], ["1", "1"]) == [0.0, 0.0]
    with pytest.raises(mathverify.MathVerifyTimeout):
        mathverify.math_accuracy([hard], ["1"])
    with pytest.raises(mathverify.MathVerifyTimeout):
        chemistry_grader.chemistry_accuracy([r"<answer>\frac{3}{4}</answer>"], ["0.75"])
    assert chemistry_grader.chemistry_accuracy([r"<answer>\frac{3}{4}</answer>"] * 2, ["0.75"] * 2) == [0.0, 0.0]
    results = worker_process.run_item([mathverify.math_accuracy], hard, {"answer": "1"}, timeout_s=30.0)
    assert results == [(0.0, worker_process.TIMEOUT, worker_process.OWN_BUDGET)]  # never gives up on the function
    assert not [r for r in caplog.records if r.name.startswith("math_verify")]


def test_math_verify_parse_failures_are_silent(caplog):
    import logging

    from podsjax.rewards import mathverify

    caplog.set_level(logging.DEBUG)
    junk = "<answer>$" + "\\frac{" * 2000 + "$</answer>"
    assert mathverify.math_accuracy([junk, "<answer>2</answer>"], ["2", "2"]) == [0.0, 1.0]
    assert sum(len(r.getMessage()) for r in caplog.records) < 1000


def test_a_pool_launched_without_waiting_starts_while_the_caller_works_and_scores_after():
    launched = RewardPool(max_workers=1, timeout_s=5.0)  # not `with`: entering it waits for the workers
    try:
        assert launched.start(wait=False) is launched
        assert [w.state for w in launched._workers] == ["starting"]  # returned before the worker was ready
        scores = launched.score(["<answer>18</answer>"], "gsm8k_accuracy", answer=["18"])
        assert [w.state for w in launched._workers] == ["idle"]
    finally:
        launched.close()
    np.testing.assert_array_equal(scores.total_B, [1.0])
