"""Synthetic chemistry problems in SciBench's shape: a numeric answer in a stated unit.

Moles and masses, concentrations, heat in joules and Boyle's law, with the reference
unit in a ``unit`` column and the question asking for a bare number in it
(``data.chemistry_question``, as the real chemistry task asks). A completion is right
within 5 % of the reference (``rewards.chemistry_accuracy``), so a near miss such as
``160`` for 162.8 scores, which the GSM8K- and MATH-like tasks never allow.

Every example carries ``steps`` (the worked lines), ``problem`` and ``unit``.
"""

from __future__ import annotations

import numpy as np

from podsjax.data.datasets import Example, chemistry_question

# (name, formula, molar mass in g/mol), rounded to integers as textbook exercises do.
COMPOUNDS = (("water", "H2O", 18), ("methane", "CH4", 16), ("oxygen", "O2", 32), ("nitrogen", "N2", 28),
             ("carbon dioxide", "CO2", 44), ("helium", "He", 4), ("hydrogen", "H2", 2), ("neon", "Ne", 20),
             ("ammonia", "NH3", 17), ("ethane", "C2H6", 30), ("argon", "Ar", 40), ("propane", "C3H8", 44))
SOLUTES = ("salt", "sugar", "NaCl", "KCl", "glucose", "urea")
VOLUMES_L = (2, 4, 5, 8, 10)


def number(value: float) -> str:
    """A reference value as text: ``"54"``, ``"0.25"``, ``"1.875"``."""
    return format(value, "g") if value != int(value) else str(int(value))


def _pick(rng: np.random.Generator, low: int, high: int) -> int:
    return int(rng.integers(low, high, endpoint=True))


def _compound(rng):
    return COMPOUNDS[_pick(rng, 0, len(COMPOUNDS) - 1)]


_ASK = ("What is", "Find", "Calculate")


def _mass(rng):
    (name, formula, molar), moles = _compound(rng), _pick(rng, 2, 40)
    problem = f"{_ASK[_pick(rng, 0, 2)]} the mass of {moles} mol of {name} ({formula}, molar mass {molar} g/mol)?"
    return problem, "g", [f"{moles} mol * {molar} g/mol = {moles * molar} g"], moles * molar


def _moles(rng):
    (name, formula, molar), moles = _compound(rng), _pick(rng, 2, 40)
    mass = moles * molar
    problem = f"{('How many moles are', 'How many mol are', 'What amount is')[_pick(rng, 0, 2)]} in {mass} g of {name} ({formula}, molar mass {molar} g/mol)?"
    return problem, "mol", [f"{mass} g / {molar} g/mol = {moles} mol"], moles


def _concentration(rng):
    solute, moles = SOLUTES[_pick(rng, 0, len(SOLUTES) - 1)], _pick(rng, 1, 40)
    volume = VOLUMES_L[_pick(rng, 0, len(VOLUMES_L) - 1)]
    value = moles / volume
    problem = f"{moles} mol of {solute} is dissolved to make {volume} L of solution. What is the concentration?"
    return problem, "mol/L", [f"{moles} mol / {volume} L = {number(value)} mol/L"], value


def _heat(rng):
    kilojoules, verb = _pick(rng, 2, 400), ("releases", "absorbs")[_pick(rng, 0, 1)]
    problem = f"A reaction {verb} {kilojoules} kJ of heat. How much heat is that?"
    return problem, "J", [f"{kilojoules} kJ * 1000 J/kJ = {kilojoules * 1000} J"], kilojoules * 1000


def _boyle(rng):
    pressure, volume = _pick(rng, 1, 9), _pick(rng, 1, 20)
    product = pressure * volume
    # A new pressure that divides p * V, so the textbook answer is exact.
    choices = [p for p in range(1, 10) if product % p == 0 and p != pressure]
    new_pressure = choices[_pick(rng, 0, len(choices) - 1)] if choices else pressure + 1
    value = product / new_pressure
    problem = f"A gas fills {volume} L at {pressure} atm. What volume does it fill at {new_pressure} atm?"
    steps = [f"{pressure} atm * {volume} L = {product} atm L", f"{product} / {new_pressure} atm = {number(value)} L"]
    return problem, "L", steps, value


_TEMPLATES = (_mass, _moles, _concentration, _heat, _boyle)


def make_example(rng: np.random.Generator, split: str, index: int) -> Example:
    """One chemistry-like problem drawn from ``rng``; ``source`` is ``tiny-chemistry:<split>:<index>``."""
    problem, unit, steps, value = _TEMPLATES[int(rng.integers(len(_TEMPLATES)))](rng)
    columns = {"steps": tuple(steps), "problem": problem, "unit": unit}
    return Example(chemistry_question(problem, unit), number(value), columns, source=f"tiny-chemistry:{split}:{index}")
