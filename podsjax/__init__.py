"""podsjax: PODS (Policy Optimization with Down-Sampling) for RLVR in JAX/Flax.

Axis glossary used in names throughout the package (``rewards_PN``, ``logits_BLV``):

    B  batch (sequences)          P  prompts (groups)
    N  rollouts per prompt        M  selected rollouts per prompt
    L  sequence length            V  vocabulary
    D  model width                H  attention heads
    K  key/value heads

A trailing ``...`` in a docstring shape means any number of leading batch axes.

Submodules load lazily, so host-side users (reward worker processes, data
tools) do not pay for importing JAX.
"""

import importlib

from podsjax import moved as _moved
from podsjax.devices import accelerators as _accelerators

__version__ = "0.1.0"

# No accelerator-probe noise on a CPU-only host (see podsjax.devices.accelerators).
_accelerators.cpu_alone_without_accelerator()

_SUBMODULES = ("core", "data", "devices", "models", "rewards", "rl", "run", "sampler", "tiny", "update")
_SELECTION_NAMES = ("select", "select_flat", "flat_rows", "register_rule", "indices_to_mask")
__all__ = [*_SUBMODULES, *_SELECTION_NAMES]
_moved.install()


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"podsjax.{name}")
    if _moved.new_path(f"podsjax.{name}") is not None:  # an old path: podsjax.selection, podsjax.loop
        return importlib.import_module(f"podsjax.{name}")  # through the alias, which warns
    if name in _SELECTION_NAMES:
        return getattr(importlib.import_module("podsjax.core.selection"), name)
    raise AttributeError(f"module 'podsjax' has no attribute {name!r}")
