"""The authors' answer grader agrees with their grade_answer on hand-worked answers.

Each expected value is worked out by hand from release 3fc107e's ``utils/grader.py`` and
``utils/normalize.py`` (MATH's normalization, then PRM800K's, string equality, sympy off).
"""

import pytest

from podsjax.rewards import authors
from podsjax.rewards.answer_grader import grade_answer, mathd_normalize, prm_normalize

CASES = [
    # (given, gold, right?, why)
    ("72", "72", True, "the same string"),
    ("72.0", "72", True, "PRM800K writes a whole float as an integer"),
    ("$72$", "72", True, "PRM800K drops dollar signs"),
    ("1,000", "1000", True, "thousands commas go"),
    ("3 hours", "3", True, "unit words go"),
    ("1/2", "\\frac{1}{2}", True, "MATH turns a/b into \\frac{a}{b}"),
    ("0.5", "\\frac{1}{2}", True, "MATH's one decimal rule"),
    ("\\dfrac12", "\\frac{1}{2}", True, "dfrac is frac, and \\frac12 is braced"),
    ("x = 5", "5", True, "a short left side of = is dropped"),
    ("(1, 2)", "(1,2)", True, "spaces go"),
    ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}", True, "both render to sqrt(2)/2"),
    ("\\text{(A)}", "(A)", True, "an enclosing \\text goes"),
    ("1,000/3", "1000/3", True, "a tuple of one fraction, written alike once commas go"),
    ("2/4", "\\frac{1}{2}", False, "no algebra: an unreduced fraction is wrong"),
    ("\\sqrt{4}", "2", False, "no algebra"),
    ("2 1/2", "2.5", False, "a mixed number becomes 2+1/2, not 2.5"),
    ("(1,2]", "(1,2)", False, "the brackets differ"),
    ("71", "72", False, "a different number"),
    (None, "72", False, "no answer"),
]


@pytest.mark.parametrize("given,gold,right,why", CASES, ids=[case[3] for case in CASES])
def test_grade_answer_matches_the_authors_grader(given, gold, right, why):
    assert grade_answer(given, gold) is right, why


def test_each_normalization_on_its_own():
    assert mathd_normalize("\\left( \\frac12, .5 \\right)") == "(\\frac{1}{2},0.5)"
    assert mathd_normalize("5\\text{ cm}\\text{ m}") == "5\\text{ cm}\\text{ m}"  # two units: left as it is
    assert prm_normalize("Mondays") == "mon"  # "days" is a unit word, wherever it appears
    assert prm_normalize("3 million") == "3*10^6"
    assert mathd_normalize(None) is None and prm_normalize(None) is None


def test_the_authors_correctness_tries_the_text_the_tag_and_the_last_integer():
    assert authors.authors_correct("72", "72")  # the whole text
    assert authors.authors_correct("<answer> $72$ </answer> since 9 x 8", "72")  # the tag
    assert authors.authors_correct("so it is 72 apples.", "72")  # the last run of digits
    assert not authors.authors_correct("72 apples, or 73", "72")
    assert authors.authors_correct("no digits at all", "-1")  # "-1" stands in for no digits, as theirs does


def test_the_authors_math_accuracy_reads_the_gold_from_the_answer_or_the_solution():
    completions = ["<answer>1/2</answer>", "<answer>2/4</answer>", "<answer>\\frac{1}{2}</answer>"]
    from_answer = authors.authors_math_accuracy(completions, answer=["\\frac{1}{2}"] * 3)
    from_solution = authors.authors_math_accuracy(completions, solution=["so \\boxed{\\frac{1}{2}}."] * 3)
    assert from_answer == from_solution == [1.0, 0.0, 1.0]


def test_the_authors_gsm8k_gold_is_the_text_after_the_marker_without_commas():
    assert authors.authors_gsm8k_gold("48 + 24 = 72\n#### 1,072") == "1072"
    assert authors.authors_gsm8k_gold(72) == "72"
    assert authors.authors_gsm8k_accuracy(["<answer>1,072</answer>", "1072", "1071"],
                                          answer=["#### 1,072"] * 3) == [1.0, 1.0, 0.0]


# The authors' reader truncates a MATH training gold such as \frac{1}{2} to "\frac{1": pylatexenc
# renders its \frac without arguments and warns "macro '\frac' failed its substitution!".
TRUNCATED = "\\frac{1"


def test_a_macro_short_of_its_arguments_logs_no_warning(caplog):
    with caplog.at_level("DEBUG"):
        assert prm_normalize(TRUNCATED) == "%s/%s1"  # pylatexenc keeps the macro's text
        assert not grade_answer("\\frac{1}{2}", TRUNCATED)
    assert not [r for r in caplog.records if "failed its substitution" in r.getMessage()], caplog.text


def test_reward_workers_print_no_pylatexenc_warning(capfd):
    from podsjax.rewards import RewardPool, WeightedReward

    # spawn: the workers write to this test's captured stderr.
    with RewardPool(max_workers=1, start_method="spawn") as pool:
        scores = pool.score(["\\boxed{\\frac{1}{2}}", "<answer>\\frac{1</answer>"],
                            [WeightedReward(authors.authors_math_accuracy, 1.0)], answer=[TRUNCATED] * 2)
    assert list(scores.per_function["authors_math_accuracy"]) == [0.0, 1.0]
    err = capfd.readouterr().err
    assert "failed its substitution" not in err, err
