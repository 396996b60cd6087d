"""The command line: launch flags, then the config tree's flags (``experiments.config``), into one config.

Two kinds of flags:

- launch flags say how to start (``--out``, ``--resume``, ``--setting``, ``--method``,
  ``--config``, ``--dry-run``, multi-host, compile cache) and are not part of the config;
- every field of the config tree is a flag ``--<section>.<field> VALUE`` (draccus), and
  :data:`SHORTCUTS` gives the common ones short names (``--n`` is ``--algorithm.n``).

The config is the method's and the named setting's values, then ``--config FILE``
(YAML or JSON: a run's ``config.json`` works), then the flags. Every check here runs
before JAX starts, a model loads or anything is written. A config file, a flag's value and
a run's ``config.json`` are read within bounds (size, nesting, YAML aliases), kept in
memory, and handed to draccus as one tree (``experiments.config_decoding``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from typing import Any

import draccus

from experiments.config import METHODS, ExperimentConfig, Layer, merge, preset_layers, stack
from experiments.config_decoding import (
    _check_values,
    field_types,
    _flag_values,
    _negative_values,
    _read_file,
    _unknown,
    as_json,
    decode,
    read_run_config,
)
from experiments.config_documents import show_value
from experiments.launch_checks import has_run, planned_only
from experiments.usage import UsageError
from experiments import paper_settings

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
    "--eval-metric": "run.eval_metric", "--eval-k": "run.eval_k",
    "--checkpoint-every-steps": "run.checkpoint_every_steps",
    "--seed": "run.seed", "--reward-workers": "run.reward_workers", "--log": "run.log",
    "--wandb-project": "run.wandb_project", "--data": "data.train", "--eval-data": "data.test",
    "--prompt-column": "data.prompt_column", "--answer-column": "data.answer_column",
    "--train-split": "data.train_split", "--test-split": "data.test_split", "--system-prompt": "run.system_prompt",
    "--warmup-dir": "tiny.warmup_dir", "--warmup-steps": "tiny.warmup_steps",
    "--max-operations": "tiny.max_operations",
}
# Shortcuts of list fields: "--log a,b" and "--eval-k 1,4" give the list [a, b] and [1, 4], as
# "--log [a, b]" and "--eval-k [1, 4]" do.
LIST_SHORTCUTS = ("run.log", "run.eval_k")
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
    p.add_argument("--method", choices=METHODS, help="the algorithm (default: pods)")
    p.add_argument("--setting", help=f"a named setting: {', '.join(paper_settings.SETTINGS)} (the paper's; they "
                                     "need --model), or tiny (the default without --model); the run lists each "
                                     "value with where it comes from before it starts")
    p.add_argument("--config", metavar="FILE", help="YAML or JSON file of config values (a run's config.json "
                                                    "works); flags override it")
    p.add_argument("--out", help="run directory (default: runs/<task>-<method>-<date>-<time>)")
    p.add_argument("--resume", nargs="?", const=True, default=False, choices=("auto",),
                   help="continue the run in --out, with its config.json (the command may repeat the run's own "
                        "values; only --time-budget, --max-steps, --remat and the progress bar may change); "
                        "--resume auto: start the run if --out holds none yet, else continue it, so that one "
                        "job-script line serves the first start and every requeue")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the podsjax run in --out (a directory of other files, a run beside files no run "
                        "writes, or one holding the model, data or config file, is refused)")
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
                        "else $XDG_CACHE_HOME/podsjax/jax, else ~/.cache/podsjax/jax)")
    shortcuts = p.add_argument_group("shortcuts", "each sets one field of the config tree")
    for flag, field in SHORTCUTS.items():
        shortcuts.add_argument(flag, dest=_dest(flag), metavar="VALUE", help=f"= --{field}")
    return p


def _dest(flag: str) -> str:
    return "short_" + flag[2:].replace("-", "_")


def _field_flags(args, rest: list[str]) -> tuple[list[str], dict[str, str]]:
    """The shortcuts as dotted flags, then the dotted flags given as they are; and for each
    dotted field, the flag that gave it (the last one)."""
    flags: list[str] = []
    names: dict[str, str] = {}
    for flag, field in SHORTCUTS.items():
        value = getattr(args, _dest(flag))
        if value is not None:
            listed = field in LIST_SHORTCUTS and not value.lstrip().startswith("[")  # "[1, 4]" is one already
            flags += [f"--{field}", f"[{value}]" if listed else value]
            names[field] = flag
    if args.full:
        if args.short_lora_rank is not None or any(t.startswith("--model.lora_rank") for t in rest):
            raise UsageError("--full and --lora-rank exclude each other")
        flags += ["--model.lora_rank", "null"]
        names["model.lora_rank"] = "--full"
    if args.no_progress:
        flags += ["--run.progress", "false"]
        names["run.progress"] = "--no-progress"
    for token in rest:
        if token.startswith("-") and not token.startswith("--") or token.startswith("--") and "." not in token:
            launch_flags = tuple(o for o in build_parser(args.task)._option_string_actions if o.startswith("--"))
            raise _unknown(token.split("=")[0], "config fields are --<section>.<field>; see --help", launch_flags)
        if token.startswith("--"):
            names[token[2:].partition("=")[0]] = token.partition("=")[0]
    return flags + rest, names


def _given(flags: list[str]) -> dict[str, str]:
    """dotted field -> the value given for it on the command line (the last one wins)."""
    given: dict[str, str] = {}
    for i, token in enumerate(flags):
        if token.startswith("--"):
            name, equals, value = token[2:].partition("=")
            given[name] = value if equals else (flags[i + 1] if i + 1 < len(flags) else "")
    return given



def parse(task: str, argv: list[str] | None,
          method: str | None = None) -> tuple[argparse.Namespace, ExperimentConfig | None]:
    """(launch flags, the run's config); the config is None when the run in ``--out`` goes on
    (``--resume``, or ``--resume auto`` where it holds a run: read the config with
    :func:`read_run_config` and ``args.field_flags``) and for ``--help`` (``args.help``).
    ``args.resume`` is then whether the run goes on.

    ``method`` stands for ``--method`` (a caller that runs several methods on one command
    line, as ``experiments.compare`` does)."""
    args, rest = build_parser(task).parse_known_args(_negative_values(sys.argv[1:] if argv is None else argv))
    if args.out is not None:
        args.out = os.path.expanduser(args.out)  # a quoted "~/runs" names the home's folder, not a "~" here
    method_given = method is not None or args.method is not None
    if method is not None:
        if method not in METHODS:
            raise UsageError(f"method must be one of {', '.join(METHODS)}; got {method!r}")
        args.method = method
    args.method = args.method or "pods"
    args.resume_auto = args.resume == "auto"
    if args.help:
        return args, None
    flags, flag_names = _field_flags(args, rest)
    given = _given(flags)
    if "run.out_dir" in given:  # the flag form of --out (a --config file's, an old run's directory, is not)
        out_dir = os.path.expanduser(given["run.out_dir"])
        if args.out is not None and os.path.normpath(args.out) != os.path.normpath(out_dir):
            raise UsageError(f"--out {args.out} and --run.out_dir {given['run.out_dir']} name two run directories; "
                             "pass one")
        args.out = out_dir
    file_values = _read_file(args.config) if args.config else {}
    if args.resume and _goes_on(args):
        args.field_flags = _resumed_flags(task, args, flags, given, file_values, method_given)
        return args, None
    args.method = _method(args, "the comparison's method" if method is not None else "--method" if method_given
                          else None, given, file_values)
    has_model = _has_model(given, file_values)
    setting = args.setting or (None if has_model else "tiny")
    layers = _presets(task, args.method, setting)
    if setting is not None and setting.lower() != "tiny" and not has_model:
        raise UsageError(f"--setting {setting} trains a real checkpoint: pass --model DIR (its local copy; the "
                         "tiny preset has its own settings, --setting tiny)")
    if args.config:
        layers.append(Layer(f"--config {args.config}", file_values))
    layers.append(Layer("", {"run": {"task": task, "out_dir": args.out or ""}},
                        {"run.task": f"experiments.{task}", "run.out_dir": "--out"}))
    values, _ = stack(layers)
    flags = _paired_sizes(values["algorithm"].get("algorithm", args.method), given, flags, flag_names,
                          refuse_both=method is None)  # compare's grpo arm trains the m of its pods arm
    if args.dataset is not None:
        layers.append(Layer("--dataset", {"data": _dataset(args, values.get("data", {}), given)}))
    if args.reward:
        layers.append(Layer("--reward", {"rewards": _rewards(args.reward, values.get("rewards", {}))}))
    layers.append(Layer("", _flag_values(flags), flag_names))
    values, args.origins = stack(layers)
    return args, decode(values)


def _method(args, chosen_by: str | None, given: dict[str, str], file_values: dict[str, Any]) -> str:
    """The run's method, which chooses the preset's n, m and the rest: --method (or compare's,
    ``chosen_by`` names which), else --algorithm.algorithm, else the --config file's; two of them
    that differ are refused."""
    named = [(f"{chosen_by} {args.method}", args.method)] if chosen_by else []
    if "algorithm.algorithm" in given:
        named.append((f"--algorithm.algorithm {given['algorithm.algorithm']}", given["algorithm.algorithm"]))
    in_file = (file_values.get("algorithm") or {}).get("algorithm") if isinstance(file_values, dict) else None
    if in_file is not None:
        named.append((f"--config {args.config}'s algorithm.algorithm {in_file}", in_file))
    other = next((name for name, value in named if value != named[0][1]), None)
    if other is not None:
        raise UsageError(f"{named[0][0]} and {other} name different methods; name one (a run's config.json "
                         "names its method: delete algorithm.algorithm from the file to run it as another)")
    method = named[0][1] if named else args.method
    if method not in METHODS:
        raise UsageError(f"method must be one of {', '.join(METHODS)}; got {method!r}")
    return method


def _has_model(given: dict[str, str], file_values: dict[str, Any]) -> bool:
    """Whether the command names a checkpoint (else the tiny preset is the default setting)."""
    return "model.path" in given or (file_values.get("model") or {}).get("path") is not None


def _presets(task: str, method: str, setting: str | None) -> list[Layer]:
    try:
        return preset_layers(task, method, setting)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _paired_sizes(algorithm: str, given: dict[str, str], flags: list[str],
                  flag_names: dict[str, str] | None = None, refuse_both: bool = False) -> list[str]:
    """GRPO and GRPO-GA train every rollout (the paper's GRPO n=16 against PODS n=64, m=16),
    so one of --n / --m sets both (``flag_names`` then says so for both). Of two, --m does;
    with ``refuse_both`` two that differ are refused, and two alike stay as given (each
    value then checked as any flag's)."""
    chosen = "algorithm.m" if "algorithm.m" in given else "algorithm.n" if "algorithm.n" in given else None
    if algorithm not in ("grpo", "grpo-ga") or chosen is None:
        return flags
    if refuse_both and {"algorithm.n", "algorithm.m"} <= given.keys():
        if _differ(given["algorithm.n"], given["algorithm.m"]):
            n_flag, m_flag = ((flag_names or {}).get(f, "--" + f.split(".")[1]) for f in ("algorithm.n", "algorithm.m"))
            raise UsageError(f"{algorithm} trains every rollout (n = m), and {n_flag} {given['algorithm.n']} and "
                             f"{m_flag} {given['algorithm.m']} differ: give one of them, or use --method pods")
        return flags
    if flag_names is not None:
        flag_names["algorithm.n"] = flag_names["algorithm.m"] = f"{flag_names[chosen]} ({algorithm}: n = m)"
    return [*flags, "--algorithm.n", given[chosen], "--algorithm.m", given[chosen]]


def _differ(a: str, b: str) -> bool:
    """Whether two decimal integers given as text differ (016 and 16 do not); anything else
    (1_6, 16.0) is left to the value checks, which name it."""
    decimal = re.compile(r"\s*[+-]?[0-9]+\s*")
    return bool(decimal.fullmatch(a) and decimal.fullmatch(b)) and int(a) != int(b)


def _goes_on(args) -> bool:
    """Whether ``--resume`` (or ``--resume auto``) continues a run in --out; sets ``args.resume``.

    On a multi-host run every process looks before process 0 writes config.json (the runner
    waits for all of them first), so all of them decide alike."""
    if args.overwrite:
        raise UsageError("--resume and --overwrite exclude each other")
    if args.out is None:
        raise UsageError("--resume needs --out, the run directory to continue")
    args.resume = has_run(args.out)
    if not args.resume and not args.resume_auto:
        # What --resume auto would take: a new directory, or one holding no more than a dry run's files.
        takes = not os.path.exists(args.out) or planned_only(args.out)
        hint = ("--resume auto starts it there when it has none" if takes else
                "it is not empty either: start a run in a new or empty directory")
        raise UsageError(f"--resume: {args.out} holds no run to resume (no config.json of a run); {hint}")
    return args.resume


def _resumed_flags(task: str, args, flags: list[str], given: dict[str, str], file_values: dict[str, Any],
                   method_given: bool) -> list[str]:
    """The flags that continue the run in --out: those of the RESUMABLE fields the command sets.

    A job script relaunches the run's own command with --resume (SLURM --requeue, a spot VM's
    startup script), so the command may state the run's values again. Each value it states
    is compared with the run's, and one that differs is refused, unless RESUMABLE."""
    saved = read_run_config(args.out)
    stated = _stated_values(task, args, flags, given, file_values, method_given, saved)
    explicit = set(given) | ({"algorithm.algorithm"} if method_given else set())
    resumed, changed = _against_saved(stated, saved, given, explicit)
    if changed:
        _, dotted, old, new = min(changed, key=lambda change: change[0])
        raise UsageError(f"--resume keeps the run's config; --{dotted} cannot change from {show_value(old)} to "
                         f"{show_value(new)} (a resume may change only {', '.join('--' + r for r in RESUMABLE)})")
    return resumed


def _stated_values(task: str, args, flags: list[str], given: dict[str, str], file_values: dict[str, Any],
                   method_given: bool, saved: ExperimentConfig) -> dict[str, Any]:
    """What a resumed command states, applied as a new run applies it: its method and setting
    (where given), its config file, --dataset, --reward and the flags."""
    stated: dict[str, Any] = {}
    if method_given or args.setting:
        has_model = _has_model(given, file_values) or saved.model.path is not None
        method = args.method if method_given else saved.algorithm.algorithm
        stated, _ = stack(_presets(task, method, args.setting or (None if has_model else "tiny")))
    stated = merge(stated, file_values)
    saved_tree = as_json(saved)
    if args.dataset is not None:
        stated = merge(stated, {"data": _dataset(args, merge(saved_tree, stated)["data"], given)})
    if args.reward:
        stated = merge(stated, {"rewards": _rewards(args.reward, stated.get("rewards", {}))})
    algorithm = merge(saved_tree, stated)["algorithm"].get("algorithm")
    stated = merge(stated, _flag_values(_paired_sizes(algorithm, given, flags)))
    _check_values(stated, None)
    return stated


def _against_saved(stated: dict[str, Any], saved: ExperimentConfig, given: dict[str, str],
                   explicit: set[str]) -> tuple[list[str], list[tuple[bool, str, Any, Any]]]:
    """(flags that set the RESUMABLE fields ``stated`` names, the other stated fields whose value
    differs from the run's as (not given explicitly, field, run's value, stated value))."""
    fields_of, changed, resumed = field_types(), [], []
    for section, fields in stated.items():
        for name, raw in fields.items():
            dotted = f"{section}.{name}"
            if dotted == "run.out_dir" or name not in fields_of.get(section, {}):
                continue  # the directory is --out; an unknown field is refused by read_run_config
            old = getattr(getattr(saved, section), name)
            try:
                new = _as_field(getattr(saved, section), name, fields_of[section][name], raw)
            except (draccus.utils.DraccusException, ValueError, TypeError):
                new = raw  # not a value of the field: read_run_config names it
            if dotted in RESUMABLE:
                resumed += [f"--{dotted}", given[dotted] if dotted in given else show_value(raw, limit=1 << 20)]
            elif new != old:
                changed.append((dotted not in explicit, dotted, old, new))
    return resumed, changed


def _as_field(section: Any, name: str, tp: Any, raw: Any) -> Any:
    """``raw`` as field ``name`` of ``section`` holds it: decoded, then normalized by the section
    where the rest of it allows (``run.log``'s order and duplicates)."""
    value = draccus.decode(tp, raw)
    try:
        return getattr(dataclasses.replace(section, **{name: value}), name)
    except (ValueError, TypeError):
        return value


def _dataset(args, data: dict[str, Any], given: dict[str, str]) -> dict[str, Any]:
    """The data fields --dataset sets: a directory gives data.train and data.test (its split
    files), a file data.train, and an ``owner/name`` that is no local path data.hub.
    ``data``: the data section so far (its split names)."""
    from podsjax.data import datasets as data_lib  # no JAX

    dataset = args.dataset
    if os.path.isfile(dataset):
        if "data.train" in given:
            raise UsageError("--dataset FILE and --data both name the train split")
        if "data.test" not in given:
            raise UsageError(f"--dataset {dataset} is one file, the train split: pass --eval-data for the test split")
        return {"train": dataset}
    if os.path.isdir(dataset):
        if "data.train" in given or "data.test" in given:
            raise UsageError("--dataset and --data / --eval-data exclude each other")
        splits = [given.get(f"data.{key}_split") or data.get(f"{key}_split") or key for key in ("train", "test")]
        try:
            train, test = (data_lib.split_file(dataset, split) for split in splits)
        except data_lib.DataError as exc:
            raise UsageError(f"--dataset {dataset}: {exc}") from None
        return {"train": train, "test": test}
    if _HUB_NAME.fullmatch(dataset):
        return {"hub": dataset}
    raise UsageError(f"--dataset {dataset}: no such file or directory, and not a Hub name (owner/name)")


def _rewards(specs: list[str], rewards: dict[str, Any]) -> dict[str, Any]:
    """The reward fields --reward sets: the task's own names their weights, the rest join
    ``rewards.extra`` (``rewards``: the section so far)."""
    from experiments.config import parse_reward
    from podsjax.rewards import TASK_REWARD_NAMES

    fields: dict[str, Any] = {}
    extra = list(rewards.get("extra", ()))
    for spec in specs:
        try:
            name, weight = parse_reward(spec)
        except ValueError as exc:
            raise UsageError(f"--reward {spec}: {exc}") from None
        if name in TASK_REWARD_NAMES:
            if name in fields:  # the last would win unseen
                raise UsageError(f"--reward {name} is given twice; give it once, with its weight ({name}=WEIGHT)")
            fields[name] = weight
        else:
            extra.append(spec)
    fields["extra"] = extra
    return fields



def replace_run(config: ExperimentConfig, **changes) -> ExperimentConfig:
    return dataclasses.replace(config, run=dataclasses.replace(config.run, **changes))
