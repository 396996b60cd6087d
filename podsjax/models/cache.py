"""Fixed-size KV cache as a pytree, plus the prefill and decode-step entry points.

Intended use by a sampler (one prompt prefilled once, its cache shared by n samples)::

    cache = init_cache(model.config, batch=P, max_len=Lp + Lc, dtype=jnp.bfloat16)
    logits_PLV, cache = prefill(model, params, prompt_ids_PL, prompt_mask_PL, cache)
    cache = cache.repeat(n)                      # rows p*n .. p*n+n-1 belong to prompt p
    # inside lax.while_loop, with the cache in the carry (and donated to the outer jit):
    logits_BV, cache = decode_step(model, params, token_B1, cache)

Every row carries its own write slot (``index_B``) and RoPE position (``positions_B``),
so left-padded prompts of different lengths, and rows that stop early, need no special
casing. Slots past ``max_len`` are silently dropped by the scatter: size the cache for
prompt + completion.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from podsjax.devices import mesh as mesh_lib

# Logical names of each cache field, for shardings (a slot's K*E features split as its kv heads).
CACHE_LOGICAL_AXES = {
    "keys_YBSC": ("layers", "batch", "cache_slots", "kv_heads"),
    "values_YBSC": ("layers", "batch", "cache_slots", "kv_heads"),
    "mask_BS": ("batch", "cache_slots"),
    "index_B": ("batch",),
    "positions_B": ("batch",),
}


@flax.struct.dataclass
class KVCache:
    """Keys/values of every layer in S fixed slots, with per-row bookkeeping.

    Keys/values are stacked over the layers (Y), as the decoder's layer scan carries
    them. A slot holds its K heads' E features as one row of F = K * E values: a layer reads
    as ``[B, S, K, E]`` without a transpose, a new token writes one contiguous row, and a
    TPU keeps the cache in its default tiling, which its decode kernel reads in place
    (:mod:`~podsjax.models.tpu_decode_kernel`).

    Attributes:
        keys_YBSC: [Y, B, S, K * E] rotated keys.
        values_YBSC: [Y, B, S, K * E].
        mask_BS: bool, slot holds a real (non-pad) token.
        index_B: int32, next slot each row writes to.
        positions_B: int32, RoPE position of each row's next real token.
        kv_heads: K (static), how a slot's features split into heads.
    """

    keys_YBSC: jax.Array
    values_YBSC: jax.Array
    mask_BS: jax.Array
    index_B: jax.Array
    positions_B: jax.Array
    kv_heads: int = flax.struct.field(pytree_node=False)

    @property
    def max_len(self) -> int:
        return self.mask_BS.shape[1]

    def repeat(self, n: int) -> KVCache:
        """Repeats every row ``n`` times in place order: row b becomes rows b*n .. b*n+n-1."""
        return KVCache(
            keys_YBSC=jnp.repeat(self.keys_YBSC, n, axis=1),
            values_YBSC=jnp.repeat(self.values_YBSC, n, axis=1),
            mask_BS=jnp.repeat(self.mask_BS, n, axis=0),
            index_B=jnp.repeat(self.index_B, n, axis=0),
            positions_B=jnp.repeat(self.positions_B, n, axis=0),
            kv_heads=self.kv_heads,
        )


def init_cache(config, batch: int, max_len: int, dtype: Any = jnp.bfloat16, mesh: Mesh | None = None) -> KVCache:
    """Empty cache for ``batch`` rows of up to ``max_len`` tokens (prompt + completion).

    Args:
        config: a :class:`~podsjax.models.ModelConfig`.
        batch: B.
        max_len: S, the number of slots.
        dtype: storage dtype of keys/values.
        mesh: when given, the cache is created directly in :func:`cache_shardings`.
    """
    shape = (config.num_layers, batch, max_len, config.num_kv_heads * config.head_dim)

    def make():
        return KVCache(
            keys_YBSC=jnp.zeros(shape, dtype),
            values_YBSC=jnp.zeros(shape, dtype),
            mask_BS=jnp.zeros((batch, max_len), bool),
            index_B=jnp.zeros((batch,), jnp.int32),
            positions_B=jnp.zeros((batch,), jnp.int32),
            kv_heads=config.num_kv_heads,
        )

    if mesh is None:
        return make()
    return jax.jit(make, out_shardings=cache_shardings(jax.eval_shape(make), mesh))()


def cache_shardings(cache: KVCache, mesh: Mesh) -> KVCache:
    """A KVCache of NamedShardings (batch over data+fsdp, kv heads over tensor).

    ``cache`` may be abstract (``jax.eval_shape``) or concrete; use the result as the
    in/out shardings of the sampler's jit. The features split over tensor only where it
    divides the kv heads, so no device holds part of a head.
    """
    def shape(name):  # as the sharding rules see it: the kv heads in place of the features
        shape = tuple(getattr(cache, name).shape)
        return (*shape[:-1], cache.kv_heads) if name in ("keys_YBSC", "values_YBSC") else shape

    return KVCache(**{name: mesh_lib.logical_sharding(mesh, names, shape(name))
                      for name, names in CACHE_LOGICAL_AXES.items()}, kv_heads=cache.kv_heads)


def prefill(model, params, input_ids_BL: jax.Array, attention_mask_BL: jax.Array, cache: KVCache,
            *, lora=None, last_only: bool = False) -> tuple[jax.Array, KVCache]:
    """Runs the prompt through the model and fills the cache.

    Args:
        model: the :class:`~podsjax.models.Decoder`.
        params: its params.
        input_ids_BL: prompt tokens, left-padded so every row's last token is real.
        attention_mask_BL: 1 for real tokens.
        cache: an empty cache from :func:`init_cache` (or one to append a chunk to).
        lora: optional :class:`~podsjax.models.LoraParams`.
        last_only: return logits for the last position only ([B, 1, V]), skipping the
            LM head on the rest of the prompt.

    Returns:
        ``(logits_BLV, cache)``; ``logits_BLV[:, -1]`` predicts each row's first new token.
    """
    out = model.apply({"params": params}, input_ids_BL, attention_mask_BL, cache=cache, lora=lora,
                      logits_slice=slice(-1, None) if last_only else None)
    return out.logits_BLV, out.cache


def decode_step(model, params, token_B1: jax.Array, cache: KVCache, *, lora=None,
                attention_mask_B1: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
    """Feeds one token per row and returns the next-token logits.

    Args:
        token_B1: int tokens [B, 1] (a [B] vector is accepted).
        cache: the cache after prefill / previous steps.
        attention_mask_B1: 0 marks a token that later steps must not attend to (for
            example rows already past EOS); default all ones.

    Returns:
        ``(logits_BV, cache)`` with fp32 logits.
    """
    token_B1 = token_B1.reshape(token_B1.shape[0], 1)
    out = model.apply({"params": params}, token_B1, attention_mask_B1, cache=cache, lora=lora)
    return out.logits_BLV[:, 0], out.cache
