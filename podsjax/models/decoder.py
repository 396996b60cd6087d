"""One Linen decoder for Qwen2 and Llama: RMSNorm, RoPE (+llama3), GQA, SwiGLU.

The layers run under one ``nn.scan`` over params stacked on a leading layer axis Y, so
the traced program (and its compile time) stays the same size at any depth. Each layer
is rematerialised in the backward pass by default (``remat``). RoPE is in
:mod:`podsjax.models.rope`; the attention arithmetic and the KV-cache slots of new tokens are
in :mod:`podsjax.models.attention`.

Parameter tree (kernels are stored ``in_shape + out_shape``, heads kept as their own axis
so each dimension has one logical name)::

    embed/embedding             [V, D]        (vocab, embed)
    layers/attn_norm/scale      [Y, D]        (layers, embed)
    layers/attn/q/kernel        [Y, D, H, E]  (layers, embed, q_heads, head_dim)  (+ bias [Y, H, E] on Qwen2)
    layers/attn/k/kernel        [Y, D, K, E]  (layers, embed, kv_heads, head_dim) (+ bias [Y, K, E])
    layers/attn/v/kernel        [Y, D, K, E]  (layers, embed, kv_heads, head_dim) (+ bias [Y, K, E])
    layers/attn/o/kernel        [Y, H, E, D]  (layers, q_heads, head_dim, embed)
    layers/mlp_norm/scale       [Y, D]
    layers/mlp/gate|up/kernel   [Y, D, F]     (layers, embed, mlp)
    layers/mlp/down/kernel      [Y, F, D]     (layers, mlp, embed)
    final_norm/scale            [D]
    lm_head/kernel              [D, V]        (embed, vocab)   (absent when tied)

E is head_dim, F the MLP width, S the number of KV-cache slots, Y the number of layers.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from podsjax.devices import mesh as mesh_lib
from podsjax.models import lifted, token_ids, tpu_decode_kernel
from podsjax.models.attention import (LayerCache, attend, attend_cached,  # noqa: F401 - attend_cached: rollout's
                                      attention_implementation, cache_slots)
from podsjax.models.cache import KVCache
from podsjax.models.lora import PROJECTION_LOGICAL_AXES, LoraParams, check_lora_fits
from podsjax.models.model_config import ModelConfig
from podsjax.models.params import check_float_dtypes
from podsjax.models.rope import apply_rope, rope_inv_freq, rope_tables

_INIT = nn.initializers.normal(stddev=0.02)  # HF initializer_range default


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
    """``tensordot(x, w, n_in)`` as one 2-D matmul over the flattened leading dims.

    On GPU and TPU the reshapes are bitcasts. XLA:CPU copies weight-gradient operands of
    the multi-dim dot, so this form is smaller and faster there; on TPUs neither form wins
    everywhere (docs/benchmarks.md, "The update step").
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


REMAT_POLICIES = ("none", "full", "dots")
ROLLOUT_LAYERS = ("auto", "scanned", "unrolled")


def _remat_policy(name: str):
    """JAX checkpoint policy of a :data:`REMAT_POLICIES` name ("none" is not rematerialised)."""
    if name == "full":
        return None  # save nothing but the block's inputs
    if name == "dots":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    raise ValueError(f"remat must be one of {REMAT_POLICIES}; got {name!r}")


def rollout_layers_for(requested: str, platform: str) -> str:
    """The sampler's layer layout: "auto" unrolls on GPU only.

    XLA's GPU compiler copies each scanned layer's weight and cache slices; the TPU compiler
    reads them in place and compiles unrolled programs slower (docs/accelerators.md,
    "Decoding at the memory floor").
    """
    if requested != "auto":
        return requested
    return "unrolled" if platform == "gpu" else "scanned"


class _LayerModule(nn.Module):
    """The settings every layer-level module shares (positional, in this order)."""

    config: ModelConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    mesh: Mesh | None = None
    implementation: str = "xla"
    lora_scale: float = 1.0


class Attention(_LayerModule):
    """GQA self-attention with RoPE; reads and writes layer ``layer_index`` of the KV cache."""

    @nn.compact
    def __call__(self, x_BLD, rope, allowed_BLS, cache: LayerCache | None, layer_index, lora_attn):
        cfg = self.config
        h, k, e, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size

        def proj(name, out_shape, inp):
            in_names, out_names = PROJECTION_LOGICAL_AXES[name]
            bias = cfg.qkv_bias and name != "o"
            module = Projection(out_shape, in_names, out_names, bias, self.dtype, self.param_dtype, name=name)
            return module(inp, lora_attn.get(name), self.lora_scale)

        q_BLHE = proj("q", (h, e), x_BLD)
        k_BLKE = proj("k", (k, e), x_BLD)
        v_BLKE = proj("v", (k, e), x_BLD)
        q_BLHE = mesh_lib.constrain(q_BLHE, self.mesh, ("batch", "length", "q_heads", "head_dim"))
        q_BLHE, k_BLKE = apply_rope(q_BLHE, rope), apply_rope(k_BLKE, rope)

        if cache is None:
            out_BLHE = attend(q_BLHE, k_BLKE, v_BLKE, allowed_BLS, self.implementation, self.mesh)
        else:
            # Scatter the new keys/values into this layer's slots of the stacked cache, in
            # place in the scan carry; out-of-range slots are dropped. A token writes one row
            # of K*E features.
            b, length = x_BLD.shape[:2]
            rows_B1 = jnp.arange(b)[:, None]
            keys = cache.keys_YBSC.at[layer_index, rows_B1, cache.slots_BL].set(
                k_BLKE.reshape(b, length, k * e).astype(cache.keys_YBSC.dtype))
            values = cache.values_YBSC.at[layer_index, rows_B1, cache.slots_BL].set(
                v_BLKE.reshape(b, length, k * e).astype(cache.values_YBSC.dtype))
            cache = cache.replace(keys_YBSC=keys, values_YBSC=values)
            if length == 1:
                out_BLHE = tpu_decode_kernel.attend_layer(q_BLHE, keys, values, layer_index, allowed_BLS, self.mesh)
            else:  # prefill: the layer read as [B, S, K, E], then flash attention where available
                k_BSKE, v_BSKE = (c[layer_index].reshape(b, -1, k, e).astype(q_BLHE.dtype) for c in (keys, values))
                out_BLHE = attend(q_BLHE, k_BSKE, v_BSKE, allowed_BLS, self.implementation, self.mesh)
        return proj("o", (d,), out_BLHE), cache


class Mlp(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    config: ModelConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    mesh: Mesh | None = None
    lora_scale: float = 1.0

    @nn.compact
    def __call__(self, x_BLD, lora_mlp):
        d, f = self.config.hidden_size, self.config.intermediate_size

        def proj(name, out_shape, inp):
            in_names, out_names = PROJECTION_LOGICAL_AXES[name]
            module = Projection(out_shape, in_names, out_names, False, self.dtype, self.param_dtype, name=name)
            return module(inp, lora_mlp.get(name), self.lora_scale)

        gate_BLF = proj("gate", (f,), x_BLD)
        up_BLF = proj("up", (f,), x_BLD)
        act_BLF = mesh_lib.constrain(nn.silu(gate_BLF) * up_BLF, self.mesh, ("batch", "length", "mlp"))
        return proj("down", (d,), act_BLF)


class Block(_LayerModule):
    """Pre-norm decoder block, one step of the layer scan: x + attn(norm(x)), then x + mlp(norm(x)).

    ``carry`` is ``(x_BLD, cache)``; ``layer_index`` and ``lora_layer`` are this layer's
    slices of the scanned inputs; the rest is broadcast to every layer.
    """

    @nn.compact
    def __call__(self, carry, layer_index, lora_layer, rope, allowed_BLS):
        x_BLD, cache = carry
        cfg, dt, pdt = self.config, self.dtype, self.param_dtype
        hidden = RMSNorm(cfg.rms_norm_eps, dt, pdt, name="attn_norm")(x_BLD)
        attn_out, cache = Attention(cfg, dt, pdt, self.mesh, self.implementation, self.lora_scale, name="attn")(
            hidden, rope, allowed_BLS, cache, layer_index, lora_layer.get("attn", {}))
        x_BLD = mesh_lib.constrain(x_BLD + attn_out, self.mesh, ("batch", "length", "act_embed"))
        hidden = RMSNorm(cfg.rms_norm_eps, dt, pdt, name="mlp_norm")(x_BLD)
        mlp_out = Mlp(cfg, dt, pdt, self.mesh, self.lora_scale, name="mlp")(hidden, lora_layer.get("mlp", {}))
        x_BLD = mesh_lib.constrain(x_BLD + mlp_out, self.mesh, ("batch", "length", "act_embed"))
        return (x_BLD, cache), None


def scanned_blocks(remat: str, block_class: type[nn.Module] | None = None, in_axes: tuple | None = None):
    """The Block class scanned over a leading "layers" axis of its params (and LoRA), rematerialised per layer.

    One traced layer serves every depth, so compile time and program size do not
    grow with the number of layers. ``block_class`` and its scan ``in_axes`` replace
    :class:`Block`'s (the shared-prefix update's block has the same params).
    """
    block_class = Block if block_class is None else block_class
    in_axes = (0, 0, nn.broadcast, nn.broadcast) if in_axes is None else in_axes
    remat_policy = None if remat == "none" else _remat_policy(remat)
    return lifted.layer_scan(block_class, in_axes, remat != "none", remat_policy)


def lm_logits(x_BLD: jax.Array, head_VD: jax.Array) -> jax.Array:
    """fp32 logits ``[B, L, V]`` = ``x_BLD @ head_VD^T``, accumulated in fp32 for the loss."""
    return matmul(x_BLD.astype(head_VD.dtype), head_VD.T, 1, preferred_element_type=jnp.float32)


class Embed(nn.Module):
    """Token embedding ``[V, D]``; with tied weights it is also the LM head."""

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

    def head_VD(self) -> jax.Array:
        return mesh_lib.constrain(self.embedding, self.mesh, ("vocab", None)).astype(self.dtype)


class LMHead(nn.Module):
    """Untied LM head, stored ``[D, V]`` as HF's ``lm_head`` (transposed)."""

    vocab_size: int
    features: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def setup(self):
        self.kernel = self.param("kernel", nn.with_logical_partitioning(_INIT, ("embed", "vocab")),
                                 (self.features, self.vocab_size), self.param_dtype)

    def head_VD(self) -> jax.Array:
        return self.kernel.astype(self.dtype).T


@flax.struct.dataclass
class DecoderOutput:
    """What :class:`Decoder` returns; a field the call did not ask for is None.

    L' below is the input length L, or the length of ``logits_slice`` when one is given.

    Attributes:
        logits_BLV: fp32 logits [B, L', V]; None with ``return_hidden``.
        cache: the updated :class:`~podsjax.models.KVCache` when a cache was passed in.
        hidden_BLD: with ``return_hidden``, the final normed hidden states [B, L', D].
        head_VD: with ``return_hidden``, the LM head matrix [V, D] (the embedding when tied).
    """

    logits_BLV: jax.Array | None = None
    cache: KVCache | None = None
    hidden_BLD: jax.Array | None = None
    head_VD: jax.Array | None = None


class Decoder(nn.Module):
    """Qwen2 / Llama causal LM.

    Attributes:
        config: architecture.
        dtype: compute dtype of activations and matmuls (softmax, norms and logits are fp32).
        param_dtype: dtype params are created / loaded in.
        remat: one of :data:`REMAT_POLICIES`: "full" keeps only each layer's input for the
            backward pass, "dots" also keeps its matmul outputs, "none" keeps everything.
            Forward-only calls (sampling) are unaffected.
        mesh: when set, activations get sharding constraints from the logical rules.
        attention: one of ``attention.ATTENTION_IMPLEMENTATIONS``; "auto" is cuDNN flash
            attention on GPU in 16-bit, XLA elsewhere. Decode steps use XLA, except the
            GPU rollout layout's grouped decode, which then runs a fused Pallas kernel
            (``podsjax.models.decode_kernel``); "xla" opts out of both.
        rollout_layers: one of :data:`ROLLOUT_LAYERS`, how the sampler runs the layers:
            "scanned" over the stacked params, as training does; "unrolled" over merged
            per-layer weights and a per-layer KV cache (``podsjax.models.rollout``);
            "auto" is "unrolled" on GPU and "scanned" elsewhere (``rollout_layers_for``).
    """

    config: ModelConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    remat: str = "full"
    mesh: Mesh | None = None
    attention: str = "auto"
    rollout_layers: str = "auto"

    def __post_init__(self):
        if not isinstance(self.config, ModelConfig):
            raise TypeError(f"Decoder config must be a ModelConfig; got {type(self.config).__name__}")
        check_float_dtypes(dtype=self.dtype, param_dtype=self.param_dtype)  # one line here, not deep in a layer
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {REMAT_POLICIES}; got {self.remat!r}")
        if self.rollout_layers not in ROLLOUT_LAYERS:
            raise ValueError(f"rollout_layers must be one of {ROLLOUT_LAYERS}; got {self.rollout_layers!r}")
        attention_implementation(self.attention, self.dtype, self.config.head_dim)  # validates the name
        if self.mesh is not None:
            mesh_lib.check_mesh(self.mesh)
        super().__post_init__()

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
        return_hidden: bool = False,
    ) -> DecoderOutput:
        """Runs the decoder.

        Args:
            input_ids_BL: int tokens [B, L], each in [0, vocab_size) (checked unless traced;
                traced, others embed as NaN).
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
            return_hidden: return the final normed hidden states of the sliced positions
                and the LM head matrix instead of logits, so a loss can compute logits in
                chunks and never hold all [B, L, V] of them.

        Returns:
            A :class:`DecoderOutput`: ``logits_BLV`` (fp32, [B, L', V], L' = L or the
            slice's length) unless ``return_hidden``, then ``hidden_BLD`` [B, L', D] and
            ``head_VD`` [V, D] instead; ``cache`` is the updated cache when one was given.
        """
        cfg = self.config
        input_ids_BL = token_ids.as_ids(input_ids_BL, cfg.vocab_size, "input")  # pads too: NaN reaches values
        attention_mask = None if attention_mask is None else jnp.asarray(attention_mask)
        if input_ids_BL.ndim != 2 or attention_mask is not None and attention_mask.shape != input_ids_BL.shape:
            raise ValueError(f"input ids must be [B, L] and the attention mask of the same shape; got "
                             f"{input_ids_BL.shape} and {None if attention_mask is None else attention_mask.shape}")
        if not jnp.issubdtype(input_ids_BL.dtype, jnp.integer):
            raise ValueError(f"input ids must be integer token ids; got dtype {input_ids_BL.dtype}")
        b, length = input_ids_BL.shape
        mask_BL = jnp.ones((b, length), bool) if attention_mask is None else attention_mask.astype(bool)
        layer_cache = None
        if cache is None:
            if positions_BL is None:
                positions_BL = jnp.maximum(jnp.cumsum(mask_BL, axis=-1, dtype=jnp.int32) - 1, 0)
            query_ids_L = jnp.arange(length, dtype=jnp.int32)
            # Causal over real keys; a query always sees itself, so pad rows are never fully masked.
            causal_LL = query_ids_L[:, None] >= query_ids_L[None, :]
            allowed_BLS = (causal_LL[None] & mask_BL[:, None, :]) | jnp.eye(length, dtype=bool)[None]
        else:
            slots = cache_slots(cache, mask_BL)
            if positions_BL is None:
                positions_BL = slots.positions_BL
            allowed_BLS = slots.allowed_BLS
            layer_cache = LayerCache(cache.keys_YBSC, cache.values_YBSC, slots.slots_BL)
            cache = cache.replace(**slots.bookkeeping(cache, mask_BL))

        if jnp.shape(positions_BL) != (b, length):  # the rotation would fail deep inside on a broadcast
            raise ValueError(f"positions_BL must be [B, L] = {(b, length)}; got {jnp.shape(positions_BL)}")
        embed = Embed(cfg.vocab_size, cfg.hidden_size, self.dtype, self.param_dtype, self.mesh, name="embed")
        x_BLD = mesh_lib.constrain(embed(input_ids_BL), self.mesh, ("batch", "length", "act_embed"))
        rope = rope_tables(positions_BL, rope_inv_freq(cfg), self.dtype)
        implementation = attention_implementation(self.attention, self.dtype, cfg.head_dim, mesh_lib.platform(self.mesh))
        if lora is not None:
            check_lora_fits(self, lora)  # at trace time, from shapes: a mismatch had failed deep in a reshape
        lora_layers = lora.weights.get("layers", {}) if lora is not None else {}
        lora_scale = lora.scale if lora is not None else 1.0
        blocks = scanned_blocks(self.remat)(cfg, self.dtype, self.param_dtype, self.mesh, implementation, lora_scale,
                                            name="layers")
        layer_ids_Y = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        (x_BLD, layer_cache), _ = blocks((x_BLD, layer_cache), layer_ids_Y, lora_layers, rope, allowed_BLS)
        if logits_slice is not None:
            x_BLD = x_BLD[:, logits_slice]
        x_BLD = RMSNorm(cfg.rms_norm_eps, self.dtype, self.param_dtype, name="final_norm")(x_BLD)
        if cfg.tie_word_embeddings:
            head_VD = embed.head_VD()
        else:
            head_VD = LMHead(cfg.vocab_size, cfg.hidden_size, self.dtype, self.param_dtype, name="lm_head").head_VD()
        if cache is not None:
            cache = cache.replace(keys_YBSC=layer_cache.keys_YBSC, values_YBSC=layer_cache.values_YBSC)
        if return_hidden:
            return DecoderOutput(cache=cache, hidden_BLD=x_BLD, head_VD=head_VD)
        logits_BLV = lm_logits(x_BLD, head_VD)
        logits_BLV = mesh_lib.constrain(logits_BLV, self.mesh, ("batch", "length", "vocab"))
        return DecoderOutput(logits_BLV=logits_BLV, cache=cache)


for _remat in REMAT_POLICIES:  # lifted before any thread traces one (podsjax.models.lifted)
    scanned_blocks(_remat)
