"""Attention: which implementation runs, grouped-query attention over a sequence or a KV
cache, and where new tokens go in the cache.

Shapes: H query heads, K kv heads (query head h reads kv head ``h // (H // K)``), E head_dim,
S cache slots, Y layers.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from podsjax.devices import mesh as mesh_lib

ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn")


def attention_implementation(requested: str, dtype: Any, head_dim: int, platform: str | None = None) -> str:
    """"cudnn" (flash attention) where cuDNN can run it, else "xla".

    cuDNN needs a GPU, 16-bit inputs and a head size that is a multiple of 8 up to 128;
    "auto" picks it exactly then, so fp32 tests and CPU/TPU runs take the XLA path.
    ``platform`` is the one compiled for (``mesh.platform``; default: JAX's backend).
    """
    if requested not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"attention must be one of {ATTENTION_IMPLEMENTATIONS}; got {requested!r}")
    if requested != "auto":
        return requested
    fits = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and head_dim % 8 == 0
    return "cudnn" if fits and head_dim <= 128 and (platform or jax.default_backend()) == "gpu" else "xla"


def attend(q_BLHE: jax.Array, k_BSKE: jax.Array, v_BSKE: jax.Array, allowed_BLS: jax.Array,
           implementation: str = "xla", mesh: Mesh | None = None) -> jax.Array:
    """Grouped-query softmax attention through ``jax.nn.dot_product_attention``.

    Query head h uses kv head ``h // (H // K)``; K/V are never repeated. Scores and
    softmax are fp32 on both paths. Every query must allow at least one key (the
    decoder always allows a query its own slot), so no row is fully masked: cuDNN
    and the backward pass would otherwise meet 0/0.

    On a mesh of several devices cuDNN runs per device on its rows (``shard_map``): jax's
    own partitioning of the cuDNN call failed to compile an update on 8 GPUs with the
    batch split over ("data", "fsdp").
    """
    def call(q, k, v, allowed):
        if implementation == "cudnn":
            return _even_lengths(_cudnn_attention)(q, k, v, allowed)
        return jax.nn.dot_product_attention(q, k, v, mask=allowed[:, None], implementation=implementation)

    if implementation != "cudnn" or mesh is None or mesh.size == 1:
        return call(q_BLHE, k_BSKE, v_BSKE, allowed_BLS)
    rows = mesh_lib.logical_to_spec(("batch",), mesh, q_BLHE.shape[:1])
    specs = tuple(PartitionSpec(*rows, *[None] * (x.ndim - 1)) for x in (q_BLHE, k_BSKE, v_BSKE, allowed_BLS))
    return jax.shard_map(call, mesh=mesh, in_specs=specs, out_specs=specs[0], check_vma=False)(
        q_BLHE, k_BSKE, v_BSKE, allowed_BLS)


def _cudnn_attention(q_BLHE, k_BSKE, v_BSKE, allowed_BLS):
    return jax.nn.dot_product_attention(q_BLHE, k_BSKE, v_BSKE, mask=allowed_BLS[:, None], implementation="cudnn")


def _even_lengths(attention):
    """``attention`` on queries and keys padded to even lengths, the padding sliced off.

    cuDNN's flash attention with a mask (a bias to it) refuses odd sequence lengths in the
    backward pass, and jax raises while tracing: a completion of 201 tokens would stop the
    update. A padded key is allowed to no real query; a padded query sees key 0 (or the
    padded key), so no row is fully masked.
    """
    def padded(q_BLHE, k_BSKE, v_BSKE, allowed_BLS):
        extra_l, extra_s = q_BLHE.shape[1] % 2, k_BSKE.shape[1] % 2
        if not (extra_l or extra_s):
            return attention(q_BLHE, k_BSKE, v_BSKE, allowed_BLS)
        length = q_BLHE.shape[1]
        q_BLHE = jnp.pad(q_BLHE, ((0, 0), (0, extra_l), (0, 0), (0, 0)))
        k_BSKE, v_BSKE = (jnp.pad(x, ((0, 0), (0, extra_s), (0, 0), (0, 0))) for x in (k_BSKE, v_BSKE))
        allowed_BLS = jnp.pad(allowed_BLS, ((0, 0), (0, extra_l), (0, extra_s)))
        if extra_l:
            allowed_BLS = allowed_BLS.at[:, -1, -1 if extra_s else 0].set(True)
        return attention(q_BLHE, k_BSKE, v_BSKE, allowed_BLS)[:, :length]

    return padded


def attend_cached(q_BLHE: jax.Array, k_cache: jax.Array, v_cache: jax.Array, allowed_BLS: jax.Array,
                  platform: str | None = None, layout: str = "BKSE") -> jax.Array:
    """:func:`attend` over a cache layer, for few queries (decode): head-major ``[B, K, S, E]``
    (``layout="BKSE"``, the rollout cache's) or slot-major ``[B, S, K, E]`` ("BSKE", a layer
    of the decoder's stacked cache).

    The cache is read in its stored dtype and summed in fp32: decode is bound by memory
    bandwidth, and an upcast copy of the cache would double the bytes read per step. For
    one query the XLA path beats cuDNN on an H100.

    On a GPU one query is a multiply-and-sum over the cache (:func:`_attend_one_query`),
    elsewhere two matmuls: cuBLAS pads a kv head's queries and writes fp32 scores that a
    separate softmax kernel reads back (docs/accelerators.md, "Decoding at the memory floor").
    """
    if layout not in ("BKSE", "BSKE"):
        raise ValueError(f"layout must be 'BKSE' or 'BSKE'; got {layout!r}")
    cache = "bkse" if layout == "BKSE" else "bske"
    platform = platform or jax.default_backend()
    if platform == "gpu" and q_BLHE.shape[1] == 1:
        return _attend_one_query(q_BLHE, k_cache, v_cache, allowed_BLS, cache)
    b, length, h, e = q_BLHE.shape
    k = k_cache.shape[cache.index("k")]
    if platform == "cpu" and k_cache.dtype != jnp.float32:
        # XLA:CPU has no 16-bit batched dot with an fp32 result (it fails at run time);
        # it would compute in fp32 anyway.
        k_cache, v_cache = k_cache.astype(jnp.float32), v_cache.astype(jnp.float32)
    q_BLKGE = q_BLHE.reshape(b, length, k, h // k, e).astype(k_cache.dtype)
    scores_BKGLS = jnp.einsum(f"blkge,{cache}->bkgls", q_BLKGE, k_cache, preferred_element_type=jnp.float32)
    scores_BKGLS = jnp.where(allowed_BLS[:, None, None], scores_BKGLS * (e ** -0.5), jnp.finfo(jnp.float32).min)
    probs_BKGLS = jax.nn.softmax(scores_BKGLS, axis=-1).astype(v_cache.dtype)
    out_BLKGE = jnp.einsum(f"bkgls,{cache}->blkge", probs_BKGLS, v_cache, preferred_element_type=jnp.float32)
    return out_BLKGE.reshape(b, length, h, e).astype(q_BLHE.dtype)


def _attend_one_query(q_B1HE: jax.Array, k_cache: jax.Array, v_cache: jax.Array, allowed_B1S: jax.Array,
                      cache: str = "bkse") -> jax.Array:
    """One query per row as elementwise products summed in fp32: XLA fuses each sum with its
    reads of the cache (and the softmax with them), so K and V are read once, in place."""
    if cache == "bske":  # a transpose XLA folds into the fused reads' indexing
        k_cache, v_cache = jnp.swapaxes(k_cache, 1, 2), jnp.swapaxes(v_cache, 1, 2)
    b, _, h, e = q_B1HE.shape
    k = k_cache.shape[1]
    q_BKGE = q_B1HE.reshape(b, k, h // k, e).astype(jnp.float32) * (e ** -0.5)
    scores_BKGS = jnp.sum(q_BKGE[:, :, :, None, :] * k_cache[:, :, None].astype(jnp.float32), axis=-1)
    scores_BKGS = jnp.where(allowed_B1S[:, :, None, :], scores_BKGS, jnp.finfo(jnp.float32).min)
    probs_BKGS = jax.nn.softmax(scores_BKGS, axis=-1)
    out_BKGE = jnp.sum(probs_BKGS[..., None] * v_cache[:, :, None].astype(jnp.float32), axis=-2)
    return out_BKGE.reshape(b, 1, h, e).astype(q_B1HE.dtype)


@flax.struct.dataclass
class LayerCache:
    """The KV-cache part a layer scan carries: every layer's keys/values plus write slots.

    Attributes:
        keys_YBSC / values_YBSC: stacked per-layer caches ``[Y, B, S, K * E]``, updated in place.
        slots_BL: the slot each new token is written to.
    """

    keys_YBSC: jax.Array
    values_YBSC: jax.Array
    slots_BL: jax.Array


@flax.struct.dataclass
class CacheSlots:
    """Where L new tokens go in a KV cache and what each may attend to.

    Attributes:
        positions_BL: RoPE positions, continuing each row's count of real tokens.
        slots_BL: the slot each token is written to.
        slot_mask_BS: the cache's real-token mask with the new tokens in it.
        allowed_BLS: each token sees the real tokens up to its own slot, and itself.
    """

    positions_BL: jax.Array
    slots_BL: jax.Array
    slot_mask_BS: jax.Array
    allowed_BLS: jax.Array

    def bookkeeping(self, cache, mask_BL: jax.Array) -> dict[str, jax.Array]:
        """The cache's ``mask_BS``, ``index_B`` and ``positions_B`` after the tokens."""
        return dict(mask_BS=self.slot_mask_BS, index_B=cache.index_B + mask_BL.shape[1],
                    positions_B=cache.positions_B + jnp.sum(mask_BL, axis=-1, dtype=jnp.int32))


def cache_slots(cache, mask_BL: jax.Array) -> CacheSlots:
    """:class:`CacheSlots` of tokens masked ``mask_BL`` (bool) going into ``cache`` (any cache
    with ``mask_BS``, ``index_B`` and ``positions_B``)."""
    b, length = mask_BL.shape
    offsets_BL = jnp.maximum(jnp.cumsum(mask_BL, axis=-1, dtype=jnp.int32) - 1, 0)
    slots_BL = cache.index_B[:, None] + jnp.arange(length, dtype=jnp.int32)
    slot_mask_BS = cache.mask_BS.at[jnp.arange(b)[:, None], slots_BL].set(mask_BL)
    slot_ids_S = jnp.arange(cache.mask_BS.shape[1], dtype=jnp.int32)
    earlier_BLS = slot_ids_S[None, None, :] <= slots_BL[:, :, None]
    allowed_BLS = (slot_mask_BS[:, None, :] & earlier_BLS) | (slot_ids_S[None, None, :] == slots_BL[:, :, None])
    return CacheSlots(cache.positions_B[:, None] + offsets_BL, slots_BL, slot_mask_BS, allowed_BLS)
