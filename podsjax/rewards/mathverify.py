"""MATH accuracy through math-verify (symbolic and numeric equivalence of LaTeX answers)."""

from __future__ import annotations

import functools
import re
import threading
from typing import Any, Sequence

from podsjax.rewards.text import extract_answer_tag, last_boxed, texts

# math-verify's own per-call budget, in whole seconds (it uses signal.alarm). The
# pool's per-item timeout is the outer bound; this inner one lets a slow parse
# fail alone instead of losing the whole item.
DEFAULT_MATH_VERIFY_TIMEOUT_S = 3
_LATEX_MARKERS = ("$", "\\(", "\\[", "\\boxed", "\\fbox")
_SCIENTIFIC = re.compile(r"(-?[0-9]+(?:\.[0-9]+)?)[eE]([+-]?[0-9]+)")
_COMMAND = re.compile(r"\\[A-Za-z]+")  # \frac, \begin{pmatrix}: LaTeX, not prose
_WORD = re.compile(r"[A-Za-z]{2,}")
# Names that are math written plainly, not prose.
_MATH_WORDS = {"sqrt", "pi", "inf", "infty", "infinity", "oo", "sin", "cos", "tan", "cot", "sec", "csc", "log", "ln",
               "exp", "arcsin", "arccos", "arctan", "mod"}


class MathVerifyTimeout(TimeoutError):
    """math-verify ran out of its own time budget on one item (RewardPool counts it in ``reward/timeouts``)."""


def quiet_parse(text: str, timeout_s: int | None) -> list:
    """math-verify's ``parse``, silent: an unreadable answer is ``[]``, a timeout raises MathVerifyTimeout.

    Left to itself math-verify logs every failure with the whole input (megabytes for
    a runaway completion) and hides its timeouts; with ``raise_on_error`` neither happens.
    """
    from math_verify import parse
    from math_verify.errors import TimeoutException

    try:
        return parse(text, parsing_timeout=timeout_s, raise_on_error=True)
    except TimeoutException:
        raise MathVerifyTimeout(f"math-verify parse ran past {timeout_s} s") from None
    except Exception:  # noqa: BLE001 - sympy/latex2sympy raise many types on odd input: no answer
        return []


def quiet_verify(gold: list, predicted: list, timeout_s: int | None) -> bool:
    """math-verify's ``verify`` (gold first), silent like :func:`quiet_parse`."""
    from math_verify import verify
    from math_verify.errors import TimeoutException

    try:
        return bool(verify(gold, predicted, timeout_seconds=timeout_s, raise_on_error=True))
    except TimeoutException:
        raise MathVerifyTimeout(f"math-verify comparison ran past {timeout_s} s") from None
    except Exception:  # noqa: BLE001 - an answer sympy cannot compare is not equal
        return False


def signal_timeout(timeout_s: int) -> int | None:
    """``timeout_s`` on the main thread, else None: math-verify's timeouts use SIGALRM, which only it may arm."""
    return timeout_s if threading.current_thread() is threading.main_thread() else None


def math_gold(answer: Any = None, solution: Any = None) -> str:
    r"""Returns the gold answer: the ``answer`` field, else the solution's last ``\boxed{...}``.

    Raises:
        ValueError: neither gives an answer.
    """
    if answer is not None and str(answer).strip():
        return str(answer).strip()
    if solution is not None:
        boxed = last_boxed(str(solution))
        if boxed is not None and boxed.strip():
            return boxed.strip()
    raise ValueError("MATH gold: no answer field and no \\boxed{...} in the solution")


def unreadable_gold(gold: str) -> str | None:
    r"""Why the grader cannot read ``gold`` as an answer (None: it can).

    The grader reads the gold as ``\boxed{gold}``; with unbalanced braces (``\frac{1}{``)
    that box never closes, math-verify falls back to comparing text, and no completion can
    match it. A cheap check for every row at load, where parsing each gold would take seconds.
    """
    depth = 0
    escaped = False
    for char in gold:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth < 0:
                return "a '}' closes nothing"
    return f"{depth} '{{' never closed" if depth else None


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str, timeout_s: int | None) -> tuple:
    from math_verify import parse

    parsed = parse("\\boxed{" + gold + "}", parsing_timeout=timeout_s)  # a data bug should be loud
    if not parsed:
        raise ValueError(f"MATH gold does not parse: {gold[:80]!r}")
    return tuple(parsed)


def _parse_prediction(completion: str, timeout_s: int | None) -> list:
    parse = quiet_parse
    tagged = extract_answer_tag(completion)
    if tagged is None:
        return parse(completion, timeout_s)
    tagged = tagged.strip()
    if not tagged:
        return []
    unescaped = tagged.replace("\\$", "")  # "\$36" is a dollar sign, not a math delimiter
    if any(marker in unescaped for marker in _LATEX_MARKERS):
        return parse(tagged, timeout_s)
    scientific = _SCIENTIFIC.fullmatch(tagged)
    if scientific:  # "7.2e1": between delimiters the e would be Euler's number
        return parse(f"${scientific[1]}\\times 10^{{{scientific[2]}}}$", timeout_s)
    if not _COMMAND.search(unescaped) and set(_WORD.findall(unescaped)) - _MATH_WORDS:
        # prose ("72 dollars"), no LaTeX: between delimiters it would be a product of its letters
        return parse(tagged, timeout_s) or parse("$" + tagged + "$", timeout_s)
    # Bare LaTeX inside the tags ("\frac{1}{2}", "3, 5, 7", "p - q") is only read
    # as math between delimiters; plain text such as "1/2" parses either way.
    return parse("$" + tagged + "$", timeout_s) or parse(tagged, timeout_s)


def math_accuracy(
    completions: Sequence[str],
    answer: Sequence[Any] | None = None,
    solution: Sequence[Any] | None = None,
    *,
    timeout_s: int = DEFAULT_MATH_VERIFY_TIMEOUT_S,
    **_: Any,
) -> list[float]:
    r"""1.0 where math-verify finds the completion's answer equivalent to the gold, else 0.0.

    The prediction is the content of the last ``<answer>`` tag when there is
    one (prose in it, "72 dollars", is read as plain text, not as math), else whatever
    math-verify extracts from the whole completion: its ``\boxed{}`` answer (two different
    boxes are read as a set, which no single gold equals) or last expression. ``verify`` is
    called gold first, as math-verify requires (the comparison is not symmetric).

    Args:
        completions: [B] decoded completions.
        answer: [B] gold answers in LaTeX (MATH-500's ``answer`` column).
        solution: [B] reference solutions; their last ``\boxed{...}`` is the gold
            where ``answer`` is missing or empty.
        timeout_s: math-verify's own per-call timeout, in whole seconds.
        **_: other dataset columns, ignored.

    Returns:
        [B] rewards in {0.0, 1.0}. An item on which math-verify times out scores 0;
        called on one completion, as ``RewardPool`` calls every reward, it raises
        :class:`MathVerifyTimeout` instead, so the pool counts it in ``reward/timeouts``.
    """

    completions = texts("math_accuracy", completions, {"answer": answer, "solution": solution})
    if answer is None and solution is None:
        raise ValueError("math_accuracy needs an 'answer' or a 'solution' column")
    timeout = signal_timeout(int(timeout_s))
    rewards = []
    for i, completion in enumerate(completions):
        gold = _parse_gold(
            math_gold(None if answer is None else answer[i], None if solution is None else solution[i]), timeout
        )
        try:
            predicted = _parse_prediction(completion, timeout)
            ok = bool(predicted) and quiet_verify(list(gold), predicted, timeout)
        except MathVerifyTimeout:
            if len(completions) == 1:
                raise
            ok = False
        rewards.append(1.0 if ok else 0.0)
    return rewards
