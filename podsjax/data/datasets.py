"""Datasets for the PODS tasks: GSM8K, MATH and chemistry, from the Hugging Face Hub or local files.

``load_task(name, split, path=None)`` returns a ``Task``: a tuple of ``Example``
rows, each a question (``prompt``), a gold ``answer`` and the row's other columns.
With ``path`` it reads a local ``.jsonl``/``.json``/``.parquet`` file, or
``<dir>/<split>.jsonl``/``.parquet`` in a directory (``podsjax.data.data_files`` reads
them, ``split_file`` says which file a split is); without it, the Hub:

=========  =====  =================================================================
task       split  Hub dataset
=========  =====  =================================================================
gsm8k      train  ``openai/gsm8k`` (config "main")
gsm8k      test   ``openai/gsm8k`` (config "main")
math       train  ``EleutherAI/hendrycks_math`` (its 7 subject configs, concatenated)
math       test   ``HuggingFaceH4/MATH-500`` (the PRM800K 500-problem test subset)
chemistry  -      none: local files only (see below)
=========  =====  =================================================================

Gold answers: GSM8K's is the number after ``####`` in its solution (commas
removed; the full solution stays in the ``solution`` column). MATH's is the
``answer`` field, else the last ``\\boxed{...}`` of ``solution`` (braces nested).

Chemistry stands in for the paper's setting (d), whose dataset is not named in what
is reachable: SciBench's 223 chemistry problems (``data/chemistry`` in the repository, MIT
License), rows of ``problem``, a numeric ``answer`` and its ``unit``. SciBench's own
column names (``problem_text``, ``answer_number``) load too. The prompt is the
problem plus a sentence asking for a bare number in the reference unit
(``chemistry_question``); the reward accepts it within 5 % (``rewards.chemistry``).
SciBench is on the Hub only as one mixed-subject split (``xw27/scibench``), so
there is no Hub default here: pass a local file or directory.
"""

from __future__ import annotations

import dataclasses
import decimal
import logging
import math
import os
import re
from typing import Any, Callable, Iterator, Mapping, Sequence

from podsjax.data.data_files import MAX_ROW_CHARS, DataError, read_rows, split_file
from podsjax.rewards.chemistry_grader import parse_reference
from podsjax.rewards.gsm8k_grader import GSM8K_MARKER
from podsjax.rewards.mathverify import math_gold, unreadable_gold
from podsjax.rewards.text import ascii_minus, find_numbers, normalize_number_text, parse_number

MATH_TRAIN_SUBJECTS = (
    "algebra",
    "counting_and_probability",
    "geometry",
    "intermediate_algebra",
    "number_theory",
    "prealgebra",
    "precalculus",
)
CHEMISTRY_DATA_HINT = "data/chemistry in the podsjax repository (SciBench's chemistry problems)"
_BAD_ROW_MODES = ("error", "skip")
_JSON_KINDS = {"list": "array", "str": "string", "int": "number", "float": "number", "bool": "boolean",
               "NoneType": "null"}


@dataclasses.dataclass(frozen=True)
class Example:
    """One problem.

    Attributes:
        prompt: the question text, before any chat template.
        answer: the gold final answer as text ("18", "\\frac{14}{3}").
        columns: the row's other fields (e.g. ``solution``, ``subject``, ``level``).
        source: where the row came from, "file:line" or "hub:name/split:index".
    """

    prompt: str
    answer: str
    columns: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)
    source: str = ""

    def __post_init__(self):
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise DataError(f"{self.source or 'example'}: empty prompt")
        if not isinstance(self.answer, str) or not self.answer.strip():
            raise DataError(f"{self.source or 'example'}: empty answer")


@dataclasses.dataclass(frozen=True)
class Task:
    """A loaded split: its examples, and what was skipped on the way.

    Attributes:
        name: "gsm8k", "math" or "chemistry".
        split: the split name.
        examples: the rows that loaded.
        num_skipped: bad rows skipped (only with ``on_bad_row="skip"``).
        skipped: the first few skip reasons, "file:line: reason".
        origin: the file path or Hub name it came from.
    """

    name: str
    split: str
    examples: tuple[Example, ...]
    num_skipped: int = 0
    skipped: tuple[str, ...] = ()
    origin: str = ""

    def __len__(self) -> int:
        return len(self.examples)

    def __iter__(self) -> Iterator[Example]:
        return iter(self.examples)

    def __getitem__(self, index):
        return self.examples[index]


# Names the reward scorer and functions take for their own arguments, so no data column can be one.
REWARD_ARGUMENTS = frozenset({"completions", "rewards"})


def reward_columns(examples: Sequence[Example], num_samples: int = 1) -> dict[str, list[Any]]:
    """Builds reward-function columns ([P * num_samples] lists) from examples.

    Gives ``answer``, ``prompt`` and every column the examples share.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    shared = set.intersection(*(set(e.columns) for e in examples)) if examples else set()
    columns: dict[str, list[Any]] = {"answer": [], "prompt": []}
    columns.update({name: [] for name in sorted(shared - {"answer", "prompt"})})
    for example in examples:
        for name, values in columns.items():
            value = getattr(example, name) if name in ("answer", "prompt") else example.columns[name]
            values.extend([value] * num_samples)
    return columns


# --------------------------------------------------------------------- row rules


def _text(row: Mapping[str, Any], field: str) -> str:
    if field not in row:
        raise DataError(f"missing field {field!r}")
    value = row[field]
    if not isinstance(value, str):
        raise DataError(f"field {field!r} is {type(value).__name__}, not text")
    if not value.strip():
        raise DataError(f"field {field!r} is empty")
    return value


def _gsm8k_row(row: Mapping[str, Any]) -> tuple[str, str, dict[str, Any]]:
    question = _text(row, "question")
    answer = row.get("answer")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool) and math.isfinite(answer):
        row = {**row, "answer": str(answer)}  # a bare number, as JSON or parquet hold it
    solution = _text(row, "answer")
    marker = solution.rfind(GSM8K_MARKER)
    if marker >= 0:
        final = solution[marker + len(GSM8K_MARKER):]
    elif parse_number(solution.strip()) is not None:  # a dataset of bare final answers ("42")
        final = solution
    else:
        raise DataError("answer has no '####' final-answer marker and is not a bare number")
    # One number, read whole as the grader reads it ("1/2" and "1e3" are one; "1 000" is two,
    # and a first-number rule would make it a gold of 1 that no right answer matches).
    numbers = find_numbers(re.sub(r"-\s+(?=[0-9.])", "-", ascii_minus(final).replace("$", "")))
    if len(numbers) != 1 or parse_number(numbers[0]) is None:
        raise DataError(f"the final answer {final.strip()[:40]!r} is not one decimal number (as 18, -3.5 or 1,000), "
                        "the form the GSM8K grader reads")
    extra = {k: v for k, v in row.items() if k not in ("question", "answer")}
    extra.setdefault("solution", solution)  # a dataset's own solution column stays its own
    return question, normalize_number_text(numbers[0]), extra


def _math_row(row: Mapping[str, Any]) -> tuple[str, str, dict[str, Any]]:
    problem = _text(row, "problem")
    answer = row.get("answer")
    if isinstance(answer, float) and not math.isfinite(answer):
        raise DataError(f"field 'answer' is {answer}, not a finite number")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float, type(None))):
        raise DataError(f"field 'answer' is {type(answer).__name__}, not text")
    if isinstance(answer, (int, float)):
        # In plain decimals: str() writes 0.00005 as 5e-05, whose e the grader reads as Euler's number.
        answer = format(decimal.Decimal(repr(answer)), "f")
    if not (isinstance(answer, str) and answer.strip()):
        if "answer" in row and "solution" not in row:
            raise DataError("field 'answer' is empty and there is no 'solution'")
        solution = _text(row, "solution") if "solution" in row else None
        try:
            answer = math_gold(None, solution)  # the reward's own rule: the solution's last \boxed{}
        except ValueError:
            raise DataError("no 'answer' field and no \\boxed{...} in 'solution'") from None
    problem_with_gold = unreadable_gold(answer)
    if problem_with_gold is not None:
        raise DataError(f"gold answer {answer.strip()[:60]!r} cannot be read as an answer ({problem_with_gold}), so "
                        "no completion could ever match it")
    extra = {k: v for k, v in row.items() if k not in ("problem", "answer")}
    return problem, answer.strip(), extra


def chemistry_question(problem: str, unit: str) -> str:
    """The problem, then a request for a bare number in the reference unit.

    The unit may carry a power of ten (``$10^{-19} \\mathrm{~J}$``): asking for the
    number in that unit is what makes the reference value (3.52) the answer.
    """
    if unit.strip():
        ask = (f"Give the final answer as a number in units of {unit.strip()}: write only the number, "
               "without the unit.")
    else:
        ask = "Give the final answer as a plain number, without units."
    return f"{problem.rstrip()}\n\n{ask}"


def _first_present(row: Mapping[str, Any], names: Sequence[str]) -> str:
    return next((name for name in names if name in row), names[0])


def _chemistry_row(row: Mapping[str, Any]) -> tuple[str, str, dict[str, Any]]:
    problem_field = _first_present(row, ("problem", "problem_text"))
    answer_field = _first_present(row, ("answer", "answer_number"))
    problem = _text(row, problem_field)
    answer = row.get(answer_field)
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or not str(answer).strip():
        raise DataError(f"field {answer_field!r} is missing or empty")
    try:
        parse_reference(answer)
    except ValueError as exc:
        raise DataError(str(exc)) from None
    unit = row.get("unit")
    if unit is None:
        unit = ""
    if not isinstance(unit, str):
        raise DataError(f"field 'unit' is {type(unit).__name__}, not text")
    extra = {k: v for k, v in row.items() if k not in (problem_field, answer_field)}
    extra.update(problem=problem, unit=unit)
    return chemistry_question(problem, unit), str(answer).strip(), extra


# Each task's prompt field, which --prompt-column maps a dataset's own column onto.
PROMPT_FIELD = {"gsm8k": "question", "math": "problem", "chemistry": "problem"}


def _renamed(row: Mapping[str, Any], columns: Mapping[str, str]) -> dict[str, Any]:
    """``row`` with each task field taken from the user's column (``columns``: field -> column)."""
    missing = next(((field, column) for field, column in columns.items() if column not in row), None)
    if missing is not None:
        raise DataError(f"missing column {missing[1]!r} (read as the task's {missing[0]!r})")
    # All at once, from the row as read: one at a time, {"answer": "final", "problem": "answer"}
    # had read the problem from the answer just renamed, and a swap had lost a column.
    out = {name: value for name, value in row.items() if name not in columns.values()}
    out.update({field: row[column] for field, column in columns.items()})
    return out


_ROW_RULES: dict[str, Callable[[Mapping[str, Any]], tuple[str, str, dict[str, Any]]]] = {
    "gsm8k": _gsm8k_row,
    "math": _math_row,
    "chemistry": _chemistry_row,
}
# Tasks with no Hub default, which load from local files only, and where to find theirs.
TASKS = tuple(_ROW_RULES)  # the tasks whose rows load (and whose rewards and graders exist)
LOCAL_ONLY_TASKS = {"chemistry": CHEMISTRY_DATA_HINT}


# --------------------------------------------------------------------------- Hub


def _read_hub(name: str, split: str, cache_dir: str | None,
              hub: str | None = None) -> tuple[str, Iterator[tuple[str, Any]]]:
    if hub is not None:
        repo, _, config = hub.partition(":")
        parts = [(repo, config or None)]
    elif name == "gsm8k":
        parts = [("openai/gsm8k", "main")]
    elif split == "test":
        parts = [("HuggingFaceH4/MATH-500", None)]
    else:
        parts = [("EleutherAI/hendrycks_math", subject) for subject in MATH_TRAIN_SUBJECTS]
    origin = parts[0][0]
    http_log = logging.getLogger("huggingface_hub.utils._http")
    level = http_log.level
    http_log.setLevel(logging.ERROR)  # its retry notices, each twice: the error below says it in one line
    try:
        import datasets

        loaded = [datasets.load_dataset(repo, config, split=split, cache_dir=cache_dir) for repo, config in parts]
    except Exception as exc:  # noqa: BLE001 - offline, missing split, auth: one line with a way out
        detail = (str(exc).strip().splitlines() or [""])[0][:200]
        raise DataError(
            f"cannot load {origin} split {split!r} from the Hugging Face Hub ({type(exc).__name__}: {detail}); "
            "pass path= to a local .jsonl or .parquet file"
        ) from None
    finally:
        http_log.setLevel(level)

    def rows():
        for (repo, config), dataset in zip(parts, loaded):
            label = repo if config is None else f"{repo}/{config}"
            for index, row in enumerate(dataset):
                yield f"hub:{label}/{split}:{index}", row

    return origin, rows()


# -------------------------------------------------------------------------- API


def _valid_text(row: Mapping[str, Any]) -> bool:
    """False where a string in the row (keys and nested values too) cannot be encoded as UTF-8."""
    stack: list[Any] = [row]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    return False
        elif isinstance(value, Mapping):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    return True


def load_task(
    name: str,
    split: str,
    path: str | os.PathLike | None = None,
    *,
    on_bad_row: str = "error",
    limit: int | None = None,
    cache_dir: str | None = None,
    max_skipped_reasons: int = 20,
    columns: Mapping[str, str] | None = None,
    hub: str | None = None,
) -> Task:
    """Loads a split of GSM8K, MATH or chemistry.

    Args:
        name: "gsm8k", "math" or "chemistry".
        split: the split's name: the file stem in a directory, the Hub split ("train" or
            "test" for the task's own Hub datasets).
        path: a local .jsonl/.json/.parquet file, or a directory holding
            ``<split>.jsonl``/``<split>.parquet``. None loads from the Hub: ``hub``, else
            the task's own dataset (GSM8K and MATH only).
        on_bad_row: "error" raises DataError naming the file and line of the first
            bad row; "skip" drops bad rows and counts them in ``Task.num_skipped``.
        limit: keep at most this many examples (the first ones).
        cache_dir: the ``datasets`` cache directory for Hub loads.
        max_skipped_reasons: how many skip reasons ``Task.skipped`` keeps.
        columns: the task's fields read from other columns of your data, e.g.
            ``{"question": "prompt", "answer": "final"}`` (``PROMPT_FIELD`` names each
            task's prompt field).
        hub: a Hub dataset, ``"owner/name"`` or ``"owner/name:config"``, read with
            ``datasets.load_dataset`` (instead of the task's own).

    Returns:
        A Task.

    Raises:
        DataError: unknown task, missing or unreadable path, no usable rows, or (with
            on_bad_row="error") a bad row: invalid JSON or UTF-8, a line or prompt over
            ``MAX_ROW_CHARS``, a missing or malformed field.
    """
    if name not in _ROW_RULES:
        raise DataError(f"unknown task {name!r}; expected one of {sorted(_ROW_RULES)}")
    if on_bad_row not in _BAD_ROW_MODES:
        raise DataError(f"on_bad_row must be one of {_BAD_ROW_MODES}, got {on_bad_row!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise DataError(f"limit must be an integer >= 0 or None, got {limit!r}")  # 1.5 had kept 2
    if columns is not None and (not isinstance(columns, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in columns.items())):
        raise DataError(f"columns must map the task's fields to your column names ({{'question': 'prompt'}}), "
                        f"got {columns!r}")
    taken = [column for column in (columns or {}).values()]
    shared = sorted({column for column in taken if taken.count(column) > 1})
    if shared:  # a row's column can be moved onto one task field only
        raise DataError(f"columns: {shared[0]!r} is named for two of the task's fields ({dict(columns)})")
    if path is None and hub is None and name in LOCAL_ONLY_TASKS:
        raise DataError(f"{name} has no Hub dataset here; pass a local .jsonl/.parquet file or directory, "
                        f"e.g. {LOCAL_ONLY_TASKS[name]}")
    if path is None:
        if hub is None and split not in ("train", "test"):
            raise DataError(f"the {name} Hub dataset has splits 'train' and 'test', not {split!r}")
        origin, rows = _read_hub(name, split, cache_dir, hub)
    else:
        origin = split_file(path, split)
        rows = read_rows(origin)

    rule = _ROW_RULES[name]
    examples: list[Example] = []
    skipped: list[str] = []
    num_skipped = 0
    for where, row in rows:
        if limit is not None and len(examples) >= limit:
            break
        try:
            if isinstance(row, Exception):
                raise row
            if not isinstance(row, Mapping):
                kind = _JSON_KINDS.get(type(row).__name__, type(row).__name__)
                raise DataError(f"row is a JSON {kind}, not an object")
            if not _valid_text(row):
                raise DataError("text is not valid UTF-8 (undecodable bytes or a lone \\u surrogate escape)")
            prompt, answer, extra = rule(_renamed(row, columns) if columns else row)
            if len(prompt) > MAX_ROW_CHARS:
                raise DataError(f"prompt is {len(prompt)} characters, over the limit of {MAX_ROW_CHARS}")
            examples.append(Example(prompt, answer, extra, where))
        except DataError as exc:
            message = str(exc) if str(exc).startswith(where) else f"{where}: {exc}"
            if on_bad_row == "error":
                raise DataError(f"bad {name} row at {message}") from None
            num_skipped += 1
            if len(skipped) < max_skipped_reasons:
                skipped.append(message)
    clash = sorted(REWARD_ARGUMENTS.intersection(*(e.columns for e in examples))) if examples else []
    if clash:  # the scorer's call would fail at the first evaluation: score(completions, rewards, **columns)
        raise DataError(f"{origin}: column {clash[0]!r} has the name of the rewards' own argument "
                        f"({', '.join(sorted(REWARD_ARGUMENTS))}); rename it in your data")
    if not examples and limit != 0:
        source = origin if path is not None else f"{origin} split {split!r}"
        detail = f"{num_skipped} skipped" + (f": {skipped[0]}" if skipped else "") if num_skipped else "it is empty"
        raise DataError(f"no usable {name} rows in {source} ({detail})")
    return Task(name, split, tuple(examples), num_skipped, tuple(skipped), origin)
