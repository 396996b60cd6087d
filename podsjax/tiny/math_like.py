r"""Synthetic MATH-format problems: LaTeX questions whose answers math-verify must judge.

Where the GSM8K-like problems end in an integer that a string compare could check,
these ask for solutions of linear equations, sums of fractions and small powers, and
their answers are LaTeX (``\frac{3}{2}``, ``-5``). A completion is right when
math-verify finds its answer equal to the gold, so ``\frac{6}{4}`` and ``1.5`` score
like ``\frac{3}{2}``: the reward path of the MATH task (``rewards.math_accuracy``).

Every example carries ``steps`` (the worked lines, in order) and ``solution`` (the
steps, then ``\boxed{answer}``, as MATH writes it).
"""

from __future__ import annotations

import math

import numpy as np

from podsjax.data.datasets import Example

VARIABLES = ("x", "y", "z", "n", "k", "t", "p", "w", "r", "m")


def latex_fraction(numerator: int, denominator: int) -> str:
    r"""``numerator / denominator`` in lowest terms: ``"\frac{3}{2}"``, ``"-4"``."""
    divisor = math.gcd(numerator, denominator)
    p, q = numerator // divisor, denominator // divisor
    if q < 0:
        p, q = -p, -q
    return str(p) if q == 1 else rf"\frac{{{p}}}{{{q}}}"


def _pick(rng: np.random.Generator, low: int, high: int) -> int:
    return int(rng.integers(low, high, endpoint=True))


def _ask(rng, expression: str) -> str:
    return (f"What is {expression}?", f"Compute {expression}.", f"Evaluate {expression}.")[_pick(rng, 0, 2)]


def _equals(line: str, answer: str) -> str:
    """``line``, then ``= answer`` unless the line already ends in it."""
    return line if line.endswith(f"= {answer}") else f"{line} = {answer}"


def _linear(rng, sign: str):
    v, a, x = VARIABLES[_pick(rng, 0, len(VARIABLES) - 1)], _pick(rng, 2, 6), _pick(rng, 1, 9)
    ax = a * x
    b = _pick(rng, 1, 19 if sign == "+" else ax - 1) if sign == "+" or ax > 1 else 0
    if b == 0:  # "2x - 0" is no equation; fall back to the sum
        sign, b = "+", _pick(rng, 1, 19)
    c = ax + b if sign == "+" else ax - b
    undo = "-" if sign == "+" else "+"
    question = f"Solve for ${v}$: ${a}{v} {sign} {b} = {c}$."
    steps = [f"{a}{v} = {c} {undo} {b} = {ax}", f"{v} = {ax} / {a} = {x}"]
    return question, steps, str(x)


def _divide(rng):
    v, a = VARIABLES[_pick(rng, 0, len(VARIABLES) - 1)], _pick(rng, 2, 6)
    c = _pick(rng, 1, 9)
    answer = latex_fraction(c, a)
    question = f"Solve for ${v}$: ${a}{v} = {c}$."
    return question, [_equals(rf"{v} = \frac{{{c}}}{{{a}}}", answer)], answer


def _fraction_sum(rng):
    d = _pick(rng, 3, 9)
    a, b = _pick(rng, 1, d - 1), _pick(rng, 1, d - 1)
    question = _ask(rng, rf"$\frac{{{a}}}{{{d}}} + \frac{{{b}}}{{{d}}}$")
    answer = latex_fraction(a + b, d)
    return question, [_equals(rf"\frac{{{a}}}{{{d}}} + \frac{{{b}}}{{{d}}} = \frac{{{a + b}}}{{{d}}}", answer)], answer


def _power(rng):
    a, b = _pick(rng, 2, 9), _pick(rng, 1, 19)
    question = _ask(rng, f"${a}^2 - {b}$")
    return question, [f"{a}^2 = {a * a}", f"{a * a} - {b} = {a * a - b}"], str(a * a - b)


_TEMPLATES = (lambda rng: _linear(rng, "+"), lambda rng: _linear(rng, "-"), _divide, _fraction_sum, _power)


def make_example(rng: np.random.Generator, split: str, index: int) -> Example:
    """One MATH-like problem drawn from ``rng``; ``source`` is ``tiny-math:<split>:<index>``."""
    question, steps, answer = _TEMPLATES[int(rng.integers(len(_TEMPLATES)))](rng)
    solution = "\n".join(steps) + "\n" + rf"The answer is $\boxed{{{answer}}}$."
    columns = {"steps": tuple(steps), "solution": solution}
    return Example(question, answer, columns, source=f"tiny-math:{split}:{index}")
