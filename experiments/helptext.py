"""``--help``: every flag with one default, the value a run with no other flags would use.

The config tree's defaults are not its dataclasses' defaults: a run takes the method's
and the setting's values first (``experiments.config.preset_layers``), so ``--help``
resolves the config the way a run does (``--help --method grpo`` shows GRPO's values)
and shows those.
"""

from __future__ import annotations

import argparse
import json
import re
import typing
from typing import Any

from experiments import config_decoding, flags
from experiments.usage import UsageError

_DEFAULT_IN_COMMENT = re.compile(r"\s*\(default: ([^()]*(?:\([^()]*\)[^()]*)*)\)")
_HELP_FLAGS = ("-h", "--help")


def resolved_config(task: str, argv: list[str] | None):
    """``(config, error)``: the config a run of ``argv`` (``--help`` left out) would use, and
    None; on flags that give none (``--resume``, a bad value, no budget) the plain command's,
    and why the flags gave none."""
    rest = [token for token in argv or () if token not in _HELP_FLAGS]
    error = None
    for attempt in (rest, []):
        try:
            _, config = flags.parse(task, attempt)
        except UsageError as e:
            error = str(e).splitlines()[0] if str(e) else type(e).__name__
            continue
        if config is not None:
            return config, (error if attempt is not rest else None)
    raise UsageError(f"experiments.{task}: no config to describe")  # not reached: the plain command has one


def show(value: Any, limit: int = 60) -> str:
    """A default as a flag would give it: YAML's null, true and [a, b], cut short."""
    if isinstance(value, bool) or value is None:
        text = json.dumps(value)
    elif isinstance(value, (list, tuple)):
        text = "[" + ", ".join(show(v, limit) for v in value) + "]"
    else:
        text = str(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _tree_values(config) -> dict[str, Any]:
    """dotted field -> the config's value (``run.out_dir``: what --out defaults to)."""
    values = {f"{section}.{key}": value for section, fields in config_decoding.as_json(config).items()
              for key, value in fields.items()}
    values["run.out_dir"] = "runs/<task>-<method>-<date>-<time> (--out)"
    return values


def _with_default(comment: str, value: Any) -> str:
    """``comment`` with one default: the run's value, or the comment's own words where the value
    is null and the comment says what null means."""
    own = _DEFAULT_IN_COMMENT.search(comment)
    if value is None and own:
        return comment
    return f"{_DEFAULT_IN_COMMENT.sub('', comment)} (default: {show(value)})"


def _kind(tp: Any) -> str:
    """A field's type as the help's metavar: ``int``, ``float|null``, ``[str]``."""
    args = typing.get_args(tp)
    nullable = type(None) in args
    if nullable:
        tp = next(a for a in args if a is not type(None))
    origin = typing.get_origin(tp)
    if origin in (tuple, list):
        name = f"[{typing.get_args(tp)[0].__name__}]"
    else:
        name = getattr(tp, "__name__", str(tp))
    return f"{name}|null" if nullable else name


def help_text(task: str, argv: list[str] | None = None) -> str:
    """The launch flags and shortcuts, then every field of the config tree, each with one default."""
    config, error = resolved_config(task, argv)
    values, comments = _tree_values(config), _comments()
    parser = flags.build_parser(task)
    for action in parser._actions:
        if action.dest.startswith("short_"):
            field = flags.SHORTCUTS[action.option_strings[0]]
            own = _DEFAULT_IN_COMMENT.search(comments.get(field, "")) if values[field] is None else None
            action.help = f"= --{field} ({own.group(0).strip()[1:-1] if own else f'default: {show(values[field])}'})"
        elif action.help and "(default" not in action.help and action.dest != "help":
            action.help += f" (default: {'off' if action.nargs == 0 else 'none'})"
    note = "" if error is None else (
        f"note: these flags give no run ({error}); the defaults below are the plain command's "
        f"(python -m experiments.{task}, the tiny preset), not theirs\n\n")
    return note + parser.format_help() + "\n" + _tree_help(task, values, comments)


def _comments() -> dict[str, str]:
    """dotted field -> its comment in the config's source, on one line (draccus reads them)."""
    import draccus.argparsing

    from experiments.config import ExperimentConfig

    return {action.option_strings[0][2:]: " ".join((action.help or "").split())
            for action in draccus.argparsing.ArgumentParser(ExperimentConfig).parser._actions
            if action.option_strings and "." in action.option_strings[0]}


def _tree_help(task: str, values: dict[str, Any], comments: dict[str, str]) -> str:
    """Every field of the config tree: ``--section.field TYPE  comment (default: value)``."""
    tree = argparse.ArgumentParser(prog=f"python -m experiments.{task}", usage=argparse.SUPPRESS, add_help=False,
                                   description="The config tree: every field is a flag --<section>.<field> VALUE "
                                               "(YAML: null, true, [a, b]); the defaults are this command's.")
    types_of = config_decoding.field_types()
    for section in config_decoding.SECTIONS:
        group = tree.add_argument_group(section)
        for name, tp in types_of[section].items():
            dotted = f"{section}.{name}"
            text = _with_default(comments.get(dotted, ""), values.get(dotted))
            group.add_argument(f"--{dotted}", metavar=_kind(tp), help=text.replace("%", "%%"))
    return tree.format_help()
