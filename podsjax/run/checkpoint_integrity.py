"""Whether a checkpoint on disk is the one that was saved, and the one the caller expects.

Every state leaf gets a 32-bit checksum, computed on the devices at save time (a
position-weighted sum of the raw bits, so a flipped byte or a swapped block changes it).
Restore recomputes them and refuses a checkpoint whose arrays changed
(:class:`CheckpointCorrupt`); a whole checkpoint that holds other leaves, shapes or dtypes than
the target is :class:`CheckpointMismatch`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


class CheckpointCorrupt(ValueError):
    """A checkpoint's files are damaged: they do not load, or their arrays fail the checksums.

    ``proven`` is False where the load failed in orbax without saying why: the files, or
    this process (memory, a target sharding), may be at fault.
    """

    def __init__(self, message: str, proven: bool = True):
        super().__init__(message)
        self.proven = proven


class CheckpointMismatch(ValueError):
    """A checkpoint is whole but holds another state's leaves, shapes or dtypes."""


def first_line(exc: BaseException) -> str:
    """The first line of an error, without the kilobyte of JSON spec that tensorstore appends."""
    line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return line.split(" [tensorstore_spec=")[0]


def leaf_checksum(x: jax.Array) -> jax.Array:
    """A uint32 checksum of ``x``'s raw bits: sum over i of bits[i] * (i mod 65521 + 1), wrapping.

    Integer sums wrap the same way in any order, so the value does not depend on the
    sharding or the reduction order of the device that computes it.
    """
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    else:
        width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
        bits = jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)  # 8-byte types gain a trailing axis
    flat = bits.reshape(-1)
    weights = (jnp.arange(flat.shape[0], dtype=jnp.uint32) % jnp.uint32(65521)) + jnp.uint32(1)
    return jnp.sum(flat * weights, dtype=jnp.uint32)


_checksum = jax.jit(leaf_checksum)


def host_checksums(flat: Mapping[str, Any]) -> dict[str, int]:
    """Each leaf's checksum, by its path."""
    # One program per leaf shape and placement (leaves may live on different devices), each
    # finished before the next starts (fake CPU devices: docs/reliability.md, "Not promised").
    return {p: int(jax.device_get(_checksum(x))) for p, x in flat.items()}


def verify_checksums(flat: Mapping[str, Any], expected: Mapping[str, int] | None, where: str) -> None:
    """Raises CheckpointCorrupt when a restored leaf's checksum is not the one saved with it."""
    expected, actual = expected or {}, host_checksums(flat)
    bad = sorted(p for p in actual if expected.get(p) != actual[p])
    if bad:
        raise CheckpointCorrupt(f"{where}: {len(bad)} array(s) fail their checksum, first {bad[0]!r}")


def check_matches(saved: Mapping[str, Any] | None, targets: Mapping[str, jax.ShapeDtypeStruct], where: str) -> None:
    """Raises CheckpointMismatch when the saved leaves' names, shapes or dtypes differ from the targets'.

    Args:
        saved: the checkpoint's array metadata by leaf path (None or empty: unreadable, which
            raises CheckpointCorrupt).
        targets: the restore targets by leaf path.
        where: names the checkpoint in the messages.
    """
    if not saved:
        raise CheckpointCorrupt(f"{where} has no readable array metadata")
    missing = [p for p in targets if p not in saved]
    if missing:
        raise CheckpointMismatch(f"{where} has no leaf {missing[0]!r} that the target state expects ({len(missing)} missing)")
    extra = [p for p in saved if p not in targets]
    if extra:
        raise CheckpointMismatch(f"{where} has leaf {extra[0]!r} that the target state lacks ({len(extra)} extra)")
    for p, t in targets.items():
        s = saved[p]
        if tuple(s.shape) != tuple(t.shape):
            raise CheckpointMismatch(f"{where}: leaf {p!r} has shape {tuple(s.shape)}, target expects {tuple(t.shape)}")
        if np.dtype(s.dtype) != np.dtype(t.dtype):
            raise CheckpointMismatch(f"{where}: leaf {p!r} has dtype {np.dtype(s.dtype)}, target expects {np.dtype(t.dtype)}")
