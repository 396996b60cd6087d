"""The command line: launch flags, then the config tree's flags (``experiments.config``), into one config.

Two kinds of flags:

- launch flags say how to start (``--out``, ``--resume``, ``--setting``, ``--method``,
  ``--config``, ``--dry-run``, multi-host, compile cache) and are not part of the config;
- every field of the config tree is a flag ``--<section>.<field> VALUE`` (draccus), and
  :data:`SHORTCUTS` gives the common ones short names (``--n`` is ``--algorithm.n``).

The config is the method's and the named setting's values, then ``--config FILE``
(YAML or JSON: a run's ``config.json`` works), then the flags. Every check here runs
before JAX starts, a model loads or anything is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import tempfile
from typing import Any

from experiments.config import METHODS, SETTINGS, ExperimentConfig, base_values, merge
from experiments.usage import CONFIG_FILE, DRY_RUN_FILE, UsageError

# Short names of config fields: flag -> dotted field.
SHORTCUTS: dict[str, str] = {
    "--model": "model.path", "--mesh": "model.mesh", "--dtype": "model.dtype", "--remat": "model.remat",
    "--lora-rank": "model.lora_rank", "--lora-alpha": "model.lora_alpha",
    "--rule": "algorithm.rule", "--n": "algorithm.n", "--m": "algorithm.m", "--grad-accum": "algorithm.grad_accum",
    "--groups-per-prompt": "algorithm.groups_per_prompt", "--beta": "algorithm.beta",
    "--lr": "algorithm.learning_rate", "--temperature": "algorithm.temperature",
    "--prompts-per-step": "run.prompts_per_step", "--max-completion-length": "run.max_new_tokens",
    "--max-prompt-length": "run.max_prompt_length", "--time-budget": "run.time_budget_s",
    "--max-steps": "run.max_steps", "--eval-every": "run.eval_every_s", "--eval-limit": "run.eval_limit",
    "--eval-temperature": "run.eval_temperature", "--eval-repeats": "run.eval_repeats",
    "--eval-metric": "run.eval_metric", "--checkpoint-every-steps": "run.checkpoint_every_steps",
    "--seed": "run.seed", "--reward-workers": "run.reward_workers", "--log": "run.log",
    "--wandb-project": "run.wandb_project", "--data": "data.train", "--eval-data": "data.test",
    "--prompt-column": "data.prompt_column", "--answer-column": "data.answer_column",
    "--train-split": "data.train_split", "--test-split": "data.test_split", "--system-prompt": "run.system_prompt",
    "--warmup-dir": "tiny.warmup_dir", "--warmup-steps": "tiny.warmup_steps",
}
SECTIONS = tuple(f.name for f in dataclasses.fields(ExperimentConfig))
_HUB_NAME = re.compile(r"[\w.-]+/[\w.-]+(:[\w.-]+)?")
# What a resumed run may change: how long it goes on, and memory (the same numbers either way).
RESUMABLE = ("run.time_budget_s", "run.max_steps", "model.remat", "run.progress")


class UsageParser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + message
        raise UsageError(message)


def build_parser(task: str) -> argparse.ArgumentParser:
    """The launch flags and the shortcuts (``--help`` lists the config tree's flags after them)."""
    p = UsageParser(prog=f"python -m experiments.{task}", allow_abbrev=False, add_help=False,
                description=f"GRPO / GRPO-GA / GRPO-PODS on {task}. Launch flags and shortcuts first; every field "
                            "of the config tree is also a flag --<section>.<field> (listed after these).")
    p.set_defaults(task=task)
    p.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    p.add_argument("--method", choices=METHODS, default="pods")
    p.add_argument("--setting", help=f"a named setting: {', '.join(s for s in SETTINGS if s != 'tiny')} (the "
                                     "paper's; they need --model), or tiny (the default without --model)")
    p.add_argument("--config", metavar="FILE", help="YAML or JSON file of config values (a run's config.json "
                                                    "works); flags override it")
    p.add_argument("--out", help="run directory (default: runs/<task>-<method>-<date>-<time>)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out, with its config.json")
    p.add_argument("--overwrite", action="store_true", help="delete --out first")
    p.add_argument("--dry-run", action="store_true",
                   help="compile generate and the update, report memory per device and compile times "
                        "(also in <out>/dry_run.json), then exit without training")
    p.add_argument("--topology", metavar="DEVICES",
                   help="with --dry-run: compile for devices this host does not have: a TPU slice (v5e:2x4, "
                        "v5p:2x2x2, ...; needs pip install 'podsjax[tpu]') or GPUs (h100, h100:8, h200, a100, "
                        "a100:8, l40s; needs pip install 'podsjax[cuda]'); --mesh defaults to all of them")
    p.add_argument("--dataset", help="both splits at once: a local directory with <split>.jsonl/.json/.parquet "
                                     "files (--train-split, --test-split name them), or a Hub dataset "
                                     "owner/name[:config]; or a file, the train split (then --eval-data too)")
    p.add_argument("--reward", action="append", default=[], metavar="NAME[=WEIGHT]",
                   help="repeatable. accuracy, format or tag_count set the weight of the task's own rewards "
                        "(0 keeps one as a metric only); a registered name or package.module:function adds "
                        "your reward fn(completions, **columns) -> list[float] (weight 1 unless given)")
    p.add_argument("--full", action="store_true", help="full fine-tune (model.lora_rank null)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (progress lines are still printed)")
    p.add_argument("--coordinator", metavar="HOST:PORT",
                   help="multi-host: process 0's address, with --num-processes and --process-id (or "
                        "$PODSJAX_COORDINATOR, $PODSJAX_NUM_PROCESSES, $PODSJAX_PROCESS_ID); TPU pods and "
                        "SLURM or Open MPI jobs of several tasks need none of them")
    p.add_argument("--num-processes", type=int, help="multi-host: processes in the run, one per host")
    p.add_argument("--process-id", type=int, help="multi-host: this process's index, 0 to --num-processes - 1")
    p.add_argument("--no-compile-cache", action="store_true", help="do not use JAX's persistent compilation cache")
    p.add_argument("--compile-cache-dir",
                   help="persistent compilation cache (default: $PODSJAX_CACHE_DIR, else $JAX_COMPILATION_CACHE_DIR, "
                        "else ~/.cache/podsjax/jax)")
    shortcuts = p.add_argument_group("shortcuts", "each sets one field of the config tree")
    for flag, field in SHORTCUTS.items():
        shortcuts.add_argument(flag, dest=_dest(flag), metavar="VALUE", help=f"= --{field}")
    return p


def _dest(flag: str) -> str:
    return "short_" + flag[2:].replace("-", "_")


def help_text(task: str) -> str:
    """The launch flags' help, then every field of the config tree with its comment and default."""
    import draccus.argparsing

    tree = draccus.argparsing.ArgumentParser(ExperimentConfig, prog=f"python -m experiments.{task}")
    return build_parser(task).format_help() + "\nThe config tree:\n" + tree.parser.format_help()


def _field_flags(args, rest: list[str]) -> list[str]:
    """The shortcuts as dotted flags, then the dotted flags given as they are."""
    flags: list[str] = []
    for flag, field in SHORTCUTS.items():
        value = getattr(args, _dest(flag))
        if value is not None:
            flags += [f"--{field}", f"[{value}]" if field == "run.log" else value]  # --log a,b: a list
    if args.full:
        if args.short_lora_rank is not None or any(t.startswith("--model.lora_rank") for t in rest):
            raise UsageError("--full and --lora-rank exclude each other")
        flags += ["--model.lora_rank", "null"]
    if args.no_progress:
        flags += ["--run.progress", "false"]
    for token in rest:
        if token.startswith("-") and not token.startswith("--") or token.startswith("--") and "." not in token:
            raise UsageError(f"unrecognized argument {token.split('=')[0]} (config fields are --<section>.<field>; "
                             "see --help)")
    return flags + rest


def _given(flags: list[str]) -> dict[str, str]:
    """dotted field -> the value given for it on the command line (the last one wins)."""
    given: dict[str, str] = {}
    for i, token in enumerate(flags):
        if token.startswith("--"):
            name, equals, value = token[2:].partition("=")
            given[name] = value if equals else (flags[i + 1] if i + 1 < len(flags) else "")
    return given


def _draccus_error(exc: Exception) -> str:
    """The one line of a draccus error: its own for a value of the wrong type (it names the
    field), the config's message when a config refused the values."""
    import draccus.utils

    cause = exc.__cause__ or exc.__context__
    if not isinstance(exc, draccus.utils.DecodingError) and isinstance(cause, (ValueError, TypeError)) and str(cause):
        return str(cause).splitlines()[0]
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def decode(values: dict[str, Any], flags: list[str] = (), where: str | None = None) -> ExperimentConfig:
    """The config from nested ``values`` with dotted ``flags`` over them; one-line errors."""
    import draccus
    import draccus.argparsing

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        json.dump(values, f)  # JSON is YAML
    try:
        parser = draccus.argparsing.ArgumentParser(ExperimentConfig, config_path=f.name, exit_on_error=False)
        config, unknown = parser.parse_known_args(list(flags))
    except draccus.utils.DraccusException as exc:
        raise UsageError(_where(where, _draccus_error(exc))) from None
    except (ValueError, TypeError) as exc:  # a config's __post_init__ outside draccus's wrapping
        raise UsageError(_where(where, str(exc).splitlines()[0])) from None
    finally:
        os.unlink(f.name)
    if unknown:
        raise UsageError(f"unrecognized argument {unknown[0].split('=')[0]} (see --help for the config's fields)")
    return config


def _where(where: str | None, message: str) -> str:
    return f"{where}: {message}" if where else message


def _read_file(path: str) -> dict[str, Any]:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            values = yaml.safe_load(f)
    except OSError as exc:
        raise UsageError(f"--config {path}: {exc.strerror or exc}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise UsageError(f"--config {path}: not YAML or JSON ({str(exc).splitlines()[0]})") from None
    if not isinstance(values, dict):
        raise UsageError(f"--config {path}: holds a {type(values).__name__}, not a mapping of config sections")
    return values


def parse(task: str, argv: list[str] | None,
          method: str | None = None) -> tuple[argparse.Namespace, ExperimentConfig | None]:
    """(launch flags, the run's config); the config is None on ``--resume`` (read it with
    :func:`read_run_config`) and for ``--help`` (``args.help``).

    ``method`` stands for ``--method`` (a caller that runs several methods on one command
    line, as ``experiments.compare`` does)."""
    args, rest = build_parser(task).parse_known_args(argv)
    if method is not None:
        if method not in METHODS:
            raise UsageError(f"method must be one of {', '.join(METHODS)}; got {method!r}")
        args.method = method
    if args.help:
        return args, None
    flags = _field_flags(args, rest)
    given = _given(flags)
    if args.resume:
        if args.config or args.setting:
            raise UsageError("--resume reads the run's own config.json; --config and --setting mean nothing with it")
        changed = [name for name in given if name not in RESUMABLE]
        if changed:
            raise UsageError(f"--resume keeps the run's config; --{changed[0]} cannot change (only "
                             f"{', '.join('--' + r for r in RESUMABLE)} may)")
        args.field_flags = flags
        return args, None
    file_values = _read_file(args.config) if args.config else {}
    has_model = "model.path" in given or (file_values.get("model") or {}).get("path") is not None
    setting = args.setting or (None if has_model else "tiny")
    try:
        values = base_values(task, args.method, setting)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if setting is not None and setting.lower() != "tiny" and not has_model:
        raise UsageError(f"--setting {setting} trains a real checkpoint: pass --model DIR (its local copy; the "
                         "tiny preset has its own settings, --setting tiny)")
    values = merge(values, file_values)
    values = merge(values, {"run": {"task": task, "out_dir": args.out or ""}})
    if values["algorithm"].get("algorithm", args.method) in ("grpo", "grpo-ga"):
        # GRPO and GRPO-GA train every rollout (the paper's GRPO n=16 against PODS n=64,
        # m=16), so one of --n / --m sets both, and --m wins.
        chosen = given.get("algorithm.m") or given.get("algorithm.n")
        if chosen is not None:
            flags += ["--algorithm.n", chosen, "--algorithm.m", chosen]
    _dataset(args, values, given)
    if args.reward:
        values = merge(values, {"rewards": _rewards(args.reward, values.get("rewards", {}))})
    config = decode(values, flags)
    return args, config


def _dataset(args, values: dict[str, Any], given: dict[str, str]) -> None:
    """--dataset: a directory becomes data.train and data.test (its split files), a file
    data.train, and an ``owner/name`` that is no local path data.hub."""
    if args.dataset is None:
        return
    from podsjax import data  # no JAX

    dataset, section = args.dataset, dict(values.get("data", {}))
    if os.path.isfile(dataset):
        if "data.train" in given:
            raise UsageError("--dataset FILE and --data both name the train split")
        if "data.test" not in given:
            raise UsageError(f"--dataset {dataset} is one file, the train split: pass --eval-data for the test split")
        section["train"] = dataset
    elif os.path.isdir(dataset):
        if "data.train" in given or "data.test" in given:
            raise UsageError("--dataset and --data / --eval-data exclude each other")
        splits = [given.get(f"data.{key}_split") or section.get(f"{key}_split") or key for key in ("train", "test")]
        try:  # the file load_task reads for a split of a directory
            section["train"], section["test"] = (data._resolve(dataset, split) for split in splits)
        except data.DataError as exc:
            raise UsageError(f"--dataset {dataset}: {exc}") from None
    elif _HUB_NAME.fullmatch(dataset):
        section["hub"] = dataset
    else:
        raise UsageError(f"--dataset {dataset}: no such file or directory, and not a Hub name (owner/name)")
    values["data"] = section


def _rewards(specs: list[str], rewards: dict[str, Any]) -> dict[str, Any]:
    """--reward values: the task's own names set their weights; the rest join rewards.extra."""
    from experiments.config import parse_reward
    from podsjax.rewards import TASK_REWARD_NAMES

    rewards = dict(rewards)
    extra = list(rewards.get("extra", ()))
    for spec in specs:
        try:
            name, weight = parse_reward(spec)
        except ValueError as exc:
            raise UsageError(f"--reward {spec}: {exc}") from None
        if name in TASK_REWARD_NAMES:
            rewards[name] = weight
        else:
            extra.append(spec)
    rewards["extra"] = extra
    return rewards


def check(args, config: ExperimentConfig) -> None:
    """What the config cannot check alone: paths, the task, the run directory."""
    if args.resume and args.overwrite:
        raise UsageError("--resume and --overwrite exclude each other")
    if args.no_compile_cache and args.compile_cache_dir is not None:
        raise UsageError("--no-compile-cache and --compile-cache-dir exclude each other")
    if args.topology and not args.dry_run:
        raise UsageError("--topology compiles for devices that this host does not have, so it only goes "
                         "with --dry-run")
    if config.run.task != args.task:
        raise UsageError(f"the config is a {config.run.task} run; run experiments.{config.run.task}")
    for flag, path in (("--model", config.model.path), ("--data", config.data.train), ("--eval-data", config.data.test)):
        if path is not None and not os.path.exists(path):
            raise UsageError(f"{flag} {path}: no such file or directory")
    from podsjax import data  # no JAX

    hint = data._LOCAL_ONLY.get(config.task)  # the tasks without a Hub dataset
    missing = [flag for flag, path in (("--data", config.data.train), ("--eval-data", config.data.test))
               if path is None]
    if hint and missing and config.data.hub is None and config.model.path is not None and not args.resume:
        raise UsageError(f"{config.task} has no Hub dataset: pass --dataset DIR (its train and test files), or "
                         f"{' and '.join(missing)}; e.g. --dataset {hint}")
    if config.model.path is not None and not os.path.isfile(os.path.join(config.model.path, "config.json")):
        raise UsageError(f"--model {config.model.path}: not a Hugging Face checkpoint directory (no config.json)")
    if "wandb" in config.run.log:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise UsageError("--log wandb needs the wandb package: pip install 'podsjax[wandb]'")


def check_out(args) -> None:
    """The run directory: a file is refused, and an existing run needs --resume or --overwrite."""
    out = args.out
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--out {out} exists and is not a directory")
    # A dry run writes only dry_run.json and config.json, so it may look at any directory,
    # and the real run may follow it into the same one.
    planned_only = (os.path.isfile(os.path.join(out, DRY_RUN_FILE))
                    and set(os.listdir(out)) <= {DRY_RUN_FILE, CONFIG_FILE}) or (os.path.isdir(out) and not os.listdir(out))
    has_run = os.path.isfile(os.path.join(out, CONFIG_FILE)) and not planned_only
    if args.resume and not has_run:
        raise UsageError(f"--resume: {out} holds no run to resume (no config.json of a run)")
    occupied = os.path.isdir(out) and not planned_only
    if occupied and not (args.resume or args.overwrite or args.dry_run):
        raise UsageError(f"--out {out} is not empty; pass --resume to continue it or --overwrite to replace it")


def read_run_config(out: str, flags: list[str] = ()) -> ExperimentConfig:
    """The config.json a run wrote, with ``flags`` (only :data:`RESUMABLE` fields) over it."""
    path = os.path.join(out, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"--resume: cannot read {path} ({exc})") from None
    if not isinstance(values, dict):
        raise UsageError(f"--resume: {path} holds a JSON {type(values).__name__}, not the run's config object")
    wrong = [key for key, value in values.items() if key in SECTIONS and not isinstance(value, dict)]
    if wrong:
        raise UsageError(f"--resume: {path}: {wrong[0]!r} must be an object of fields, got "
                         f"{type(values[wrong[0]]).__name__}")
    if "run" not in values or "model_path" in values:
        raise UsageError(f"--resume: {path} is not a podsjax run config of this version (no 'run' section, or an "
                         "older layout); start a new run")
    values = merge(values, {"run": {"out_dir": out}})
    return decode(values, flags, where=f"--resume: {path}")


def describe_setting(setting: str, method: str, config: ExperimentConfig) -> str:
    """What ``--setting`` sets for the method (``Setting.describe``), then the fields set over it."""
    from podsjax import paper_settings

    lines = [paper_settings.get_setting(setting).describe(method)]
    for section, values in SETTINGS[setting.lower()](method, config.task).items():
        for key, value in values.items():
            final = getattr(getattr(config, section), key)
            if final != value:
                lines.append(f"  set over the setting: {section}.{key} = {final} (setting: {value})")
    return "\n".join(lines)


def as_json(config: ExperimentConfig) -> dict[str, Any]:
    """The config as config.json holds it (every field, nested by section)."""
    import draccus

    values = draccus.encode(config)
    values["run"] = {k: v for k, v in values["run"].items() if k != "out_dir"}  # the directory it lies in
    return values


def replace_run(config: ExperimentConfig, **changes) -> ExperimentConfig:
    return dataclasses.replace(config, run=dataclasses.replace(config.run, **changes))
