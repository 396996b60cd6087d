"""Decode attention over the stacked KV cache as one TPU kernel (Pallas, lowered through Mosaic).

Inside the decoder's layer scan, XLA's TPU compiler reads a layer of the stacked cache
``[Y, B, S, C]`` (C = K * E) by copying that layer's slice out of the loop carry first. At 64 rows
of Qwen2.5-1.5B the slice fits VMEM and the copy costs nothing in HBM; at 256 rows (134 MB
a layer) it goes through HBM, and a decode step moved 2.65x its floor. This kernel takes
the whole stacked cache and the layer index (scalar-prefetched), and its block index maps
fetch only that layer's rows, so each layer's keys and values are read from HBM once, in
place. Keys and values of a slot are one row of ``K*E`` values, so the cache keeps the
TPU's default tiling and the compiler does not relay it out for the kernel.

A grid step holds a few rows' whole cache in VMEM (both buffers double-buffered), and for
each row and kv head computes the G queries' scores over every slot, the softmax and the
sum over the values, in fp32.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from podsjax.devices import mesh as mesh_lib
from podsjax.models.attention import attend_cached

_NEG = 0.7 * float(jnp.finfo(jnp.float32).min)  # masked scores: exp underflows to 0, no inf - inf
_VMEM_BUDGET = 24 << 20  # bytes of cache blocks a grid step may hold (keys and values, two buffers each)


def rows_per_step(rows: int, slots: int, features: int, itemsize: int) -> int | None:
    """The rows a grid step reads: a power of two up to 8 (amortizing a grid step's overhead) dividing ``rows``
    whose cache blocks fit ``_VMEM_BUDGET``; None where not even one row fits."""
    block = 4 * slots * features * itemsize  # keys and values, double-buffered
    return next((n for n in (8, 4, 2, 1) if rows % n == 0 and n * block <= _VMEM_BUDGET), None)


def dot_precision(dtype) -> jax.lax.Precision:
    """The kernel's matmul precision, whatever ``jax_default_matmul_precision`` says: full fp32 for
    an fp32 cache (decode waits on memory, not on the MXU's extra passes), else the MXU's native
    pass (Mosaic has no fp32-precision matmul of bf16 operands)."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def _kernel(layer_ref, q_ref, allowed_ref, k_ref, v_ref, o_ref, *, kv_heads: int, head_dim: int):
    """Refs: ``layer`` ``[1]`` (prefetched; used by the index maps); q and out ``[R, H, E]``;
    allowed ``[R, 1, S]``; this layer's keys and values of the R rows ``[R, S, K*E]``."""
    del layer_ref
    rows, heads, e = q_ref.shape
    groups = heads // kv_heads
    precision = dot_precision(k_ref.dtype)
    for r in range(rows):
        allowed = allowed_ref[r] != 0  # [1, S]
        for k in range(kv_heads):
            q = q_ref[r, k * groups:(k + 1) * groups, :]  # [G, E]
            keys = k_ref[r, :, k * head_dim:(k + 1) * head_dim]  # [S, E]
            scores = jax.lax.dot_general(q, keys, (((1,), (1,)), ((), ())), precision=precision,
                                         preferred_element_type=jnp.float32)
            scores = jnp.where(allowed, scores * (head_dim ** -0.5), _NEG)
            p = jnp.exp(scores - scores.max(axis=-1, keepdims=True))
            values = v_ref[r, :, k * head_dim:(k + 1) * head_dim]
            out = jax.lax.dot_general(p.astype(values.dtype), values, (((1,), (0,)), ((), ())), precision=precision,
                                      preferred_element_type=jnp.float32)
            o_ref[r, k * groups:(k + 1) * groups, :] = (out / p.sum(axis=-1, keepdims=True)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret",))
def stacked_decode_attention(q_BHE: jax.Array, keys_YBSC: jax.Array, values_YBSC: jax.Array, layer: jax.Array,
                             allowed_BS: jax.Array, *, interpret: bool = False) -> jax.Array:
    """Softmax attention of one query per head and row over layer ``layer`` of the cache.

    Args:
        q_BHE: the queries, in the cache's dtype; query head h reads kv head ``h // (H // K)``.
        keys_YBSC, values_YBSC: the stacked cache, ``C = K * E``.
        layer: int32 scalar, the layer to read.
        allowed_BS: the slots each row attends to (at least one per row).
        interpret: run Pallas's interpreter (any backend), for tests.

    Returns:
        ``[B, H, E]`` in ``q_BHE``'s dtype.
    """
    b, heads, e = q_BHE.shape
    _, _, slots, features = keys_YBSC.shape
    itemsize = keys_YBSC.dtype.itemsize
    rows = rows_per_step(b, slots, features, itemsize)
    if rows is None:
        raise ValueError(f"a row's cache ({slots} slots of {features}) does not fit the kernel's VMEM budget")
    cache_block = pl.BlockSpec((None, rows, slots, features), lambda i, y: (y[0], i, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(b // rows,),
        in_specs=[pl.BlockSpec((rows, heads, e), lambda i, y: (i, 0, 0)),
                  pl.BlockSpec((rows, 1, slots), lambda i, y: (i, 0, 0)),
                  cache_block, cache_block],
        out_specs=pl.BlockSpec((rows, heads, e), lambda i, y: (i, 0, 0)))
    # What the blocks move: this layer's keys and values, the queries, the mask and the output.
    moved = 2 * b * slots * features * itemsize + 2 * q_BHE.size * q_BHE.dtype.itemsize + 4 * b * slots
    return pl.pallas_call(
        functools.partial(_kernel, kv_heads=features // e, head_dim=e),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q_BHE.shape, q_BHE.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",),
                                             vmem_limit_bytes=_VMEM_BUDGET + (8 << 20)),
        cost_estimate=pl.CostEstimate(flops=4 * b * heads * slots * e, transcendentals=b * heads * slots,
                                      bytes_accessed=moved),
        interpret=interpret,
        name="stacked_decode_attention",
    )(jnp.asarray(layer, jnp.int32).reshape(1), q_BHE, allowed_BS.astype(jnp.int32)[:, None, :], keys_YBSC,
      values_YBSC)


def attend_layer(q_B1HE: jax.Array, keys_YBSC: jax.Array, values_YBSC: jax.Array, layer: jax.Array,
                 allowed_B1S: jax.Array, mesh: Mesh | None = None, platform: str | None = None,
                 interpret: bool = False) -> jax.Array:
    """One decode step's attention over layer ``layer`` of the stacked cache: the kernel on a
    TPU (on a mesh, per device on its rows), elsewhere XLA's :func:`attend_cached` on the
    layer's slice. ``platform`` is the one compiled for (default: the mesh's)."""
    b, _, heads, e = q_B1HE.shape
    _, _, slots, features = keys_YBSC.shape
    platform = platform or mesh_lib.platform(mesh)
    sharded = mesh is not None and mesh.size > 1
    rows = mesh_lib.logical_to_spec(("batch",), mesh, (b,)) if sharded else P(None)
    shards = math.prod(mesh.shape[a] for a in mesh_lib.spec_axes(rows[0])) if sharded else 1
    # The cache splits its kv heads over tensor where that divides them (cache.cache_shardings).
    heads_split = sharded and mesh_lib.logical_to_spec(("kv_heads",), mesh, (features // e,)) != P(None)
    if platform != "tpu" or heads_split or rows_per_step(b // shards, slots, features,
                                                         keys_YBSC.dtype.itemsize) is None:
        k_BSKE, v_BSKE = (c[layer].reshape(b, slots, features // e, e) for c in (keys_YBSC, values_YBSC))
        return attend_cached(q_B1HE, k_BSKE, v_BSKE, allowed_B1S, platform, layout="BSKE")

    def call(layer, q, keys, values, allowed):
        out = stacked_decode_attention(q[:, 0].astype(keys.dtype), keys, values, layer, allowed[:, 0],
                                       interpret=interpret)
        return out[:, None].astype(q.dtype)

    args = (jnp.asarray(layer, jnp.int32), q_B1HE, keys_YBSC, values_YBSC, allowed_B1S)
    if shards == 1:
        return call(*args)
    specs = (P(), P(*rows, None, None, None), P(None, *rows, None, None), P(None, *rows, None, None),
             P(*rows, None, None))
    return jax.shard_map(call, mesh=mesh, in_specs=specs, out_specs=specs[1], check_vma=False)(*args)
