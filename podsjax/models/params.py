"""Abstract params, their logical axes and shardings, and sharded random init."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from podsjax.devices import mesh as mesh_lib


def check_key(key, name: str = "rng") -> None:
    """A PRNG key (``jax.random.key`` or a legacy uint32 ``PRNGKey``), else a one-line TypeError."""
    if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return
    try:  # raw key data of the default implementation (threefry: uint32[2], rbg: uint32[4]), NumPy's too
        jax.random.wrap_key_data(jnp.asarray(key))
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a PRNG key (jax.random.key(seed)); got {key!r}") from None


# What params and activations may be: float8 types are floats too, but no layer computes in them.
FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float64")


def check_float_dtypes(**dtypes) -> None:
    """Each named dtype one of :data:`FLOAT_DTYPES` (or None), else a one-line ValueError naming it."""
    for name, dtype in dtypes.items():
        try:
            floating = dtype is None or jnp.dtype(dtype).name in FLOAT_DTYPES
        except TypeError:
            floating = False
        if not floating:
            raise ValueError(f"{name} must be one of jnp.{', jnp.'.join(FLOAT_DTYPES)}; got {dtype!r}")


def _boxed_abstract(model) -> Any:
    # One token is enough: no param shape depends on the sequence length.
    dummy_ids = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    return jax.eval_shape(lambda ids: model.init(jax.random.key(0), ids), dummy_ids)["params"]


def abstract_params(model) -> Any:
    """Params as a tree of ``jax.ShapeDtypeStruct``; allocates nothing (works for 7B)."""
    return nn.meta.unbox(_boxed_abstract(model))


def check_params_fit(model, params: Any) -> None:
    """``params`` hold every tensor ``model``'s config needs, each of its shape (params from
    another checkpoint, or None, would fail deep inside a layer).

    Raises:
        ValueError: naming the first tensor missing, extra or of another shape.
    """
    want = {jax.tree_util.keystr(path): tuple(x.shape)
            for path, x in jax.tree_util.tree_flatten_with_path(abstract_params(model))[0]}
    got = {jax.tree_util.keystr(path): tuple(getattr(x, "shape", ()))
           for path, x in jax.tree_util.tree_flatten_with_path(params)[0]} if isinstance(params, Mapping) else {}
    if not got:
        raise ValueError(f"params must be the model's params tree (a dict of arrays); got {type(params).__name__}")
    for name in sorted(set(want) | set(got)):
        if want.get(name) != got.get(name):
            raise ValueError(f"params do not fit this model: {name} is {got.get(name, 'missing')}, the model's config "
                             f"gives {want.get(name, 'no such tensor')}; were they loaded for another config?")


def param_logical_axes(model) -> Any:
    """Tree of logical-name tuples, e.g. ``("embed", "q_heads", "head_dim")``, per param."""
    specs = nn.get_partition_spec(_boxed_abstract(model))
    return jax.tree.map(tuple, specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))


def param_shardings(model, mesh: Mesh) -> Any:
    """Tree of ``NamedSharding`` for the params on ``mesh`` under the logical rules."""
    return mesh_lib.tree_shardings(mesh, param_logical_axes(model), abstract_params(model))


def init_params(model, rng: jax.Array, mesh: Mesh | None = None) -> Any:
    """Random params (HF-style N(0, 0.02) kernels, unit norms), born sharded on ``mesh``."""
    check_key(rng)
    def init(key):
        return nn.meta.unbox(model.init(key, jnp.zeros((1, 1), jnp.int32))["params"])

    if mesh is None:
        return jax.jit(init)(rng)
    return jax.jit(init, out_shardings=param_shardings(model, mesh))(rng)
