"""Datasets: the real GSM8K, MATH-500 and chemistry files, local formats, bad rows, and the Hub path offline."""

import json
import os
import re

import pytest

from podsjax.data import datasets as data
from podsjax.data.datasets import DataError, Example, load_task, reward_columns
from podsjax.rewards import math_accuracy


def _write_jsonl(path, rows):
    with open(path, "w") as handle:
        for row in rows:
            handle.write(row if isinstance(row, str) else json.dumps(row))
            handle.write("\n")
    return str(path)


# ---------------------------------------------------------------- real files


@pytest.mark.parametrize("split, count", [("train", 382), ("test", 215)])  # tests/data/README.md
def test_gsm8k_real_files(data_dir, split, count):
    path = os.path.join(data_dir, "gsm8k", f"{split}.jsonl")
    task = load_task("gsm8k", split, path)
    assert len(task) == count and task.num_skipped == 0
    with open(path) as handle:
        raw = [json.loads(line) for line in handle]
    # Independent reference: openai/grade-school-math's regex, commas removed.
    expected = [re.search(r"#### (\-?[0-9\.\,]+)", row["answer"]).group(1).replace(",", "") for row in raw]
    assert [example.answer for example in task] == expected
    assert [example.prompt for example in task] == [row["question"] for row in raw]
    assert [example.columns["solution"] for example in task] == [row["answer"] for row in raw]
    assert task[0].source == f"{path}:1"


def test_gsm8k_directory_path_picks_the_split(data_dir):
    task = load_task("gsm8k", "test", os.path.join(data_dir, "gsm8k"))
    assert task.origin.endswith(os.path.join("gsm8k", "test.jsonl"))
    assert task[0].answer == "18" and task[0].prompt.startswith("Janet")
    assert len(load_task("gsm8k", "test", os.path.join(data_dir, "gsm8k"), limit=5)) == 5


def test_split_file_names_the_file_a_split_loads_from(data_dir, tmp_path):
    directory = os.path.join(data_dir, "gsm8k")
    assert data.split_file(directory, "test") == load_task("gsm8k", "test", directory).origin
    with pytest.raises(DataError, match="no dev.jsonl or dev.parquet in"):
        data.split_file(directory, "dev")
    # The tasks with no Hub dataset name where their files are.
    assert "data/chemistry" in data.LOCAL_ONLY_TASKS["chemistry"] and "gsm8k" not in data.LOCAL_ONLY_TASKS


def test_math500_real_file(data_dir):
    path = os.path.join(data_dir, "math500", "test.jsonl")
    task = load_task("math", "test", path)
    assert len(task) == 150 and task.num_skipped == 0  # the first 150 rows (tests/data/README.md)
    with open(path) as handle:
        raw = [json.loads(line) for line in handle]
    assert [example.answer for example in task] == [row["answer"].strip() for row in raw]
    assert [example.prompt for example in task] == [row["problem"] for row in raw]
    first = task[0]
    assert first.answer == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert set(first.columns) == {"solution", "subject", "level", "unique_id"}
    assert first.columns["unique_id"] == "test/precalculus/807.json"


@pytest.mark.parametrize("split, count", [("train", 179), ("test", 44)])
def test_chemistry_real_files(chemistry_dir, split, count):
    path = os.path.join(chemistry_dir, f"{split}.jsonl")
    task = load_task("chemistry", split, path)
    assert len(task) == count and task.num_skipped == 0
    with open(path) as handle:
        raw = [json.loads(line) for line in handle]
    assert [example.answer for example in task] == [row["answer"] for row in raw]
    assert [example.columns["unit"] for example in task] == [row["unit"] for row in raw]
    for example, row in zip(task, raw):
        assert example.prompt.startswith(row["problem"].rstrip())
        assert (row["unit"].strip() or "plain number") in example.prompt.split("\n\n")[-1]
    assert load_task("chemistry", split, chemistry_dir).origin == path


def test_math_gold_from_last_boxed_with_nested_braces(tmp_path):
    # Hendrycks MATH train rows have no answer field: the gold is the solution's last box.
    path = _write_jsonl(
        tmp_path / "train.jsonl",
        [
            {"problem": "Halve 1.", "solution": "Try \\boxed{2}. No: $\\boxed{\\frac{1}{2}}$.", "type": "Algebra"},
            {"problem": "Set?", "solution": "It is $\\boxed{\\{1,2\\}}$", "level": "Level 1"},
        ],
    )
    task = load_task("math", "train", tmp_path)
    assert task.origin == path
    assert [example.answer for example in task] == ["\\frac{1}{2}", "\\{1,2\\}"]
    assert task[0].columns == {"solution": "Try \\boxed{2}. No: $\\boxed{\\frac{1}{2}}$.", "type": "Algebra"}


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = {"question": ["One plus one?", "Two times three?"], "answer": ["1+1=2\n#### 2", "#### 6"]}
    pq.write_table(pa.table(rows), tmp_path / "test.parquet")
    task = load_task("gsm8k", "test", tmp_path)
    assert [example.answer for example in task] == ["2", "6"]
    pq.write_table(pa.table({"question": ["Q"], "answer": ["no marker"]}), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"bad\.parquet:row 0: answer has no '####'"):
        load_task("gsm8k", "test", tmp_path / "bad.parquet")


# ------------------------------------------------------------------ bad rows

_GOOD = {"question": "What is 2 + 2?", "answer": "2 + 2 = 4\n#### 4"}
_BAD_ROWS = [
    ({"answer": "#### 4"}, "missing field 'question'"),
    ({"question": "Q?", "answer": "2 + 2 is four"}, "no '####'"),
    ({"question": "   ", "answer": "#### 4"}, "field 'question' is empty"),
    ({"question": "Q?", "answer": "#### four"}, "the final answer 'four' is not one decimal number"),
    # A first-number rule made this 1: a gold no completion of the true value matches.
    ({"question": "Q?", "answer": "#### 1 000"}, "the final answer '1 000' is not one decimal number"),
    ({"question": 7, "answer": "#### 4"}, "field 'question' is int"),
    ('{"question": "unterminated', "invalid JSON"),
    ("[1, 2]", "not an object"),
]


def test_a_fraction_or_an_exponent_is_one_gold_value(tmp_path):
    # The grader reads 1/2 and 1e3 whole, so a gold may be written so.
    from podsjax.rewards import gsm8k_accuracy

    path = _write_jsonl(tmp_path / "rows.jsonl", [{"question": "Q?", "answer": "#### 1/2"}, {"question": "R?", "answer": "1e3"}])
    golds = [example.answer for example in load_task("gsm8k", "test", path)]
    assert golds == ["1/2", "1e3"]
    assert gsm8k_accuracy(["<answer>0.5</answer>", "<answer>1,000</answer>"], answer=golds) == [1.0, 1.0]


@pytest.mark.parametrize("bad, reason", _BAD_ROWS)
def test_bad_row_raises_naming_file_and_line(tmp_path, bad, reason):
    path = _write_jsonl(tmp_path / "rows.jsonl", [_GOOD, "", _GOOD, bad, _GOOD])  # the blank line 2 is skipped
    with pytest.raises(DataError) as info:
        load_task("gsm8k", "test", path)
    message = str(info.value)
    assert f"{path}:4" in message and reason in message
    assert "\n" not in message


def test_bad_rows_skipped_and_counted(tmp_path):
    rows = [_GOOD] + [bad for bad, _ in _BAD_ROWS] + [_GOOD]
    path = _write_jsonl(tmp_path / "rows.jsonl", rows)
    task = load_task("gsm8k", "test", path, on_bad_row="skip")
    assert len(task) == 2 and task.num_skipped == len(_BAD_ROWS)
    assert [example.source for example in task] == [f"{path}:1", f"{path}:{len(rows)}"]
    assert task.skipped[0].startswith(f"{path}:2: ")
    assert len(load_task("gsm8k", "test", path, on_bad_row="skip", max_skipped_reasons=2).skipped) == 2


def test_math_bad_rows(tmp_path):
    path = _write_jsonl(
        tmp_path / "m.jsonl",
        [
            {"problem": "P", "answer": "3"},
            {"problem": "P", "solution": "no box"},
            {"problem": "P", "solution": "unclosed \\boxed{\\frac{1}{2}"},
            {"problem": "P", "answer": ""},
            {"problem": "", "answer": "3"},
        ],
    )
    task = load_task("math", "test", path, on_bad_row="skip")
    assert [example.answer for example in task] == ["3"] and task.num_skipped == 4
    with pytest.raises(DataError, match=re.escape(f"{path}:2: no 'answer' field and no \\boxed")):
        load_task("math", "test", path)


def test_a_math_gold_number_loads_in_plain_decimals_and_other_kinds_are_named(tmp_path):
    # str() had written 0.00005 as 5e-05, whose e the grader reads as Euler's number: never right.
    path = _write_jsonl(tmp_path / "m.jsonl", [{"problem": "P", "answer": 0.00005}, {"problem": "Q", "answer": 1e16},
                                               {"problem": "R", "answer": 3}, {"problem": "S", "answer": -2.5}])
    golds = [example.answer for example in load_task("math", "train", path)]
    assert golds == ["0.00005", "10000000000000000", "3", "-2.5"]
    assert math_accuracy([f"<answer>{gold}</answer>" for gold in golds], answer=golds) == [1.0] * 4
    listed = _write_jsonl(tmp_path / "l.jsonl", [{"problem": "P", "answer": [1, 2]}])
    with pytest.raises(DataError, match="l.jsonl:1: field 'answer' is list, not text"):  # had said it was empty
        load_task("math", "train", listed)


def test_math_gold_answers_the_grader_cannot_read_are_refused_with_file_and_line(tmp_path):
    rows = [{"problem": "P", "answer": "\\frac{1}{2}"}, {"problem": "P", "answer": "\\frac{1}{"},
            {"problem": "P", "answer": "}{"}, {"problem": "P", "answer": "\\{1, 2\\}"}]
    path = _write_jsonl(tmp_path / "m.jsonl", rows)
    with pytest.raises(DataError) as err:
        load_task("math", "train", path)
    message = str(err.value)
    assert message.startswith(f"bad math row at {path}:2: gold answer '\\\\frac{{1}}{{' cannot be read as an answer")
    assert "\n" not in message
    task = load_task("math", "train", path, on_bad_row="skip")
    assert [example.answer for example in task] == ["\\frac{1}{2}", "\\{1, 2\\}"] and task.num_skipped == 2


# ------------------------------------------------------------ paths and names


def test_missing_paths_and_bad_arguments_give_one_line_errors(tmp_path):
    cases = [
        (lambda: load_task("gsm8k", "test", tmp_path / "nope.jsonl"), "dataset file not found"),
        (lambda: load_task("gsm8k", "validation", tmp_path), "no validation.jsonl or validation.parquet"),
        (lambda: load_task("gsm9k", "test", tmp_path), "unknown task 'gsm9k'"),
        (lambda: load_task("gsm8k", "test", tmp_path, on_bad_row="ignore"), "on_bad_row must be"),
    ]
    (tmp_path / "notes.txt").write_text("x")
    cases.append((lambda: load_task("gsm8k", "test", tmp_path / "notes.txt"), "unsupported dataset file"))
    for call, fragment in cases:
        with pytest.raises(DataError) as info:
            call()
        assert fragment in str(info.value) and "\n" not in str(info.value)


def test_hub_failure_is_one_line_with_a_way_out(monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def unreachable(repo, config=None, split=None, cache_dir=None):
        calls.append((repo, config, split))
        raise ConnectionError(f"Couldn't reach '{repo}' on the Hub (OfflineModeIsEnabled)\nsecond line")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(DataError) as info:
        load_task("gsm8k", "train")
    message = str(info.value)
    assert "openai/gsm8k" in message and "pass path=" in message and "\n" not in message
    assert calls == [("openai/gsm8k", "main", "train")]
    calls.clear()
    with pytest.raises(DataError, match="EleutherAI/hendrycks_math"):
        load_task("math", "train")
    assert [config for _, config, _ in calls] == [data.MATH_TRAIN_SUBJECTS[0]]
    calls.clear()
    with pytest.raises(DataError, match="HuggingFaceH4/MATH-500"):
        load_task("math", "test")


def test_hub_rows_become_examples(monkeypatch):
    datasets = pytest.importorskip("datasets")
    fake = {"openai/gsm8k": [{"question": "Q1?", "answer": "#### 1"}, {"question": "Q2?", "answer": "#### 2,000"}]}
    monkeypatch.setattr(datasets, "load_dataset", lambda repo, config=None, split=None, cache_dir=None: fake[repo])
    task = load_task("gsm8k", "test")
    assert [example.answer for example in task] == ["1", "2000"]
    assert task[1].source == "hub:openai/gsm8k/main/test:1" and task.origin == "openai/gsm8k"


@pytest.mark.skipif(os.environ.get("HF_DATASETS_OFFLINE") != "1", reason="needs HF_DATASETS_OFFLINE=1 (no network)")
def test_real_offline_hub_call_fails_cleanly(tmp_path):
    pytest.importorskip("datasets")
    # An empty cache directory, so nothing cached can satisfy the call either.
    with pytest.raises(DataError) as info:
        load_task("gsm8k", "test", cache_dir=str(tmp_path))
    assert "pass path=" in str(info.value) and "\n" not in str(info.value)


# ------------------------------------------------------------------- columns


def test_reward_columns_repeat_each_example_per_sample():
    examples = [
        Example("q0", "1", {"solution": "s0", "level": 1}),
        Example("q1", "2", {"solution": "s1"}),
    ]
    columns = reward_columns(examples, num_samples=3)
    assert columns == {
        "answer": ["1", "1", "1", "2", "2", "2"],
        "prompt": ["q0", "q0", "q0", "q1", "q1", "q1"],
        "solution": ["s0", "s0", "s0", "s1", "s1", "s1"],  # 'level' is not shared by every example
    }
    with pytest.raises(DataError, match="empty answer"):
        Example("q", " ")


def test_your_own_columns_and_bare_final_answers(tmp_path):
    rows = [{"prompt": "One plus one?", "final": "2", "id": 7}, {"prompt": "Half of 3?", "final": "1.5", "id": 8}]
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    task = load_task("gsm8k", "train", path, columns={"question": "prompt", "answer": "final"})
    assert [(e.prompt, e.answer, e.columns["id"]) for e in task] == [("One plus one?", "2", 7), ("Half of 3?", "1.5", 8)]
    with pytest.raises(DataError, match=r"mine\.jsonl:1: missing column 'question_text' \(read as the task's 'question'\)"):
        load_task("gsm8k", "train", path, columns={"question": "question_text", "answer": "final"})
    math_task = load_task("math", "train", path, columns={"problem": "prompt", "answer": "final"})
    assert [e.answer for e in math_task] == ["2", "1.5"]
    with pytest.raises(DataError, match="columns: 'prompt' is named for two of the task's fields"):
        load_task("gsm8k", "train", path, columns={"question": "prompt", "answer": "prompt"})
    # Mappings that name another field's column: read from the row as it is, in either order.
    # One at a time, the first had read the problem from the answer just renamed; the swap had failed.
    crossed = tmp_path / "crossed.jsonl"
    crossed.write_text(json.dumps({"answer": "Half of 3?", "final": "1.5"}) + "\n")
    for columns in ({"answer": "final", "problem": "answer"}, {"problem": "answer", "answer": "final"}):
        assert [(e.prompt, e.answer) for e in load_task("math", "train", crossed, columns=columns)] == [
            ("Half of 3?", "1.5")]
    for bad, message in (({"limit": 1.5}, "limit must be an integer >= 0 or None, got 1.5"),
                         ({"columns": ["prompt"]}, "columns must map the task's fields to your column names")):
        with pytest.raises(DataError, match=message):
            load_task("gsm8k", "train", crossed, **bad)
    swapped = tmp_path / "swapped.jsonl"
    swapped.write_text(json.dumps({"question": "2", "answer": "One plus one?"}) + "\n")
    task = load_task("gsm8k", "train", swapped, columns={"question": "answer", "answer": "question"})
    assert [(e.prompt, e.answer) for e in task] == [("One plus one?", "2")]


@pytest.mark.parametrize("name", ["completions", "rewards"])
def test_a_column_named_as_the_rewards_own_argument_is_refused_at_load(tmp_path, name):
    # It had loaded, and the first evaluation failed with "score() got multiple values for argument".
    rows = [{"question": "One plus one?", "answer": "2", name: "x"}, {"question": "Q?", "answer": "3", name: "y"}]
    path = _write_jsonl(tmp_path / "rows.jsonl", rows)
    with pytest.raises(DataError, match=f"column '{name}' has the name of the rewards' own argument"):
        load_task("gsm8k", "train", path)
    mixed = _write_jsonl(tmp_path / "mixed.jsonl", [rows[0], {"question": "Q?", "answer": "3"}])
    assert len(load_task("gsm8k", "train", mixed)) == 2  # not shared by every row: no reward sees it


def test_gsm8k_final_answers_keep_their_sign_and_decimals_and_numbers_load_as_numbers(tmp_path):
    answers = [".5", "#### -.5", "-$5", "#### - 7", 42, 3.5, "#### 1,234", "#### 18 dollars", "#### 18."]
    path = _write_jsonl(tmp_path / "rows.jsonl", [{"question": "Q?", "answer": a} for a in answers])
    assert [e.answer for e in load_task("gsm8k", "train", path)] == [
        ".5", "-.5", "-5", "-7", "42", "3.5", "1234", "18", "18"]


def test_a_gsm8k_dataset_s_own_solution_column_stays_its_own(tmp_path):
    path = _write_jsonl(tmp_path / "rows.jsonl", [{"question": "Q?", "answer": "42", "solution": "6 * 7 = 42"},
                                                  {"question": "Q?", "answer": "6 * 7 = 42\n#### 42"}])
    assert [e.columns["solution"] for e in load_task("gsm8k", "train", path)] == ["6 * 7 = 42", "6 * 7 = 42\n#### 42"]
