"""The config tree's values: a config file, dotted flags and a run's config.json, checked
field by field and decoded into one :class:`ExperimentConfig` (one-line errors)."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import json
import os
import re
import types
import typing
from typing import Any

import draccus
import draccus.argparsing

from experiments.config import ExperimentConfig, merge
from experiments.config_documents import (
    _DEEPER,
    _INT_LIMIT,
    MAX_DEPTH,
    _first_line,
    _HugeInt,
    _json_int,
    _kind,
    _load,
    _read_bytes,
    show_value,
)
from experiments.usage import CONFIG_FILE, UsageError

SECTIONS = tuple(f.name for f in dataclasses.fields(ExperimentConfig))
# A value that starts with a minus sign: -1e-4, -.5, -inf, -nan.
_NEGATIVE_VALUE = re.compile(r"-(\d|\.\d|inf\b|nan\b)", re.IGNORECASE)


def _unknown(flag: str, where: str, launch_flags: tuple[str, ...] = ()) -> UsageError:
    """``unrecognized argument --flag; did you mean --known?`` when a known flag (a config
    field's, or one of ``launch_flags``) is a close misspelling."""
    known = [*launch_flags, *(f"--{section}.{name}" for section, fields in field_types().items() for name in fields)]
    close = difflib.get_close_matches(flag, known, n=1, cutoff=0.75)
    return UsageError(f"unrecognized argument {flag}{f'; did you mean {close[0]}?' if close else ''} ({where})")


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
    tree = _as_lists(merge(values, _flag_values(flags, where)))
    _check_values(tree, where)
    try:
        return draccus.decode(ExperimentConfig, tree)
    except draccus.utils.DraccusException as exc:
        raise UsageError(_where(where, _draccus_error(exc))) from None
    except (ValueError, TypeError) as exc:  # a config's __post_init__ outside draccus's wrapping
        raise UsageError(_where(where, _first_line(exc))) from None


def _as_lists(tree: dict[str, Any]) -> dict[str, Any]:
    """A list field given one value (``log: jsonl``, ``eval_k: 4``, ``--run.log jsonl,wandb``) as
    the list of it, as the flags' shortcuts give: draccus had made a string its characters."""
    fields_of = field_types()
    out = {}
    for section, fields in tree.items():
        if isinstance(fields, dict):
            fields = dict(fields)
            for name, value in fields.items():
                listed = typing.get_origin(fields_of.get(section, {}).get(name)) in (tuple, list)
                if listed and isinstance(value, (str, int, float)) and not isinstance(value, bool):
                    fields[name] = [v.strip() for v in value.split(",")] if isinstance(value, str) else [value]
        out[section] = fields
    return out


def _where(where: str | None, message: str) -> str:
    return f"{where}: {message}" if where else message


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
                             f"{_kind(fields)} {show_value(fields)}")
        sections[name] = fields or {}
    return sections

# -- the values, field by field ---------------------------------------------------------------

@functools.cache
def field_types() -> dict[str, dict[str, Any]]:
    """section -> field -> its type, from the dataclasses' annotations."""
    return {section: typing.get_type_hints(cls) for section, cls in typing.get_type_hints(ExperimentConfig).items()}


def _kinds(tp: Any) -> set:
    """The types a field takes, None left out (``int | None`` -> {int})."""
    union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    return set(typing.get_args(tp) if union else (tp,)) - {type(None)}


_SCALARS = {int: "a number", float: "a number", str: "text", bool: "true or false"}


def _scalar(tp: Any) -> str | None:
    """What a field of one value takes ("a number", "text"), or None for a list or mapping field."""
    kinds = _kinds(tp)
    if not kinds or not kinds <= set(_SCALARS):
        return None
    return " or ".join(dict.fromkeys(_SCALARS[kind] for kind in sorted(kinds, key=str)))


def _check_shape(value: Any, tp: Any, path: str, where: str | None) -> None:
    """A list or mapping given where one value belongs (``--n [4]``), or as a list's item
    (``--eval-k [[1]]``): draccus's own error would name its internals."""
    items = [arg for kind in _kinds(tp) if typing.get_origin(kind) in (list, tuple)
             for arg in typing.get_args(kind) if arg is not Ellipsis]
    if isinstance(value, list) and len(set(items)) == 1:  # a list of one kind: check its items
        for item in value:
            _check_shape(item, items[0], f"{path}'s item", where)
    elif isinstance(value, (list, dict)) and _scalar(tp):
        raise UsageError(_where(where, f"{path} takes {_scalar(tp)}, not a "
                                       f"{'mapping' if isinstance(value, dict) else 'list'} ({show_value(value)})"))


def _check_values(values: dict[str, Any], where: str | None) -> None:
    """What draccus would take silently or trip over: a boolean where a number belongs (it
    would store true as 1.0), null where a number must be, an integer no field holds, a value
    that is no plain YAML value."""
    fields_of = field_types()
    for section, fields in values.items():
        if not isinstance(fields, dict):
            continue  # draccus names the section
        for name, value in fields.items():
            path = f"{section}.{name}"
            _check_plain(value, path, where, 2)
            tp = fields_of.get(section, {}).get(name, Any)
            _check_shape(value, tp, path, where)
            # off had become the text 'False' and 1.50 '1.5'; an int reads as written (mesh: 8)
            if _kinds(tp) == {str} and isinstance(value, (bool, float)):
                raise UsageError(_where(where, f"{path} takes text, not the {_kind(value)} {show_value(value)}; "
                                               "quote it to mean the text"))
            if _kinds(tp) and _kinds(tp) <= {int, float}:
                if isinstance(value, bool):
                    raise UsageError(_where(where, f"{path} must be a number, not a boolean ({str(value).lower()})"))
                if value is None and type(None) not in typing.get_args(tp):
                    raise UsageError(_where(where, f"{path} must be a number, not null"))
                if isinstance(value, str) and _read_otherwise(value):
                    raise UsageError(_where(where, f"{path} must be a number written in decimal; got {value!r}"))


def _read_otherwise(text: str) -> bool:
    """Whether Python's float() and int(), which draccus calls on a number field's text, would read
    as a number a text that YAML 1.2 reads as none: 1_6 as 16, ' 7' as 7, Arabic-Indic digits.
    inf and nan pass, for the fields' own finiteness checks; other text is draccus's to refuse."""
    if text.strip().lstrip("+-").lower() in ("inf", "infinity", "nan"):
        return False
    try:
        float(text)
    except ValueError:
        return False
    return True


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
        raise _unknown(unknown[0].split("=")[0], "see --help for the config's fields")
    fields_of, tree = field_types(), {}
    for name, text in given.items():
        section, _, field = name.partition(".")
        tree.setdefault(section, {})[field] = _flag_value(text, f"--{name}", fields_of[section][field])
    return tree


_YAML_NULLS = ("null", "Null", "NULL", "~")


def _flag_value(text: str, what: str, tp: Any) -> Any:
    """A flag's text as YAML (``[a, b]``, ``null``, ``0.5``), read within the bounds.

    A string field takes the text itself, but for null and a quoted text (``'null'``): YAML
    would cut a prompt at `` #`` (a comment) and read ``&``, ``|`` and ``>`` as its own
    syntax, ``Answer: a number`` would be a mapping and ``yes`` true, and no value is a file
    to include (draccus's ``include`` keyword and ``!include`` tag are not read)."""
    if text == "":
        return text  # as draccus: the empty string, not null
    if _kinds(tp) == {str}:
        if text in _YAML_NULLS:
            return None
        quoted = len(text) >= 2 and text[0] == text[-1] and text[0] in "'\""
        value = _load(text, what) if quoted else text
        return value if isinstance(value, str) else text
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
    if "run" not in values:  # a model's config.json (model_type, architectures, ...), or another tool's
        raise UsageError(f"--resume: {path} is no podsjax run's config (no 'run' section; it holds "
                         f"{', '.join(repr(k) for k in list(values)[:3]) or 'nothing'}); --out names no run to resume")
    if unknown:
        raise UsageError(f"--resume: {path} is not a podsjax run config of this version ({unknown[0]!r} is no "
                         "section of it: an older layout); start a new run")
    values = merge(values, {"run": {"out_dir": out}})
    return decode(values, flags, where=where)


def as_json(config: ExperimentConfig) -> dict[str, Any]:
    """The config as config.json holds it (every field, nested by section)."""
    import draccus

    values = draccus.encode(config)
    values["run"] = {k: v for k, v in values["run"].items() if k != "out_dir"}  # the directory it lies in
    return values
