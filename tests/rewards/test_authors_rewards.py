"""Each paper setting's rewards score fixed completions as the authors' functions do.

The expected totals are worked out by hand from the authors' code: release 3fc107e's
``utils/data.py`` (a, c, d), commit 0c453d2 (b) and open-r1's ``rewards.py`` (e, f).
"""

import pytest

from experiments import paper_settings
from podsjax.rewards import authors, default_rewards, score_rewards

RIGHT = "<think>48+24=72</think><answer>72</answer>"
WRONG = "<think>48+24=71</think><answer>71</answer> extra"  # 6 characters after the span
LATEX = "<think>\nadd them\n</think>\n<answer>\n$72$\n</answer>"
BARE = "<answer>\n72\n</answer>"
BOXED = "The sum is \\boxed{72}."
RESCUED = "<think>so 71</think><answer>71</answer> no wait, 72"  # 12 characters after; the last integer is right
COMPLETIONS = [RIGHT, WRONG, LATEX, BARE, BOXED, RESCUED]

EXPECTED = {
    # correctness, then for wrong answers only 0.1 - 0.001 x 6 = 0.094 and 4 x 0.025.
    "a": [1.0, 0.194, 1.0, 1.0, 1.0, 1.0],
    # correctness, then on every completion 0.01 x (1 - 0.01 x outside) and 0.01 x 0.25 a tag.
    # The box's sentence ends in ".", the last number the Llama commit reads there: wrong.
    "b": [1.0 + 0.01 + 0.01, 0.01 * 0.94 + 0.01, 1.0 + 0.01 + 0.01, 1.0 + 0.0 + 0.01 * 0.5, 0.0,
          1.0 + 0.01 * (1 - 0.01 * 12) + 0.01],
    # correctness alone, by grade_answer: "$72$" loses its dollars, and the box's 72 and the
    # rescued 72 are the last runs of digits.
    "c": [1.0, 0.0, 1.0, 1.0, 1.0, 1.0],
    # SciBench's 5 % rule: 71 is within 5 % of 72, so nothing is wrong and no format counts.
    "d": [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
    # LaTeX-only accuracy + newline-exact format + newline-exact tags (0.25 each).
    "e": [0.0, 0.0, 3.0, 0.25, 1.0, 0.0],
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_setting_scores_fixed_completions_as_the_authors_code_does(name):
    setting = paper_settings.get_setting(name)
    rewards = default_rewards(setting.task, **setting.rewards)
    columns = {"answer": ["72"] * len(COMPLETIONS)}
    if setting.task == "chemistry":
        columns["unit"] = [""] * len(COMPLETIONS)
    scores = score_rewards(COMPLETIONS, rewards, **columns)
    assert list(scores.total_B) == pytest.approx(EXPECTED[name], abs=1e-6), scores.per_function  # float32 totals


def test_the_eight_gpu_settings_share_their_rewards():
    assert paper_settings.get_setting("f").rewards == paper_settings.get_setting("e").rewards


# (completion, gold, right for release 3fc107e (a, c, d), right for the Llama commit 0c453d2 (b)).
# The release's last number is the last run of digits; the Llama commit's the last run of
# digits, dots and commas. The whole text and the answer tag are read alike by both.
LAST_NUMBER_CASES = [
    # A sentence's closing "." is the Llama commit's last number: wrong for b, right for a.
    ("... So, Janet makes $18 every day at the farmers' market.", "18", True, False),
    ("Janet has 3 ducks and sells 18,", "18", True, False),  # "18," is one number there
    ("Each costs 2.5, so 5", "5", True, True),
    ("Each costs 2.5", "5", True, False),  # the release reads the "5" after the dot
    ("The total is 1,000", "1000", False, True),  # the release reads "000"
    ("Total: 5.00", "5", False, True),  # the release reads "00"
    ("The answer is 18.", "18", True, True),  # "18." grades as 18
    ("So she makes $18 a day.\n<answer>18</answer>.", "18", True, True),  # the answer tag
    ("no number here", "18", False, False),
]


@pytest.mark.parametrize("text,gold,release,llama", LAST_NUMBER_CASES)
def test_each_commit_reads_the_last_number_with_its_own_extractor(text, gold, release, llama):
    assert authors.authors_correct(text, gold) is release
    assert authors.authors_correct(text, gold, authors.LLAMA_LAST_NUMBER) is llama
    # As setting a and setting b score it (b's accuracy is the Llama commit's grader).
    for name, right in (("a", release), ("b", llama)):
        setting = paper_settings.get_setting(name)
        scores = score_rewards([text], default_rewards(setting.task, **setting.rewards), answer=[gold])
        assert scores.per_function["accuracy"][0] == float(right), name


def test_open_r1_accuracy_reads_a_latex_gold_as_math_and_a_number_as_it_comes():
    # Without its "$", math-verify reads 3\sqrt{13} as 3 and \left( 3, \frac{\pi}{2} \right) as
    # nothing: a boxed copy of the gold scored 0 on 108 of MATH-500's answers.
    golds = ["3\\sqrt{13}", "\\left( 3, \\frac{\\pi}{2} \\right)", "6 - 5i", "p - q", "18", "1,000"]
    right = [f"$\\boxed{{{g}}}$" for g in golds]
    assert authors.r1_accuracy(right, answer=golds) == [1.0] * len(golds)
    assert authors.r1_accuracy(["$\\boxed{3}$", "$\\boxed{17}$"], answer=["3\\sqrt{13}", "18"]) == [0.0, 0.0]


def test_open_r1_accuracy_scores_a_timeout_0_and_alone_raises_it(monkeypatch):
    # math-verify's TimeoutException is a BaseException: it went past `except Exception` and
    # took the batch's other items with it.
    import math_verify
    from math_verify.errors import TimeoutException

    from podsjax.rewards.mathverify import MathVerifyTimeout

    parse = math_verify.parse

    def slow_on_deep(text, *args, **kwargs):
        if "deep" in text:
            raise TimeoutException("parse ran too long")
        return parse(text, *args, **kwargs)

    monkeypatch.setattr(math_verify, "parse", slow_on_deep)
    assert authors.r1_accuracy(["\\boxed{deep}", "$\\boxed{18}$"], answer=["18", "18"]) == [0.0, 1.0]
    with pytest.raises(MathVerifyTimeout):
        authors.r1_accuracy(["\\boxed{deep}"], answer=["18"])
