"""Format rewards for the PODS output format ``<think>...</think><answer>...</answer>``."""

from __future__ import annotations

from typing import Any, Sequence

from podsjax.rewards.text import ANSWER_CLOSE, ANSWER_OPEN, THINK_CLOSE, THINK_OPEN

_TAGS = (THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE)


def follows_format(text: str) -> bool:
    """True when ``text`` is exactly ``<think>..</think><answer>..</answer>``.

    Whitespace may surround the two blocks; nothing else may. Each tag appears
    once and the answer is not blank. Uses ``str.find`` instead of a regex so
    the check stays linear on adversarial input.
    """
    if any(text.count(tag) != 1 for tag in _TAGS):
        return False
    think_open, think_close = text.find(THINK_OPEN), text.find(THINK_CLOSE)
    answer_open, answer_close = text.find(ANSWER_OPEN), text.find(ANSWER_CLOSE)
    if not think_open < think_close < answer_open < answer_close:
        return False
    outside = (
        text[:think_open],
        text[think_close + len(THINK_CLOSE):answer_open],
        text[answer_close + len(ANSWER_CLOSE):],
    )
    if any(part.strip() for part in outside):
        return False
    return bool(text[answer_open + len(ANSWER_OPEN):answer_close].strip())


def format_reward(completions: Sequence[str], **_: Any) -> list[float]:
    """1.0 for completions in the exact think/answer format (see ``follows_format``), else 0.0.

    Args:
        completions: [B] decoded completions.
        **_: dataset columns, ignored.

    Returns:
        [B] rewards in {0.0, 1.0}.
    """
    return [1.0 if follows_format(text) else 0.0 for text in completions]


def tag_count_reward(completions: Sequence[str], **_: Any) -> list[float]:
    """0.25 for each of the four tags that appears exactly once.

    A softer signal than ``format_reward``: a completion that gets some tags
    right earns partial credit, which helps a model that has not found the format yet.

    Args:
        completions: [B] decoded completions.
        **_: dataset columns, ignored.

    Returns:
        [B] rewards in {0, 0.25, 0.5, 0.75, 1.0}.
    """
    return [0.25 * sum(text.count(tag) == 1 for tag in _TAGS) for text in completions]
