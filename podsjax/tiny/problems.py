"""The tiny preset's synthetic tasks: seeded problems with worked solutions, split by hash.

Three tasks mirror the paper's benchmarks: ``"gsm8k"`` (word problems, below),
``"math"`` (LaTeX answers judged by math-verify, ``tiny.math_like``) and
``"chemistry"`` (numbers in a unit within 5 %, ``tiny.chemistry_like``). Every example
carries ``steps``, the worked lines the warm-up teaches inside ``<think>``.

The GSM8K-like word problems are seeded, with worked solutions ending in ``#### N``.

The problems are small on purpose: one or two operations (+, -, *) on numbers a
tiny model can learn to add within minutes on a CPU, so that RL starts from a
policy that is right some of the time and has room to improve.

Every example carries, besides the question and the integer gold answer:

- ``solution``: one equation per line, then ``#### N`` (the GSM8K layout);
- ``operands``: the numbers in the order they appear in the question;
- ``operations``: the operators applied left to right, e.g. ``"+-"``.

The question states its numbers in the order the solution uses them, so the gold
is ``operands[0] op0 operands[1] op1 operands[2]`` evaluated left to right, which
the tests recompute independently.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from typing import Iterable, Iterator

import numpy as np

from podsjax.data.datasets import Example
from podsjax.rewards.gsm8k_grader import GSM8K_MARKER
from podsjax.rewards.text import ANSWER_CLOSE, ANSWER_OPEN, THINK_CLOSE, THINK_OPEN
from podsjax.tiny import chemistry_like, math_like

NAMES = ("Tom", "Anna", "Ben", "Lily", "Sam", "Maria", "Jack", "Emma", "Leo", "Mia", "Omar", "Zoe")
ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "coins", "shells", "cards", "flowers")
SPLITS = ("train", "validation", "test")

# A template is (operations, question). Operands are named a, b, c in the order the
# question states them and the solution applies them. Subtractions are drawn so that
# no intermediate result goes below zero.
TEMPLATES: tuple[tuple[str, str], ...] = (
    ("+", "{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?"),
    ("+", "{name} found {a} {item} on Monday and {b} {item} on Tuesday. How many {item} did {name} find?"),
    ("-", "{name} has {a} {item} and gives {b} of them to a friend. How many {item} does {name} have left?"),
    ("-", "There are {a} {item} in a box. {name} takes out {b}. How many {item} are still in the box?"),
    ("*", "{name} buys {a} bags with {b} {item} in each bag. How many {item} does {name} buy?"),
    ("+-", "{name} has {a} {item}, gets {b} more, and then loses {c}. How many {item} does {name} have?"),
    ("-+", "{name} has {a} {item}, gives away {b}, and then buys {c} more. How many {item} does {name} have?"),
    ("++", "{name} has {a} {item}. A friend gives {name} {b} and a teacher gives {name} {c}. "
           "How many {item} does {name} have?"),
    ("*+", "{name} fills {a} boxes with {b} {item} each and has {c} {item} left over. "
           "How many {item} does {name} have in all?"),
    ("*-", "{name} buys {a} packs of {b} {item} and gives {c} of them away. How many {item} does {name} keep?"),
)
# Operand ranges (inclusive). Single-digit operands keep the arithmetic within what a
# tiny model learns in a minute or two (two-digit operands took several times longer);
# every answer stays below 40.
_ADD_RANGE = (2, 9)
_MUL_RANGE = (2, 5)

# Question-hash buckets (out of _BUCKETS) of each split: 10% test, 5% validation.
_BUCKETS = 20
_SPLIT_BUCKETS = (("test", 2), ("validation", 3), ("train", _BUCKETS))
# Consecutive rejected draws (repeats or another split's) after which the space counts
# as exhausted.
_MAX_MISSES = 10_000

_APPLY = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}
# The most operations a template has: the default difficulty.
MAX_OPERATIONS = max(len(operations) for operations, _ in TEMPLATES)


def _split_rng(seed: int, split: str) -> np.random.Generator:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    # A stable per-split stream (str hash() is salted per process; crc32 is not).
    return np.random.default_rng([int(seed), zlib.crc32(split.encode())])


def _draw_operands(rng: np.random.Generator, operations: str) -> list[int]:
    """Operands for ``operations`` with every intermediate result non-negative."""
    if operations[0] == "*":
        values = [int(rng.integers(*_MUL_RANGE, endpoint=True)), int(rng.integers(*_MUL_RANGE, endpoint=True))]
    else:
        values = [int(rng.integers(*_ADD_RANGE, endpoint=True))]
        values.append(int(rng.integers(1, values[0], endpoint=True)) if operations[0] == "-"
                      else int(rng.integers(*_ADD_RANGE, endpoint=True)))
    total = _APPLY[operations[0]](values[0], values[1])
    for op in operations[1:]:
        low, high = (1, total) if op == "-" else _ADD_RANGE
        values.append(int(rng.integers(low, max(low, high), endpoint=True)))
        total = _APPLY[op](total, values[-1])
    return values


def worked_steps(operands: Iterable[int], operations: str) -> tuple[list[str], int]:
    """The solution's equations, one per operation, and the final value.

    Args:
        operands: the numbers, in the order they are applied.
        operations: the operators, e.g. ``"*+"``.

    Returns:
        (["3 * 4 = 12", "12 + 5 = 17"], 17).
    """
    operands = list(operands)
    if len(operands) != len(operations) + 1:
        raise ValueError(f"{len(operations)} operations need {len(operations) + 1} operands, got {operands}")
    total, steps = operands[0], []
    for op, value in zip(operations, operands[1:]):
        result = _APPLY[op](total, value)
        steps.append(f"{total} {op} {value} = {result}")
        total = result
    return steps, total


def _make_example(rng: np.random.Generator, split: str, index: int,
                  templates: tuple[tuple[str, str], ...] = TEMPLATES) -> Example:
    operations, template = templates[int(rng.integers(len(templates)))]
    operands = _draw_operands(rng, operations)
    name, item = NAMES[int(rng.integers(len(NAMES)))], ITEMS[int(rng.integers(len(ITEMS)))]
    question = template.format(name=name, item=item, **dict(zip("abc", operands)))
    steps, answer = worked_steps(operands, operations)
    solution = "\n".join(steps) + f"\n{GSM8K_MARKER} {answer}"
    columns = {"steps": tuple(steps), "solution": solution, "operands": tuple(operands), "operations": operations}
    return Example(question, str(answer), columns, source=f"tiny:{split}:{index}")


# task -> (rng, split, index) -> Example
_MAKERS = {"gsm8k": _make_example, "math": math_like.make_example, "chemistry": chemistry_like.make_example}
TASKS = tuple(_MAKERS)


def split_of(question: str) -> str:
    """The split a question belongs to, by a stable hash of its text.

    Splits are disjoint by construction, whatever their sizes and seeds: a test
    question never turns up in any seed's training stream.
    """
    bucket = zlib.crc32(question.encode()) % _BUCKETS
    for split, upper in _SPLIT_BUCKETS:
        if bucket < upper:
            return split
    raise AssertionError("unreachable: the last bucket bound is _BUCKETS")


def check_task(task: str, max_operations: int | None = None) -> None:
    """Raises ValueError, in one line, for a task the tiny preset lacks or a difficulty it cannot set."""
    if task not in _MAKERS:
        raise ValueError(f"the tiny preset has no task {task!r}; expected one of {', '.join(TASKS)}")
    if max_operations is None:
        return
    if task != "gsm8k":
        raise ValueError(f"max_operations sets the gsm8k task's difficulty; the {task} task has none")
    if isinstance(max_operations, bool) or not isinstance(max_operations, int) \
            or not 1 <= max_operations <= MAX_OPERATIONS:
        raise ValueError(f"max_operations must be an integer from 1 to {MAX_OPERATIONS}, got {max_operations!r}")


def iter_problems(seed: int, split: str, task: str = "gsm8k", *,
                  max_operations: int | None = None) -> Iterator[Example]:
    """A seeded stream of distinct problems of one split, until the task's space runs out.

    Args:
        seed: the stream's seed; each split draws from its own stream.
        split: "train", "validation" or "test".
        task: "gsm8k", "math" or "chemistry".
        max_operations: gsm8k only: draw only problems of at most this many operations
            (1: one-step problems, an easier task); None: every template.

    Yields:
        Examples whose ``source`` is ``tiny:<split>:<index>`` (``tiny-math:...``, ...).

    Raises:
        ValueError: after the last distinct problem, when ``_MAX_MISSES`` draws in a
            row found nothing new.
    """
    check_task(task, max_operations)
    make = _MAKERS[task]
    if max_operations is not None:  # the gsm8k task's templates of at most that many operations, chosen once
        make = functools.partial(make, templates=tuple(t for t in TEMPLATES if len(t[0]) <= max_operations))
    rng = _split_rng(seed, split)
    seen: set[str] = set()
    index = misses = 0
    while True:
        example = make(rng, split, index)
        if example.prompt in seen or split_of(example.prompt) != split:
            misses += 1
            if misses > _MAX_MISSES:  # the space is exhausted; stop instead of spinning forever
                raise ValueError(f"ran out of distinct {split} problems after {index}")
            continue
        seen.add(example.prompt)
        index, misses = index + 1, 0
        yield example


def generate_problems(count: int, seed: int, split: str = "train", task: str = "gsm8k", *,
                      at_most: bool = False, max_operations: int | None = None) -> list[Example]:
    """The first ``count`` problems of ``iter_problems(seed, split, task, max_operations=...)``.

    With ``at_most``, a task with fewer distinct problems returns all it has instead
    of raising.
    """
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    problems: list[Example] = []
    stream = iter_problems(seed, split, task, max_operations=max_operations)
    try:
        while len(problems) < count:
            problems.append(next(stream))
    except ValueError:
        if not at_most:
            raise
    return problems


@dataclasses.dataclass(frozen=True)
class TinyTasks:
    """The tiny preset's splits: disjoint sets of question texts.

    Attributes:
        train: problems the RL loop (and the warm-up) trains on.
        validation: problems the warm-up's early stop looks at.
        test: problems every evaluation reports on.
    """

    train: tuple[Example, ...]
    validation: tuple[Example, ...]
    test: tuple[Example, ...]


# The test problems the RL loop evaluates on unless --eval-limit asks for more.
TEST_PROBLEMS = 256
TRAIN_PROBLEMS = 2000  # the RL loop's training problems (it cycles through them)
# The most a test split holds, whatever is asked: 16x the default, far past where an
# evaluation's interval stops narrowing for the comparisons run here.
MAX_TEST_PROBLEMS = 4096


def make_splits(seed: int = 0, *, task: str = "gsm8k", num_train: int = TRAIN_PROBLEMS, num_validation: int = 128,
                num_test: int = TEST_PROBLEMS, max_operations: int | None = None) -> TinyTasks:
    """Builds the train / validation / test splits of a data seed.

    Each split is a prefix of its own stream, so a smaller request returns the first
    problems of a larger one (the warm-up's 128 test problems are the first 128 of
    the loop's 256).
    """
    for name, value in (("num_train", num_train), ("num_validation", num_validation), ("num_test", num_test)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return TinyTasks(*(tuple(generate_problems(count, seed, split, task, max_operations=max_operations))
                       for split, count in (("train", num_train), ("validation", num_validation),
                                            ("test", num_test))))


def tiny_tasks(seed: int = 0, *, task: str = "gsm8k", num_train: int = TRAIN_PROBLEMS, num_test: int = TEST_PROBLEMS,
               max_operations: int | None = None) -> tuple[list[Example], list[Example]]:
    """(train, test) examples for the RL loop on the tiny preset.

    Args:
        seed: the data seed (independent of the model seed).
        task: "gsm8k", "math" or "chemistry".
        num_train: training problems (the loop cycles through them).
        num_test: test problems, at most ``MAX_TEST_PROBLEMS`` and at most what the task has
            (``RunConfig.eval_limit`` may evaluate fewer).
        max_operations: gsm8k only: at most this many operations per problem (``iter_problems``).
    """
    for name, value, least in (("seed", seed, 0), ("num_train", num_train, 1), ("num_test", num_test, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")  # 2.5 had given 3
    splits = make_splits(seed, task=task, num_train=num_train, num_validation=1, num_test=1,
                         max_operations=max_operations)
    # A task with fewer distinct test problems than asked gives all it has (chemistry-like: 505).
    test = generate_problems(min(num_test, MAX_TEST_PROBLEMS), seed, "test", task, at_most=True,
                             max_operations=max_operations)
    return list(splits.train), test


def sft_completion(example: Example) -> str:
    """The PODS-format target a warm-up trains on: ``<think>steps</think><answer>answer</answer>``.

    The think block holds the example's worked lines (``columns["steps"]``), one per
    line; the answer tag holds the gold answer.
    """
    steps = example.columns.get("steps")
    if not isinstance(steps, (tuple, list)) or not steps:
        raise ValueError(f"{example.source or 'example'}: no worked lines in columns['steps']")
    return f"{THINK_OPEN}{chr(10).join(steps)}{THINK_CLOSE}{ANSWER_OPEN}{example.answer}{ANSWER_CLOSE}"
