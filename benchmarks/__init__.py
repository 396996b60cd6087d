"""Benchmarks of podsjax against PyTorch on whatever device JAX and torch have.

JAX and PyTorch share one accelerator in each benchmark process, so JAX must not
reserve most of its memory up front (its default on GPU); set before JAX starts.
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
