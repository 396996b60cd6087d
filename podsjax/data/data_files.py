"""A dataset's rows from local files: JSON Lines, a JSON list or Parquet, read within bounds.

``split_file`` finds the file of a split (a file, or ``<dir>/<split>.jsonl``/``.parquet``/
``.json``); ``read_rows`` yields its rows with where each came from, "file:line". A bad
line (invalid JSON or UTF-8, longer than ``MAX_ROW_CHARS``) comes as a ``DataError`` in
its place, so that ``podsjax.data.datasets.load_task`` can skip it or name it.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator

_SUFFIXES = (".jsonl", ".json", ".parquet")
# The longest row accepted, in characters: a JSONL line, and any row's prompt. GSM8K and
# MATH rows are a few KB; a longer one is a broken file, and would otherwise be read whole.
MAX_ROW_CHARS = 64 * 1024
_MAX_LINE_BYTES = 4 * MAX_ROW_CHARS  # UTF-8 takes at most 4 bytes a character
_DISCARD_BYTES = 64 * 1024


class DataError(ValueError):
    """A dataset cannot be loaded: missing file, malformed row, unknown task."""


def split_file(path: str | os.PathLike, split: str) -> str:
    """The file a split is read from: ``path`` itself, or in a directory ``<split>.jsonl``,
    ``.parquet`` or ``.json``; a DataError says why there is none."""
    path = os.fspath(path)
    if os.path.isdir(path):
        for suffix in (".jsonl", ".parquet", ".json"):
            candidate = os.path.join(path, split + suffix)
            if os.path.isfile(candidate):
                return candidate
        raise DataError(f"no {split}.jsonl or {split}.parquet in {path}")
    if not os.path.exists(path):
        raise DataError(f"dataset file not found: {path}")
    if not os.path.isfile(path):  # a FIFO or device would block or never end
        raise DataError(f"dataset path is not a regular file: {path}")
    if not path.endswith(_SUFFIXES):
        raise DataError(f"unsupported dataset file {path}: expected .jsonl, .json or .parquet")
    return path


def read_rows(path: str) -> Iterator[tuple[str, Any]]:
    """(where, row) for each row of a file ``split_file`` returned; a bad row is a DataError."""
    reader = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet}
    return reader[os.path.splitext(path)[1]](path)


def _open(path: str):
    try:
        return open(path, "rb")
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}") from None


def _lines(path: str) -> Iterator[tuple[int, str | DataError]]:
    """A text file's numbered lines; an over-long or non-UTF-8 line comes as a DataError.

    Bytes, read a bounded piece at a time, so that one bad byte costs only its own line
    and a giant line is never held in memory whole.
    """
    with _open(path) as handle:
        number = 0
        while line := handle.readline(_MAX_LINE_BYTES + 1):
            number += 1
            if len(line) > _MAX_LINE_BYTES and not line.endswith(b"\n"):
                while line and not line.endswith(b"\n"):
                    line = handle.readline(_DISCARD_BYTES)
                yield number, DataError(f"line longer than {MAX_ROW_CHARS} characters")
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield number, DataError(f"not UTF-8 text: byte {exc.start + 1} of the line is 0x{line[exc.start]:02x}")
                continue
            if number == 1:
                text = text.removeprefix("\ufeff")  # a byte-order mark some editors write
            if len(text.rstrip("\r\n")) > MAX_ROW_CHARS:
                yield number, DataError(f"line longer than {MAX_ROW_CHARS} characters")
            else:
                yield number, text


def _json_failure(exc: Exception) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"{exc.msg} at column {exc.colno}"
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return str(exc).split(";")[0]  # ValueError: an integer of more digits than Python converts


def _read_jsonl(path: str) -> Iterator[tuple[str, Any]]:
    for number, line in _lines(path):
        where = f"{path}:{number}"
        if isinstance(line, DataError):
            yield where, line
        elif line.strip():
            try:
                row = json.loads(line)
            except (ValueError, RecursionError) as exc:
                row = DataError(f"invalid JSON ({_json_failure(exc)})")
            yield where, row


def _read_json(path: str) -> Iterator[tuple[str, Any]]:
    with _open(path) as handle:
        # Undecodable bytes become lone surrogates, so that only the rows holding them are bad.
        text = handle.read().decode("utf-8", "surrogateescape").removeprefix("\ufeff")
    if not text.strip():
        return
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as exc:
        hint = "; is it JSON Lines, to be named .jsonl?" if exc.msg == "Extra data" else ""
        raise DataError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg}{hint})") from None
    except (ValueError, RecursionError) as exc:
        raise DataError(f"{path}: invalid JSON ({_json_failure(exc)})") from None
    if not isinstance(rows, list):
        raise DataError(f"{path}: expected a JSON list of rows")
    for index, row in enumerate(rows):
        yield f"{path}[{index}]", row


def _read_parquet(path: str) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types; report one line
        raise DataError(f"{path}: cannot read parquet ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None
    step = 1024  # Python objects for a slice at a time, not the whole table
    for start in range(0, table.num_rows, step):
        chunk = table.slice(start, step)
        try:
            rows = chunk.to_pylist()
        except UnicodeDecodeError:  # a string column holding bytes that are not UTF-8: find the rows
            rows = [_parquet_row(chunk.slice(i, 1)) for i in range(chunk.num_rows)]
        for index, row in enumerate(rows, start=start):
            yield f"{path}:row {index}", row


def _parquet_row(table) -> Any:
    try:
        return table.to_pylist()[0]
    except UnicodeDecodeError:
        return DataError("not UTF-8 text")
