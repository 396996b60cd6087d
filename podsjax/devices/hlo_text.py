"""HLO module text (``compiled.as_text()``) as data: computations of instructions, and array
types' sizes in device memory."""

from __future__ import annotations

import dataclasses
import json
import math
import re

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5,
                "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1, "token": 0}
ARRAY_TYPE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
# A layout's memory space other than 0 is not device memory: S(1) is a TPU's on-chip VMEM,
# S(2) its sync flags, S(5) the host. Only arrays in space 0 cost HBM traffic.
_MEMORY_SPACE = re.compile(r"S\((\d+)\)")
_SCRATCH = {"s8", "u8"}  # library calls' workspace outputs, not traffic


@dataclasses.dataclass
class Instr:
    """One instruction: its name, result type, opcode, operand names, the text after its
    operands (attributes), whether it is its computation's root, and the text between its
    parentheses."""

    name: str
    type: str
    opcode: str
    operands: list[str]
    attrs: str
    root: bool
    args: str = ""


def arrays(type_text: str, in_hbm_only: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    """``(dtype, dims)`` of each array in an HLO type, optionally only those in device memory."""
    return [(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims, layout in ARRAY_TYPE.findall(type_text)
            if d in _DTYPE_BYTES and not (in_hbm_only and on_chip(layout))]


def on_chip(layout: str) -> bool:
    """Whether an array layout (``{1,0:T(8,128)S(1)}``) puts it outside device memory."""
    space = _MEMORY_SPACE.search(layout or "")
    return space is not None and int(space.group(1)) != 0


def type_bytes(type_text: str, skip_scratch: bool = False, in_hbm_only: bool = True) -> float:
    """Bytes an HLO type (an array or a tuple of them) occupies in device memory: tiling
    ignored, arrays in another memory space (a TPU's VMEM) left out unless ``in_hbm_only``
    is False."""
    return sum(_DTYPE_BYTES[d] * math.prod(dims) for d, dims in arrays(type_text, in_hbm_only)
               if not (skip_scratch and d in _SCRATCH))


def _matching(text: str, start: int, open_c: str, close_c: str) -> int:
    """Index just past the bracket that closes the one at ``start``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_c:
            depth += 1
        elif text[i] == close_c:
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


_HEAD = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")


def _parse_instruction(line: str) -> Instr | None:
    head = _HEAD.match(line)
    if head is None:
        return None
    pos = head.end()
    if line[pos] == "(":
        end = _matching(line, pos, "(", ")")
    else:
        end = line.index(" ", pos)
    type_text = line[pos:end]
    rest = line[end:].lstrip()
    paren = rest.find("(")
    if paren < 0:
        return None
    opcode = rest[:paren]
    close = _matching(rest, paren, "(", ")")
    operands = re.findall(r"%([\w.\-]+)", rest[paren:close])
    return Instr(head.group(2), type_text, opcode, operands, rest[close:], bool(head.group(1)),
                  rest[paren + 1:close - 1])


def parse_module(text: str) -> tuple[dict[str, list[Instr]], str]:
    """``({computation name: instructions}, entry name)`` of an HLO module's text."""
    computations: dict[str, list[Instr]] = {}
    entry, current = "", None
    for line in text.splitlines():
        stripped = line.strip()
        if current is None:
            match = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*)?\{\s*$", stripped)
            if match and not stripped.startswith(("HloModule", "FileNames", "FunctionNames", "FileLocations",
                                                  "StackFrames")):
                current = match.group(2)
                computations[current] = []
                if match.group(1):
                    entry = current
            continue
        if stripped == "}":
            current = None
            continue
        instr = _parse_instruction(line)
        if instr is not None:
            computations[current].append(instr)
    return computations, entry


def called_computations(attrs: str, key: str) -> list[str]:
    """The computations an instruction's attribute ``key`` names (``calls``, ``body``, ...)."""
    match = re.search(key + r"=\{([^}]*)\}", attrs) or re.search(key + r"=%?([\w.\-]+)", attrs)
    return re.findall(r"%?([\w.\-]+)", match.group(1)) if match else []


def backend_config(attrs: str) -> dict:
    """An instruction's ``backend_config`` JSON; empty when it has none or it does not parse."""
    start = attrs.find("backend_config=")
    if start < 0 or attrs[start + 15: start + 16] != "{":
        return {}
    begin = start + 15
    try:
        return json.loads(attrs[begin:_matching(attrs, begin, "{", "}")])
    except ValueError:
        return {}


def constant_value(instr: Instr | None) -> int | None:
    """The integer a scalar ``constant`` instruction holds, else None."""
    if instr is None or instr.opcode != "constant" or not re.fullmatch(r"-?\d+", instr.args.strip()):
        return None
    return int(instr.args)
