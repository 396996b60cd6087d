"""Text helpers shared by the reward functions: answer tags, boxed answers, numbers.

Every helper runs in time linear in its input and never raises on odd text, so a
reward built on them can be applied to arbitrary model output (1 MB strings,
unbalanced braces, unicode) without a timeout doing the work.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any, Mapping, Sequence

ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

# A number token: an optional minus that is not a hyphen between words or digits
# ("10-20" and "10 - 20" are two numbers, not 10 and -20), which a space or a dollar
# may follow ("-$5", "- 5" are -5, as the gold's "- 5" is); then either a
# thousands-grouped integer or a plain one, an optional decimal part and exponent
# ("3.5e2" is 350, not 2), and an optional denominator ("3/4" is 0.75, not 4). ASCII
# digits only: a model that answers in other scripts does not match the gold's notation.
_NUMBER = re.compile(
    r"(?:(?<![0-9A-Za-z])-(?=[0-9.])"  # "-5", "x=-5"
    r"|(?<![0-9A-Za-z])(?<![0-9)\]}] )-(?:[ \t]+(?:\\?\$[ \t]*)?|\\?\$[ \t]*))?"  # "-$5", "- 5", not "10 - 5"
    r"(?:(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)(?:\.[0-9]+)?"
    r"|(?<![0-9.])\.[0-9]+)"  # ".5", read whole: its "5" alone would match a gold of 5
    r"(?:[eE][+-]?[0-9]+(?![0-9A-Za-z]))?(?:/[0-9]+(?![0-9.,/]))?"
)
# \frac{3}{4} (and \dfrac, \tfrac) of plain numbers, read as 3/4.
# TeX's unbraced \frac12 too (its arguments one digit each), which had read as 12; a negative
# denominator moves its sign to the numerator (\frac{1}{-2} is -1/2).
_FRAC = re.compile(r"\\[dt]?frac\s*(?:\{\s*(-?[0-9.]+)\s*\}|([0-9]))\s*(?:\{\s*(-?[0-9.]+)\s*\}|([0-9])(?![0-9]))")
# Longer tokens are not answers; capping them keeps Fraction() cheap and clear of
# Python's int-from-str digit limit.
_MAX_NUMBER_CHARS = 64
# Minus signs a model may emit in place of ASCII '-'.
_MINUS_SIGNS = str.maketrans({"\u2212": "-", "\u2013": "-", "\u2012": "-", "\ufe63": "-", "\uff0d": "-"})


def extract_answer_tag(text: str) -> str | None:
    """Returns the content of the last ``<answer>`` tag, or None without one.

    A last ``<answer>`` that is never closed (a truncated completion) yields
    the rest of the text.
    """
    start = require_text(text).rfind(ANSWER_OPEN)
    if start < 0:
        return None
    body = text[start + len(ANSWER_OPEN):]
    end = body.find(ANSWER_CLOSE)
    return body if end < 0 else body[:end]


def last_boxed(text: str) -> str | None:
    r"""Returns the content of the last ``\boxed{...}`` (or ``\fbox{...}``) in ``text``.

    Braces nest, so ``\boxed{\frac{1}{2}}`` gives ``\frac{1}{2}``; escaped
    braces (``\{``, ``\}``) do not count towards nesting. ``\boxed 5`` (no
    braces) gives ``5``. Returns None when there is no box or the last box is
    never closed.
    """
    start = max(require_text(text).rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    n = len(text)
    if i < n and text[i] != "{" and not text[i].isspace():
        return None  # a longer command such as \boxedx, not a box
    while i < n and text[i] in " \t":
        i += 1
    if i >= n:
        return None
    if text[i] != "{":
        # "\boxed 5$": the argument is one token, up to a space or the end of math.
        match = re.match(r"[^\s$]+", text[i:])
        return match.group(0) if match else None
    depth = 0
    j = i
    while j < n:
        ch = text[j]
        if ch == "\\":
            j += 2  # an escaped character, e.g. \{ or \}, never opens or closes a group
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
        j += 1
    return None


def ascii_minus(text: str) -> str:
    """Replaces the minus signs a model may emit (U+2212, dashes) with ASCII '-'."""
    return text.translate(_MINUS_SIGNS)


def normalize_number_text(text: str) -> str:
    """Strips the decorations a numeric answer may carry: ``$``, ``,``, spaces, a final period."""
    text = text.translate(_MINUS_SIGNS).strip()
    text = text.replace("$", "").replace("\\", "").replace(",", "").replace(" ", "").replace("\t", "")
    return text.rstrip(".")


def parse_number(text: str) -> Fraction | None:
    """Parses one numeric token ("1,000", "$18.00", "-3.") exactly, or returns None."""
    text = normalize_number_text(text)
    if not text or len(text) > _MAX_NUMBER_CHARS:
        return None
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def _prepared(text: str) -> str:
    """``text`` as the number tokens are read from: ASCII minus signs, ``\frac{a}{b}`` as a/b."""
    return _FRAC.sub(_fraction, text.translate(_MINUS_SIGNS))


def _fraction(match: re.Match) -> str:
    numerator, denominator = match.group(1) or match.group(2), match.group(3) or match.group(4)
    if denominator.startswith("-"):
        denominator = denominator[1:]
        numerator = numerator[1:] if numerator.startswith("-") else "-" + numerator
    return f"{numerator}/{denominator}"


def find_numbers(text: str) -> list[str]:
    """Returns every number token in ``text``, in order, with its commas and sign."""
    return _NUMBER.findall(_prepared(text))


def last_number(text: str) -> Fraction | None:
    """The value of the last number token in ``text``, or None (also when that token is no
    answer, e.g. longer than 64 characters: an earlier number does not stand in for it)."""
    tokens = find_numbers(text)
    return parse_number(tokens[-1]) if tokens else None


def first_number(text: str) -> Fraction | None:
    """The value of the first number token in ``text``, or None (as :func:`last_number`)."""
    match = _NUMBER.search(_prepared(text))
    return parse_number(match.group(0)) if match else None


def require_text(value: Any, what: str = "the text") -> str:
    """``value`` if it is a str, else a one-line TypeError (None had failed inside a str method)."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be decoded text (str); got {type(value).__name__}")
    return value


def texts(reward: str | None, completions: Sequence[str], columns: Mapping[str, Sequence[Any] | None],
          *, missing_ok: bool = True) -> list[str]:
    """The completions as a list of texts, and every column one entry per completion (None
    columns pass where ``missing_ok``); else a one-line error, naming ``reward`` when given.
    One text is refused: it would be scored character by character."""
    prefix = f"{reward}: " if reward else ""
    for what, value in (("completions", completions), *((f"column {n!r}", c) for n, c in columns.items())):
        if value is None and missing_ok and what != "completions":
            continue
        if isinstance(value, (str, bytes, Mapping, set, frozenset)) or not hasattr(value, "__len__"):
            raise TypeError(f"{prefix}{what} must be a list with one entry per completion; "
                            f"got a {type(value).__name__}")
    completions = list(completions)
    for i, text in enumerate(completions):
        require_text(text, f"{prefix}completion {i}")
    for name, column in columns.items():
        if column is not None and len(column) != len(completions):
            raise ValueError(f"{prefix}column {name!r} has {len(column)} entries for {len(completions)} completions")
    return completions
