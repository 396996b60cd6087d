"""Format rewards for the PODS output format ``<think>...</think><answer>...</answer>``.

``format_reward`` is exact (1 or 0); ``format_score_reward`` is the authors' single-GPU
score, which loses 0.01 per character outside the tagged span; ``tag_count_reward`` gives
0.25 per tag; ``strict_format_reward`` is the authors' evaluation check (``format_correct``),
which the Llama setting's metric "answer and format both correct" uses.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from podsjax.rewards.text import ANSWER_CLOSE, ANSWER_OPEN, THINK_CLOSE, THINK_OPEN, require_text, texts

_TAGS = (THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE)
# The authors' evaluation format check (YixuanEvenXu/pods utils/data.py format_correct),
# applied with re.match, so "$" also matches before one final newline.
STRICT_FORMAT = re.compile(r"^[ \n]?<think>.*</think>[ \n]?<answer>.*</answer>[ \n]?$", re.DOTALL)


def follows_format(text: str) -> bool:
    """True when ``text`` is exactly ``<think>..</think><answer>..</answer>``.

    Whitespace may surround the two blocks; nothing else may. Each tag appears
    once and the answer is not blank. Uses ``str.find`` instead of a regex so
    the check stays linear on adversarial input.
    """
    if any(require_text(text).count(tag) != 1 for tag in _TAGS):
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
    return [1.0 if follows_format(text) else 0.0 for text in texts("format_reward", completions, {})]


def format_score(text: str) -> float:
    """The authors' single-GPU format score: 1 - 0.01 per character outside the tagged span, at least 0.

    Their regex ``<think>.*</think>[ \\n]?<answer>.*</answer>`` (DOTALL, searched) spans
    from the first ``<think>`` to the last ``</answer>`` whenever some ``</think>`` after
    that ``<think>`` is followed, after at most one space or newline, by an ``<answer>``
    that a later ``</answer>`` closes; 0 when there is none. Computed with ``str.find``
    in linear time instead of the backtracking regex.
    """
    start = require_text(text).find(THINK_OPEN)
    end = text.rfind(ANSWER_CLOSE)
    if start < 0 or end < 0:
        return 0.0
    position = text.find(THINK_CLOSE, start + len(THINK_OPEN))
    while position >= 0:
        after = position + len(THINK_CLOSE)
        if text[after:after + 1] in (" ", "\n") and text.startswith(ANSWER_OPEN, after + 1):
            answer = after + 1
        elif text.startswith(ANSWER_OPEN, after):
            answer = after
        else:
            answer = -1
        if 0 <= answer and answer + len(ANSWER_OPEN) <= end:
            outside = len(text) - (end + len(ANSWER_CLOSE) - start)
            return max(0.0, 1.0 - 0.01 * outside)
        position = text.find(THINK_CLOSE, after)
    return 0.0


def format_score_reward(completions: Sequence[str], **_: Any) -> list[float]:
    """``format_score`` of each completion (the authors' soft format reward of settings a-d).

    Args:
        completions: [B] decoded completions.
        **_: dataset columns, ignored.

    Returns:
        [B] rewards in [0, 1].
    """
    return [format_score(text) for text in texts("format_score_reward", completions, {})]


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
    return [0.25 * sum(text.count(tag) == 1 for tag in _TAGS) for text in texts("tag_count_reward", completions, {})]


def format_correct(text: str) -> bool:
    """The authors' evaluation format check: ``STRICT_FORMAT`` matches ``text``.

    Unlike ``follows_format`` it allows repeated tags and a blank answer, and at most
    one space or newline around the blocks (plus a final newline, which ``$`` allows).
    Its backtracking costs O(length x matches of ``</think><answer>``); the reward
    pool's per-item timeout bounds a pathological text.
    """
    return STRICT_FORMAT.match(require_text(text)) is not None


def strict_format_reward(completions: Sequence[str], **_: Any) -> list[float]:
    """[B] rewards: 1.0 where ``format_correct``, else 0.0 (the format half of "answer and
    format both correct"); dataset columns are ignored, as in :func:`format_reward`."""
    return [1.0 if format_correct(text) else 0.0 for text in texts("strict_format_reward", completions, {})]
