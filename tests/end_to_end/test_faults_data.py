"""Bad data files: undecodable text, giant lines, empty splits and malformed rows give one-line DataErrors."""

import json
import os
import tracemalloc

import pytest

from podsjax.data.datasets import MAX_ROW_CHARS, DataError, load_task

_GOOD = {"question": "What is 2 + 2?", "answer": "2 + 2 = 4\n#### 4"}


def _write(path, lines):
    """Writes byte lines (a dict is dumped as JSON, non-ASCII kept as UTF-8), one a line."""
    with open(path, "wb") as handle:
        for line in lines:
            handle.write(json.dumps(line, ensure_ascii=False).encode() if isinstance(line, dict) else line)
            handle.write(b"\n")
    return str(path)


def _one_line_error(*args, **kwargs) -> str:
    with pytest.raises(DataError) as info:
        load_task(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------- undecodable text


def test_non_utf8_line_names_file_and_line_and_obeys_on_bad_row(tmp_path):
    bad = b'{"question": "Caf\xe9 au lait?", "answer": "#### 4"}'  # Latin-1, not UTF-8
    path = _write(tmp_path / "rows.jsonl", [_GOOD, bad, _GOOD])
    message = _one_line_error("gsm8k", "test", path)
    assert f"{path}:2: not UTF-8 text: byte 18 of the line is 0xe9" in message
    task = load_task("gsm8k", "test", path, on_bad_row="skip")
    assert [example.source for example in task] == [f"{path}:1", f"{path}:3"]
    assert task.num_skipped == 1 and task.skipped[0].startswith(f"{path}:2: not UTF-8 text")


def test_lone_surrogate_escape_is_a_bad_row(tmp_path):
    # Valid JSON, but the text cannot be encoded for a tokenizer.
    path = _write(tmp_path / "rows.jsonl", [_GOOD, b'{"question": "Q\\udcff?", "answer": "#### 4"}'])
    assert f"{path}:2: text is not valid UTF-8" in _one_line_error("gsm8k", "test", path)
    task = load_task("gsm8k", "test", path, on_bad_row="skip")
    assert len(task) == 1 and task.num_skipped == 1


def test_non_utf8_row_in_a_json_file_costs_only_that_row(tmp_path):
    path = tmp_path / "rows.json"
    path.write_bytes(b'[' + json.dumps(_GOOD).encode() + b', {"question": "Q\xff?", "answer": "#### 4"}]')
    assert f"{path}[1]: text is not valid UTF-8" in _one_line_error("gsm8k", "test", path)
    task = load_task("gsm8k", "test", path, on_bad_row="skip")
    assert [example.source for example in task] == [f"{path}[0]"] and task.num_skipped == 1


def test_non_utf8_string_in_parquet_is_a_bad_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    # A string column whose second value is not UTF-8 (pyarrow's builders would refuse it).
    offsets = pa.array([0, 14, 18], pa.int32()).buffers()[1]
    questions = pa.Array.from_buffers(pa.string(), 2, [None, offsets, pa.py_buffer(b"What is 2 + 2?Q\xff?!")])
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"question": questions, "answer": ["#### 4", "#### 4"]}), path)
    assert f"{path}:row 1: not UTF-8 text" in _one_line_error("gsm8k", "test", path)
    task = load_task("gsm8k", "test", path, on_bad_row="skip")
    assert [example.prompt for example in task] == ["What is 2 + 2?"] and task.num_skipped == 1


def test_byte_order_mark_is_not_part_of_the_first_row(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(_GOOD).encode() + b"\r\n")
    assert load_task("gsm8k", "test", path)[0].answer == "4"
    path = tmp_path / "rows.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps([_GOOD]).encode())
    assert load_task("gsm8k", "test", path)[0].answer == "4"


# ----------------------------------------------------------------- over-long rows


def _row_of_length(length: int, char: str = "x") -> bytes:
    """A good GSM8K JSONL line of exactly ``length`` characters, padded in the question."""
    frame = json.dumps({"question": "", "answer": "#### 4"})
    line = frame.replace('""', '"' + char * (length - len(frame)) + '"', 1)
    assert len(line) == length
    return line.encode()


def test_row_length_limit_is_in_characters(tmp_path):
    path = _write(tmp_path / "rows.jsonl", [
        _row_of_length(MAX_ROW_CHARS),
        _row_of_length(MAX_ROW_CHARS + 1),
        _row_of_length(MAX_ROW_CHARS, "\u20ac"),  # 3 bytes a character in UTF-8: still within the limit
        _row_of_length(MAX_ROW_CHARS + 1, "\u20ac"),
    ])
    task = load_task("gsm8k", "test", path, on_bad_row="skip")
    assert [example.source for example in task] == [f"{path}:1", f"{path}:3"]
    assert task.skipped == (f"{path}:2: line longer than {MAX_ROW_CHARS} characters",
                            f"{path}:4: line longer than {MAX_ROW_CHARS} characters")
    assert f"{path}:2: line longer than {MAX_ROW_CHARS} characters" in _one_line_error("gsm8k", "test", path)


def test_giant_line_is_skipped_without_reading_it_whole(tmp_path):
    giant = b'{"question": "' + b"x" * 3_000_000 + b'", "answer": "#### 4"}'
    path = _write(tmp_path / "rows.jsonl", [_GOOD, giant, _GOOD, b"[" * 400_000, _GOOD])
    tracemalloc.start()
    try:
        task = load_task("gsm8k", "test", path, on_bad_row="skip")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [example.source for example in task] == [f"{path}:1", f"{path}:3", f"{path}:5"]
    assert task.num_skipped == 2
    assert all(reason.endswith(f"line longer than {MAX_ROW_CHARS} characters") for reason in task.skipped)
    assert peak < 1_500_000, f"loading held {peak} bytes at once for a 3 MB line"


def test_prompt_over_the_limit_is_a_bad_row_in_any_format(tmp_path):
    long_row = {"question": "x" * (MAX_ROW_CHARS + 1), "answer": "#### 4"}
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([long_row, _GOOD]))
    message = _one_line_error("gsm8k", "test", path)
    assert f"{path}[0]: prompt is {MAX_ROW_CHARS + 1} characters, over the limit of {MAX_ROW_CHARS}" in message
    task = load_task("gsm8k", "test", path, on_bad_row="skip")
    assert len(task) == 1 and task.num_skipped == 1


# --------------------------------------------------------------------- empty sets


@pytest.mark.parametrize("name, content", [
    ("test.jsonl", b""),
    ("test.jsonl", b"\n  \n"),
    ("test.json", b"[]"),
    ("test.json", b""),
])
def test_empty_file_is_an_error_naming_it(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    for mode in ("error", "skip"):
        message = _one_line_error("gsm8k", "test", path, on_bad_row=mode)
        assert message == f"no usable gsm8k rows in {path} (it is empty)"
    assert len(load_task("gsm8k", "test", path, limit=0)) == 0  # nothing asked for, nothing missing


def test_empty_parquet_is_an_error_naming_it(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": pa.array([], pa.string()), "answer": pa.array([], pa.string())}),
                   tmp_path / "train.parquet")
    message = _one_line_error("gsm8k", "train", tmp_path)
    assert message == f"no usable gsm8k rows in {tmp_path / 'train.parquet'} (it is empty)"


def test_every_row_skipped_is_an_error_with_the_first_reason(tmp_path):
    path = _write(tmp_path / "rows.jsonl", [{"question": "Q?", "answer": "four"}, b"not json"])
    message = _one_line_error("gsm8k", "test", path, on_bad_row="skip")
    assert message == (f"no usable gsm8k rows in {path} (2 skipped: {path}:1: answer has no '####' final-answer "
                       "marker and is not a bare number)")
    message = _one_line_error("gsm8k", "test", path, on_bad_row="skip", max_skipped_reasons=0)
    assert message == f"no usable gsm8k rows in {path} (2 skipped)"


def test_empty_hub_split_is_an_error_naming_it(monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets, "load_dataset", lambda repo, config=None, split=None, cache_dir=None: [])
    assert _one_line_error("gsm8k", "test") == "no usable gsm8k rows in openai/gsm8k split 'test' (it is empty)"
    assert "EleutherAI/hendrycks_math split 'train'" in _one_line_error("math", "train")


# ----------------------------------------------------------------- malformed input

_BAD_LINES = [
    ("gsm8k", b"[1, 2]", "row is a JSON array, not an object"),
    ("gsm8k", b'"just text"', "row is a JSON string, not an object"),
    ("gsm8k", b"null", "row is a JSON null, not an object"),
    ("gsm8k", b'{"question": "Q?", "answer": true}', "field 'answer' is bool, not text"),  # 4 is a number: it loads
    ("gsm8k", b'{"question": "Q?", "answer": NaN}', "field 'answer' is float, not text"),
    ("math", b'{"problem": 3, "answer": "3"}', "field 'problem' is int, not text"),
    ("math", b'{"problem": "P", "answer": NaN}', "field 'answer' is nan, not a finite number"),
    ("math", b'{"problem": "P", "answer": 1e999}', "field 'answer' is inf, not a finite number"),
    ("gsm8k", b"[" * 60_000, "invalid JSON (nested too deeply)"),
    ("gsm8k", b'{"question": "Q?", "answer": "#### 4", "id": ' + b"7" * 5000 + b"}",
     "invalid JSON (Exceeds the limit (4300 digits)"),
]


@pytest.mark.parametrize("task, bad, reason", _BAD_LINES)
def test_malformed_row_is_one_line_naming_file_and_line(tmp_path, task, bad, reason):
    good = {"gsm8k": _GOOD, "math": {"problem": "P", "answer": "3"}}[task]
    path = _write(tmp_path / "rows.jsonl", [good, bad, good])
    assert f"{path}:2: {reason}" in _one_line_error(task, "test", path)
    skipped = load_task(task, "test", path, on_bad_row="skip")
    assert [example.source for example in skipped] == [f"{path}:1", f"{path}:3"]
    assert skipped.num_skipped == 1 and skipped.skipped[0].startswith(f"{path}:2: {reason}")


@pytest.mark.parametrize("content, reason", [
    (b"[" * 60_000, "rows.json: invalid JSON (nested too deeply)"),
    (b"[" + b"1" * 5000 + b"]", "rows.json: invalid JSON (Exceeds the limit (4300 digits)"),
    (b'{"question": "Q?"}', "rows.json: expected a JSON list of rows"),
    (json.dumps(_GOOD).encode() + b"\n" + json.dumps(_GOOD).encode(),
     "rows.json:2: invalid JSON (Extra data; is it JSON Lines, to be named .jsonl?)"),
])
def test_broken_json_file_is_one_line(tmp_path, content, reason):
    (tmp_path / "rows.json").write_bytes(content)
    for mode in ("error", "skip"):
        assert reason in _one_line_error("gsm8k", "test", tmp_path / "rows.json", on_bad_row=mode)


def test_paths_that_are_not_dataset_files(tmp_path):
    assert "no test.jsonl or test.parquet in" in _one_line_error("gsm8k", "test", tmp_path)
    (tmp_path / "test.jsonl").mkdir()  # a directory where the split file should be
    assert "no test.jsonl or test.parquet in" in _one_line_error("gsm8k", "test", tmp_path)
    assert "dataset file not found" in _one_line_error("gsm8k", "test", tmp_path / "missing.jsonl")
    if hasattr(os, "mkfifo"):  # opening a FIFO would block until a writer came
        os.mkfifo(tmp_path / "pipe.jsonl")
        message = _one_line_error("gsm8k", "test", tmp_path / "pipe.jsonl")
        assert message == f"dataset path is not a regular file: {tmp_path / 'pipe.jsonl'}"


def test_unreadable_file_is_one_line(tmp_path, monkeypatch):
    path = _write(tmp_path / "rows.jsonl", [_GOOD])

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr("builtins.open", denied)  # chmod does not stop root, who may run the tests
    assert _one_line_error("gsm8k", "test", path) == f"cannot read {path}: Permission denied"
