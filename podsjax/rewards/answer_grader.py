"""The answer grader of the authors' single-GPU code (``grade_answer`` in release 3fc107e's
``utils/grader.py``, which takes PRM800K's grader with its sympy step switched off).

An answer is right when it equals the gold as a string after either of two normalizations:

- :func:`mathd_normalize`, the MATH dataset's own (``\\dfrac`` to ``\\frac``, ``0.5`` to
  ``\\frac{1}{2}``, ``a/b`` to ``\\frac{a}{b}``, a short ``x =`` prefix dropped, ...);
- :func:`prm_normalize`, PRM800K's (units and ``$``/``%`` dropped, LaTeX rendered to text by
  pylatexenc, integers in canonical form, lower case).

or when both are tuples of the same fractions written alike. No algebra is done: ``2/4`` is
not ``1/2``, and ``\\sqrt{4}`` is not ``2`` (math-verify, in ``podsjax.rewards.math_accuracy``,
says both are).
"""

from __future__ import annotations

import logging
import re

_TEXT_WRAPPED = re.compile(r"^\\text\{(?P<text>.+?)\}$")
_FRACTION = re.compile(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$")
_THOUSANDS_COMMA = re.compile(r"(\d)(,)(\d\d\d)($|\D)")
_MIXED_NUMBER = re.compile(r"([0-9]) +([0-9])")
_TUPLE_BRACKETS = "()[]"
# Unit words PRM800K strips wherever they occur, in its order (so "days" inside "Mondays" too).
_UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week",
          "month", "year", "foot", "feet", "inch", "yard")
_UNIT_PATTERNS = tuple(re.compile(unit + r"(es)?(s)? *(\^[0-9]+)?") for unit in _UNITS)
_SCALE_WORDS = (("million", "*10^6"), ("billion", "*10^9"), ("trillion", "*10^12"))
_SYMBOL_NAMES = (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*"))


class _QuietSubstitution(logging.Filter):
    """Drops pylatexenc's "macro '\\frac' failed its substitution!" warning.

    A macro short of its arguments (the gold ``\\frac{1`` that the authors' MATH reader
    leaves) keeps its text, which is all grading needs; pylatexenc would print the warning
    to stderr once for every such answer, in every reward worker.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed its substitution" not in record.getMessage()


# pylatexenc's own logger (it takes the same name at import), quieted once for this process.
_PYLATEXENC_LOGGER = logging.getLogger("pylatexenc.latex2text")
if not any(isinstance(f, _QuietSubstitution) for f in _PYLATEXENC_LOGGER.filters):
    _PYLATEXENC_LOGGER.addFilter(_QuietSubstitution())


class _Unnormalizable(Exception):
    """The MATH normalization gives up; its caller keeps the answer as it was."""


def _unwrap_text(answer: str) -> str:
    match = _TEXT_WRAPPED.search(answer)
    return match.group("text") if match else answer


def _replace_all(text: str, pairs) -> str:
    for old, new in pairs:
        text = text.replace(old, new)
    return text


def _sqrt_braced(text: str) -> str:
    """``\\sqrt3`` -> ``\\sqrt{3}`` (one character only, as MATH does)."""
    head, *rest = text.split("\\sqrt")
    pieces = [head]
    for piece in rest:
        if not piece:
            raise _Unnormalizable
        pieces.append(piece if piece[0] == "{" else "{" + piece[0] + "}" + piece[1:])
    return "\\sqrt".join(pieces)


def _frac_braced(text: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{72}`` -> ``\\frac{1}{72}``; a ``\\frac``
    with fewer than two characters after it leaves the whole text as it was."""
    head, *rest = text.split("\\frac")
    out = head
    for piece in rest:
        out += "\\frac"
        if not piece:
            raise _Unnormalizable
        if piece[0] == "{":
            out += piece
            continue
        if len(piece) < 2:
            return text
        numerator, second, tail = piece[0], piece[1], piece[2:]
        out += "{" + numerator + "}" + (second + tail if second == "{" else "{" + second + "}" + tail)
    return out


def _slash_as_frac(text: str) -> str:
    """``3/4`` -> ``\\frac{3}{4}`` when both sides are plainly written integers."""
    parts = text.split("/")
    if len(parts) != 2:
        return text
    try:
        numerator, denominator = int(parts[0]), int(parts[1])
    except ValueError:
        return text
    if text != f"{numerator}/{denominator}":
        return text
    return "\\frac{" + str(numerator) + "}{" + str(denominator) + "}"


def _mathd_strip(text: str) -> str:
    text = _replace_all(text, (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"),
                               ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", "")))
    if "\\text{ " in text:  # a unit on the right; more than one is beyond it
        parts = text.split("\\text{ ")
        if len(parts) != 2:
            raise _Unnormalizable
        text = parts[0]
    text = _replace_all(text, (("\\%", ""), (" .", " 0."), ("{.", "{0.")))
    if not text:
        return text
    if text[0] == ".":
        text = "0" + text
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "k = 5" -> " 5"
        text = sides[1]
    if "\\sqrt" in text:
        text = _sqrt_braced(text)
    text = _frac_braced(text.replace(" ", ""))
    if text == "0.5":
        text = "\\frac{1}{2}"
    return _slash_as_frac(text)


def mathd_normalize(answer: str | None) -> str | None:
    """The MATH dataset's answer normalization (``None`` stays ``None``)."""
    if answer is None:
        return None
    answer = _unwrap_text(answer.strip()).strip()
    try:
        return _mathd_strip(answer)
    except _Unnormalizable:
        return answer


def _float_or_none(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _is_whole(value: float) -> bool:
    try:
        return abs(value - int(round(value))) <= 1e-7
    except (OverflowError, ValueError):  # inf, nan
        return False


def _without_thousands_commas(text: str) -> str:
    while True:
        stripped = _THOUSANDS_COMMA.sub(r"\1\3\4", text)
        if stripped == text:
            return text
        text = stripped


def _whole_number_text(text: str) -> str | None:
    """The canonical integer ``text`` writes (``1,000`` -> ``1000``, ``5.0`` -> ``5``), else None."""
    value = _float_or_none(_without_thousands_commas(text))
    if value is None or not _is_whole(value):
        return None
    return str(int(float(text.replace(",", ""))))


def _latex_to_text(text: str) -> str:
    from pylatexenc import latex2text

    text = _replace_all(text, (("\\tfrac", "\\frac"), ("\\dfrac", "\\frac"), ("\\frac", " \\frac")))
    text = latex2text.LatexNodes2Text().latex_to_text(text)
    return _replace_all(text, _SYMBOL_NAMES).strip()


def prm_normalize(answer: str | None) -> str | None:
    """PRM800K's answer normalization (``None`` stays ``None``)."""
    if answer is None:
        return None
    text = _unwrap_text(answer)
    text = _replace_all(text, (("\\%", "%"), ("\\$", "$"), ("$", ""), ("%", ""), (" or ", " , "),
                               (" and ", " , ")) + _SCALE_WORDS)
    for unit in _UNIT_PATTERNS:
        text = unit.sub("", text)
    text = re.sub(r"\^ *\\circ", "", text)
    if text and text[0] == "{" and text[-1] == "}":
        text = text[1:-1]
    text = re.sub(r",\\! *", "", text)
    value = _float_or_none(text)
    if value is not None and _is_whole(value):
        text = str(int(round(value)))
    if "\\" in text:
        try:
            text = _latex_to_text(text)
        except Exception:  # noqa: BLE001 - pylatexenc refuses odd LaTeX: keep the text as it is
            pass
    text = _MIXED_NUMBER.sub(r"\1+\2", re.sub(r"- *", "-", text))  # "7 3/4" -> "7+3/4"
    text = _replace_all(text, ((" ", ""), ("{", ""), ("}", ""))).lower()
    return _whole_number_text(text) or text


def _tuple_items(text: str) -> list[str]:
    text = _without_thousands_commas(text)
    inner = text[1:-1]
    if (len(text) > 2 and text[0] in _TUPLE_BRACKETS and text[-1] in _TUPLE_BRACKETS
            and not any(bracket in inner for bracket in _TUPLE_BRACKETS)):
        return [item.strip() for item in inner.split(",")]
    return [text]


def grade_answer(given: str | None, gold: str | None) -> bool:
    """True when ``given`` is the gold answer by either normalization (see the module)."""
    if given is None:
        return False
    if mathd_normalize(gold) == mathd_normalize(given):
        return True
    gold_text, given_text = prm_normalize(gold), prm_normalize(given)
    if gold_text is None:
        return False
    if gold_text == given_text:
        return True
    if not gold_text or not given_text:
        return False
    gold_items, given_items = _tuple_items(gold_text), _tuple_items(given_text)
    if len(gold_items) > 1 and (gold_text[0] != given_text[0] or gold_text[-1] != given_text[-1]):
        return False
    if len(gold_items) != len(given_items):
        return False
    # With the sympy step off, only fractions written alike can still match item by item.
    return all(bool(_FRACTION.search(a)) and bool(_FRACTION.search(b)) and a == b
               for a, b in zip(gold_items, given_items))
