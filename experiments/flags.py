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
memory, and handed to draccus as one tree.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import sys
import types
import typing
from typing import Any

import draccus
import draccus.argparsing
import yaml

from experiments import run_dir
from experiments.config import METHODS, ExperimentConfig, Layer, merge, preset_layers, stack
from experiments.usage import CONFIG_FILE, DRY_RUN_FILE, UsageError
from podsjax import paper_settings

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
# Shortcuts of list fields: "--log a,b" and "--eval-k 1,4" give the list [a, b] and [1, 4].
LIST_SHORTCUTS = ("run.log", "run.eval_k")
SECTIONS = tuple(f.name for f in dataclasses.fields(ExperimentConfig))
_HUB_NAME = re.compile(r"[\w.-]+/[\w.-]+(:[\w.-]+)?")
# A value that starts with a minus sign: -1e-4, -.5, -inf, -nan.
_NEGATIVE_VALUE = re.compile(r"-(\d|\.\d|inf\b|nan\b)", re.IGNORECASE)
# What a resumed run may change: how long it goes on, and memory (the same numbers either way).
RESUMABLE = ("run.time_budget_s", "run.max_steps", "model.remat", "run.progress")

# Bounds on a config file, a flag's value and a run's config.json. A config is six sections
# of about 100 values, 4 levels deep; the bounds refuse, before anything is expanded, a
# document that would take minutes or gigabytes to read, such as a YAML alias bomb (a few
# hundred bytes that expand to billions of values).
MAX_CONFIG_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_VALUES = 10_000
_INT_LIMIT = 2**63  # no field needs more; Python refuses to convert more than 4300 digits at all


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
                   help="replace the podsjax run in --out (a directory of other files, or one holding the model, "
                        "data or config file, is refused)")
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


def help_text(task: str, argv: list[str] | None = None) -> str:
    """The launch flags' help, then every field of the config tree, each with the default that the
    command ``argv`` would run with (``experiments.helptext``)."""
    from experiments import helptext

    return helptext.help_text(task, argv)


def _unknown(flag: str, task: str, where: str) -> UsageError:
    from experiments import helptext

    return UsageError(f"unrecognized argument {flag}{helptext.suggestion(flag, task)} ({where})")


def _field_flags(args, rest: list[str]) -> tuple[list[str], dict[str, str]]:
    """The shortcuts as dotted flags, then the dotted flags given as they are; and for each
    dotted field, the flag that gave it (the last one)."""
    flags: list[str] = []
    names: dict[str, str] = {}
    for flag, field in SHORTCUTS.items():
        value = getattr(args, _dest(flag))
        if value is not None:
            flags += [f"--{field}", f"[{value}]" if field in LIST_SHORTCUTS else value]
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
            raise _unknown(token.split("=")[0], args.task, "config fields are --<section>.<field>; see --help")
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


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines()]
    if not lines or not lines[0]:
        return type(exc).__name__
    # A line ending in ":" introduces the reasons below it (draccus on an optional field: "Could not
    # decode the value into any of the given types:" then one line per type): keep them on the line.
    if lines[0].endswith(":") and len(lines) > 1:
        return _clip(lines[0] + " " + "; ".join(line for line in lines[1:] if line))
    return _clip(lines[0])


def _clip(line: str, limit: int = 300) -> str:
    """A message line short enough to read (draccus quotes the value it could not parse)."""
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _draccus_error(exc: Exception) -> str:
    """The one line of a draccus error: its own for a value of the wrong type (it names the
    field), the config's message when a config refused the values."""
    cause = exc.__cause__ or exc.__context__
    if not isinstance(exc, draccus.utils.DecodingError) and isinstance(cause, (ValueError, TypeError)) and str(cause):
        return _first_line(cause)
    return _first_line(exc)


def decode(values: dict[str, Any], flags: list[str] = (), where: str | None = None) -> ExperimentConfig:
    """The config from nested ``values`` with dotted ``flags`` over them; one-line errors.

    The flags are read here (``_flag_values``) and merged into ``values``, and draccus
    decodes the one tree in memory."""
    tree = merge(values, _flag_values(flags, where))
    _check_values(tree, where)
    try:
        return draccus.decode(ExperimentConfig, tree)
    except draccus.utils.DraccusException as exc:
        raise UsageError(_where(where, _draccus_error(exc))) from None
    except (ValueError, TypeError) as exc:  # a config's __post_init__ outside draccus's wrapping
        raise UsageError(_where(where, _first_line(exc))) from None


def _where(where: str | None, message: str) -> str:
    return f"{where}: {message}" if where else message


# -- reading a document within the bounds ---------------------------------------------------

class _TooLarge(Exception):
    """A document past one of the bounds (its message names the bound)."""


class _HugeInt:
    """An integer literal with more digits than Python converts (``sys.get_int_max_str_digits``),
    kept so that the field it was given for can be named."""

    def __init__(self, digits: int):
        self.digits = digits

    def __repr__(self):
        return f"<an integer of {self.digits} digits>"


_DEEPER = f"nested deeper than {MAX_DEPTH} levels, the limit for a config"
_LARGER = f"more than {MAX_VALUES} values, the limit for a config (one has about 100)"


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, bounded while it composes: it recurses once per level, so a deep
    document would end in RecursionError, and it reads nodes one by one, so a long one is
    cut short. Aliases are counted after composing (``_check_expansion``)."""

    def __init__(self, stream):
        super().__init__(stream)
        self.depth = self.nodes = 0

    def compose_node(self, parent, index):
        self.depth += 1
        self.nodes += 1
        try:
            if self.depth > MAX_DEPTH:
                raise _TooLarge(_DEEPER)
            if self.nodes > MAX_VALUES:
                raise _TooLarge(_LARGER)
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_yaml_int(self, node):
        try:
            return super().construct_yaml_int(node)
        except ValueError:  # past Python's 4300 digits
            return _HugeInt(sum(c.isdigit() for c in node.value))


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)
# A date is text to a config (a split may be named 2024-01-01), not a datetime draccus cannot take.
_Loader.add_constructor("tag:yaml.org,2002:timestamp", lambda loader, node: loader.construct_scalar(node))


def _check_expansion(root: yaml.Node) -> None:
    """Refuses a node graph whose expansion (each alias replaced by a copy of its anchor) is
    deeper than MAX_DEPTH or holds more than MAX_VALUES values, without expanding it: each
    node's expanded size and height are computed once. An alias inside its own anchor
    expands forever, so it is refused as too deep."""
    known: dict[int, tuple[int, int]] = {}  # id(node) -> (values, levels) of its expansion

    def visit(node, depth):
        sizes = known.get(id(node))
        if sizes is None:
            if depth > MAX_DEPTH:
                raise _TooLarge(_DEEPER)
            if isinstance(node, yaml.SequenceNode):
                children = node.value
            elif isinstance(node, yaml.MappingNode):
                children = [child for pair in node.value for child in pair]
            else:
                children = ()
            values, levels = 1, 1
            for child in children:
                child_values, child_levels = visit(child, depth + 1)
                values, levels = values + child_values, max(levels, child_levels + 1)
                if values > MAX_VALUES:
                    raise _TooLarge(f"more than {MAX_VALUES} values once its YAML aliases are expanded, the limit "
                                    "for a config (one has about 100)")
            sizes = known[id(node)] = (values, levels)
        if depth + sizes[1] - 1 > MAX_DEPTH:
            raise _TooLarge(_DEEPER)
        return sizes

    visit(root, 1)


def _load(text: str, what: str, broken: str = "not YAML or JSON") -> Any:
    """YAML text (JSON is YAML) -> plain values, within the bounds; errors as one line about ``what``."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node)
        return loader.construct_document(node)
    except _TooLarge as exc:
        raise UsageError(f"{what}: {exc}") from None
    except (yaml.YAMLError, ValueError, TypeError) as exc:
        raise UsageError(f"{what}: {broken} ({_first_line(exc)})") from None
    finally:
        loader.dispose()


def _read_bytes(path: str, where: str) -> bytes:
    """At most MAX_CONFIG_BYTES of a file (OSError as it comes)."""
    with open(path, "rb") as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise UsageError(f"{where}: larger than {MAX_CONFIG_BYTES >> 20} MiB, the limit for a config (a run's "
                         "config.json is about 4 KB)")
    return data


def _read_file(path: str) -> dict[str, Any]:
    where = f"--config {path}"
    try:
        data = _read_bytes(path, where)
    except OSError as exc:
        raise UsageError(f"{where}: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{where}: not YAML or JSON ({_first_line(exc)})") from None
    values = _load(text, where)
    if not isinstance(values, dict):
        raise UsageError(f"{where}: holds a {type(values).__name__}, not a mapping of config sections")
    sections = {}
    for name, fields in values.items():
        if name not in SECTIONS:
            raise UsageError(f"{where}: unknown section {name!r}; the sections are {', '.join(SECTIONS)}")
        if fields is not None and not isinstance(fields, dict):  # null: a section with every field left out
            raise UsageError(f"{where}: section {name!r} must be a mapping of its fields, got "
                             f"{_kind(fields)} {_show(fields)}")
        sections[name] = fields or {}
    return sections


def _kind(value: Any) -> str:
    return "int" if isinstance(value, _HugeInt) else type(value).__name__


def _show(value: Any, limit: int = 60) -> str:
    """A value as a message shows it: JSON, cut short."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


# -- the values, field by field ---------------------------------------------------------------

@functools.cache
def _field_types() -> dict[str, dict[str, Any]]:
    """section -> field -> its type, from the dataclasses' annotations."""
    return {section: typing.get_type_hints(cls) for section, cls in typing.get_type_hints(ExperimentConfig).items()}


def _kinds(tp: Any) -> set:
    """The types a field takes, None left out (``int | None`` -> {int})."""
    union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    return set(typing.get_args(tp) if union else (tp,)) - {type(None)}


def _check_values(values: dict[str, Any], where: str | None) -> None:
    """What draccus would take silently or trip over: a boolean where a number belongs (it
    would store true as 1.0), null where a number must be, an integer no field holds, a value
    that is no plain YAML value."""
    fields_of = _field_types()
    for section, fields in values.items():
        if not isinstance(fields, dict):
            continue  # draccus names the section
        for name, value in fields.items():
            path = f"{section}.{name}"
            _check_plain(value, path, where, 2)
            tp = fields_of.get(section, {}).get(name, Any)
            if _kinds(tp) and _kinds(tp) <= {int, float}:
                if isinstance(value, bool):
                    raise UsageError(_where(where, f"{path} must be a number, not a boolean ({str(value).lower()})"))
                if value is None and type(None) not in typing.get_args(tp):
                    raise UsageError(_where(where, f"{path} must be a number, not null"))


def _check_plain(value: Any, path: str, where: str | None, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise UsageError(_where(where, f"{path}: {_DEEPER}"))
    if isinstance(value, _HugeInt) or (isinstance(value, int) and not isinstance(value, bool)
                                       and not -_INT_LIMIT <= value < _INT_LIMIT):
        digits = value.digits if isinstance(value, _HugeInt) else len(str(abs(value)))
        raise UsageError(_where(where, f"{path}: an integer of {digits} digits is out of range (a config's integers "
                                       "are below 2**63)"))
    if isinstance(value, (list, tuple)):
        for item in value:
            _check_plain(item, path, where, depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_plain(item, f"{path}.{key}", where, depth + 1)
    elif value is not None and not isinstance(value, (str, int, float)):
        raise UsageError(_where(where, f"{path}: a {type(value).__name__} is not a config value"))


class _FlagParser(draccus.argparsing.ArgumentParser):
    """draccus's flags of the config tree, each value kept as the text given: ``_flag_values``
    reads it (bounded) and ``decode`` merges it into the tree."""

    def __init__(self):
        super().__init__(ExperimentConfig, exit_on_error=False)
        self.parser.error = self._error  # argparse would print its usage and exit

    @staticmethod
    def _error(message):
        raise UsageError(message)

    def _postprocessing(self, parsed_args):
        return vars(parsed_args)


def _flag_values(flags: list[str], where: str | None = None) -> dict[str, Any]:
    """Dotted flags -> the nested values they give (unknown flags and bad values refused)."""
    if not flags:
        return {}
    try:
        given, unknown = _FlagParser().parse_known_args(_negative_values(flags))
    except argparse.ArgumentError as exc:
        raise UsageError(_where(where, str(exc))) from None
    unknown += [f"--{name}" for name in given if "." not in name]  # draccus's own --config_path
    if unknown:
        raise _unknown(unknown[0].split("=")[0], "gsm8k", "see --help for the config's fields")
    fields_of, tree = _field_types(), {}
    for name, text in given.items():
        section, _, field = name.partition(".")
        tree.setdefault(section, {})[field] = _flag_value(text, f"--{name}", fields_of[section][field])
    return tree


def _flag_value(text: str, what: str, tp: Any) -> Any:
    """A flag's text as YAML (``[a, b]``, ``null``, ``0.5``), read within the bounds.

    A string field takes the text itself unless it reads as a string or null: a prompt such
    as ``Answer: a number`` is not a mapping, ``yes`` is not true, and no value is a file to
    include (draccus's ``include`` keyword and ``!include`` tag are not read)."""
    if text == "":
        return text  # as draccus: the empty string, not null
    if _kinds(tp) == {str}:
        try:
            value = _load(text, what)
        except UsageError:
            return text
        return value if value is None or isinstance(value, str) else text
    return _load(text, what, "not a YAML value")


def _negative_values(argv: list[str]) -> list[str]:
    """``--lr -1e-4`` as ``--lr=-1e-4``: argparse takes a token starting with "-" for an option
    unless it is a plain negative number (-1, -0.5), so ``-1e-4`` or ``-inf`` would be refused as
    a missing value instead of being read (and checked) as one."""
    joined: list[str] = []
    for token in argv:
        if joined and _NEGATIVE_VALUE.match(token) and joined[-1].startswith("--") and "=" not in joined[-1]:
            joined[-1] = f"{joined[-1]}={token}"
        else:
            joined.append(token)
    return joined


def parse(task: str, argv: list[str] | None,
          method: str | None = None) -> tuple[argparse.Namespace, ExperimentConfig | None]:
    """(launch flags, the run's config); the config is None when the run in ``--out`` goes on
    (``--resume``, or ``--resume auto`` where it holds a run: read the config with
    :func:`read_run_config` and ``args.field_flags``) and for ``--help`` (``args.help``).
    ``args.resume`` is then whether the run goes on.

    ``method`` stands for ``--method`` (a caller that runs several methods on one command
    line, as ``experiments.compare`` does)."""
    args, rest = build_parser(task).parse_known_args(_negative_values(sys.argv[1:] if argv is None else argv))
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
    file_values = _read_file(args.config) if args.config else {}
    if args.resume and _goes_on(args):
        args.field_flags = _resumed_flags(task, args, flags, given, file_values, method_given)
        return args, None
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
    flags = _paired_sizes(values["algorithm"].get("algorithm", args.method), given, flags, flag_names)
    if args.dataset is not None:
        layers.append(Layer("--dataset", {"data": _dataset(args, values.get("data", {}), given)}))
    if args.reward:
        layers.append(Layer("--reward", {"rewards": _rewards(args.reward, values.get("rewards", {}))}))
    layers.append(Layer("", _flag_values(flags), flag_names))
    values, args.origins = stack(layers)
    return args, decode(values)


def _has_model(given: dict[str, str], file_values: dict[str, Any]) -> bool:
    """Whether the command names a checkpoint (else the tiny preset is the default setting)."""
    return "model.path" in given or (file_values.get("model") or {}).get("path") is not None


def _presets(task: str, method: str, setting: str | None) -> list[Layer]:
    try:
        return preset_layers(task, method, setting)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _paired_sizes(algorithm: str, given: dict[str, str], flags: list[str],
                  flag_names: dict[str, str] | None = None) -> list[str]:
    """GRPO and GRPO-GA train every rollout (the paper's GRPO n=16 against PODS n=64, m=16),
    so one of --n / --m sets both, and --m wins (``flag_names`` then says so for both)."""
    chosen = "algorithm.m" if "algorithm.m" in given else "algorithm.n" if "algorithm.n" in given else None
    if algorithm not in ("grpo", "grpo-ga") or chosen is None:
        return flags
    if flag_names is not None:
        flag_names["algorithm.n"] = flag_names["algorithm.m"] = f"{flag_names[chosen]} ({algorithm}: n = m)"
    return [*flags, "--algorithm.n", given[chosen], "--algorithm.m", given[chosen]]


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
        raise UsageError(f"--resume: {args.out} holds no run to resume (no config.json of a run); "
                         "--resume auto starts it there when it has none")
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
        raise UsageError(f"--resume keeps the run's config; --{dotted} cannot change from {_show(old)} to "
                         f"{_show(new)} (a resume may change only {', '.join('--' + r for r in RESUMABLE)})")
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
    fields_of, changed, resumed = _field_types(), [], []
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
                resumed += [f"--{dotted}", given[dotted] if dotted in given else _show(raw, limit=1 << 20)]
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
    from podsjax import data as data_lib  # no JAX

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
            fields[name] = weight
        else:
            extra.append(spec)
    fields["extra"] = extra
    return fields


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

    hint = data.LOCAL_ONLY_TASKS.get(config.task)
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
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--out {out} exists and is not a directory")
    if args.resume and not has_run(out):
        raise UsageError(f"--resume: {out} holds no run to resume (no config.json of a run)")
    occupied = os.path.isdir(out) and not planned_only(out)
    if occupied and not (args.resume or args.overwrite or args.dry_run):
        if getattr(args, "resume_auto", False):
            raise UsageError(f"--resume auto: {out} is not empty and holds no run (no config.json); start the run "
                             "in an empty or new directory")
        raise UsageError(f"--out {out} is not empty; pass --resume to continue it or --overwrite to replace it")


def _json_int(text: str) -> int | _HugeInt:
    try:
        return int(text)
    except ValueError:  # past Python's 4300 digits
        return _HugeInt(len(text.lstrip("-")))


def read_run_config(out: str, flags: list[str] = ()) -> ExperimentConfig:
    """The config.json a run wrote, with ``flags`` (only :data:`RESUMABLE` fields) over it."""
    path = os.path.join(out, CONFIG_FILE)
    where = f"--resume: {path}"
    try:
        values = json.loads(_read_bytes(path, where).decode("utf-8"), parse_int=_json_int)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"--resume: cannot read {path} ({_first_line(exc)})") from None
    except RecursionError:
        raise UsageError(f"--resume: cannot read {path} (nested too deeply)") from None
    if not isinstance(values, dict):
        raise UsageError(f"--resume: {path} holds a JSON {type(values).__name__}, not the run's config object")
    wrong = [key for key, value in values.items() if key in SECTIONS and not isinstance(value, dict)]
    if wrong:
        raise UsageError(f"--resume: {path}: {wrong[0]!r} must be an object of fields, got "
                         f"{_kind(values[wrong[0]])}")
    unknown = [key for key in values if key not in SECTIONS]
    if "run" not in values or unknown:
        reason = f"{unknown[0]!r} is no section of it: an older layout" if unknown else "no 'run' section"
        raise UsageError(f"--resume: {path} is not a podsjax run config of this version ({reason}); start a new run")
    values = merge(values, {"run": {"out_dir": out}})
    return decode(values, flags, where=where)


def as_json(config: ExperimentConfig) -> dict[str, Any]:
    """The config as config.json holds it (every field, nested by section)."""
    import draccus

    values = draccus.encode(config)
    values["run"] = {k: v for k, v in values["run"].items() if k != "out_dir"}  # the directory it lies in
    return values


def replace_run(config: ExperimentConfig, **changes) -> ExperimentConfig:
    return dataclasses.replace(config, run=dataclasses.replace(config.run, **changes))
