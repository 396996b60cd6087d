"""The tiny preset's MATH-like and chemistry-like tasks: answers, rewards, splits, prompt lengths."""

import re
from fractions import Fraction

import pytest

from experiments import paper_settings
from podsjax import rewards, tiny
from podsjax.data import prompts
from podsjax.data.datasets import reward_columns
from podsjax.rewards.combine import TASK_ACCURACY
from podsjax.tiny import chemistry_like, math_like, problems

OTHER_TASKS = ("math", "chemistry")


def _math_value(text: str) -> Fraction:
    """A gold answer as a Fraction, read independently of math-verify."""
    match = re.fullmatch(r"\\frac\{(-?\d+)\}\{(\d+)\}", text)
    return Fraction(int(match[1]), int(match[2])) if match else Fraction(int(text))


def _solve_math(question: str) -> Fraction:
    """Recomputes a MATH-like question's answer from its text alone."""
    if match := re.search(r"\$(\d+)([a-z]) ([-+]) (\d+) = (-?\d+)\$", question):
        a, _, sign, b, c = match.groups()
        return Fraction(int(c) - int(b) if sign == "+" else int(c) + int(b), int(a))
    if match := re.search(r"\$(\d+)([a-z]) = (\d+)\$", question):
        return Fraction(int(match[3]), int(match[1]))
    if match := re.search(r"\\frac\{(\d+)\}\{(\d+)\} \+ \\frac\{(\d+)\}\{(\d+)\}", question):
        a, d, b, d2 = map(int, match.groups())
        return Fraction(a, d) + Fraction(b, d2)
    match = re.search(r"\$(\d+)\^2 - (\d+)\$", question)
    return Fraction(int(match[1]) ** 2 - int(match[2]))


def _solve_chemistry(problem: str) -> float:
    """Recomputes a chemistry-like problem's answer from its text alone."""
    numbers = [int(n) for n in re.findall(r"(?<![A-Za-z])\d+", problem)]
    if "the mass of" in problem:
        return numbers[0] * numbers[-1]
    if " g of " in problem:
        return numbers[0] / numbers[-1]
    if "dissolved" in problem:
        return numbers[0] / numbers[1]
    if "kJ" in problem:
        return numbers[0] * 1000
    volume, pressure, new_pressure = numbers
    return volume * pressure / new_pressure


def test_math_like_answers_recompute_from_the_question():
    examples = tiny.generate_problems(1500, seed=0, task="math")
    for e in examples:
        assert _math_value(e.answer) == _solve_math(e.prompt), e.prompt
        assert rewards.math_gold(solution=e.columns["solution"]) == e.answer  # the MATH layout: \boxed last
    assert any("frac" in e.answer for e in examples) and any(e.answer.startswith("-") for e in examples)


def test_math_fractions_are_in_lowest_terms():
    assert math_like.latex_fraction(6, 4) == r"\frac{3}{2}"
    assert math_like.latex_fraction(8, 4) == "2" and math_like.latex_fraction(-3, 6) == r"\frac{-1}{2}"


def test_chemistry_like_answers_recompute_from_the_problem():
    examples = tiny.generate_problems(1500, seed=0, task="chemistry")
    units = {e.columns["unit"] for e in examples}
    assert units == {"g", "mol", "mol/L", "J", "L"}
    for e in examples:
        assert float(e.answer) == pytest.approx(_solve_chemistry(e.columns["problem"]), rel=1e-12), e.prompt
        assert e.prompt.startswith(e.columns["problem"]) and e.columns["unit"] in e.prompt


@pytest.mark.parametrize("task", OTHER_TASKS)
def test_sft_targets_score_full_reward_and_a_wrong_answer_scores_zero(task):
    examples = tiny.generate_problems(200, seed=7, split="test", task=task)
    completions = [tiny.sft_completion(e) for e in examples]
    columns = reward_columns(examples)
    accuracy = TASK_ACCURACY[task]
    assert accuracy(completions, **columns) == [1.0] * len(examples)
    assert rewards.format_reward(completions) == [1.0] * len(examples)
    # A wrong number in the answer tag scores 0 (for chemistry: 20 % off, outside the 5 % band).
    def wrong(e):
        value = _math_value(e.answer) + 1 if task == "math" else float(e.answer) * 1.2
        return f"<think>x</think><answer>{value}</answer>"

    assert accuracy([wrong(e) for e in examples], **columns) == [0.0] * len(examples)


def test_chemistry_reward_accepts_a_near_miss_within_five_percent():
    example = next(e for e in tiny.generate_problems(200, seed=1, task="chemistry") if float(e.answer) >= 20)
    near = float(example.answer) * 1.04
    score = rewards.chemistry_accuracy([f"<answer>{near}</answer>"], [example.answer], [example.columns["unit"]])
    assert score == [1.0]


@pytest.mark.parametrize("task", OTHER_TASKS)
def test_splits_are_disjoint_and_seeded(task):
    splits = tiny.make_splits(0, task=task, num_train=1000, num_validation=64, num_test=256)
    sets = [{e.prompt for e in s} for s in (splits.train, splits.validation, splits.test)]
    assert [len(s) for s in sets] == [1000, 64, 256]
    assert not sets[0] & sets[1] and not sets[0] & sets[2] and not sets[1] & sets[2]
    other = tiny.make_splits(1, task=task, num_train=1000, num_validation=64, num_test=256)
    assert [e.prompt for e in other.test] != [e.prompt for e in splits.test]
    assert not {e.prompt for e in other.train} & sets[2]


@pytest.mark.parametrize("task", OTHER_TASKS)
def test_prompts_fit_the_tiny_defaults(task):
    """Every test prompt fits max_prompt_length, so none is skipped from evaluation."""
    tokenizer = tiny.build_tokenizer(task=task)
    limit = paper_settings.TINY.run["max_prompt_length"]
    examples = tiny.generate_problems(256, seed=0, split="test", task=task)
    lengths = [len(tokenizer(prompts.build_prompt(tokenizer, e.prompt))["input_ids"]) for e in examples]
    assert max(lengths) <= limit
    completion_lengths = [len(tokenizer(tiny.sft_completion(e))["input_ids"]) for e in examples]
    assert max(completion_lengths) < paper_settings.TINY.run["max_new_tokens"]


def test_exhausted_space_raises_unless_at_most():
    with pytest.raises(ValueError, match="ran out of distinct validation problems"):
        tiny.generate_problems(10_000, seed=0, split="validation", task="chemistry")
    every = tiny.generate_problems(10_000, seed=0, split="validation", task="chemistry", at_most=True)
    assert 64 <= len(every) < 10_000 and len({e.prompt for e in every}) == len(every)


@pytest.mark.parametrize("task", tiny.TASKS)
def test_a_larger_test_split_extends_the_default_one_and_stops_where_the_task_does(task):
    _, default = tiny.tiny_tasks(0, task=task)
    train, larger = tiny.tiny_tasks(0, task=task, num_test=512)
    assert len(default) == tiny.TEST_PROBLEMS
    assert [e.prompt for e in larger[:len(default)]] == [e.prompt for e in default]
    # chemistry-like has fewer than 512 distinct test problems: all of them, none repeated
    assert tiny.TEST_PROBLEMS < len(larger) <= 512 and len({e.prompt for e in larger}) == len(larger)
    assert (len(larger) == 512) == (task != "chemistry")
    assert not {e.prompt for e in train} & {e.prompt for e in larger}
    with pytest.raises(ValueError, match="num_test must be an integer >= 1, got 0"):
        tiny.tiny_tasks(0, task=task, num_test=0)
    # 2.5 had given 3 test problems, and a negative seed failed inside NumPy.
    for kwargs, message in ((dict(num_test=2.5), "num_test must be an integer >= 1, got 2.5"),
                            (dict(num_train=True), "num_train must be an integer >= 1, got True")):
        with pytest.raises(ValueError, match=message):
            tiny.tiny_tasks(0, task=task, **kwargs)
    with pytest.raises(ValueError, match="seed must be an integer >= 0, got -1"):
        tiny.tiny_tasks(-1, task=task)


def test_an_absurd_test_split_stops_at_its_cap(monkeypatch):
    monkeypatch.setattr(problems, "MAX_TEST_PROBLEMS", 300)  # the cap, small enough to generate here
    _, test = tiny.tiny_tasks(0, task="gsm8k", num_test=1000)
    assert len(test) == 300


def test_unknown_task_is_one_line():
    with pytest.raises(ValueError, match="no task 'mmlu'; expected one of gsm8k, math, chemistry"):
        tiny.generate_problems(1, seed=0, task="mmlu")
    with pytest.raises(ValueError, match="WarmupConfig.task"):
        tiny.WarmupConfig(task="mmlu")


def test_each_task_has_its_own_vocabulary():
    assert problems.TASKS == ("gsm8k", "math", "chemistry")
    vocab = tiny.build_tokenizer(task="chemistry").get_vocab()
    assert any("mol" in token for token in vocab)
    assert chemistry_like.number(0.25) == "0.25" and chemistry_like.number(54.0) == "54"


def test_max_operations_draws_one_step_problems_only():
    easy = tiny.generate_problems(500, seed=0, max_operations=1)
    assert {e.columns["operations"] for e in easy} == {ops for ops, _ in tiny.TEMPLATES if len(ops) == 1}
    assert all(len(e.columns["operands"]) == 2 for e in easy)
    # The default difficulty is every template, drawn exactly as without the argument.
    full = tiny.generate_problems(300, seed=0, max_operations=tiny.MAX_OPERATIONS)
    assert [e.prompt for e in full] == [e.prompt for e in tiny.generate_problems(300, seed=0)]
    train, test = tiny.tiny_tasks(0, num_train=200, num_test=100, max_operations=1)
    assert not {e.prompt for e in train} & {e.prompt for e in test}
    assert {len(e.columns["operations"]) for e in train + test} == {1}


@pytest.mark.parametrize("task, value, message", [
    ("math", 1, "max_operations sets the gsm8k task's difficulty; the math task has none"),
    ("gsm8k", 0, "max_operations must be an integer from 1 to 2, got 0"),
    ("gsm8k", 3, "max_operations must be an integer from 1 to 2, got 3"),
    ("gsm8k", True, "max_operations must be an integer from 1 to 2, got True"),
])
def test_max_operations_out_of_reach_is_one_line(task, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tiny.generate_problems(1, seed=0, task=task, max_operations=value)
    with pytest.raises(ValueError, match=re.escape(message)):
        tiny.WarmupConfig(task=task, max_operations=value)
