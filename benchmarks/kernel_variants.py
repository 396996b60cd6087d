"""Named variants of the decode-attention kernel's split and compiler settings, for benchmarks.

A variant sets some of ``podsjax.models.decode_kernel``'s constants (``MIN_PROGRAMS``,
``_BLOCK``, ``ONE_LAUNCH``) and ``decode_launch.COMPILER_PARAMS`` in this process; the kernel
reads them when it traces. ``benchmarks.decode_attention`` times every variant against the XLA
form; the GPU check then runs the decode benchmark and the CLI under the fastest:

    python -m benchmarks.kernel_variants NAME MODULE [ARGS...]   # apply NAME, then run MODULE as __main__
"""

from __future__ import annotations

import runpy
import sys

from jax.experimental.pallas import triton as plgpu

from podsjax.models import decode_kernel, decode_launch

DEFAULT = "the plan"


def _stages(stages: int, warps: int = 4) -> plgpu.CompilerParams:
    return plgpu.CompilerParams(num_warps=warps, num_stages=stages)


# name -> the constants it changes (decode_kernel's, and decode_launch's COMPILER_PARAMS)
VARIANTS: dict[str, dict] = {
    DEFAULT: {},
    "fill 528 programs (shorter walks, more waves)": {"MIN_PROGRAMS": 528},
    "fill 1056 programs": {"MIN_PROGRAMS": 1056},
    "walks of one block (fill 2112)": {"MIN_PROGRAMS": 2112},
    "blocks of 32 slots": {"_BLOCK": 32},
    "blocks of 128 slots": {"_BLOCK": 128},
    "3 pipeline stages": {"COMPILER_PARAMS": _stages(3)},
    "8 warps a program": {"COMPILER_PARAMS": _stages(2, warps=8)},
    "a launch a pass": {"ONE_LAUNCH": False},
    "a launch a pass, 3 stages": {"ONE_LAUNCH": False, "COMPILER_PARAMS": _stages(3)},
    "fill 1056, 3 stages": {"MIN_PROGRAMS": 1056, "COMPILER_PARAMS": _stages(3)},
    "walks of one block, 3 stages": {"MIN_PROGRAMS": 2112, "COMPILER_PARAMS": _stages(3)},
    "fill 1056, 8 warps": {"MIN_PROGRAMS": 1056, "COMPILER_PARAMS": _stages(2, warps=8)},
}


def _owner(constant: str):
    return decode_launch if constant == "COMPILER_PARAMS" else decode_kernel


def apply(name: str) -> dict:
    """Sets variant ``name``'s constants; returns the values they replaced (for :func:`restore`)."""
    if name not in VARIANTS:
        raise SystemExit(f"error: unknown kernel variant {name!r}; expected one of {sorted(VARIANTS)}")
    saved = {}
    for constant, value in VARIANTS[name].items():
        saved[constant] = getattr(_owner(constant), constant)
        setattr(_owner(constant), constant, value)
    return saved


def restore(saved: dict) -> None:
    for constant, value in saved.items():
        setattr(_owner(constant), constant, value)


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit("usage: python -m benchmarks.kernel_variants NAME MODULE [ARGS...]")
    name, module, rest = argv[0], argv[1], argv[2:]
    apply(name)
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
