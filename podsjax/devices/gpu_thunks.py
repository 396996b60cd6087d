"""What a GPU program launches, read from XLA's thunk sequence: kernels, and the CUDA graphs holding them.

XLA's GPU runtime runs a program as a sequence of thunks (kernels, library calls, loops).
Runs of thunks that a CUDA graph can hold become one graph (a command buffer), launched at
once; the rest launch one by one, each paying its own launch. Which it is for a decode
step's ~300 kernels does not show in the optimized HLO. It shows in the thunk sequence,
which XLA writes where :func:`dump_options` asks it to, also for a GPU it compiles for
without one (:mod:`podsjax.devices.gpu_topology`).

Example:
    >>> gen = sampling.Generator(model, compiler_options=gpu_thunks.dump_options(tmp))
    >>> gen.compile(...)
    >>> gpu_thunks.innermost_loop(gpu_thunks.read(tmp, "sample"))   # the decode step
    Launches(graphs=1, alone=0, kernels_in_graphs=288)
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

# Thunks that launch work on the GPU: kernels, library calls, copies.
_LAUNCHING = frozenset({"kKernel", "kCustomKernel", "kGemm", "kCublasLtMatmul", "kCuDnn", "kCustomCall", "kCopy",
                        "kConvolution", "kSelectK", "kFft", "kTriangularSolve", "kCholesky"})
_THUNK = re.compile(r"^(\s*)\d+: (k\w+)")


def dump_options(directory) -> dict:
    """XLA's options that write each compiled program's thunk sequence into ``directory``."""
    return {"xla_dump_to": str(directory), "xla_dump_hlo_pass_re": "thunk_passes"}


def read(directory, program: str) -> str:
    """The thunk sequence of the newest dump of jitted function ``program`` in ``directory``.

    Raises:
        ValueError: one line, when no such dump is there.
    """
    folder = pathlib.Path(directory)
    for suffix in ("thunk_sequence_after_thunk_passes.txt", "thunk_sequence.txt"):  # the first once passes changed it
        found = sorted(folder.glob(f"module_*.jit_{program}.{suffix}"))
        if found:
            return found[-1].read_text()
    raise ValueError(f"no thunk sequence of jit_{program} in {folder} (compiled with gpu_thunks.dump_options?)")


@dataclasses.dataclass(frozen=True)
class Launches:
    """What one pass over a sequence launches: ``graphs`` CUDA graphs holding ``kernels_in_graphs``
    kernels, and ``alone`` kernels launched one by one."""

    graphs: int
    alone: int
    kernels_in_graphs: int

    @property
    def launches(self) -> int:
        return self.graphs + self.alone


def innermost_loop(text: str) -> Launches:
    """What one iteration of the innermost loop's body launches (a sampling program's: a
    decode step).

    Raises:
        ValueError: one line, when the sequence has no loop.
    """
    lines = text.splitlines()
    thunks = [(i, len(m.group(1)), m.group(2)) for i, line in enumerate(lines) if (m := _THUNK.match(line))]
    loops = [(i, indent) for i, indent, kind in thunks if kind == "kWhile"]
    if not loops:
        raise ValueError("the thunk sequence has no loop")
    for start, indent in reversed(loops):  # a loop nested in another comes after it
        inside = _after(thunks, start, indent)
        if not any(kind == "kWhile" for _, _, kind in inside):
            break
    body_from = next(i for i in range(start, len(lines)) if lines[i].strip() == "body:")
    body = [t for t in inside if t[0] > body_from]
    top = min(indent for _, indent, _ in body)
    graphs = [t for t in body if t[1] == top and t[2] == "kCommandBuffer"]
    alone = sum(1 for t in body if t[1] == top and t[2] in _LAUNCHING)
    in_graphs = sum(1 for t in body if t[1] > top and t[2] in _LAUNCHING)
    return Launches(graphs=len(graphs), alone=alone, kernels_in_graphs=in_graphs)


def _after(thunks: list, start: int, indent: int) -> list:
    """The thunks nested under the one on line ``start`` (deeper indented, up to the next at its depth)."""
    nested = []
    for t in thunks:
        if t[0] <= start:
            continue
        if t[1] <= indent:
            break
        nested.append(t)
    return nested
