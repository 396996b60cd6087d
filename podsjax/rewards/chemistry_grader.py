r"""Chemistry accuracy: a numeric answer within 5 % of the reference, SciBench's rule.

SciBench (Wang et al. 2023) scores an answer correct when
``math.isclose(prediction, reference, rel_tol=0.05)``: the difference is at most 5 % of
the larger magnitude, and a reference of 0 needs exactly 0. Answers are numbers in the
problem's unit; the unit may carry a power of ten (``$10^{-19} \mathrm{~J}$`` with a
reference of 3.52), and an answer that writes the power out (``3.52 \times 10^{-19}``)
counts too.

Numbers are read in two passes. Plain text first: ``-50``, ``+17.7``, ``11,000``,
``3.2e-4``, ``3.2 x 10^-4``, ``3.2 \times 10^{-4}``, ``10^{-4}``, ``1/3``, each optionally
followed by a unit (``524 K``, ``-50 kJ/mol``). Anything else that is LaTeX math
(``\frac{1}{3}``, ``\sqrt{2}``, ``3\frac{1}{3}``) goes to math-verify, whose sympy value
must be a finite real number.
"""

from __future__ import annotations

import math
import re
from typing import Any, Sequence

from podsjax.rewards.mathverify import DEFAULT_MATH_VERIFY_TIMEOUT_S, MathVerifyTimeout, quiet_parse, signal_timeout
from podsjax.rewards.text import ascii_minus, extract_answer_tag, last_boxed, require_text, texts

REL_TOL = 0.05  # SciBench's tolerance
_MAX_CHARS = 200  # a longer "answer" is a derivation, not a number: not worth a sympy parse


def _exponent(name: str) -> str:
    """``^{-4}``, ``^-4`` or ``**-4``, the power captured as group ``name``."""
    return r"(?:\^|\*\*)\s*\{?\s*(?P<" + name + r">[-+]?\d+)\s*\}?"


_QUANTITY = re.compile(
    r"(?P<sign>[-+])?\s*(?:"
    + r"10\s*" + _exponent("power")  # 10^{-4} alone
    + r"|(?P<mantissa>\d+(?:\.\d*)?|\.\d+)(?:[eE](?P<e>[-+]?\d+)"
    + r"|\s*(?:\\times|\\cdot|×|·|\*|x)\s*10\s*" + _exponent("times") + r")?"
    + r")(?:\s*/\s*(?P<denominator>\d+(?:\.\d*)?)(?![\d.]))?"
)
# What may not follow a plain number for it to be the whole value ("2^{10}", "3\frac{1}{3}",
# "2 \times 3", "3/\pi"); those go to math-verify instead.
_NOT_A_UNIT = ("^", "_", "(", "!", "/", "*", "\\frac", "\\dfrac", "\\tfrac", "\\sqrt", "\\pi", "\\times",
               "\\cdot", "×", "·")
_UNIT_POWER = re.compile(r"^\s*\$?\s*10\s*\^\s*\{?\s*([-+]?\d+)\s*\}?")
# Math delimiters, spacing and degree signs that carry no value ("-273 ^{\circ} C" is -273).
# "{,}" and "\," are LaTeX thousands separators.
_NOISE = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\degree|°|\\left|\\right|\\[!,;: ]|\{,\}|\\\(|\\\)|\\\[|\\\]|[$~]")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
# Text wrappers keep their argument: "\text{5.5 kJ}" reads as "{5.5 kJ}".
_TEXT_COMMANDS = re.compile(r"\\(?:text|textrm|textbf|mathrm|mathbf|operatorname)\s*(?=\{)")
_SUPERSCRIPT = re.compile("[⁺⁻⁰¹²³⁴⁵⁶⁷⁸⁹]+")
_FROM_SUPERSCRIPT = str.maketrans("⁺⁻⁰¹²³⁴⁵⁶⁷⁸⁹", "+-0123456789")
_RELATIONS = re.compile(r"=|\\approx|≈|\\simeq|\\sim")


def unit_scale(unit: Any) -> float:
    r"""The power of ten a unit starts with: 1e-19 for ``$10^{-19} \mathrm{~J}$``, else 1."""
    match = _UNIT_POWER.match(str(unit or ""))
    return float("1e" + match.group(1)) if match else 1.0


def _plain_number(text: str) -> float | None:
    """The number at the start of ``text`` (after plain words), or None when it is LaTeX math."""
    match = _QUANTITY.search(text)
    if match is None or "\\" in text[: match.start()] or any(c.isdigit() for c in text[: match.start()]):
        return None
    if text[match.end():].lstrip().startswith(_NOT_A_UNIT):
        return None
    sign = -1.0 if match["sign"] == "-" else 1.0
    # float("1e400") is inf where 10.0 ** 400 raises; inf is rejected by the caller.
    if match["power"] is not None:
        value = float("1e" + match["power"])
    else:
        value = float(match["mantissa"] + "e" + (match["e"] or match["times"] or "0"))
    if match["denominator"] is not None:
        denominator = float(match["denominator"])
        if denominator == 0:
            return None
        value /= denominator
    return sign * value


# Larger exponents are no quantity (and a tower such as 10^{10^{10}} keeps sympy's evalf
# busy past any timeout: math-verify's covers its parse, not this).
_MAX_EXPONENT = 1000


def _huge_power(expr) -> bool:
    from sympy import Pow

    for power in expr.atoms(Pow):
        exponent = power.exp
        if exponent.has(Pow) or not exponent.is_number or abs(complex(exponent.evalf(15))) > _MAX_EXPONENT:
            return True
    return False


def _sympy_number(text: str, timeout_s: int | None) -> float | None:
    for candidate in quiet_parse("$" + text + "$", timeout_s):
        if isinstance(candidate, str) or not hasattr(candidate, "atoms") or _huge_power(candidate):
            continue
        try:
            value = complex(candidate.evalf())
        except (TypeError, ValueError, AttributeError, OverflowError):
            continue
        if value.imag == 0 and math.isfinite(value.real):
            return value.real
    return None


def parse_quantity(text: str, *, timeout_s: int | None = DEFAULT_MATH_VERIFY_TIMEOUT_S) -> float | None:
    r"""Reads one numeric answer (``3.2 \times 10^{-4} \mathrm{~J}``, ``\frac{1}{3}``) as a float.

    After ``=`` or ``\approx`` only the last part counts (``\Delta G = -50``). Returns
    None for text with no finite number, and never raises on odd input (a math-verify
    timeout raises ``MathVerifyTimeout``).

    Args:
        text: the answer text.
        timeout_s: math-verify's per-call budget for LaTeX, in whole seconds (applied
            on the main thread only; None for none).
    """
    text = ascii_minus(require_text(text))
    text = _SUPERSCRIPT.sub(lambda m: "^{" + m.group(0).translate(_FROM_SUPERSCRIPT) + "}", text)
    text = _TEXT_COMMANDS.sub("", _NOISE.sub("", text)).strip()
    text = _THOUSANDS.sub("", text)
    parts = [part for part in _RELATIONS.split(text) if part.strip()]
    if not parts:
        return None
    text = parts[-1].strip()
    if len(text) > _MAX_CHARS:
        return None
    value = _plain_number(text)
    if value is not None:
        return value if math.isfinite(value) else None
    if not any(c.isdigit() for c in text):
        return None
    try:
        return _sympy_number(text, signal_timeout(timeout_s) if timeout_s else None)
    except MathVerifyTimeout:
        raise
    except Exception:  # noqa: BLE001 - math-verify/sympy raise many types on odd LaTeX; no number
        return None


def extract_chemistry_answer(completion: str, *, timeout_s: int | None = DEFAULT_MATH_VERIFY_TIMEOUT_S) -> float | None:
    r"""The completion's numeric answer: its last ``<answer>`` (its ``\boxed{}`` if any), else its last ``\boxed{}``.

    A completion with neither has no answer (None): a stray number in the reasoning is
    not one, and units such as ``mol^{-1}`` make "the last number" meaningless here.
    """
    answer = extract_answer_tag(completion)
    boxed = last_boxed(completion if answer is None else answer)
    if boxed is not None:
        answer = boxed
    return None if answer is None else parse_quantity(answer, timeout_s=timeout_s)


def is_close(predicted: float, reference: float, scale: float = 1.0) -> bool:
    """SciBench's test, against the reference in its unit or with the unit's power of ten written out."""
    targets = (reference,) if scale == 1.0 else (reference, reference * scale)
    return any(math.isclose(predicted, target, rel_tol=REL_TOL, abs_tol=0.0) for target in targets)


def parse_reference(answer: Any) -> float:
    """The gold value from the ``answer`` column ("524", "+17.7", 0.042).

    Raises:
        ValueError: the gold is not a finite number (a data bug, never the model's fault).
    """
    try:
        value = float(str(answer).strip().replace(",", ""))
    except ValueError:
        raise ValueError(f"chemistry gold answer is not a number: {str(answer)[:80]!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"chemistry gold answer is not finite: {answer!r}")
    return value


def chemistry_accuracy(
    completions: Sequence[str],
    answer: Sequence[Any] | None = None,
    unit: Sequence[Any] | None = None,
    *,
    timeout_s: int = DEFAULT_MATH_VERIFY_TIMEOUT_S,
    **_: Any,
) -> list[float]:
    """1.0 where the completion's number is within 5 % of the reference (SciBench's rule), else 0.0.

    Args:
        completions: [B] decoded completions.
        answer: [B] reference values in the problem's unit ("524", "-0.347").
        unit: [B] units (may start with a power of ten); None when the data has none.
        timeout_s: math-verify's own per-call timeout for LaTeX answers, in whole seconds.
        **_: other dataset columns, ignored.

    Returns:
        [B] rewards in {0.0, 1.0}.
    """
    if answer is None:
        raise ValueError("chemistry_accuracy needs an 'answer' column")
    completions = texts("chemistry_accuracy", completions, {"answer": answer, "unit": unit})
    rewards = []
    for i, completion in enumerate(completions):
        reference = parse_reference(answer[i])
        try:
            predicted = extract_chemistry_answer(completion, timeout_s=int(timeout_s))
        except MathVerifyTimeout:  # scored 0; alone (as RewardPool calls it) counted as a timeout
            if len(completions) == 1:
                raise
            predicted = None
        scale = unit_scale(None if unit is None else unit[i])
        rewards.append(1.0 if predicted is not None and is_close(predicted, reference, scale) else 0.0)
    return rewards
