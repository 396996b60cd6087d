"""What the config cannot check alone: paths, the task, the run directory (before JAX starts)."""

from __future__ import annotations

import json
import math
import os

from experiments import completed, run_dir
from experiments.config import DataSection, ExperimentConfig
from experiments.usage import CONFIG_FILE, DRY_RUN_FILE, UsageError
from podsjax.devices.mesh_spec import BATCH_AXES, parse_mesh_spec  # no JAX


def check(args, config: ExperimentConfig) -> None:
    """What the config cannot check alone: paths, the task, the run directory."""
    if args.resume and args.overwrite:
        raise UsageError("--resume and --overwrite exclude each other")
    if args.resume:
        _check_resumable(args.out)
    if config.run.eval_every_s is None:  # the evaluation's own flags would be ignored without a word
        flag = next((origin for field, origin in getattr(args, "origins", {}).items() if field in _EVAL_FIELDS
                     and origin.startswith("--") and not origin.startswith("--config")), None)
        if flag is not None:
            raise UsageError(f"{flag} sets the evaluation, which --eval-every null turns off; remove one of them")
    if config.model.mesh is not None:  # before a CPU makes the mesh's host devices (100,000 of them, say)
        sizes = parse_mesh_spec(config.model.mesh, None)
        # rl.prompt_rows x n, whose module imports JAX
        check_rows_over(config.run.prompts_per_step * config.algorithm.groups_per_prompt * config.algorithm.n,
                        math.prod(sizes[axis] for axis in BATCH_AXES))
    if args.no_compile_cache and args.compile_cache_dir is not None:
        raise UsageError("--no-compile-cache and --compile-cache-dir exclude each other")
    if args.topology and not args.dry_run:
        raise UsageError("--topology compiles for devices that this host does not have, so it only goes "
                         "with --dry-run")
    if config.run.task != args.task:
        raise UsageError(f"the config is a {config.run.task} run; run experiments.{config.run.task}")
    if config.model.path is None and config.data != DataSection() and not args.resume:
        raise UsageError("--data, --eval-data, --dataset and the other data.* settings need --model: the tiny preset "
                         "trains and evaluates on problems it makes itself")
    for flag, path in (("--model", config.model.path), ("--data", config.data.train), ("--eval-data", config.data.test)):
        if path is not None and not os.path.exists(path):
            raise UsageError(f"{flag} {path}: no such file or directory")
    from podsjax.data import datasets as data  # no JAX

    hint = data.LOCAL_ONLY_TASKS.get(config.task)
    missing = [flag for flag, path in (("--data", config.data.train), ("--eval-data", config.data.test))
               if path is None]
    if hint and missing and config.data.hub is None and config.model.path is not None and not args.resume:
        raise UsageError(f"{config.task} has no Hub dataset: pass --dataset DIR (its train and test files), or "
                         f"{' and '.join(missing)}; e.g. --dataset {hint}")
    given = [(flag, path) for flag, path in (("--data", config.data.train), ("--eval-data", config.data.test)) if path]
    if len(missing) == 1 and config.data.hub is None and not args.resume and os.path.isdir(given[0][1]):
        # A directory of splits names both: the other one had come from the Hub, not from it.
        raise UsageError(f"{given[0][0]} {given[0][1]} is a directory of splits: pass --dataset "
                         f"{given[0][1]} for both, or name the other split with {missing[0]}")
    if config.model.path is not None:
        _check_model_config(config.model.path)
    if "wandb" in config.run.log:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise UsageError("--log wandb needs the wandb package: pip install 'podsjax[wandb]'")


def check_rows_over(rows: int, shards: int) -> None:
    """A step's rollout rows split evenly over the mesh's batch shards."""
    if rows % shards:
        raise UsageError(f"--prompts-per-step x --n = {rows} rollout rows must divide evenly over the mesh's "
                         f"{shards} batch shards; change --n, --prompts-per-step or --mesh")


def check_processes(coordinator: str, processes: int, process_id: int) -> None:
    """A multi-host run's flags, before JAX's client meets them (a bad address crashes or hangs it)."""
    host, colon, port = coordinator.rpartition(":")
    if not colon or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UsageError(f"--coordinator must be HOST:PORT with a port in 1..65535; got {coordinator!r}")
    if processes < 1:
        raise UsageError(f"--num-processes must be >= 1; got {processes}")
    if not 0 <= process_id < processes:
        raise UsageError(f"--process-id must be in 0..{processes - 1}; got {process_id}")


_EVAL_FIELDS = ("run.eval_limit", "run.eval_temperature", "run.eval_repeats", "run.eval_metric", "run.eval_k")


def _check_resumable(out: str) -> None:
    """A run whose exports a resume would replace has a checkpoint to continue from: without
    one the resume would train again from step 0 over them."""
    steps = _steps(os.path.join(out, run_dir.CHECKPOINTS_DIRNAME))
    exports = [name for name in completed.EXPORTS if os.path.exists(os.path.join(out, name))]
    # best/<step>: the best policy's params (podsjax.run.best). The untrained one of step 0, which
    # a run killed before its first checkpoint leaves, is evaluated again: nothing is lost.
    if any(int(step) > 0 for step in _steps(os.path.join(out, "best"))):
        exports.append("best")
    if not steps and exports:
        raise UsageError(f"--resume: {out} has no checkpoint to continue from, and a resume would train again from "
                         f"step 0 over its {', '.join(exports)}; pass --overwrite to start the run again, or choose "
                         "another --out")


def _steps(folder: str) -> list[str]:
    return [name for name in os.listdir(folder) if name.isdigit()] if os.path.isdir(folder) else []


def _check_model_config(path: str) -> None:
    """--model names a directory whose config.json is a JSON object (the model loads it later;
    the tokenizer, loading first, would report anything else as its own failure)."""
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise UsageError(f"--model {path}: not a Hugging Face checkpoint directory (no config.json)")
    try:
        with open(config_path, encoding="utf-8") as f:
            values = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise UsageError(f"--model {path}: cannot read config.json ({str(exc).splitlines()[0][:120]})") from None
    if not isinstance(values, dict):
        raise UsageError(f"--model {path}: config.json holds a JSON {type(values).__name__}, not a model's config")


def planned_only(out: str) -> bool:
    """Whether ``out`` is empty or holds only what a dry run writes (dry_run.json and podsjax's
    config.json): the real run may follow its dry run into the same one. A lock file alone does
    not count: the run takes it over, or names its live holder."""
    if not os.path.isdir(out):
        return False
    files = {name for name in os.listdir(out) if not run_dir.is_bookkeeping(name)}  # a lock, a failed start's logs
    if CONFIG_FILE in files and not run_dir.is_podsjax_run(out):
        return False  # a model's config.json, say, beside a dry run's figures
    return not files or (DRY_RUN_FILE in files and files <= {DRY_RUN_FILE, CONFIG_FILE})


def has_run(out: str) -> bool:
    """Whether ``out`` holds a run to continue (its config.json, and more than a dry run's files)."""
    return os.path.isfile(os.path.join(out, CONFIG_FILE)) and not planned_only(out)


def check_out(args) -> None:
    """The run directory: a file is refused, and an existing run needs --resume or --overwrite
    (a dry run may look at any directory: it writes only its dry_run.json there)."""
    out = args.out
    if not out.strip():
        raise UsageError("--out is empty; name the run directory")
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--out {out} exists and is not a directory")
    _check_writable(out)
    if args.resume and not has_run(out):
        raise UsageError(f"--resume: {out} holds no run to resume (no config.json of a run)")
    if args.resume and not args.dry_run:
        _refuse_if_in_use(out)  # before anything loads, and before a complete run is reported as untouched
    if args.dry_run and run_dir.foreign_dry_run_file(out):
        raise UsageError(f"--dry-run: {os.path.join(out, DRY_RUN_FILE)} is not a podsjax dry run's, and the dry run "
                         "would replace it; choose another --out")
    occupied = os.path.isdir(out) and not planned_only(out)
    if occupied and not (args.resume or args.overwrite or args.dry_run):
        _refuse_if_in_use(out)  # a live run there: --resume and --overwrite would be refused too
        if getattr(args, "resume_auto", False):
            raise UsageError(f"--resume auto: {out} is not empty and holds no run (no config.json); start the run "
                             "in an empty or new directory")
        if not run_dir.is_podsjax_run(out):  # neither flag would take it: say so, not "pass --resume"
            raise UsageError(f"--out {out} is not empty and holds no podsjax run (no config.json of a run); "
                             "choose a new or empty directory")
        raise UsageError(f"--out {out} is not empty; pass --resume to continue it or --overwrite to replace it")


def _check_writable(out: str) -> None:
    """``out``, or the folder it would be made in, is writable: said before a model loads, not after."""
    here = os.path.abspath(out)
    while not os.path.exists(here) and os.path.dirname(here) != here:
        here = os.path.dirname(here)
    if os.path.exists(here) and not os.path.isdir(here):
        raise UsageError(f"--out {out}: {here} is a file, so the run directory cannot be made under it")
    if not os.access(here, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write --out {out}: {here} is not writable")


def _refuse_if_in_use(out: str) -> None:
    """One line naming the live run that holds ``out``'s lock (the lock file is only read)."""
    from podsjax.run.run_state import RunLock

    in_use = RunLock(out).in_use()
    if in_use:
        raise UsageError(in_use)
