"""What the core's functions do to their array inputs before their maths: NumPy's 64-bit
numbers without JAX's x64 mode, and sharded axes that a reshape cannot split."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def host_rewards(rewards, *, per_group: bool):
    """Rewards as given, checked to be numbers when they are NumPy's or Python's; 64-bit ones,
    when JAX runs without x64, as float32 after a shift by the smallest finite reward (of each
    group on the last axis with ``per_group``, else of all), exact for integers and in float64
    for floats: JAX would wrap int64 past int32 (2**32 + 1 is 1) and round float64 before any
    shift (1e8 + 1 is 1e8). JAX's arrays, tracers (a list of them too) and a shift float32
    cannot hold are returned as they are."""
    host = as_host_array(rewards)
    if host is None or jax.config.jax_enable_x64 or host.dtype.kind not in "iuf" or host.dtype.itemsize < 8:
        return rewards
    if host.ndim < 1 or not host.size:
        return rewards
    axis = -1 if per_group else None
    if host.dtype.kind in "iu":
        low = host.min(axis=axis, keepdims=True)
        spread = host.astype(np.float64).max(axis=axis, keepdims=True) - low.astype(np.float64)
        # Subtracted as integers where the difference cannot overflow them: exact past 2**53.
        shifted = (host - low) if host.dtype.kind == "u" or np.all(spread < 2.0**62) else (
            host.astype(np.float64) - low.astype(np.float64))
        return shifted.astype(np.float32)
    finite = np.isfinite(host)
    low = np.min(np.where(finite, host, np.inf), axis=axis, keepdims=True)
    shifted = host - np.where(np.isfinite(low), low, 0.0)
    if np.any(np.abs(shifted[finite]) > np.finfo(np.float32).max):
        return rewards
    return shifted.astype(np.float32)


def as_host_array(rewards) -> np.ndarray | None:
    """NumPy's or Python's rewards as a NumPy array, checked to be numbers (complex is the
    caller's to name); None for JAX's arrays and tracers, in a list or not."""
    if isinstance(rewards, jax.Array):
        return None
    try:
        host = np.asarray(rewards)
    except jax.errors.TracerArrayConversionError:
        return None
    except ValueError:
        raise TypeError("rewards must be real numbers; got a ragged nest of lists") from None
    if host.dtype != bool and not jnp.issubdtype(host.dtype, jnp.number):  # ml_dtypes' bfloat16 is a number
        raise TypeError(f"rewards must be real numbers; got {host.dtype} values")
    return host


def replicated_unless_divides(x: jax.Array, groups: int) -> jax.Array:
    """``x``, replicated first on a mesh of Explicit axes whose devices do not divide ``groups``,
    where JAX cannot reshape a sharded axis into [groups, ...]."""
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    if jax.sharding.AxisType.Explicit in getattr(mesh, "axis_types", ()) and groups % mesh.size:
        x = jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    return x


def finite_on_host(x: jax.Array, name: str) -> np.ndarray | None:
    """``x`` as float64 on the host, with a one-line error naming its first non-finite value;
    None where it is traced or not all here (a traced value cannot raise)."""
    if isinstance(x, jax.core.Tracer) or not x.is_fully_addressable:
        return None
    host = np.asarray(x, np.float64)
    bad = np.argwhere(~np.isfinite(host))
    if bad.size:
        raise ValueError(f"{name} must be finite; got {float(host[tuple(bad[0])])} at {bad[0].tolist()}")
    return host
