"""What a GPU program launches, read from what XLA dumps: kernels, the CUDA graphs holding
them, and how many of a kernel's programs the GPU runs at once.

XLA's GPU runtime runs a program as a sequence of thunks (kernels, library calls, loops).
Runs of thunks that a CUDA graph can hold become one graph (a command buffer), launched at
once; the rest launch one by one, each paying its own launch. Which it is for a decode
step's ~300 kernels does not show in the optimized HLO. It shows in the thunk sequence,
which XLA writes where :func:`dump_options` asks it to, also for a GPU it compiles for
without one (:mod:`podsjax.devices.gpu_topology`), beside each kernel's PTX. A kernel's
registers (ptxas, on that PTX) and shared memory say how many of its programs an SM holds,
and so in how many waves its grid runs (:func:`occupancy`).

Example:
    >>> gen = sampling.Generator(model, compiler_options=gpu_thunks.dump_options(tmp))
    >>> gen.compile(...)
    >>> gpu_thunks.innermost_loop(gpu_thunks.read(tmp, "sample"))   # the decode step
    Launches(graphs=1, alone=0, kernels_in_graphs=270)
    >>> gpu_thunks.occupancy(tmp, "sample", "grouped_decode_attention", "h100").waves
    0.89
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import pathlib
import re
import shutil
import subprocess

from podsjax.devices import gpu_topology

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


@dataclasses.dataclass(frozen=True)
class Occupancy:
    """One kernel's launch: its ``programs`` (thread blocks) of ``threads`` threads, the
    ``registers`` a thread and ``shared_memory`` bytes a program take, and how many programs
    an SM of the GPU holds at once (``per_sm``, the tightest of its limits) of ``sms``."""

    kernel: str
    programs: int
    threads: int
    registers: int
    shared_memory: int
    per_sm: int
    sms: int

    @property
    def waves(self) -> float:
        """Programs over what the GPU holds at once: up to 1.0 all run together."""
        return self.programs / (self.per_sm * self.sms)


_LAUNCH = r" grid: \[(\d+), (\d+), (\d+)\] threads: \[(\d+), (\d+), (\d+)\]\s+shared_memory: (\d+)"
_REGISTER_GRANULE = 256  # registers are given to a warp in units of 256
_RESERVED_SHARED = 1024  # shared memory the runtime keeps per program


def occupancy(directory, program: str, kernel: str, gpu: str) -> Occupancy:
    """``kernel``'s launch in jitted function ``program``, dumped in ``directory``
    (:func:`dump_options`), on ``gpu`` (a :data:`podsjax.devices.gpu_topology.GPUS` name).

    Raises:
        ValueError: one line, when the kernel is not in the dump, or ptxas is missing or refuses its PTX.
    """
    info = gpu_topology.GPUS[gpu]
    launch = re.search(re.escape(kernel) + _LAUNCH, read(directory, program))
    if launch is None:
        raise ValueError(f"no launch of kernel {kernel!r} in jit_{program}'s thunk sequence in {directory}")
    numbers = [int(x) for x in launch.groups()]
    programs, threads, shared = math.prod(numbers[:3]), math.prod(numbers[3:6]), numbers[6]
    entry = re.compile(r"\.entry " + re.escape(kernel) + r"\(")
    ptx = next((p for p in sorted(pathlib.Path(directory).glob(f"module_*.jit_{program}.*.ptx"))
                if entry.search(p.read_text())), None)
    if ptx is None:
        raise ValueError(f"no PTX of kernel {kernel!r} in {directory}")
    arch = f"sm_{info['major']}{info['minor']}" + ("a" if info["major"] == 9 else "")
    run = subprocess.run([_ptxas(), f"-arch={arch}", "-v", str(ptx), "-o", os.devnull], capture_output=True, text=True)
    report = run.stderr
    if run.returncode != 0:
        raise ValueError(f"ptxas refused {ptx.name}: {(report.strip().splitlines() or ['no message'])[-1]}")
    ours = report[report.index(f"Compiling entry function '{kernel}'"):].split("Compiling entry function", 2)[1]
    registers = int(re.search(r"Used (\d+) registers", ours).group(1))
    static = re.search(r"(\d+) bytes smem", ours)
    shared += int(static.group(1)) if static else 0
    warps = math.ceil(threads / 32)
    per_warp = math.ceil(registers * 32 / _REGISTER_GRANULE) * _REGISTER_GRANULE
    per_sm = min(gpu_topology.REGISTERS_PER_SM // (per_warp * warps), info["threads_per_core_limit"] // (warps * 32),
                 info["shared_memory_per_core"] // (shared + _RESERVED_SHARED), info["blocks_per_core_limit"])
    return Occupancy(kernel=kernel, programs=programs, threads=threads, registers=registers, shared_memory=shared,
                     per_sm=per_sm, sms=info["core_count"])


def _ptxas() -> str:
    """NVIDIA's PTX assembler: the one XLA compiles with (jax's CUDA plugin), else on PATH."""
    spec = importlib.util.find_spec("nvidia.cuda_nvcc")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        found = pathlib.Path(folder, "bin", "ptxas")
        if found.exists():
            return str(found)
    found = shutil.which("ptxas")
    if found is None:
        raise ValueError("reading a kernel's registers needs NVIDIA's ptxas: pip install 'podsjax[cuda]'")
    return found
