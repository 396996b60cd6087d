"""A run directory's logs: the evaluation history, and cutting every log back to a checkpoint.

A checkpoint keeps each log's size (``HostState.log_sizes``). A resume from it cuts the
logs back to those sizes, so the steps redone after the restore are logged once; the cut
records are kept in ``<log>.superseded``.
"""

from __future__ import annotations

import json
import math
import os

from podsjax.devices import hosts
from podsjax.run import metrics as metrics_lib

HISTORY_FILE = "eval_history.jsonl"
LOGS = ("metrics.jsonl", "samples.jsonl", HISTORY_FILE)


class LogDamaged(ValueError):
    """A run log is damaged before the restored checkpoint; resuming would lose its records."""


def log_sizes(out_dir) -> dict[str, int]:
    """Each log's size now, which a resume from a checkpoint taken now cuts back to."""
    paths = {name: os.path.join(out_dir, name) for name in LOGS}
    return {name: os.path.getsize(path) for name, path in paths.items() if os.path.exists(path)}


def resume_logs(out_dir, sizes: dict[str, int], step: int) -> bool:
    """Checks the logs up to the restored checkpoint, then rewinds them to it (process 0; all agree).

    Returns:
        Whether anything was logged after the checkpoint (and moved to ``<log>.superseded``).

    Raises:
        LogDamaged: a log holds less than, or something else than, whole records up to its
            size at the checkpoint.
    """
    problem, moved = None, False
    if hosts.is_primary():
        problem = damaged_log(out_dir, sizes, step)
        if problem is None:
            moved = rewind_logs(out_dir, sizes)
    if hosts.sum_over_processes({"damaged": float(problem is not None)})["damaged"]:  # the others stop too
        raise LogDamaged(problem or "process 0 found a run log damaged before the restored checkpoint (its error "
                         "names the file)")
    return moved


def damaged_log(out_dir, sizes: dict[str, int], step: int) -> str | None:
    """The one line for the first log whose part before the checkpoint is not whole records, or None.

    A checkpoint keeps each log's size, not its records, so records lost before it cannot be
    rebuilt from it; resuming over the damage (a line cut short, garbage, the file cut back)
    would leave steps missing from the log with no sign of it. So the resume is refused, and
    the line says what to do. A log that is gone (moved aside) is not damaged: it starts over.
    """
    for name in LOGS:
        path, size = os.path.join(out_dir, name), sizes.get(name, 0)
        what = _first_damage(path, size) if size and os.path.exists(path) else None
        if what is not None:
            return (f"run log {path} is damaged before the checkpoint of step {step}: {what}; resuming would lose "
                    "the records it logged, so move the file aside (the resumed run starts a new one) or put back "
                    "a whole copy, then rerun with --resume")
    return None


def _first_damage(path: str, size: int) -> str | None:
    """What is wrong with the first ``size`` bytes of a log, or None when they are whole JSON records."""
    read = number = 0
    with open(path, "rb") as f:
        while read < size:
            line = f.readline(size - read)
            if not line:
                return f"it ends after line {number} ({read} of the {size} bytes it had then)"
            read += len(line)
            number += 1
            if not line.endswith(b"\n"):
                return f"line {number} is cut short"
            try:
                record = json.loads(line)
            except ValueError:  # not JSON, or not UTF-8
                record = None
            if not isinstance(record, dict):
                return f"line {number} is not a JSON record"
    return None


def rewind_logs(out_dir, sizes: dict[str, int]) -> bool:
    """Cuts each log back to its size at the restored checkpoint, keeping the cut tail.

    Whatever a killed run logged after that checkpoint is redone by the resumed run;
    leaving it in place would log those steps (and evaluations) twice.

    Returns:
        Whether any log had a tail to move.
    """
    moved = False
    for name in LOGS:
        path = os.path.join(out_dir, name)
        if not os.path.exists(path):
            continue
        size = sizes.get(name, 0)  # a log born after the checkpoint is all tail
        with open(path, "rb+") as f:
            f.seek(size)
            tail = f.read()
            if tail:
                with open(path + ".superseded", "ab") as kept:
                    kept.write(tail if tail.endswith(b"\n") else tail + b"\n")  # a torn line stays one line
                f.truncate(size)
                moved = True
    return moved


def history_path(out_dir) -> str:
    """The run's evaluation history: one JSON line per evaluation."""
    return os.path.join(out_dir, HISTORY_FILE)


def read_history(out_dir) -> list[dict[str, float]]:
    """Every evaluation of the run in ``out_dir`` so far (none before the first)."""
    path = history_path(out_dir)
    records = metrics_lib.read_jsonl(path) if os.path.exists(path) else []
    return [{k: math.nan if v is None else v for k, v in r.items()} for r in records]  # null: a NaN written


def append_history(out_dir, record) -> None:
    """One evaluation as a line of strict JSON (NaN: null; NumPy scalars as numbers)."""
    with open(history_path(out_dir), "a") as f:
        f.write(json.dumps(metrics_lib.to_jsonable(record, "evaluation"), allow_nan=False) + "\n")
