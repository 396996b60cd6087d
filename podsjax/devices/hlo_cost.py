"""Flops, bytes and kernels of an optimized XLA program, counted from its HLO text.

XLA's own ``cost_analysis()`` needs a device on GPU (a deviceless compile returns None),
and it counts a loop body once. This walks ``compiled.as_text()`` instead, for any
backend:

- every top-level instruction of an executed computation is one kernel (a fusion, a
  library call such as cuBLAS or cuDNN, a copy, a collective), except those that move no
  data (parameters, tuples, bitcasts, constants, control flow);
- its bytes are the bytes its operands and result occupy in device memory (HBM), except
  where only part is touched: an operand a fusion reads only through slices or gathers
  counts what they take, and a result written in place (dynamic-update-slice, scatter)
  counts the update. Arrays in another memory space (a TPU's on-chip VMEM, ``S(1)`` in
  their layout) cost nothing; an async copy or slice between the spaces counts its HBM side;
- flops are those of matmuls (dots, cuBLAS calls) and of cuDNN attention, the terms that
  can reach a chip's peak; elementwise work is left out;
- a ``while`` loop costs its body times its trip count when that is known (XLA:GPU's
  ``known_trip_count``, or a counter compared with a constant); otherwise once, and
  :func:`while_loops` gives the cost of one iteration, and :func:`sampling_costs` one step
  of a sampling loop (chunks of steps included) and the program without it;
- a ``conditional`` costs its most expensive branch.

Reading the text is ``hlo_text``'s part; this module is the cost model.

Example:
    >>> cost = program_cost(compiled.as_text())
    >>> cost.bytes, cost.flops, cost.kernels
"""

from __future__ import annotations

import dataclasses
import math
import re

from podsjax.devices.hlo_text import (ARRAY_TYPE, Instr, arrays, backend_config, called_computations, constant_value,
                                     on_chip, parse_module, type_bytes)

_ASYNC_COPIES = {"copy-start": 0, "slice-start": -2}  # where the destination sits in the result tuple
# Instructions that launch nothing and move no data.
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id",
         "replica-id", "opt-barrier", "add-dependency", "domain", "get-dimension-size"}
_CONTROL = {"while", "conditional", "call"}
_SLICES = {"slice", "dynamic-slice"}
_PARTIAL_READS = _SLICES | {"gather"}  # read only what their result holds of operand 0
_UPDATES = {"dynamic-update-slice": 1, "scatter": 2}  # in-place writes: the operand holding the update


@dataclasses.dataclass
class Cost:
    """What a program (or one loop iteration) does: matmul flops, bytes moved, kernels launched."""

    flops: float = 0.0
    bytes: float = 0.0
    kernels: float = 0.0
    # Seconds at a device's bandwidth and peak, kernel by kernel (the slower of the two each).
    roofline_s: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        return Cost(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def __mul__(self, k: float) -> Cost:
        return Cost(*(a * k for a in dataclasses.astuple(self)))


def _async_copy_bytes(instr: Instr, operand_type: str) -> float:
    """An async copy or slice between memory spaces: its destination's bytes, once for the
    read where the source is in HBM and once for the write where the destination is."""
    found = list(ARRAY_TYPE.finditer(instr.type))
    if len(found) < 2:
        return 0.0
    destination = found[_ASYNC_COPIES[instr.opcode]]
    size = type_bytes(destination.group(0), in_hbm_only=False)
    source = ARRAY_TYPE.search(operand_type)
    from_hbm = source is not None and not on_chip(source.group(3))
    return size * (int(from_hbm) + int(not on_chip(destination.group(3))))


_TRITON = '"__gpu$xla.gpu.triton"'


def _updated_in_place(instr: Instr) -> float:
    """Bytes of a Triton (Pallas) kernel's outputs that alias its operands: buffers it updates
    in place, read with its operands, of which it writes what it stores (the decode kernel
    one cache slot a row), not the whole buffer. Other kernels' aliased outputs (a cuBLAS
    epilogue's) are written whole."""
    if instr.opcode != "custom-call" or _TRITON not in instr.attrs:
        return 0.0
    aliased = re.search(r"output_to_operand_aliasing=\{(.*?)\}(?:,|$)", instr.attrs)
    if aliased is None:
        return 0.0
    outputs = [m.group(0) for m in ARRAY_TYPE.finditer(instr.type)]
    return sum(type_bytes(outputs[i]) for i in map(int, re.findall(r"\{(\d+)\}:", aliased.group(1)))
               if i < len(outputs))


def _declared_cost(instr: Instr) -> tuple[float, float] | None:
    """(flops, bytes) a TPU kernel declares (Pallas's ``cost_estimate``), else None. A kernel
    whose blocks read part of an operand (one layer of a stacked cache) moves that part, not
    the operand: its declaration, computed from its blocks, is the count to take."""
    if instr.opcode != "custom-call" or "tpu_custom_call" not in instr.attrs:
        return None
    estimate = backend_config(instr.attrs).get("custom_call_config", {}).get("cost_estimate")
    if not estimate or "bytes_accessed" not in estimate:
        return None
    return float(estimate.get("flops", 0)), float(estimate["bytes_accessed"])


def _dot_flops(out_type: str, lhs_type: str, contracting: list[int]) -> float:
    out = arrays(out_type)
    lhs = arrays(lhs_type)
    if not out or not lhs:
        return 0.0
    k = math.prod(lhs[0][1][d] for d in contracting if d < len(lhs[0][1]))
    return 2.0 * math.prod(out[0][1]) * k


def _matmul_flops(instr: Instr, types: dict[str, str]) -> float:
    """2 x output elements x contracted elements of a dot, or of a convolution.

    The TPU compiler writes matmuls as convolutions, some with their batch dims as padded
    or dilated windows: a window position over padding or a dilation hole multiplies
    nothing, so each spatial dim contracts over at most the input's size, and at most
    one in ``lhs_dilate`` of its window.
    """
    if instr.opcode == "dot":
        dims = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", instr.attrs)
        contracting = [int(x) for x in dims.group(1).split(",") if x] if dims else []
        return _dot_flops(instr.type, types.get(instr.operands[0], ""), contracting)
    labels = re.search(r"dim_labels=([^_]*)_([^-]*)->", instr.attrs)
    out = arrays(instr.type)
    lhs, kernel = (arrays(types.get(o, "")) for o in (instr.operands + ["", ""])[:2])
    if not labels or not out or not lhs or not kernel:
        return 0.0
    lhs_labels, kernel_labels = labels.groups()
    lhs_dims, kernel_dims = lhs[0][1], kernel[0][1]
    if len(lhs_labels) != len(lhs_dims) or len(kernel_labels) != len(kernel_dims) or "i" not in kernel_labels:
        return 0.0
    window = re.search(r"window=\{([^}]*)\}", instr.attrs)
    fields = dict(f.split("=", 1) for f in window.group(1).split()) if window else {}
    sizes = [int(x) for x in fields.get("size", "").split("x") if x]
    dilations = [int(x) for x in fields.get("lhs_dilate", "").split("x") if x] or [1] * len(sizes)
    per_output = kernel_dims[kernel_labels.index("i")]
    for d, size in enumerate(sizes):
        spatial = str(d)
        if spatial in lhs_labels:
            per_output *= min(size, lhs_dims[lhs_labels.index(spatial)], -(-size // dilations[d]))
    # A grouped convolution's kernel "i" is already one group's inputs: no group count enters.
    return 2.0 * math.prod(out[0][1]) * per_output


class _Module:
    def __init__(self, text: str, bandwidth: float | None, peak_flops: float | None):
        self.computations, self.entry = parse_module(text)
        self.types = {c: {i.name: i.type for i in instrs} for c, instrs in self.computations.items()}
        self.bandwidth, self.peak = bandwidth, peak_flops
        self._memo: dict[str, Cost] = {}

    # -- flops of what runs inside one kernel --------------------------------------------

    def _inner_flops(self, computation: str) -> float:
        flops = 0.0
        types = self.types.get(computation, {})
        for instr in self.computations.get(computation, []):
            if instr.opcode in ("dot", "convolution"):
                flops += _matmul_flops(instr, types)
            elif instr.opcode == "fusion":
                flops += sum(self._inner_flops(c) for c in called_computations(instr.attrs, "calls"))
        return flops

    def _custom_call_flops(self, instr: Instr, types: dict[str, str]) -> float:
        target = re.search(r'custom_call_target="([^"]+)"', instr.attrs)
        target = target.group(1) if target else ""
        operand_types = [types.get(o, "") for o in instr.operands]
        if "gemm" in target or "matmul" in target:
            numbers = backend_config(instr.attrs)
            numbers = numbers.get("gemm_backend_config", numbers).get("dot_dimension_numbers", {})
            contracting = [int(x) for x in numbers.get("lhs_contracting_dimensions", [])]
            return _dot_flops(instr.type, operand_types[0], contracting)
        if "fmha" in target or "flash" in target:
            q, k = (arrays(t) for t in operand_types[:2])
            if not q or not k:
                return 0.0
            b, lq, h, e = q[0][1] if len(q[0][1]) == 4 else (1, *q[0][1][-3:])
            lk = k[0][1][1] if len(k[0][1]) == 4 else k[0][1][-3]
            forward = 4.0 * b * lq * lk * h * e  # Q K^T and P V
            return forward * (2.5 if "Backward" in target or "backward" in target else 1.0)
        return 0.0

    # -- bytes of one kernel ----------------------------------------------------------------

    def _fusion_bytes(self, instr: Instr, types: dict[str, str]) -> float:
        called = called_computations(instr.attrs, "calls")
        inner = self.computations.get(called[0], []) if called else []
        root = next((i for i in inner if i.root), None)
        in_place = self._in_place_updates(root, inner)  # parameter name -> update bytes written
        params = self._params(called[0]) if called else {}
        total = 0.0
        for index, operand in enumerate(instr.operands):
            size = type_bytes(types.get(operand, ""))
            name = params.get(index)
            if name is None:
                total += size
            elif name not in in_place:  # a buffer updated where it lies moves only the update
                total += self._read_bytes(called[0], name, size)
        out = type_bytes(instr.type)
        if in_place:
            out = out - sum(type_bytes(self.types[called[0]][n]) for n in in_place) + sum(in_place.values())
        return total + max(out, 0.0)

    def _params(self, computation: str) -> dict[int, str]:
        return {int(i.args): i.name for i in self.computations.get(computation, [])
                if i.opcode == "parameter" and i.args.strip().isdigit()}

    def _read_bytes(self, computation: str, name: str, size: float) -> float:
        """Bytes a fused computation reads of its value ``name``: the slices or gathers it
        takes (through bitcasts and nested fusions), or all of it."""
        readers = [i for i in self.computations.get(computation, []) if name in i.operands]
        if not readers:
            return size
        total = 0.0
        for reader in readers:
            if reader.opcode in _PARTIAL_READS and reader.operands[0] == name:
                total += type_bytes(reader.type, in_hbm_only=False)  # read from HBM, wherever it goes
            elif reader.opcode == "bitcast":
                total += self._read_bytes(computation, reader.name, size)
            elif reader.opcode == "fusion":
                nested = called_computations(reader.attrs, "calls")[0]
                params = self._params(nested)
                total += sum(self._read_bytes(nested, params[k], size) for k, o in enumerate(reader.operands)
                             if o == name and k in params)
            else:
                return size
        return min(total, size)

    def _in_place_updates(self, root: Instr | None, inner: list[Instr]) -> dict[str, float]:
        """Parameters a fusion's result updates in place (dynamic-update-slice roots), with the
        bytes of each update."""
        if root is None:
            return {}
        by_name = {i.name: i for i in inner}
        roots = [by_name.get(o) for o in root.operands] if root.opcode == "tuple" else [root]
        out = {}
        for r in roots:
            while r is not None and r.opcode == "bitcast":
                r = by_name.get(r.operands[0])
            if r is not None and r.opcode in _UPDATES:
                buffer = by_name.get(r.operands[0])
                while buffer is not None and buffer.opcode == "bitcast":
                    buffer = by_name.get(buffer.operands[0])
                if buffer is not None and buffer.opcode == "parameter":
                    update = by_name.get(r.operands[_UPDATES[r.opcode]])
                    out[buffer.name] = out.get(buffer.name, 0.0) + type_bytes(update.type if update else "")
        return out

    def _kernel(self, instr: Instr, types: dict[str, str]) -> Cost:
        if instr.opcode == "fusion":
            moved = self._fusion_bytes(instr, types)
            flops = sum(self._inner_flops(c) for c in called_computations(instr.attrs, "calls"))
        elif instr.opcode in _UPDATES:
            update = type_bytes(types.get(instr.operands[_UPDATES[instr.opcode]], ""))
            moved, flops = 2 * update, 0.0
        elif instr.opcode in _SLICES:
            moved, flops = 2 * type_bytes(instr.type), 0.0
        elif instr.opcode in _ASYNC_COPIES:
            moved, flops = _async_copy_bytes(instr, types.get(instr.operands[0], "") if instr.operands else ""), 0.0
        elif (declared := _declared_cost(instr)) is not None:
            flops, moved = declared
        else:
            scratch = instr.opcode == "custom-call"
            moved = (sum(type_bytes(types.get(o, "")) for o in instr.operands) + type_bytes(instr.type, scratch)
                     - _updated_in_place(instr))
            flops = self._custom_call_flops(instr, types) if instr.opcode == "custom-call" else 0.0
            if instr.opcode in ("dot", "convolution"):
                flops = _matmul_flops(instr, types)
        seconds = 0.0
        if self.bandwidth:
            seconds = max(moved / self.bandwidth, flops / self.peak if self.peak else 0.0)
        return Cost(flops=flops, bytes=moved, kernels=1.0, roofline_s=seconds)

    def trip_count(self, instr: Instr, computation: str) -> int | None:
        """A while loop's trip count: XLA's record (GPU), else a counter that starts at a
        constant and runs while below another (a scan, as the TPU compiler leaves it); None
        when it depends on data."""
        n = backend_config(instr.attrs).get("known_trip_count", {}).get("n")
        if n is not None:
            return int(n)
        cond = self.computations.get(next(iter(called_computations(instr.attrs, "condition")), ""), [])
        by_name = {i.name: i for i in cond}
        root = next((i for i in cond if i.root), None)
        if root is None or root.opcode != "compare" or "direction=LT" not in root.attrs:
            return None
        counter, bound = (by_name.get(o) for o in root.operands)
        limit = constant_value(bound)
        if limit is None or counter is None or counter.opcode != "get-tuple-element":
            return None
        index = int(re.search(r"index=(\d+)", counter.attrs).group(1))
        scope = {i.name: i for i in self.computations.get(computation, [])}
        init = scope.get(instr.operands[0]) if instr.operands else None
        start = constant_value(scope.get(init.operands[index])) if init is not None and init.opcode == "tuple" else None
        return max(limit - (start or 0), 0)

    def iteration(self, instr: Instr) -> Cost:
        """One iteration of a while loop: its body and its condition."""
        parts = called_computations(instr.attrs, "body") + called_computations(instr.attrs, "condition")
        return sum((self.cost(c) for c in parts), Cost())

    def cost(self, computation: str) -> Cost:
        if computation in self._memo:
            return self._memo[computation]
        total = Cost()
        types = self.types.get(computation, {})
        for instr in self.computations.get(computation, []):
            if instr.opcode in _FREE or instr.opcode.endswith("-done"):
                continue
            if instr.opcode == "while":
                total = total + self.iteration(instr) * (self.trip_count(instr, computation) or 1)
            elif instr.opcode == "conditional":
                branches = called_computations(instr.attrs, "branch_computations") or (
                    called_computations(instr.attrs, "true_computation")
                    + called_computations(instr.attrs, "false_computation"))
                costs = [self.cost(b) for b in branches]
                total = total + max(costs, key=lambda c: (c.roofline_s, c.bytes), default=Cost())
            elif instr.opcode == "call":
                total = total + sum((self.cost(c) for c in called_computations(instr.attrs, "to_apply")), Cost())
            else:
                total = total + self._kernel(instr, types)
        self._memo[computation] = total
        return total


def program_cost(hlo_text: str, bandwidth: float | None = None, peak_flops: float | None = None) -> Cost:
    """The :class:`Cost` of a whole optimized program (``compiled.as_text()``).

    Args:
        bandwidth: the device's memory bandwidth in bytes/s, for ``roofline_s``.
        peak_flops: its peak matmul flops/s (bf16), for ``roofline_s``.
    """
    module = _Module(hlo_text, bandwidth, peak_flops)
    return module.cost(module.entry)


def while_loops(hlo_text: str, bandwidth: float | None = None, peak_flops: float | None = None
                ) -> list[tuple[int | None, Cost]]:
    """``(trip count or None, cost of one iteration)`` of each while loop the entry runs directly."""
    module = _Module(hlo_text, bandwidth, peak_flops)
    return [(module.trip_count(instr, module.entry), module.iteration(instr))
            for instr in module.computations.get(module.entry, []) if instr.opcode == "while"]


def sampling_costs(hlo_text: str, bandwidth: float | None = None, peak_flops: float | None = None
                   ) -> tuple[Cost, Cost]:
    """``(the rest, one step)`` of a sampling program: the program without the loops the entry
    runs whose length depends on data (a prefill), and one step of the costliest such loop.
    A step is the loop's iteration divided by the trip count of a fixed-count loop its body
    runs, where the body runs its steps in chunks that way (one check of the condition a chunk)."""
    module = _Module(hlo_text, bandwidth, peak_flops)
    rest, steps = module.cost(module.entry), []
    for instr in module.computations.get(module.entry, []):
        if instr.opcode != "while" or module.trip_count(instr, module.entry) is not None:
            continue
        once = module.iteration(instr)
        body = called_computations(instr.attrs, "body")
        chunks = [module.trip_count(inner, c) for c in body for inner in module.computations.get(c, [])
                  if inner.opcode == "while"]
        rest = rest + once * -1
        steps.append(once * (1 / chunks[0]) if len(chunks) == 1 and chunks[0] else once)
    return rest, max(steps, key=lambda c: c.bytes, default=Cost())


def data_loop_step(hlo_text: str, bandwidth: float | None = None, peak_flops: float | None = None) -> Cost:
    """One step of a sampling program's loop (:func:`sampling_costs`), chunks of steps included."""
    return sampling_costs(hlo_text, bandwidth, peak_flops)[1]


def custom_call_targets(hlo_text: str) -> list[str]:
    """The library calls a program makes (``__cublas$gemm``, ``__cudnn$fmhaSoftmax``, ...)."""
    return re.findall(r'custom_call_target="([^"]+)"', hlo_text)
