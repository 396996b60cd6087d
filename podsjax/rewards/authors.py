"""The rewards of the paper's runs, as the authors' code computes them (YixuanEvenXu/pods).

Single GPU, release 3fc107e (``utils/data.py``), settings a, c and d:

- correctness 1 or 0: :func:`authors_correct`, the authors' ``grade_answer`` on the whole
  text, the answer tag's content or the last run of digits (GSM8K and MATH alike);
- for **wrong** answers only, a format score of 0.1 less 0.001 per character outside the
  ``<think>..</think>[ \\n]?<answer>..</answer>`` span, and 0.025 per tag that appears
  exactly once (:func:`release_format_reward`, :func:`release_tag_count_reward`).

Single GPU, commit 0c453d2 (Llama, setting b): the same correctness but for its last number,
the last run of digits, dots and commas (:data:`LLAMA_LAST_NUMBER`: ``1,000`` and ``5.00``
whole, and a sentence's closing ``.`` a number of its own), and 0.01 x the format and tag
rewards of ``podsjax.rewards.format`` on every completion.

Eight GPUs, open-r1's ``rewards.py`` (settings e and f), each with weight 1:

- :func:`r1_accuracy`: math-verify with LaTeX extraction only, so a bare ``72`` scores 0
  and ``$72$`` or ``\\boxed{72}`` score 1;
- :func:`r1_format_reward`: exactly ``<think>\\n..\\n</think>\\n<answer>\\n..\\n</answer>``;
- :func:`r1_tag_count_reward`: 0.25 for each of ``<think>\\n``, ``\\n</think>\\n``,
  ``\\n<answer>\\n`` and ``\\n</answer>`` that appears exactly once.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

from podsjax.rewards.answer_grader import grade_answer
from podsjax.rewards.format import format_score
from podsjax.rewards.gsm8k_grader import GSM8K_MARKER
from podsjax.rewards.mathverify import (DEFAULT_MATH_VERIFY_TIMEOUT_S, MathVerifyTimeout, math_gold, quiet_parse,
                                        quiet_verify, signal_timeout)
from podsjax.rewards.text import ANSWER_CLOSE, ANSWER_OPEN, THINK_CLOSE, THINK_OPEN, parse_number, texts

_RELEASE_FORMAT_SCALE = 0.1  # 0.1 - 0.001 per character outside: 0.1 x format_score
_RELEASE_TAG = 0.025
_TAGS = (THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE)
# The last number each commit's extract_last_integer takes: release 3fc107e's, and the Llama commit 0c453d2's.
RELEASE_LAST_NUMBER = re.compile(r"\d+")
LLAMA_LAST_NUMBER = re.compile(r"[\d\.\,]+")
_R1_FORMAT = re.compile(r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$", re.DOTALL | re.MULTILINE)
_R1_TAGS = ("<think>\n", "\n</think>\n", "\n<answer>\n", "\n</answer>")


def _split_answer(text: str) -> str:
    """The authors' ``extract_xml_answer``: after the last ``<answer>``, up to the next ``</answer>``."""
    return text.split(ANSWER_OPEN)[-1].split(ANSWER_CLOSE)[0].strip()


def authors_correct(text: str, gold: str, last_number: re.Pattern = RELEASE_LAST_NUMBER) -> bool:
    """The authors' correctness: :func:`~podsjax.rewards.answer_grader.grade_answer` accepts the
    whole text, the answer tag's content or the last match of ``last_number`` in the text
    (``-1`` when there is none): :data:`RELEASE_LAST_NUMBER` or :data:`LLAMA_LAST_NUMBER`."""
    numbers = last_number.findall(text)
    return any(grade_answer(candidate, gold) for candidate in (text, _split_answer(text), numbers[-1] if numbers else "-1"))


def authors_gsm8k_gold(answer: Any) -> str:
    """The gold as the authors read it: the text after ``####`` without commas, else the value as text."""
    text = str(answer)
    if GSM8K_MARKER in text:
        return text.split(GSM8K_MARKER)[1].strip().replace(",", "")
    return text.strip()


def _gsm8k_accuracy(name: str, completions: Sequence[str], answer, last_number: re.Pattern) -> list[float]:
    if answer is None:
        raise ValueError(f"{name} needs an 'answer' column")
    completions = texts(name, completions, {"answer": answer})
    return [1.0 if authors_correct(text, authors_gsm8k_gold(gold), last_number) else 0.0
            for text, gold in zip(completions, answer)]


def _math_accuracy(name: str, completions: Sequence[str], answer, solution, last_number: re.Pattern) -> list[float]:
    if answer is None and solution is None:
        raise ValueError(f"{name} needs an 'answer' or 'solution' column")
    completions = texts(name, completions, {"answer": answer, "solution": solution})
    answers = answer if answer is not None else [None] * len(completions)
    solutions = solution if solution is not None else [None] * len(completions)
    return [1.0 if authors_correct(text, math_gold(gold, worked), last_number) else 0.0
            for text, gold, worked in zip(completions, answers, solutions)]


def authors_gsm8k_accuracy(completions: Sequence[str], answer: Sequence[Any] | None = None, **_: Any) -> list[float]:
    """[B] 1.0 where :func:`authors_correct` (release 3fc107e), else 0.0 (``answer``: the gold,
    a number or a solution ending in ``#### n``)."""
    return _gsm8k_accuracy("authors_gsm8k_accuracy", completions, answer, RELEASE_LAST_NUMBER)


def authors_math_accuracy(completions: Sequence[str], answer: Sequence[Any] | None = None,
                          solution: Sequence[Any] | None = None, **_: Any) -> list[float]:
    """[B] 1.0 where :func:`authors_correct` (release 3fc107e), else 0.0; the gold is ``answer``,
    else the solution's last ``\\boxed{..}`` (:func:`~podsjax.rewards.math_gold`)."""
    return _math_accuracy("authors_math_accuracy", completions, answer, solution, RELEASE_LAST_NUMBER)


def llama_gsm8k_accuracy(completions: Sequence[str], answer: Sequence[Any] | None = None, **_: Any) -> list[float]:
    """[B] :func:`authors_gsm8k_accuracy` as the Llama commit 0c453d2 grades: its last number
    is :data:`LLAMA_LAST_NUMBER`'s."""
    return _gsm8k_accuracy("llama_gsm8k_accuracy", completions, answer, LLAMA_LAST_NUMBER)


def llama_math_accuracy(completions: Sequence[str], answer: Sequence[Any] | None = None,
                        solution: Sequence[Any] | None = None, **_: Any) -> list[float]:
    """[B] :func:`authors_math_accuracy` as the Llama commit 0c453d2 grades (:data:`LLAMA_LAST_NUMBER`)."""
    return _math_accuracy("llama_math_accuracy", completions, answer, solution, LLAMA_LAST_NUMBER)


def _wrong_only(values: list[float], correct: Sequence[float]) -> list[float]:
    return [0.0 if right else value for value, right in zip(values, correct)]


def release_format_reward(completions: Sequence[str], *, accuracy: Callable[..., Sequence[float]] = authors_gsm8k_accuracy,
                          **columns: Any) -> list[float]:
    """[B] ``max(0, 0.1 - 0.001 x characters outside the span)`` for wrong answers, 0 for right
    ones (right as ``accuracy`` grades them)."""
    completions = texts("release_format_reward", completions, {})
    scores = [_RELEASE_FORMAT_SCALE * format_score(text) for text in completions]
    return _wrong_only(scores, accuracy(completions, **columns))


def release_tag_count_reward(completions: Sequence[str], *,
                             accuracy: Callable[..., Sequence[float]] = authors_gsm8k_accuracy,
                             **columns: Any) -> list[float]:
    """[B] 0.025 per tag that appears exactly once, for wrong answers only."""
    completions = texts("release_tag_count_reward", completions, {})
    counts = [_RELEASE_TAG * sum(text.count(tag) == 1 for tag in _TAGS) for text in completions]
    return _wrong_only(counts, accuracy(completions, **columns))


def _latex_extraction():
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig

    return [LatexExtractionConfig(
        # open-r1 also passed equations=True, which math-verify now deprecates: its parser
        # handles equations itself.
        normalization_config=NormalizationConfig(nits=False, malformed_operators=False, basic_latex=True,
                                                 boxed="all", units=True),
        boxed_match_priority=0, try_extract_without_anchor=False)]


def r1_accuracy(completions: Sequence[str], answer: Sequence[Any] | None = None, *,
                timeout_s: int = DEFAULT_MATH_VERIFY_TIMEOUT_S, **_: Any) -> list[float]:
    """[B] open-r1's accuracy: the gold parsed as it comes, the completion's first LaTeX
    answer (a box first), equal under math-verify. A gold that does not parse scores 0, as
    in the authors' trainer (open-r1 returns None, which it sums as NaN with nansum). A gold
    that is no plain number is read as LaTeX math, ``$gold$``: MATH's bare answers
    (``3\\sqrt{13}``, which math-verify reads as 3 without its ``$``; open-r1's datasets
    hold them inside ``$...$``). An item on which math-verify times out scores 0; alone
    (as ``RewardPool`` calls it) it raises :class:`~podsjax.rewards.mathverify.MathVerifyTimeout`."""
    if answer is None:
        raise ValueError("r1_accuracy needs an 'answer' column")
    completions = texts("r1_accuracy", completions, {"answer": answer})
    from math_verify import parse
    from math_verify.errors import TimeoutException

    timeout = signal_timeout(timeout_s)
    config = _latex_extraction()
    out = []
    for text, gold in zip(completions, answer):
        try:
            gold = str(gold)
            latex = parse_number(gold) is None and "$" not in gold  # as plain text, a piece of it would parse
            gold_parsed = quiet_parse(f"${gold}$" if latex else gold, timeout)
            if not gold_parsed:
                out.append(0.0)
                continue
            try:
                predicted = parse(text, extraction_config=config, extraction_mode="first_match",
                                  parsing_timeout=timeout, raise_on_error=True)
            except TimeoutException:  # a BaseException: `except Exception` lets it through
                raise MathVerifyTimeout(f"math-verify parse ran past {timeout} s") from None
            except Exception:  # noqa: BLE001 - no LaTeX answer in the completion
                predicted = []
            out.append(1.0 if predicted and quiet_verify(gold_parsed, predicted, timeout) else 0.0)
        except MathVerifyTimeout:
            if len(completions) == 1:
                raise
            out.append(0.0)
    return out


def r1_format_reward(completions: Sequence[str], **_: Any) -> list[float]:
    """[B] 1.0 for exactly ``<think>\\n..\\n</think>\\n<answer>\\n..\\n</answer>``, else 0.0."""
    return [1.0 if _R1_FORMAT.match(text) else 0.0 for text in texts("r1_format_reward", completions, {})]


def r1_tag_count_reward(completions: Sequence[str], **_: Any) -> list[float]:
    """[B] 0.25 for each newline-exact tag that appears exactly once."""
    completions = texts("r1_tag_count_reward", completions, {})
    return [0.25 * sum(text.count(tag) == 1 for tag in _R1_TAGS) for text in completions]
