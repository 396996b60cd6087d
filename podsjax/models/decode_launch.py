"""How the decode attention's two passes launch: one launch on a flat grid, or a launch each.

A pass (:class:`Pass`) is a kernel body with its grid, BlockSpecs and outputs, as
:mod:`~podsjax.models.decode_kernel` builds them; this module only launches them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

COMPILER_PARAMS = plgpu.CompilerParams(num_warps=4, num_stages=2)


@dataclasses.dataclass(frozen=True)
class Pass:
    """One pass as Pallas launches it: its kernel, grid, specs and outputs. The kernel takes
    its refs and then ``part_ids(its program's grid ids)``."""

    kernel: Callable
    part_ids: Callable[[tuple], tuple]
    grid: tuple[int, ...]
    in_specs: list
    out_specs: list
    out_shape: list
    name: str
    aliases: dict = dataclasses.field(default_factory=dict)  # input -> output, the pass's own indices


def grid_ids(flat, grid: tuple[int, ...]) -> tuple:
    """A flat program id's position in ``grid`` (row-major)."""
    ids = []
    for size in reversed(grid):
        ids.append(flat % size)
        flat = flat // size
    return tuple(reversed(ids))


def _on_flat_grid(spec, grid: tuple[int, ...], first: int):
    """``spec`` for programs ``first .. first + prod(grid) - 1`` of a flat grid; the other
    programs get a block in range (clamped), which they do not touch."""
    count = math.prod(grid)
    return pl.BlockSpec(spec.block_shape,
                        lambda pid: spec.index_map(*grid_ids(jnp.clip(pid - first, 0, count - 1), grid)))


def launch_apart(passes: tuple[Pass, Pass], inputs: tuple[list, list], interpret: bool) -> list:
    """Each pass its own launch, the first pass's programs before the second's."""
    outs = []
    for one, args in zip(passes, inputs):
        def kernel(*refs, one=one):
            one.kernel(*refs, *one.part_ids(tuple(pl.program_id(axis) for axis in range(len(one.grid)))))

        outs += pl.pallas_call(kernel, grid=one.grid, in_specs=one.in_specs, out_specs=one.out_specs,
                               out_shape=one.out_shape, input_output_aliases=one.aliases,
                               compiler_params=COMPILER_PARAMS, interpret=interpret, name=one.name)(*args)
    return outs


def launch_together(passes: tuple[Pass, Pass], inputs: tuple[list, list], interpret: bool, name: str) -> list:
    """Both passes in one launch on a flat grid: the first pass's programs first, then the
    second's. Each pass's programs are a few us of latency-bound work; apart, each launch
    paid its own start and tail (on an H200, 14.6 and 12.5 us a layer)."""
    first, second = passes
    first_of_second = math.prod(first.grid)

    def kernel(*refs):
        pid = pl.program_id(0)
        n_in, m_in, n_out = len(first.in_specs), len(second.in_specs), len(first.out_specs)
        first_refs = refs[:n_in] + refs[n_in + m_in:n_in + m_in + n_out]
        second_refs = refs[n_in:n_in + m_in] + refs[n_in + m_in + n_out:]

        @pl.when(pid < first_of_second)
        def _():
            first.kernel(*first_refs, *first.part_ids(grid_ids(pid, first.grid)))

        @pl.when(pid >= first_of_second)
        def _():
            second.kernel(*second_refs, *second.part_ids(grid_ids(pid - first_of_second, second.grid)))

    def flat(one: Pass, start: int, specs: list) -> list:
        return [_on_flat_grid(spec, one.grid, start) for spec in specs]

    return pl.pallas_call(
        kernel,
        grid=(first_of_second + math.prod(second.grid),),
        in_specs=flat(first, 0, first.in_specs) + flat(second, first_of_second, second.in_specs),
        out_specs=flat(first, 0, first.out_specs) + flat(second, first_of_second, second.out_specs),
        out_shape=first.out_shape + second.out_shape,
        input_output_aliases={len(first.in_specs) + i: len(first.out_specs) + o for i, o in second.aliases.items()},
        compiler_params=COMPILER_PARAMS,
        interpret=interpret,
        name=name,
    )(*inputs[0], *inputs[1])
