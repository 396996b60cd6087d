"""Benchmarks of podsjax against PyTorch on whatever device JAX and torch have.

JAX and PyTorch share one accelerator in each benchmark process, so JAX must not
reserve most of its memory up front (its default on GPU); set before JAX starts. On a
host with no GPU or TPU, JAX starts on the CPU alone, so no installed accelerator plugin
probes for a device that is not there. On an NVIDIA GPU the programs compile with the main
job's XLA flags (``podsjax.devices.accelerators.GPU_XLA_FLAGS``), unless XLA_FLAGS sets them.
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from experiments.usage import has_accelerator  # noqa: E402 - imports no JAX
from podsjax.devices.accelerators import has_nvidia_gpu, with_gpu_flags  # noqa: E402 - imports no JAX

if not has_accelerator():
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
if has_nvidia_gpu():  # the main job's XLA flags for its GPU programs
    os.environ["XLA_FLAGS"] = with_gpu_flags(os.environ.get("XLA_FLAGS", ""))

