"""What ``--overwrite`` may delete (only a run directory that podsjax made, and never one that
holds the run's own inputs), when it deletes it (once the new run has finished a step: until
then the old run waits in ``.replaced-*`` and comes back if the new one stops), and what a
run that fails before its first step leaves behind.

A run directory's marker is the ``config.json`` podsjax writes there first (a JSON object of
the config's sections, ``run`` among them). A Hugging Face checkpoint's ``config.json`` is no
such marker, so a model directory, a dataset or a project folder given as ``--out`` is refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import tempfile

from experiments.usage import CONFIG_FILE, DRY_RUN_FILE, UsageError
from podsjax.run.run_state import LOCK_FILE

CHECKPOINTS_DIRNAME = "checkpoints"
METRICS_FILE = "metrics.jsonl"
REPLACED_PREFIX = ".replaced-"

_NAMES_SHOWN = 3


def is_podsjax_run(directory: str) -> bool:
    """Whether ``directory`` holds the config.json of a podsjax run (or dry run)."""
    from experiments.config_decoding import SECTIONS

    try:
        with open(os.path.join(directory, CONFIG_FILE), encoding="utf-8") as f:
            values = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False
    return isinstance(values, dict) and isinstance(values.get("run"), dict) and set(values) <= set(SECTIONS)


def foreign_dry_run_file(directory: str) -> bool:
    """Whether ``directory`` holds a ``dry_run.json`` that no podsjax dry run wrote (which a dry
    run must not replace)."""
    try:
        with open(os.path.join(directory, DRY_RUN_FILE), encoding="utf-8") as f:
            values = json.load(f)
    except FileNotFoundError:
        return False
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return True
    return not (isinstance(values, dict) and {"params", "total", "device_kind"} <= set(values))


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
    if not is_podsjax_run(out) and not all(is_bookkeeping(name) for name in entries):
        raise UsageError(f"{head}: it is no podsjax run directory (no {CONFIG_FILE} of a run); delete it yourself "
                         "or choose another --out")
    foreign = foreign_files(out)
    if foreign:
        raise UsageError(f"--overwrite: refusing to delete {out}: it holds {describe(foreign)}, which no podsjax run "
                         "writes; move them out or choose another --out")


def describe(entries: list[str]) -> str:
    """A few of a directory's names, and how many more."""
    shown = ", ".join(entries[:_NAMES_SHOWN])
    rest = len(entries) - _NAMES_SHOWN
    return f"{shown} and {rest} more" if rest > 0 else shown


# What a run writes beside its config that a rerun in the same directory may find: the lock
# (taken over), and the reports kept off the console (appended to), which explain a failure.
_RUN_LOG = re.compile(r"run(\.\d+)?\.log")


# What a run writes at the top of its directory (tests/experiments/test_overwrite.py checks a
# real run's against it): --overwrite deletes these and nothing else.
_RUN_ENTRY = re.compile(r"config\.json|dry_run\.json|exported\.json|(metrics|samples|eval_history)\.jsonl(\.superseded)?"
                        r"|checkpoints|best|best_model|final_model|final_adapter|tiny_warmup(\.partial-.+)?|wandb"
                        r"|events\.out\.tfevents\..+|" + re.escape(REPLACED_PREFIX) + r".+")


def kept_run(out: str) -> bool:
    """Whether a run that failed left ``out`` a run of its own to --resume: its config.json, and not
    the old run that --overwrite put back (resuming that would train it further)."""
    return os.path.isfile(os.path.join(out, CONFIG_FILE)) and not put_back_into(out)


def put_back_into(out: str) -> bool:
    """Whether this process put the run that --overwrite was to replace back into ``out``."""
    return os.path.realpath(out) in ReplacedRun.restored


def foreign_files(out: str) -> list[str]:
    """What a run directory holds that no podsjax run writes, as paths inside it: its top level,
    the exported models' files, and the checkpoint folders' entries (a step's insides are
    orbax's, and change with its version)."""
    from podsjax.models import hf_export, hf_io, peft_io  # their file names; imported only to replace a run
    from podsjax.run import checkpoint_layout as layout

    exported = re.compile("|".join([r"config\.json", re.escape(hf_io.SINGLE_FILE), re.escape(hf_io.INDEX_FILE),
                                    r"model-\d{5}-of-\d{5}\.safetensors", *map(re.escape, hf_export.TOKENIZER_FILES),
                                    re.escape(hf_export.STAGING_PREFIX) + ".+"]))  # an export killed mid-write
    inside = {"final_model": exported, "best_model": exported,
              # and a write killed midway (peft_io stages each file as .<name>.partial)
              "final_adapter": re.compile(rf"(\.)?({re.escape(peft_io.CONFIG_FILE)}|{re.escape(peft_io.WEIGHTS_FILE)})"
                                          rf"(?(1)\.partial)"),
              # steps, damaged ones moved aside (``checkpoint_layout.move_aside``), and saves under way
              CHECKPOINTS_DIRNAME: layout.ENTRY}
    inside["best"] = inside[CHECKPOINTS_DIRNAME]
    foreign = [name for name in sorted(os.listdir(out)) if not is_run_entry(name)]
    for sub, allowed in inside.items():
        foreign += [f"{sub}/{name}" for name in _names(os.path.join(out, sub)) if not allowed.fullmatch(name)]
    return sorted(foreign)


def _names(directory: str) -> list[str]:
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


def is_run_entry(name: str) -> bool:
    """Whether a run directory's top-level ``name`` is one a podsjax run writes."""
    return _RUN_ENTRY.fullmatch(name) is not None or is_bookkeeping(name)


def is_bookkeeping(name: str) -> bool:
    """Whether a run directory's entry is its lock or a run log, which never make it a run."""
    return name == LOCK_FILE or _RUN_LOG.fullmatch(name) is not None


def made_progress(directory: str, before: set[str] = frozenset()) -> bool:
    """Whether a run got anywhere worth keeping: a checkpoint of a step past 0, a step logged,
    or the figures of a dry run (this one's: a ``dry_run.json`` named in ``before`` was there
    before the run). A run stopped before its first step saves step 0, which trained nothing:
    it must not outweigh the run that --overwrite was to replace."""
    checkpoints = os.path.join(directory, CHECKPOINTS_DIRNAME)
    dry_run = DRY_RUN_FILE not in before and os.path.isfile(os.path.join(directory, DRY_RUN_FILE))
    if dry_run or (os.path.isdir(checkpoints) and any(_past_step_0(name) for name in os.listdir(checkpoints))):
        return True
    try:
        with open(os.path.join(directory, METRICS_FILE), "rb") as f:
            return any(_step(line) >= 1 for line in f)
    except OSError:
        return False


def _past_step_0(name: str) -> bool:
    """A checkpoint entry (``12``, or a save in flight such as ``12.orbax-checkpoint-tmp-3``) of a
    step past 0; an entry without a step counts, as anything unknown is kept."""
    digits = re.match(r"\d+", name)
    return digits is None or int(digits.group()) > 0


def _step(line: bytes) -> float:
    try:
        record = json.loads(line)
    except ValueError:
        return 0
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, (int, float)) and not isinstance(step, bool) else 0


def remove_failed_start(directory: str, before: set[str], existed: bool) -> None:
    """Removes what a run that failed before its first step wrote, so that the corrected rerun
    is not refused as "not empty" (nor its --resume as a changed config).

    Only entries that were not there before the run are removed, and not its run logs, which
    say why it failed; the directory itself goes when the run made it and nothing is left.
    """
    if not os.path.isdir(directory) or made_progress(directory, before):
        return
    for name in set(os.listdir(directory)) - before:
        if is_bookkeeping(name):
            continue
        path = os.path.join(directory, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)
    if not existed:
        with contextlib.suppress(OSError):
            os.rmdir(directory)  # only when empty


def say_replaced_leftovers(out: str, overwrite: bool) -> None:
    """Names the old runs that an --overwrite killed before its first step left aside in ``out``
    (a stop puts them back; a kill cannot), so that a run starting there does not hide them;
    ``overwrite``: this run replaces the directory (not a dry run, which deletes nothing)."""
    for name in sorted(n for n in os.listdir(out) if n.startswith(REPLACED_PREFIX)) if os.path.isdir(out) else []:
        fate = ("this --overwrite deletes it with the rest at its first step" if overwrite
                else "move its files back to restore it, or delete it")
        print(f"note: {os.path.join(out, name)} holds the run that an --overwrite killed before its first step "
              f"was to replace; {fate}", file=sys.stderr, flush=True)


class ReplacedRun:
    """The run that ``--overwrite`` replaces, moved aside into ``<out>/.replaced-*`` (a rename:
    no copy, no deletion) until the new run has finished a step (:meth:`drop`), or back in
    place when the new run stops before that (:meth:`put_back`).

    Args:
        out_dir: the run directory, locked by this process; its lock stays where it is.
    """

    restored: set[str] = set()  # where this process put an old run back (real paths; a new start forgets it)

    def __init__(self, out_dir: str):
        self.out_dir, self.path = out_dir, None
        names = sorted(set(os.listdir(out_dir)) - {LOCK_FILE})
        if names:
            self.path = tempfile.mkdtemp(prefix=REPLACED_PREFIX, dir=out_dir)
            for name in names:
                os.rename(os.path.join(out_dir, name), os.path.join(self.path, name))

    def drop(self) -> None:
        """Deletes the old run: the new one has replaced it."""
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None

    def put_back(self) -> None:
        """Moves the old run back, once the new run's own files are gone (``remove_failed_start``):
        a run log the new run wrote is appended to the old run's, which it explains."""
        if self.path is None:
            return
        for name in sorted(os.listdir(self.path)):
            old, new = os.path.join(self.path, name), os.path.join(self.out_dir, name)
            if is_bookkeeping(name) and os.path.isfile(new) and os.path.isfile(old):
                with open(old, "ab") as kept, open(new, "rb") as added:
                    shutil.copyfileobj(added, kept)
                os.unlink(new)
            if not os.path.lexists(new):
                os.rename(old, new)
        with contextlib.suppress(OSError):
            os.rmdir(self.path)  # only when all went back; else what is left stays there
        self.path = None
        ReplacedRun.restored.add(os.path.realpath(self.out_dir))
