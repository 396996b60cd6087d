"""Devices to compile for without having them, and the figures of each accelerator.

``compile_only_devices("v5e:2x4")`` gives a TPU slice's devices (``podsjax.devices.tpu_topology``),
``compile_only_devices("h100:8")`` a GPU host's (``podsjax.devices.gpu_topology``). :data:`CHIPS`
holds what a plan needs of each accelerator, by the device kind XLA reports: memory,
memory bandwidth and peak bf16 matmul flops (dense), from the vendors' specifications.
"""

from __future__ import annotations

import dataclasses

from podsjax.devices import gpu_topology, tpu_topology


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator: bytes it holds, bytes/s it reads, bf16 flops/s it computes."""

    hbm_bytes: int
    bandwidth: float
    peak_flops: float


def _gpu(name: str, peak_flops: float) -> tuple[str, Chip]:
    info = gpu_topology.GPUS[name]
    return info["kind"], Chip(info["device_memory_size"], float(info["memory_bandwidth"]), peak_flops)


CHIPS: dict[str, Chip] = {
    "TPU v4": Chip(32 * 2**30, 1.2e12, 275e12),
    "TPU v5 lite": Chip(16 * 2**30, 819e9, 197e12),
    "TPU v5": Chip(95 * 2**30, 2.765e12, 459e12),
    "TPU v6 lite": Chip(32 * 2**30, 1.64e12, 918e12),
    **dict([_gpu("h100", 989e12), _gpu("h200", 989e12), _gpu("a100", 312e12), _gpu("l40s", 362e12)]),
}


def chip(device_kind: str) -> Chip | None:
    """The figures of an accelerator by its device kind, or None for one not listed (a CPU)."""
    return CHIPS.get(device_kind)


def compile_only_devices(name: str) -> list:
    """Devices of a TPU slice ("v5e:2x4") or of GPUs on one host ("h100", "a100:8").

    Raises:
        ValueError: one line, naming what is wrong with ``name`` or missing on this host.
    """
    if not isinstance(name, str):
        raise ValueError(f"a topology is a name such as 'v5e:2x4' or 'h100:8'; got {name!r}")
    if gpu_topology.is_gpu_name(name):
        return gpu_topology.compile_only_devices(name)
    if name[:1] == "v":
        return tpu_topology.compile_only_devices(name)
    raise ValueError(f"a topology is a TPU slice (v5e:2x4, v5p:2x2x2, ...) or GPUs ({', '.join(gpu_topology.GPUS)}, "
                     f"optionally :count, as h100:8); got {name!r}")
