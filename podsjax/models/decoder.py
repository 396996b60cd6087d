"""One Linen decoder for Qwen2 and Llama: RMSNorm, RoPE (+llama3), GQA, SwiGLU.

Parameter tree (kernels are stored ``in_shape + out_shape``, heads kept as their own axis
so each dimension has one logical name)::

    embed/embedding          [V, D]      (vocab, embed)
    layers_i/attn_norm/scale [D]         (embed,)
    layers_i/attn/q/kernel   [D, H, E]   (embed, q_heads, head_dim)   (+ bias [H, E] on Qwen2)
    layers_i/attn/k/kernel   [D, K, E]   (embed, kv_heads, head_dim)  (+ bias [K, E])
    layers_i/attn/v/kernel   [D, K, E]   (embed, kv_heads, head_dim)  (+ bias [K, E])
    layers_i/attn/o/kernel   [H, E, D]   (q_heads, head_dim, embed)
    layers_i/mlp_norm/scale  [D]
    layers_i/mlp/gate|up/kernel [D, F]   (embed, mlp)
    layers_i/mlp/down/kernel [F, D]      (mlp, embed)
    final_norm/scale         [D]
    lm_head/kernel           [D, V]      (embed, vocab)   (absent when tied)

E is head_dim, F the MLP width, S the number of KV-cache slots.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from podsjax import mesh as mesh_lib
from podsjax.models.cache import KVCache
from podsjax.models.config import ModelConfig
from podsjax.models.lora import LoraParams

_INIT = nn.initializers.normal(stddev=0.02)  # HF initializer_range default


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """RoPE inverse frequencies ``[E/2]`` in float32, llama3 rescaling included.

    Computed in float32 like transformers so angles agree to the last bit that matters.
    """
    dim = config.head_dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (np.float32(1.0) / (np.float32(config.rope_theta) ** exponents)).astype(np.float32)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    # llama3: keep high frequencies, divide low ones by `factor`, blend linearly between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def apply_rope(x_BLNE: jax.Array, positions_BL: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotates ``x_BLNE`` (N = H or K heads) by ``positions_BL`` in the "rotate_half" layout."""
    angles_BLF = positions_BL[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)
    cos = jnp.cos(angles_BLF)[:, :, None, :].astype(x_BLNE.dtype)
    sin = jnp.sin(angles_BLF)[:, :, None, :].astype(x_BLNE.dtype)
    x1, x2 = jnp.split(x_BLNE, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, scaled in the compute dtype (as transformers does)."""

    eps: float
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
                           (x_BLD.shape[-1],), self.param_dtype)
        x32 = x_BLD.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale.astype(self.dtype) * normed.astype(self.dtype)


def matmul(x: jax.Array, w: jax.Array, n_in: int, **kwargs) -> jax.Array:
    """``tensordot(x, w, n_in)`` computed as one 2-D matmul.

    Flattening the leading dims of ``x`` and both sides of ``w`` first matters for
    speed: XLA CPU lays out the backward of a 3-D dot_general with strided transposed
    copies (the MLP backward ran 1.6x slower); as a 2-D matmul it picks plain layouts.
    """
    lead, out = x.shape[: x.ndim - n_in], w.shape[n_in:]
    k = int(np.prod(w.shape[:n_in]))
    y = jnp.matmul(x.reshape(-1, k), w.reshape(k, -1), **kwargs)
    return y.reshape(lead + out)


class Projection(nn.Module):
    """``y = x @ W (+ b)`` contracting the last ``len(in_names)`` dims, plus optional LoRA.

    Attributes:
        out_shape: trailing output dims.
        in_names / out_names: logical axis names of the kernel's input / output dims.
        use_bias: add a bias of shape ``out_shape``.
    """

    out_shape: tuple[int, ...]
    in_names: tuple[str, ...]
    out_names: tuple[str, ...]
    use_bias: bool = False
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, lora_ab: dict[str, jax.Array] | None = None, lora_scale=1.0) -> jax.Array:
        n_in = len(self.in_names)
        kernel = self.param("kernel", nn.with_logical_partitioning(_INIT, self.in_names + self.out_names),
                            x.shape[-n_in:] + self.out_shape, self.param_dtype)
        x = x.astype(self.dtype)
        y = matmul(x, kernel.astype(self.dtype), n_in)
        if self.use_bias:
            bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, self.out_names),
                              self.out_shape, self.param_dtype)
            y = y + bias.astype(self.dtype)
        if lora_ab is not None:
            # Low-rank path: rank-r intermediate, so the merged W is never built.
            low = matmul(x, lora_ab["a"].astype(self.dtype), n_in)
            y = y + matmul(low, lora_ab["b"].astype(self.dtype), 1) * jnp.asarray(lora_scale, self.dtype)
        return y


def attend(q_BLHE: jax.Array, k_BKSE: jax.Array, v_BKSE: jax.Array, allowed_BLS: jax.Array) -> jax.Array:
    """Grouped-query softmax attention; query head h uses kv head ``h // (H // K)``.

    Keys/values come head-major ([B, K, S, E], the cache layout) so both matmuls take
    them as they are. Scores and softmax are fp32. Disallowed scores get the most
    negative finite value instead of -inf so a fully masked row (a left-pad query)
    gives a uniform average, not NaN.
    """
    b, length, h, e = q_BLHE.shape
    k = k_BKSE.shape[1]
    if length == 1:
        return _attend_one(q_BLHE, k_BKSE, v_BKSE, allowed_BLS)
    q_BLKGE = q_BLHE.reshape(b, length, k, h // k, e)
    scores_BKGLS = jnp.einsum("blkge,bkse->bkgls", q_BLKGE, k_BKSE.astype(q_BLHE.dtype),
                              preferred_element_type=jnp.float32) * (e ** -0.5)
    scores_BKGLS = jnp.where(allowed_BLS[:, None, None], scores_BKGLS, jnp.finfo(jnp.float32).min)
    probs_BKGLS = jax.nn.softmax(scores_BKGLS, axis=-1).astype(q_BLHE.dtype)
    out_BLKGE = jnp.einsum("bkgls,bkse->blkge", probs_BKGLS, v_BKSE.astype(q_BLHE.dtype))
    return out_BLKGE.reshape(b, length, h, e)


# Below this many attention scores per device the block already sits in cache, and the
# extra ops of chunking cost more than the skipped scores save (the tiny CPU preset's
# update, 4 rows x 4 heads x ~176^2 per device, ran 5% slower chunked).
CHUNK_MIN_SCORES = 2**20


def causal_attend(q_BLHE: jax.Array, k_BKSE: jax.Array, v_BKSE: jax.Array, allowed_BLS: jax.Array) -> jax.Array:
    """:func:`attend` for self-attention without a cache (S = L, key i at position i).

    Queries go in up to 8 chunks of at least 64, and chunk [q0, q1) attends to keys
    [0, q1) only: later keys are disallowed by causality anyway, so this skips nearly
    half the scores, and each chunk's [.., Lc, S] block stays in cache. On CPU that
    ran attention 2.3x faster forward and backward at L = 512. Rows with at least one
    allowed key get the same result; a fully masked (padding) query still gets a
    uniform average, over the chunk's keys.
    """
    length = q_BLHE.shape[1]
    chunk = max(64, -(-length // 8))
    if length <= chunk:
        return attend(q_BLHE, k_BKSE, v_BKSE, allowed_BLS)
    outs = []
    for q0 in range(0, length, chunk):
        q1 = min(q0 + chunk, length)
        outs.append(attend(q_BLHE[:, q0:q1], k_BKSE[:, :, :q1], v_BKSE[:, :, :q1], allowed_BLS[:, q0:q1, :q1]))
    return jnp.concatenate(outs, axis=1)


def _attend_one(q_B1HE, k_BKSE, v_BKSE, allowed_B1S):
    """:func:`attend` for one query per row (a decode step), all in fp32.

    Broadcast multiply + sum instead of two batched matmuls with G x E x S this small:
    on CPU that is fewer kernels and no transposed copies of scores or outputs.
    """
    b, _, h, e = q_B1HE.shape
    k = k_BKSE.shape[1]
    q_BKG1E = q_B1HE.reshape(b, k, h // k, 1, e).astype(jnp.float32)
    scores_BKGS = jnp.sum(q_BKG1E * k_BKSE[:, :, None].astype(jnp.float32), axis=-1) * (e ** -0.5)
    scores_BKGS = jnp.where(allowed_B1S[:, None], scores_BKGS, jnp.finfo(jnp.float32).min)
    probs_BKGS1 = jax.nn.softmax(scores_BKGS, axis=-1)[..., None]
    out_BKGE = jnp.sum(probs_BKGS1 * v_BKSE[:, :, None].astype(jnp.float32), axis=3)
    return out_BKGE.reshape(b, 1, h, e).astype(q_B1HE.dtype)


def _replace_at(items: tuple, i: int, item) -> tuple:
    return items[:i] + (item,) + items[i + 1:]


class Attention(nn.Module):
    """GQA self-attention with RoPE; reads and writes the KV cache when one is given."""

    config: ModelConfig
    layer: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    mesh: Mesh | None = None

    @nn.compact
    def __call__(self, x_BLD, positions_BL, allowed_BLS, cache, slots_BL, lora_attn, lora_scale):
        cfg = self.config
        h, k, e, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size

        def proj(name, out_shape, in_names, out_names, bias, inp):
            module = Projection(out_shape, in_names, out_names, bias, self.dtype, self.param_dtype, name=name)
            return module(inp, lora_attn.get(name), lora_scale)

        q_BLHE = proj("q", (h, e), ("embed",), ("q_heads", "head_dim"), cfg.qkv_bias, x_BLD)
        k_BLKE = proj("k", (k, e), ("embed",), ("kv_heads", "head_dim"), cfg.qkv_bias, x_BLD)
        v_BLKE = proj("v", (k, e), ("embed",), ("kv_heads", "head_dim"), cfg.qkv_bias, x_BLD)
        q_BLHE = mesh_lib.constrain(q_BLHE, self.mesh, ("batch", "length", "q_heads", "head_dim"))
        inv_freq = rope_inv_freq(cfg)
        q_BLHE = apply_rope(q_BLHE, positions_BL, inv_freq)
        k_BLKE = apply_rope(k_BLKE, positions_BL, inv_freq)

        if cache is not None:
            # Scatter the new keys/values into this layer's cache slots (in place when the
            # cache is donated); out-of-range slots are dropped. The slice between the
            # advanced indices makes the update [B, L, K, E], as k_BLKE is.
            rows_B1, i = jnp.arange(x_BLD.shape[0])[:, None], self.layer
            k_BKSE, v_BKSE = cache.keys_BKSE[i], cache.values_BKSE[i]
            k_BKSE = k_BKSE.at[rows_B1, :, slots_BL].set(k_BLKE.astype(k_BKSE.dtype))
            v_BKSE = v_BKSE.at[rows_B1, :, slots_BL].set(v_BLKE.astype(v_BKSE.dtype))
            cache = cache.replace(keys_BKSE=_replace_at(cache.keys_BKSE, i, k_BKSE),
                                  values_BKSE=_replace_at(cache.values_BKSE, i, v_BKSE))
            out_BLHE = attend(q_BLHE, k_BKSE, v_BKSE, allowed_BLS)
        else:
            k_BKSE, v_BKSE = k_BLKE.transpose(0, 2, 1, 3), v_BLKE.transpose(0, 2, 1, 3)
            b, length = x_BLD.shape[:2]
            per_device = (b // mesh_lib.shard_count(self.mesh, "batch")) * (h // mesh_lib.shard_count(
                self.mesh, "q_heads")) * length * length
            attend_fn = causal_attend if per_device >= CHUNK_MIN_SCORES else attend
            out_BLHE = attend_fn(q_BLHE, k_BKSE, v_BKSE, allowed_BLS)
        return proj("o", (d,), ("q_heads", "head_dim"), ("embed",), False, out_BLHE), cache


class Mlp(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    config: ModelConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    mesh: Mesh | None = None

    @nn.compact
    def __call__(self, x_BLD, lora_mlp, lora_scale):
        d, f = self.config.hidden_size, self.config.intermediate_size

        def proj(name, out_shape, in_names, out_names, inp):
            module = Projection(out_shape, in_names, out_names, False, self.dtype, self.param_dtype, name=name)
            return module(inp, lora_mlp.get(name), lora_scale)

        gate_BLF = proj("gate", (f,), ("embed",), ("mlp",), x_BLD)
        up_BLF = proj("up", (f,), ("embed",), ("mlp",), x_BLD)
        act_BLF = mesh_lib.constrain(nn.silu(gate_BLF) * up_BLF, self.mesh, ("batch", "length", "mlp"))
        return proj("down", (d,), ("mlp",), ("embed",), act_BLF)


class Block(nn.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x))."""

    config: ModelConfig
    layer: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    mesh: Mesh | None = None

    @nn.compact
    def __call__(self, x_BLD, positions_BL, allowed_BLS, cache, slots_BL, lora_layer, lora_scale):
        cfg, dt, pdt = self.config, self.dtype, self.param_dtype
        lora_layer = lora_layer or {}
        hidden = RMSNorm(cfg.rms_norm_eps, dt, pdt, name="attn_norm")(x_BLD)
        attn_out, cache = Attention(cfg, self.layer, dt, pdt, self.mesh, name="attn")(
            hidden, positions_BL, allowed_BLS, cache, slots_BL, lora_layer.get("attn", {}), lora_scale)
        x_BLD = mesh_lib.constrain(x_BLD + attn_out, self.mesh, ("batch", "length", "act_embed"))
        hidden = RMSNorm(cfg.rms_norm_eps, dt, pdt, name="mlp_norm")(x_BLD)
        mlp_out = Mlp(cfg, dt, pdt, self.mesh, name="mlp")(hidden, lora_layer.get("mlp", {}), lora_scale)
        x_BLD = mesh_lib.constrain(x_BLD + mlp_out, self.mesh, ("batch", "length", "act_embed"))
        return x_BLD, cache


class Embed(nn.Module):
    """Token embedding ``[V, D]``; ``attend`` is the tied LM head."""

    vocab_size: int
    features: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    mesh: Mesh | None = None

    def setup(self):
        self.embedding = self.param("embedding", nn.with_logical_partitioning(_INIT, ("vocab", "embed")),
                                    (self.vocab_size, self.features), self.param_dtype)

    def __call__(self, ids_BL: jax.Array) -> jax.Array:
        # Gather the FSDP-sharded width first (as FSDP does for every weight): a lookup
        # into a D-sharded table would leave D-sharded rows that the partitioner can only
        # re-shard to the batch layout by fully replicating them.
        table_VD = mesh_lib.constrain(self.embedding, self.mesh, ("vocab", None))
        return jnp.take(table_VD, ids_BL, axis=0).astype(self.dtype)

    def attend(self, x_BLD: jax.Array) -> jax.Array:
        table_VD = mesh_lib.constrain(self.embedding, self.mesh, ("vocab", None))
        return matmul(x_BLD, table_VD.astype(self.dtype).T, 1, preferred_element_type=jnp.float32)


class LMHead(nn.Module):
    """Untied LM head ``[D, V]``; logits accumulate and come out in fp32 for the loss."""

    vocab_size: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        kernel = self.param("kernel", nn.with_logical_partitioning(_INIT, ("embed", "vocab")),
                            (x_BLD.shape[-1], self.vocab_size), self.param_dtype)
        return matmul(x_BLD.astype(self.dtype), kernel.astype(self.dtype), 1, preferred_element_type=jnp.float32)


class Decoder(nn.Module):
    """Qwen2 / Llama causal LM.

    Attributes:
        config: architecture.
        dtype: compute dtype of activations and matmuls (softmax, norms and logits are fp32).
        param_dtype: dtype params are created / loaded in.
        remat: rematerialise each block in the backward pass (saves activation memory).
        mesh: when set, activations get sharding constraints from the logical rules.
    """

    config: ModelConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    remat: bool = False
    mesh: Mesh | None = None

    @nn.compact
    def __call__(
        self,
        input_ids_BL: jax.Array,
        attention_mask: jax.Array | None = None,
        *,
        positions_BL: jax.Array | None = None,
        cache: KVCache | None = None,
        lora: LoraParams | None = None,
        logits_slice: slice | None = None,
    ):
        """Runs the decoder.

        Args:
            input_ids_BL: int tokens [B, L].
            attention_mask: [B, L], 1 for real tokens, 0 for padding (left or right).
                Defaults to all ones.
            positions_BL: RoPE positions; default derived from the mask so left-padded
                rows start at 0 on their first real token (and continue from the cache).
            cache: KV cache. When given, the L tokens are written at each row's
                ``cache.index_B`` and attend to every valid earlier slot; L may be the
                whole prompt (prefill) or 1 (a decode step).
            lora: LoRA adapters; None runs the base model.
            logits_slice: compute logits only for these positions (a static slice of
                the length axis): prefill needs the last one, the update only those
                that predict completion tokens, and the LM head is a large share of
                the compute (vocab x hidden per row, forward and backward).

        Returns:
            fp32 logits [B, L', V] (L' = L, or the slice's length); with a cache,
            ``(logits_BLV, updated_cache)``.
        """
        cfg = self.config
        b, length = input_ids_BL.shape
        mask_BL = jnp.ones((b, length), bool) if attention_mask is None else attention_mask.astype(bool)
        offsets_BL = jnp.maximum(jnp.cumsum(mask_BL, axis=-1, dtype=jnp.int32) - 1, 0)
        slots_BL = None
        if cache is None:
            if positions_BL is None:
                positions_BL = offsets_BL
            causal_LL = jnp.tril(jnp.ones((length, length), bool))
            allowed_BLS = causal_LL[None] & mask_BL[:, None, :]
        else:
            if positions_BL is None:
                positions_BL = cache.positions_B[:, None] + offsets_BL
            slots_BL = cache.index_B[:, None] + jnp.arange(length, dtype=jnp.int32)
            rows_B1 = jnp.arange(b)[:, None]
            slot_mask_BS = cache.mask_BS.at[rows_B1, slots_BL].set(mask_BL)
            slot_ids_S = jnp.arange(cache.mask_BS.shape[1], dtype=jnp.int32)
            allowed_BLS = slot_mask_BS[:, None, :] & (slot_ids_S[None, None, :] <= slots_BL[:, :, None])
            cache = cache.replace(
                mask_BS=slot_mask_BS,
                index_B=cache.index_B + length,
                positions_B=cache.positions_B + jnp.sum(mask_BL, axis=-1, dtype=jnp.int32),
            )

        embed = Embed(cfg.vocab_size, cfg.hidden_size, self.dtype, self.param_dtype, self.mesh, name="embed")
        x_BLD = mesh_lib.constrain(embed(input_ids_BL), self.mesh, ("batch", "length", "act_embed"))
        block_cls = nn.remat(Block) if self.remat else Block
        lora_weights = lora.weights if lora is not None else {}
        lora_scale = lora.scale if lora is not None else 1.0
        for i in range(cfg.num_layers):
            block = block_cls(cfg, i, self.dtype, self.param_dtype, self.mesh, name=f"layers_{i}")
            x_BLD, cache = block(x_BLD, positions_BL, allowed_BLS, cache, slots_BL,
                                 lora_weights.get(f"layers_{i}"), lora_scale)
        if logits_slice is not None:
            x_BLD = x_BLD[:, logits_slice]
        x_BLD = RMSNorm(cfg.rms_norm_eps, self.dtype, self.param_dtype, name="final_norm")(x_BLD)
        if cfg.tie_word_embeddings:
            logits_BLV = embed.attend(x_BLD)
        else:
            logits_BLV = LMHead(cfg.vocab_size, self.dtype, self.param_dtype, name="lm_head")(x_BLD)
        logits_BLV = mesh_lib.constrain(logits_BLV, self.mesh, ("batch", "length", "vocab"))
        return logits_BLV if cache is None else (logits_BLV, cache)
