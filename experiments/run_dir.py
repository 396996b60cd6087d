"""What ``--overwrite`` may delete: only a run directory that podsjax made, and never one that
holds the run's own inputs.

A run directory's marker is the ``config.json`` podsjax writes there first (a JSON object of
the config's sections, ``run`` among them). A Hugging Face checkpoint's ``config.json`` is no
such marker, so a model directory, a dataset or a project folder given as ``--out`` is refused.
"""

from __future__ import annotations

import json
import os

from experiments.usage import CONFIG_FILE, UsageError
from podsjax.run_state import LOCK_FILE

_NAMES_SHOWN = 3


def is_podsjax_run(directory: str) -> bool:
    """Whether ``directory`` holds the config.json of a podsjax run (or dry run)."""
    from experiments.flags import SECTIONS

    try:
        with open(os.path.join(directory, CONFIG_FILE), encoding="utf-8") as f:
            values = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False
    return isinstance(values, dict) and isinstance(values.get("run"), dict) and set(values) <= set(SECTIONS)


def inputs(config, config_file: str | None = None) -> list[tuple[str, str]]:
    """The paths a run reads that must outlive it, as (what, path): its model, data, config file
    and the current directory."""
    found = [("the model (--model)", config.model.path), ("the train data", config.data.train),
             ("the test data", config.data.test), ("the config file (--config)", config_file),
             ("the tiny preset's warm-up (--tiny.warmup_dir)", config.tiny.warmup_dir)]
    found.append(("the current directory", os.getcwd()))
    return [(what, path) for what, path in found if path]


def check_overwrite(out: str, config, config_file: str | None = None) -> None:
    """Refuses ``--overwrite`` of ``out`` unless deleting it loses nothing but an earlier podsjax run.

    Raises:
        UsageError: ``out`` holds one of the run's inputs (or the current directory), or is
            not a podsjax run directory; the line names the directory and what is in it.
    """
    if not os.path.isdir(out):
        return
    entries = sorted(set(os.listdir(out)) - {LOCK_FILE})
    if not entries:
        return  # nothing to delete
    where = os.path.realpath(out)
    head = f"--overwrite: refusing to delete {out} (it holds {describe(entries)})"
    for what, path in inputs(config, config_file):
        inside = os.path.realpath(path)
        if inside == where:
            raise UsageError(f"{head}: it is {what}; choose another --out")
        if inside.startswith(where.rstrip(os.sep) + os.sep):
            raise UsageError(f"{head}: {path} inside it is {what}; choose another --out")
    if not is_podsjax_run(out):
        raise UsageError(f"{head}: it is no podsjax run directory (no {CONFIG_FILE} of a run); delete it yourself "
                         "or choose another --out")


def describe(entries: list[str]) -> str:
    """A few of a directory's names, and how many more."""
    shown = ", ".join(entries[:_NAMES_SHOWN])
    rest = len(entries) - _NAMES_SHOWN
    return f"{shown} and {rest} more" if rest > 0 else shown
