"""Benchmarks of podsjax against PyTorch on whatever device JAX and torch have.

JAX and PyTorch share one accelerator in each benchmark process, so JAX must not
reserve most of its memory up front (its default on GPU); set before JAX starts. On a
host with no GPU or TPU, JAX starts on the CPU alone, so no installed accelerator plugin
probes for a device that is not there.
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from experiments.usage import has_accelerator  # noqa: E402 - imports no JAX

if not has_accelerator():
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

