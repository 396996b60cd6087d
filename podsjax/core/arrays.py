"""What the core's functions do to their array inputs before their maths: NumPy's 64-bit
numbers without JAX's x64 mode, and sharded axes that a reshape cannot split."""

from __future__ import annotations

import jax
import numpy as np


def host_rewards(rewards, *, per_group: bool):
    """Rewards as given, checked to be real numbers when they are NumPy's or Python's; 64-bit
    ones, when JAX runs without x64, as float32 after a float64 shift by the smallest finite
    reward (of each group on the last axis with ``per_group``, else of all): JAX would wrap
    int64 past int32 (2**32 + 1 is 1) and round float64 before any shift (1e8 + 1 is 1e8).
    JAX's arrays and tracers are returned as they are, and so is a shift float32 cannot hold."""
    if isinstance(rewards, jax.Array):
        return rewards
    try:
        host = np.asarray(rewards)
    except ValueError:
        raise TypeError("rewards must be real numbers; got a ragged nest of lists") from None
    if host.dtype.kind not in "biufc":  # complex: the caller names it
        raise TypeError(f"rewards must be real numbers; got {host.dtype} values")
    if (jax.config.jax_enable_x64 or host.dtype.kind not in "iuf" or host.dtype.itemsize < 8 or host.ndim < 1
            or not host.size):
        return rewards
    host = host.astype(np.float64)
    finite = np.isfinite(host)
    low = np.min(np.where(finite, host, np.inf), axis=-1 if per_group else None, keepdims=True)
    shifted = host - np.where(np.isfinite(low), low, 0.0)
    if np.any(np.abs(shifted[finite]) > np.finfo(np.float32).max):
        return rewards
    return shifted.astype(np.float32)


def replicated_unless_divides(x: jax.Array, groups: int) -> jax.Array:
    """``x``, replicated first on a mesh of Explicit axes whose devices do not divide ``groups``,
    where JAX cannot reshape a sharded axis into [groups, ...]."""
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    if jax.sharding.AxisType.Explicit in getattr(mesh, "axis_types", ()) and groups % mesh.size:
        x = jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    return x
