"""GSM8K accuracy: numeric final answers compared exactly."""

from __future__ import annotations

from fractions import Fraction
from typing import Any, Sequence

from podsjax.rewards.text import extract_answer_tag, first_number, last_number, texts

GSM8K_MARKER = "####"


def extract_gsm8k_answer(text: str) -> Fraction | None:
    """Extracts the final numeric answer of a completion.

    The answer is looked for, in order:

    1. inside the last ``<answer>...</answer>`` (its last number);
    2. after the last ``####`` (its first number, as in the GSM8K solutions);
    3. anywhere in the text (its last number).

    When a completion has ``<answer>`` tags, only their content counts: a number
    elsewhere does not rescue an answer tag without one.

    Args:
        text: the completion.

    Returns:
        The answer as an exact Fraction (so 18.00 == 18), or None when there is none.
    """
    tagged = extract_answer_tag(text)
    if tagged is not None:
        marker = tagged.rfind(GSM8K_MARKER)
        if marker >= 0:
            return first_number(tagged[marker + len(GSM8K_MARKER):])
        return last_number(tagged)
    marker = text.rfind(GSM8K_MARKER)
    if marker >= 0:
        return first_number(text[marker + len(GSM8K_MARKER):])
    return last_number(text)


def parse_gsm8k_gold(gold: Any) -> Fraction:
    """Parses a gold answer: a number, a numeric string, or a full solution ending in ``#### n``.

    Raises:
        ValueError: the gold holds no number (a data bug, never the model's fault).
    """
    if isinstance(gold, (int, Fraction)) and not isinstance(gold, bool):
        return Fraction(gold)
    if isinstance(gold, float):
        return Fraction(str(gold))
    text = str(gold)
    marker = text.rfind(GSM8K_MARKER)
    value = first_number(text[marker + len(GSM8K_MARKER):]) if marker >= 0 else last_number(text)
    if value is None:
        raise ValueError(f"GSM8K gold answer has no number: {text[:80]!r}")
    return value


def gsm8k_accuracy(completions: Sequence[str], answer: Sequence[Any] | None = None, **_: Any) -> list[float]:
    """1.0 where the completion's final number equals the gold, else 0.0.

    Args:
        completions: [B] decoded completions.
        answer: [B] gold answers (numbers, "18", or GSM8K solutions with ``#### 18``).
        **_: other dataset columns, ignored.

    Returns:
        [B] rewards in {0.0, 1.0}.
    """
    if answer is None:
        raise ValueError("gsm8k_accuracy needs an 'answer' column")
    completions = texts("gsm8k_accuracy", completions, {"answer": answer})
    rewards = []
    for completion, gold in zip(completions, answer):
        expected = parse_gsm8k_gold(gold)  # first: a gold with no number is an error whatever the completion
        predicted = extract_gsm8k_answer(completion)
        rewards.append(1.0 if predicted is not None and predicted == expected else 0.0)
    return rewards
