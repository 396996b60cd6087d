"""Whether this host has an accelerator; on one with none, JAX starts on the CPU alone. Imports no JAX.

JAX probes every installed plugin when it starts its backends. On a host without the
device, the CUDA plugin (``jax[cuda12]``) prints a traceback ending in ``cuInit(0) failed``
and libtpu prints pages of warnings about TPU_ACCELERATOR_TYPE and worker hostnames, before
the program's own output. Both are installed for compiling to GPUs and TPUs from any host
(``--dry-run --topology``), which works with JAX on the CPU alone. So ``import podsjax``
on a Linux host with no GPU or TPU device node, and no ``JAX_PLATFORMS`` set, sets it to
``cpu``; set ``JAX_PLATFORMS`` yourself (or ``jax.config.update("jax_platforms", ...)``
before importing podsjax) to choose otherwise. Child processes inherit the variable: a
launcher on a CPU login node that imports podsjax and starts jobs on GPU nodes with its
environment should set ``JAX_PLATFORMS`` for them.
"""

from __future__ import annotations

import os
import sys

# Device nodes of an accelerator JAX could use: NVIDIA GPUs (nvidia0 before nvidiactl is made;
# dxg: under WSL), AMD GPUs (kfd), TPU chips (accel0: v4/v5p; accel/: newer; vfio: v5e/v6e),
# AWS Neuron chips.
ACCELERATOR_NODES = ("nvidiactl", "nvidia0", "dxg", "kfd", "accel0", "accel", "vfio", "neuron0")
# A loaded NVIDIA driver, whose device nodes a headless host may make only at the first CUDA call.
DRIVER_FILES = ("/proc/driver/nvidia",)
NVIDIA_NODES = ("nvidiactl", "nvidia0", "dxg")
# XLA flags the main job and the benchmarks compile for NVIDIA GPUs with, each unless XLA_FLAGS
# sets it. GEMMs as cuBLAS calls, not Triton fusions: XLA's H100 plan of setting a's decode
# step launches 272 kernels and moves 4.20 GiB with cuBLAS, 328 and 4.91 GiB with Triton's
# (split-K partials in fp32, a reduction kernel each, residual adds left out of the GEMM);
# an H200's trace counted 330. Autotuning Triton's GEMMs was most of the GPU's compile time
# (the update: 74 s there, 4-6 s compiled for an H100 here). docs/accelerators.md, "GEMMs".
GPU_XLA_FLAGS = ("--xla_gpu_enable_triton_gemm=false",)


def _has_node_or_driver(nodes: tuple[str, ...], dev: str, drivers: tuple[str, ...]) -> bool:
    return (any(os.path.exists(os.path.join(dev, node)) for node in nodes)
            or any(os.path.exists(path) for path in drivers))


def has_accelerator(dev: str = "/dev", drivers: tuple[str, ...] = DRIVER_FILES) -> bool:
    """Whether this host has a GPU or TPU device node or driver (so JAX's plugins may find one)."""
    return _has_node_or_driver(ACCELERATOR_NODES, dev, drivers)


def has_nvidia_gpu(dev: str = "/dev", drivers: tuple[str, ...] = DRIVER_FILES) -> bool:
    """Whether this host has an NVIDIA GPU's device node or driver."""
    return _has_node_or_driver(NVIDIA_NODES, dev, drivers)


def with_gpu_flags(flags: str, deviceless: bool = False) -> str:
    """An XLA_FLAGS value with :data:`GPU_XLA_FLAGS` added, each unless ``flags`` sets it already
    (either way: the user's choice stands). ``deviceless``: compiling for a GPU this host does
    not have, where nothing can be autotuned: added last whatever ``flags`` say (the last wins)."""
    given = {token.split("=")[0] for token in flags.split()}
    for flag in GPU_XLA_FLAGS:
        if deviceless or flag.split("=")[0] not in given:
            flags = f"{flags} {flag}".strip()
    return flags


def cpu_alone_without_accelerator() -> bool:
    """Sets ``JAX_PLATFORMS=cpu`` on a Linux host with no accelerator, unless it is set already.

    Takes effect when JAX has not started its backends yet (also after ``import jax``).
    Returns whether it did.
    """
    if "JAX_PLATFORMS" in os.environ or not sys.platform.startswith("linux") or has_accelerator():
        return False
    jax = sys.modules.get("jax")
    if jax is not None and (jax.config.jax_platforms or _backends_started()):
        return False  # the user chose platforms in the config, or JAX runs already
    os.environ["JAX_PLATFORMS"] = "cpu"  # read by JAX when imported, and by child processes
    if jax is not None:  # imported already: its config has read the variable
        jax.config.update("jax_platforms", "cpu")
    return True


def _backends_started() -> bool:
    try:
        from jax._src import xla_bridge

        return xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):  # a JAX without it: assume it has started
        return True
