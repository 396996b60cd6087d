"""Reading a config document within bounds: a config file, a flag's value, a run's config.json."""

from __future__ import annotations

import json
import re
from typing import Any

import yaml

from experiments.usage import UsageError

# Bounds on a config file, a flag's value and a run's config.json. A config is six sections
# of about 100 values, 4 levels deep; the bounds refuse, before anything is expanded, a
# document that would take minutes or gigabytes to read, such as a YAML alias bomb (a few
# hundred bytes that expand to billions of values).
MAX_CONFIG_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_VALUES = 10_000
_INT_LIMIT = 2**63  # no field needs more; Python refuses to convert more than 4300 digits at all


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


# -- reading a document within the bounds ---------------------------------------------------

class _Refused(Exception):
    """A document past one of the bounds, or with a key twice in a mapping (its message says which)."""


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
                raise _Refused(_DEEPER)
            if self.nodes > MAX_VALUES:
                raise _Refused(_LARGER)
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node, deep=False):
        keys = [key.value for key, _ in node.value if isinstance(key, yaml.ScalarNode) and key.value != "<<"]
        twice = next((key for i, key in enumerate(keys) if key in keys[:i]), None)
        if twice is not None:  # PyYAML keeps the last silently: a typo's copy would win unseen
            raise _Refused(f"{twice!r} is given twice in one mapping")
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):
        """A decimal integer (the only kind the resolver below tags as one), leading zeros and all."""
        try:
            return int(self.construct_scalar(node), 10)
        except ValueError:  # past Python's 4300 digits
            return _HugeInt(sum(c.isdigit() for c in node.value))


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)
# Numbers as YAML 1.2 reads them, not PyYAML's YAML 1.1: 010 is ten (not octal eight), and
# 1:30 (sexagesimal 90), 1_000 or 0b11 are text, which a number field then refuses.
_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver(_INT, re.compile(r"^[-+]?[0-9]+$"), list("-+0123456789"))
_Loader.add_implicit_resolver(
    _FLOAT, re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)"
                       r"|\.(?:nan|NaN|NAN))$"), list("-+.0123456789"))
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
                raise _Refused(_DEEPER)
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
                    raise _Refused(f"more than {MAX_VALUES} values once its YAML aliases are expanded, the limit "
                                    "for a config (one has about 100)")
            sizes = known[id(node)] = (values, levels)
        if depth + sizes[1] - 1 > MAX_DEPTH:
            raise _Refused(_DEEPER)
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
    except _Refused as exc:
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


def _kind(value: Any) -> str:
    return "int" if isinstance(value, _HugeInt) else type(value).__name__


def show_value(value: Any, limit: int = 60) -> str:
    """A value as a message shows it: JSON, cut short."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _json_int(text: str) -> int | _HugeInt:
    try:
        return int(text)
    except ValueError:  # past Python's 4300 digits
        return _HugeInt(len(text.lstrip("-")))
