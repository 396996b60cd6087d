"""Shared command line of ``python -m experiments.gsm8k`` and ``python -m experiments.math``.

It parses flags before JAX is imported, so ``--mesh 8`` can give a CPU-only
machine 8 host devices; then it builds configs and calls ``podsjax.loop``.
Bad flags, paths, data or checkpoints, a diverged run and a full disk print one line
and exit with status 2; anything else is a bug and shows its traceback, then a one-line
summary, with status 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import importlib.util
import json
import math
import os
import sys
import time
import traceback

from experiments.usage import DRY_RUN_FILE, UsageError, mesh_device_count

# The library's errors about what the user gave it (module, class): one line, status 2.
# Looked up in sys.modules so that this module never imports JAX itself.
_USER_ERRORS = (
    ("podsjax.data", "DataError"), ("podsjax.prompts", "PromptError"), ("podsjax.models.hf_io", "CheckpointError"),
    ("podsjax.checkpoint", "CheckpointCorrupt"), ("podsjax.checkpoint", "CheckpointMismatch"),
    ("podsjax.loop", "TrainingDiverged"), ("podsjax.dry_run", "DoesNotFit"), ("podsjax.tiny.warmup", "WarmupError"),
    ("podsjax.rewards.pool", "RewardPoolError"),
)
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def user_error_line(exc: BaseException, out: str | None = None) -> str | None:
    """The one line for an error the user can act on, or None when ``exc`` is a bug."""
    if isinstance(exc, UsageError):
        return str(exc)
    for module, name in _USER_ERRORS:
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and isinstance(exc, cls):
            return str(exc)
    for cause in _chain(exc):
        full = isinstance(cause, OSError) and cause.errno in _NO_SPACE
        if full or "No space left on device" in str(cause):
            where = getattr(cause, "filename", None) or out or "the run directory"
            return (f"no space left on device writing {where}; the last complete checkpoint is intact: "
                    "free some space, then rerun with --resume")
        if isinstance(cause, OSError) and cause.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return f"cannot write {cause.filename or out}: {cause.strerror}"
    return None


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + message
        raise UsageError(message)


def build_parser(task: str) -> argparse.ArgumentParser:
    p = _Parser(prog=f"python -m experiments.{task}", description=f"GRPO / GRPO-GA / GRPO-PODS on {task}.",
                allow_abbrev=False)
    p.set_defaults(task=task)
    p.add_argument("--model", help="local Hugging Face checkpoint directory (default: the built-in tiny preset)")
    p.add_argument("--dataset", help="local directory with train and test files (train.jsonl and test.jsonl, or "
                                     ".parquet): both splits at once, instead of --data and --eval-data")
    p.add_argument("--data", help="local .jsonl/.parquet file or directory for the train split (default: the Hub)")
    p.add_argument("--eval-data", help="local file or directory for the test split (default: the Hub)")
    p.add_argument("--prompt-column", help="your dataset's column holding the prompt (default: the task's own, "
                                           "question for gsm8k, problem for math and chemistry)")
    p.add_argument("--answer-column", help="your dataset's column holding the gold answer (default: answer); "
                                           "for gsm8k a bare number or a solution ending in '#### N'")
    p.add_argument("--setting", help="one of the paper's settings a-f (sets every hyperparameter below; "
                                     "flags given beside it win)")
    p.add_argument("--method", choices=("grpo", "grpo-ga", "pods"), default="pods")
    p.add_argument("--reward", action="append", default=[], metavar="NAME[=WEIGHT]",
                   help="repeatable. accuracy, format or tag_count set the weight of the task's own rewards "
                        "(0 keeps one as a metric only); a registered name or package.module:function adds "
                        "your reward fn(completions, **columns) -> list[float] (weight 1 unless given)")
    p.add_argument("--rule", help="selection rule for pods (max_variance, max_reward, random, percentile)")
    p.add_argument("--n", type=int, help="rollouts generated per prompt (grpo: n = m)")
    p.add_argument("--m", type=int, help="rollouts trained per prompt (pods), micro-batch size (grpo-ga), "
                                         "or both n and m (grpo)")
    p.add_argument("--grad-accum", type=int, help="gradient-accumulation micro-batches")
    p.add_argument("--groups-per-prompt", type=int,
                   help="groups of n rollouts per prompt each step, selected and normalized apart "
                        "(settings e-f: one per accumulation micro-batch, as the authors' trainer)")
    p.add_argument("--prompts-per-step", type=int)
    p.add_argument("--lora-rank", type=int)
    p.add_argument("--lora-alpha", type=float)
    p.add_argument("--full", action="store_true", help="full fine-tune instead of LoRA")
    p.add_argument("--beta", type=float, help="KL weight")
    p.add_argument("--lr", type=float)
    p.add_argument("--temperature", type=float)
    p.add_argument("--max-completion-length", type=int)
    p.add_argument("--max-prompt-length", type=int)
    p.add_argument("--time-budget", type=float, help="seconds of training clock (evaluation excluded)")
    p.add_argument("--max-steps", type=int)
    p.add_argument("--eval-every", type=float, help="seconds of training clock between evaluations")
    p.add_argument("--eval-limit", type=int, help="evaluate on the first N test examples")
    p.add_argument("--eval-temperature", type=float,
                   help="evaluation sampling temperature; 0 = greedy, one pass (default: the setting's, else 0)")
    p.add_argument("--eval-repeats", type=int,
                   help="evaluation passes averaged; needs --eval-temperature > 0 (default: the setting's, else 1)")
    p.add_argument("--eval-metric", help="accuracy, or accuracy_and_format: the answer counts only when the "
                                         "authors' strict format check also passes (default: the setting's)")
    p.add_argument("--checkpoint-every-steps", type=int,
                   help="also checkpoint every N steps (besides every 30 min of training clock)")
    p.add_argument("--mesh", default=None, help='"8" (all on fsdp), "data=2,fsdp=4", "fsdp=4,tensor=2"')
    p.add_argument("--coordinator", metavar="HOST:PORT",
                   help="multi-host: process 0's address, with --num-processes and --process-id (or "
                        "$PODSJAX_COORDINATOR, $PODSJAX_NUM_PROCESSES, $PODSJAX_PROCESS_ID); TPU pods and "
                        "SLURM or Open MPI jobs of several tasks need none of them")
    p.add_argument("--num-processes", type=int, help="multi-host: processes in the run, one per host")
    p.add_argument("--process-id", type=int, help="multi-host: this process's index, 0 to --num-processes - 1")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="param dtype (default: the setting's, else float32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="run directory (default: runs/<task>-<method>-<date>-<time>)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--overwrite", action="store_true", help="delete --out first")
    p.add_argument("--warmup-dir", help="tiny preset only: where the warmed-up start checkpoint is cached "
                                        "(default: <out>/tiny_warmup); runs that share it start identically")
    p.add_argument("--warmup-steps", type=int, help="tiny preset only: cap the supervised warm-up's steps")
    p.add_argument("--reward-workers", type=int, default=2)
    p.add_argument("--log", default=None, metavar="BACKENDS",
                   help="where metrics go, comma-separated: jsonl (always: metrics.jsonl), tensorboard, wandb "
                        "(pip install 'podsjax[wandb]'; WANDB_MODE=offline keeps it on disk). "
                        "Default: jsonl,tensorboard")
    p.add_argument("--wandb-project", help="W&B project (default: $WANDB_PROJECT, else podsjax)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (progress lines are still printed)")
    p.add_argument("--remat", choices=("none", "full", "dots"), default=None,
                   help="what each layer keeps for the backward pass: full (default) recomputes the layer, "
                        "dots keeps its matmul outputs, none keeps everything (fastest, most memory)")
    p.add_argument("--dry-run", action="store_true",
                   help="compile generate and the update, report memory per device and compile times "
                        "(also in <out>/dry_run.json), then exit without training")
    p.add_argument("--no-compile-cache", action="store_true", help="do not use JAX's persistent compilation cache")
    p.add_argument("--compile-cache-dir",
                   help="persistent compilation cache (default: $PODSJAX_CACHE_DIR, else $JAX_COMPILATION_CACHE_DIR, "
                        "else ~/.cache/podsjax/jax)")
    return p


def _positive(args, names):
    for name in names:
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise UsageError(f"--{name.replace('_', '-')} must be > 0; got {value}")


def check_args(args) -> None:
    """Everything checkable before JAX starts and before anything is written."""
    _positive(args, ("n", "m", "grad_accum", "groups_per_prompt", "prompts_per_step", "lora_rank", "lora_alpha", "lr",
                     "max_completion_length", "max_prompt_length", "time_budget", "max_steps", "eval_limit",
                     "checkpoint_every_steps", "reward_workers", "warmup_steps", "eval_repeats"))
    if args.full and args.lora_rank is not None:
        raise UsageError("--full and --lora-rank exclude each other")
    mesh_device_count(args.mesh)
    if args.resume and args.overwrite:
        raise UsageError("--resume and --overwrite exclude each other")
    if args.no_compile_cache and args.compile_cache_dir is not None:
        raise UsageError("--no-compile-cache and --compile-cache-dir exclude each other")
    for flag in ("model", "data", "eval_data", "dataset"):
        path = getattr(args, flag)
        if path is not None and not os.path.exists(path):
            raise UsageError(f"--{flag.replace('_', '-')} {path}: no such file or directory")
    _check_data(args)
    if args.model is not None and (args.warmup_dir is not None or args.warmup_steps is not None):
        raise UsageError("--warmup-dir and --warmup-steps belong to the tiny preset; they mean nothing with --model")
    if args.model is not None and not os.path.isfile(os.path.join(args.model, "config.json")):
        raise UsageError(f"--model {args.model}: not a Hugging Face checkpoint directory (no config.json)")
    out = args.out
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--out {out} exists and is not a directory")
    has_run = os.path.isfile(os.path.join(out, "config.json"))
    if args.resume and not has_run:
        raise UsageError(f"--resume: {out} holds no run to resume (no config.json)")
    # A dry run writes only dry_run.json, so it may look at any directory, and the real
    # run may follow it into the same one.
    occupied = os.path.isdir(out) and set(os.listdir(out)) - {DRY_RUN_FILE}
    if occupied and not (args.resume or args.overwrite or args.dry_run):
        raise UsageError(f"--out {out} is not empty; pass --resume to continue it or --overwrite to replace it")


def _check_data(args) -> None:
    """--dataset DIR becomes --data and --eval-data (its train and test files); a task with
    no Hub dataset needs one or the other."""
    from podsjax import data  # no JAX: safe before the devices are set up

    if args.dataset is not None:
        if args.data is not None or args.eval_data is not None:
            raise UsageError("--dataset and --data / --eval-data exclude each other")
        if not os.path.isdir(args.dataset):
            raise UsageError(f"--dataset {args.dataset}: not a directory (pass a file with --data / --eval-data)")
        try:  # the file load_task reads for a split of a directory
            args.data, args.eval_data = (data._resolve(args.dataset, split) for split in ("train", "test"))
        except data.DataError as exc:
            raise UsageError(f"--dataset {args.dataset}: {exc}") from None
    hint = data._LOCAL_ONLY.get(args.task)  # the tasks without a Hub dataset
    missing = [f"--{flag.replace('_', '-')}" for flag in ("data", "eval_data") if getattr(args, flag) is None]
    if hint and missing and args.model is not None and not args.resume:
        raise UsageError(f"{args.task} has no Hub dataset: pass --dataset DIR (its train and test files), or "
                         f"{' and '.join(missing)}; e.g. --dataset {hint}")


# Host devices share the CPU's threads. XLA's CPU runtime may run two independent collectives
# of one program on a device at once, and a device can then wait forever for another that
# never arrives (train.TrainBatch removes the case seen in the update). Single-threaded Eigen
# makes it rarer without slowing 2 cores down. A late device on a loaded machine is waited
# for 5 minutes (XLA's default is 40 s); a collective that never completes then aborts the
# run, which --resume continues.
CPU_DEVICE_FLAGS = {"xla_cpu_multi_thread_eigen": "false", "xla_cpu_collective_call_terminate_timeout_seconds": "300"}


def host_device_flags(count: int, flags: str) -> str:
    """``flags`` (XLA_FLAGS) plus ``count`` CPU host devices, run safely (``CPU_DEVICE_FLAGS``)."""
    if count > 1 and "xla_force_host_platform_device_count" not in flags:
        flags = f"{flags} --xla_force_host_platform_device_count={count}"
    if "xla_force_host_platform_device_count" in flags:
        flags += "".join(f" --{name}={value}" for name, value in CPU_DEVICE_FLAGS.items() if name not in flags)
    return flags.strip()


def prepare_devices(spec: str | None, processes: int = 1) -> None:
    """Gives the CPU platform enough host devices for this process's part of the mesh and
    keeps freed host memory for reuse (``podsjax.host_memory``); must run before JAX starts."""
    from podsjax import host_memory

    count = mesh_device_count(spec)
    if count % processes:
        raise UsageError(f"--mesh {spec} ({count} devices) does not split over {processes} processes")
    host_memory.retain_freed_memory()
    if "jax" in sys.modules:
        return
    os.environ["XLA_FLAGS"] = host_device_flags(count // processes, os.environ.get("XLA_FLAGS", ""))


# Cluster managers that start one process per task and tell jax.distributed who its peers
# are: (variable holding the task count, or the TPU worker list, and how to count it).
_CLUSTERS = (("SLURM_NTASKS", int), ("OMPI_COMM_WORLD_SIZE", int),
             ("TPU_WORKER_HOSTNAMES", lambda hosts: len(hosts.split(","))))


def distributed_plan(args) -> tuple[str, int, int] | str | None:
    """How this process joins a multi-host run.

    Returns (coordinator, processes, process id) from the flags or the ``PODSJAX_*``
    variables; "auto" in a SLURM or Open MPI job of several tasks or on a multi-host TPU
    slice, where jax finds its peers itself; None for a single process.
    """
    from podsjax.mesh import DISTRIBUTED_ENV

    flags = (args.coordinator, args.num_processes, args.process_id)
    values = []
    for flag, value, variable in zip(("--coordinator", "--num-processes", "--process-id"), flags, DISTRIBUTED_ENV):
        if value is None and os.environ.get(variable):
            value = os.environ[variable]
            if flag != "--coordinator":
                try:
                    value = int(value)
                except ValueError:
                    raise UsageError(f"${variable} must be an integer; got {value!r}") from None
        values.append(value)
    coordinator, processes, process_id = values
    if any(v is not None for v in values):
        if not all(v is not None for v in values):
            raise UsageError("multi-host needs all of --coordinator, --num-processes and --process-id "
                             "(or their PODSJAX_* variables)")
        if processes < 1 or not 0 <= process_id < processes:
            raise UsageError(f"--process-id must be in 0..{processes - 1} and --num-processes >= 1; "
                             f"got {process_id} of {processes}")
        return None if processes == 1 else (coordinator, processes, process_id)
    for variable, count in _CLUSTERS:
        value = os.environ.get(variable)
        if value:
            try:
                if count(value) > 1:
                    return "auto"
            except ValueError:
                continue
    return None


def start_distributed(plan) -> None:
    """Joins the multi-host run ``distributed_plan`` gave (nothing for a single process)."""
    if plan is None:
        return
    from podsjax import mesh as mesh_lib

    try:
        if plan == "auto":
            mesh_lib.initialize_distributed()
        else:
            mesh_lib.initialize_distributed(*plan)
    except (RuntimeError, ValueError) as exc:
        where = "the cluster's coordinator" if plan == "auto" else plan[0]
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"cannot join the multi-host run at {where}: {first}") from None


def resolve_config(args, task: str) -> dict:
    """Flags over the setting over the defaults, as one JSON-able dict."""
    from podsjax import presets

    algo: dict = {}
    run: dict = {"prompts_per_step": 1, "max_prompt_length": 512, "max_new_tokens": 512, "eval_every_s": 120.0}
    model = {"lora_rank": 64, "lora_alpha": 64.0, "dtype": "float32", "mesh": None, "remat": args.remat or "full"}
    rewards: dict = {}  # default_rewards' keyword arguments: its defaults without a setting
    if args.setting:
        try:
            setting = presets.get_setting(args.setting)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if setting.task != task:
            raise UsageError(f"setting {setting.name} is a {setting.task} setting; run experiments.{setting.task}")
        if args.method not in setting.algorithm:
            raise UsageError(f"setting {setting.name} has no method {args.method!r}")
        algo.update(setting.common, **setting.algorithm[args.method])
        run.update(setting.run)
        rewards.update(setting.rewards)
        model.update(lora_rank=setting.lora_rank, dtype=setting.dtype, mesh=setting.mesh, hub_name=setting.model)
    elif args.model is None:
        algo.update(tiny_defaults(args.method, run, model))
    else:
        from podsjax.train import preset

        algo.update(dataclasses.asdict(preset(args.method)))
    overrides = {"rule": args.rule, "n": args.n, "m": args.m, "grad_accum": args.grad_accum,
                 "groups_per_prompt": args.groups_per_prompt, "beta": args.beta,
                 "learning_rate": args.lr, "temperature": args.temperature}
    algo.update({k: v for k, v in overrides.items() if v is not None})
    algo["algorithm"] = args.method
    if args.method == "grpo":
        # GRPO trains every rollout: it generates as many as PODS trains (the paper's
        # GRPO n=16 against PODS n=64, m=16), so --m wins over --n here.
        algo["n"] = algo["m"] = args.m or args.n or algo["m"]
    run_overrides = {"prompts_per_step": args.prompts_per_step, "max_new_tokens": args.max_completion_length,
                     "max_prompt_length": args.max_prompt_length, "time_budget_s": args.time_budget,
                     "max_steps": args.max_steps, "eval_every_s": args.eval_every, "eval_limit": args.eval_limit,
                     "checkpoint_every_steps": args.checkpoint_every_steps, "eval_temperature": args.eval_temperature,
                     "eval_repeats": args.eval_repeats, "eval_metric": args.eval_metric}
    run.update({k: v for k, v in run_overrides.items() if v is not None})
    if args.eval_temperature == 0 and args.eval_repeats is None:
        run["eval_repeats"] = 1  # greedy asked for over a sampled setting: one pass, as greedy repeats itself
    run.update(seed=args.seed, reward_workers=args.reward_workers, progress=not args.no_progress)
    if args.log is not None:
        run["log"] = args.log.split(",")
    if args.wandb_project is not None:
        run["wandb_project"] = args.wandb_project
    if "wandb" in run.get("log", ()) and importlib.util.find_spec("wandb") is None:
        raise UsageError("--log wandb needs the wandb package: pip install 'podsjax[wandb]'")
    if run.get("time_budget_s") is None and run.get("max_steps") is None:
        raise UsageError("give a budget: --time-budget SECONDS or --max-steps N")
    if args.full:
        model["lora_rank"] = None
    if args.lora_rank is not None:
        model["lora_rank"] = args.lora_rank
    if args.lora_alpha is not None:
        model["lora_alpha"] = args.lora_alpha
    if args.dtype:
        model["dtype"] = args.dtype
    if args.mesh is not None:
        model["mesh"] = args.mesh
    extra_rewards = _parse_rewards(args.reward, rewards)
    _validate(algo, run, task, args.out)
    return {"task": task, "model_path": args.model, "warmup_dir": args.warmup_dir, "warmup_steps": args.warmup_steps,
            "data": args.data, "eval_data": args.eval_data, "algorithm": algo, "run": run, "model": model,
            "rewards": rewards, "extra_rewards": extra_rewards, "data_columns": _data_columns(args, task)}


def _data_columns(args, task: str) -> dict[str, str]:
    """The task's fields read from the user's columns (``data.load_task(columns=...)``)."""
    from podsjax.data import PROMPT_FIELD

    columns = {PROMPT_FIELD[task]: args.prompt_column, "answer": args.answer_column}
    return {field: column for field, column in columns.items() if column}


def _parse_rewards(specs: list[str], weights: dict) -> list[list]:
    """``--reward`` values: the task's own names update ``weights``; others come back as [name, weight]."""
    from podsjax.rewards import TASK_REWARD_NAMES

    extra = []
    for spec in specs:
        name, equals, value = spec.partition("=")
        try:
            weight = float(value) if equals else 1.0
        except ValueError:
            raise UsageError(f"--reward {spec}: the weight after '=' must be a number") from None
        if not math.isfinite(weight):
            raise UsageError(f"--reward {spec}: the weight must be finite")
        if not name:
            raise UsageError(f"--reward {spec}: give a reward name or package.module:function")
        if name in TASK_REWARD_NAMES:
            weights[name] = weight
        else:
            extra.append([name, weight])
    return extra


def _validate(algo: dict, run: dict, task: str, out: str) -> None:
    """AlgorithmConfig's and RunConfig's checks before any warm-up, model load or write to --out."""
    from podsjax import loop, train

    try:
        train.AlgorithmConfig(**algo)
        loop.RunConfig(out_dir=out, task=task, **run)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc).replace("RunConfig.", "")) from None


def describe_setting(args, config: dict) -> str:
    """What ``--setting`` sets for ``--method`` (``Setting.describe``), then the flags that change it."""
    from podsjax import presets

    setting = presets.get_setting(args.setting)
    lines = [setting.describe(args.method)]
    model = {"lora_rank": setting.lora_rank, "dtype": setting.dtype, "mesh": setting.mesh}
    for section, values in (("algorithm", setting.algorithm_config(args.method)), ("run", setting.run),
                            ("model", model)):
        lines += [f"  flag over the setting: {section}.{key} = {config[section].get(key)} (setting: {value})"
                  for key, value in values.items() if config[section].get(key) != value]
    return "\n".join(lines)


def tiny_defaults(method: str, run: dict, model: dict) -> dict:
    """The tiny preset's settings (podsjax.tiny.TINY_RL_DEFAULTS); fills run and model, returns algo."""
    from podsjax.tiny import TINY_RL_DEFAULTS as d

    run.update(prompts_per_step=d["prompts_per_step"], max_new_tokens=d["max_new_tokens"],
               max_prompt_length=d["max_prompt_length"], time_budget_s=d["time_budget_s"],
               eval_every_s=d["eval_every_s"], eval_limit=d["eval_limit"])
    model.update(lora_rank=None if d["full_finetune"] else 64, dtype="float32")
    from podsjax.train import preset

    n = d["m"] if method == "grpo" else d["n"]  # GRPO trains every rollout it generates
    return dataclasses.asdict(preset(method, n=n, m=d["m"], learning_rate=d["learning_rate"],
                                     temperature=d["temperature"]))


def setup_compile_cache(args) -> str | None:
    """Turns the persistent compilation cache on (unless --no-compile-cache); before any compile."""
    from podsjax import compilation

    if args.no_compile_cache:
        compilation.disable_compile_cache()
        return None
    try:
        return compilation.enable_compile_cache(args.compile_cache_dir)
    except ValueError as exc:
        raise UsageError(f"{exc}; pass --compile-cache-dir DIR or --no-compile-cache") from None


def main(task: str, argv=None) -> int:
    started_at = time.time()
    args = None
    try:
        args = build_parser(task).parse_args(argv)
        args.distributed = distributed_plan(args)
        if args.out is None and args.distributed is not None:
            raise UsageError("a multi-host run needs --out: every process must name the same run directory")
        if args.out is None:
            args.out = os.path.join("runs", f"{task}-{args.method}-{time.strftime('%Y%m%d-%H%M%S')}")
        check_args(args)
        if args.resume:
            config = read_run_config(args.out)
            if args.time_budget is not None:
                config["run"]["time_budget_s"] = args.time_budget
            if args.max_steps is not None:
                config["run"]["max_steps"] = args.max_steps
            if args.remat is not None:  # memory only: the numbers are the same, so a resume may change it
                config["model"]["remat"] = args.remat
            if "eval_temperature" not in config["run"]:  # a run from before sampled evaluation: it was greedy
                config["run"]["eval_repeats"] = 1
        else:
            config = None
        mesh_spec = args.mesh if config is None else config["model"]["mesh"]
        prepare_devices(mesh_spec, args.distributed[1] if isinstance(args.distributed, tuple) else 1)
        start_distributed(args.distributed)
        cache = setup_compile_cache(args)
        print(f"compile cache: {cache or 'off'}", flush=True)
        if config is None:
            config = resolve_config(args, task)
            if args.setting:
                print(describe_setting(args, config), flush=True)
        from experiments import runner

        return runner.run(config, args.out, overwrite=args.overwrite, resume=args.resume, dry_run=args.dry_run,
                          started_at=started_at)
    except KeyboardInterrupt:
        print("interrupted; resume with --resume", file=sys.stderr)
        return 130
    except Exception as exc:
        line = user_error_line(exc, getattr(args, "out", None))
        if line is None:
            traceback.print_exc()
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            print(f"error: unexpected {type(exc).__name__}: {first} (a bug: the traceback above says where)",
                  file=sys.stderr)
            return 1
        print(f"error: {line}", file=sys.stderr)
        return 2


_RUN_CONFIG_KEYS = ("task", "model_path", "algorithm", "run", "model")
_MODEL_KEYS = ("mesh", "dtype", "lora_rank", "lora_alpha")


def read_run_config(out: str) -> dict:
    """The config.json a run wrote, checked enough that resuming cannot fail on its shape."""
    path = os.path.join(out, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"--resume: cannot read {path} ({exc})") from None
    if not isinstance(config, dict):
        raise UsageError(f"--resume: {path} holds a JSON {type(config).__name__}, not the run's config object")
    missing = [key for key in _RUN_CONFIG_KEYS if key not in config]
    if missing:
        raise UsageError(f"--resume: {path} has no {', '.join(missing)}; it is not a podsjax run config")
    for key in ("algorithm", "run", "model"):
        if not isinstance(config[key], dict):
            raise UsageError(f"--resume: {path}: {key!r} must be an object, got {type(config[key]).__name__}")
    missing = [key for key in _MODEL_KEYS if key not in config["model"]]
    if missing:
        raise UsageError(f"--resume: {path}: 'model' has no {', '.join(missing)}")
    return config
