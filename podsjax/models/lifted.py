"""Flax's lifted layer stacks, each built once per process and under one lock.

Flax builds a lifted class (``nn.scan``, ``nn.remat``) by taking fields out of its base
classes' dataclass fields and putting them back, so two threads lifting at once can see
a base class half edited (a ``KeyError`` or "dictionary changed size during iteration").
A run's start traces the decoder on several threads at once (its compiles run side by
side), so every trace takes its stack from here, and the decoder's stacks are lifted as
their modules are imported: a lift while another thread builds a lifted module (which
reads those fields) is a race too.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import flax.linen as nn

_LIFTING = threading.Lock()


def layer_scan(block_class: type[nn.Module], in_axes: tuple, remat: bool,
               policy: Callable | None = None) -> type[nn.Module]:
    """``block_class`` scanned over a leading "layers" axis of its params (and LoRA), and
    rematerialised with ``policy`` when ``remat``; the same class for the same arguments."""
    with _LIFTING:
        return _layer_scan(block_class, in_axes, remat, policy)


@functools.cache
def _layer_scan(block_class, in_axes, remat, policy):
    block = nn.remat(block_class, policy=policy, prevent_cse=False) if remat else block_class
    return nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=in_axes,
                   metadata_params={nn.PARTITION_NAME: "layers"})
