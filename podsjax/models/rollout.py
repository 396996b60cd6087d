"""The sampler's view of a policy: merged per-layer weights and a per-layer KV cache.

Training keeps the weights stacked over the layers under one ``nn.scan`` (compile time
that does not grow with depth). Decoding them that way costs twice their bytes on a GPU:
inside a loop, XLA's GPU compiler copies each layer's slice of a stacked weight, and of
the stacked KV cache, before a cuBLAS call reads it, and its dot merger concatenates
projections that share an input (with LoRA's A matrices too) every step. Measured on the
H100 compiler, a Qwen2.5-1.5B decode step of 64 rows moved 3.0x the bytes it must read.

So rollouts read a separate layout, made once per call of the sampler:

- :class:`RolloutWeights`: one buffer per layer and projection, LoRA folded in (as TRL
  merges adapters before it hands the weights to vLLM), q|k|v and gate|up each one matrix,
  in the model's compute dtype and replicated over the mesh, so a decode step gathers no
  weight from other devices;
- :class:`RolloutCache`: one key and one value buffer per layer, written in place;
- :class:`GroupedCache`: what decoding reads: each prompt's KV once (a ``RolloutCache`` of
  the prompts), and a ``RolloutCache`` of the completions, one row per sample. A group's n
  samples attend to their shared prompt (:func:`attend_grouped`) instead of n copies of
  it: the cache holds P x prompt + P x n x completion tokens, not P x n x (prompt +
  completion), and a decode step reads that much;
- :func:`forward`: the decoder over them with the layers unrolled (prefill and decode
  steps), the same arithmetic as :class:`~podsjax.models.Decoder`'s.

The price is one more copy of the weights while generating.
"""

from __future__ import annotations

import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from podsjax.devices import mesh as mesh_lib
from podsjax.models import decode_kernel
from podsjax.models import decoder as dec
from podsjax.models.lora import LoraParams, merged_kernel



@flax.struct.dataclass
class LayerWeights:
    """One layer's weights as 2-D matrices ``[in, out]`` (``qkv_bias`` None without biases)."""

    attn_norm: jax.Array
    qkv: jax.Array
    qkv_bias: jax.Array | None
    o: jax.Array
    mlp_norm: jax.Array
    gate_up: jax.Array
    down: jax.Array


@flax.struct.dataclass
class RolloutWeights:
    """Every weight a rollout reads, a buffer per layer (``head_VD`` None when tied)."""

    embed_VD: jax.Array
    final_norm: jax.Array
    head_VD: jax.Array | None
    layers: tuple[LayerWeights, ...]


@flax.struct.dataclass
class RolloutCache:
    """The KV cache with one buffer per layer: ``keys[y]``, ``values[y]`` are ``[B, K, S, E]``.

    The bookkeeping is :class:`~podsjax.models.KVCache`'s.
    """

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    mask_BS: jax.Array
    index_B: jax.Array
    positions_B: jax.Array

    def repeat(self, n: int) -> RolloutCache:
        """Every row ``n`` times in place order: row b becomes rows b*n .. b*n+n-1."""
        return jax.tree.map(lambda x: jnp.repeat(x, n, axis=0), self)


@flax.struct.dataclass
class GroupedCache:
    """The prompts' KV once (``prompts``: P rows) and the completions' (``rows``: P x n rows,
    sample j of prompt p at row p x n + j). ``rows.positions_B`` continues each prompt's
    count of real tokens, and ``rows.index_B`` counts completion slots from 0. The
    completions' values are stored ``[B, K, E, T]``, slots last (see :func:`attend_grouped`)."""

    prompts: RolloutCache
    rows: RolloutCache

    @classmethod
    def start(cls, prompts: RolloutCache, num_samples: int, max_new_tokens: int) -> GroupedCache:
        """The cache after prefilling ``prompts``: ``num_samples`` empty completions each."""
        num_prompts, kv_heads, _, head_dim = prompts.keys[0].shape
        b, dtype = num_prompts * num_samples, prompts.keys[0].dtype
        rows = RolloutCache(
            keys=tuple(jnp.zeros((b, kv_heads, max_new_tokens, head_dim), dtype) for _ in prompts.keys),
            values=tuple(jnp.zeros((b, kv_heads, head_dim, max_new_tokens), dtype) for _ in prompts.values),
            mask_BS=jnp.zeros((b, max_new_tokens), bool), index_B=jnp.zeros((b,), jnp.int32),
            positions_B=jnp.repeat(prompts.positions_B, num_samples))
        return cls(prompts=prompts, rows=rows)


def empty_cache(config, batch: int, max_len: int, dtype: Any) -> RolloutCache:
    shape = (batch, config.num_kv_heads, max_len, config.head_dim)
    zeros = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
    return RolloutCache(keys=zeros, values=zeros, mask_BS=jnp.zeros((batch, max_len), bool),
                        index_B=jnp.zeros((batch,), jnp.int32), positions_B=jnp.zeros((batch,), jnp.int32))


def cache_shardings(cache: RolloutCache | GroupedCache, mesh: Mesh) -> RolloutCache | GroupedCache:
    """Rows over the mesh's batch axes, everything else whole (``cache`` may be abstract).

    A grouped cache's prompts follow their samples' rows where the prompt count divides
    over the batch axes (each device then holds the prompts of its own rows), and are
    whole on every device where it does not."""
    return jax.tree.map(lambda x: mesh_lib.logical_sharding(mesh, ("batch",) + (None,) * (x.ndim - 1), x.shape), cache)


def weights_shardings(weights: RolloutWeights, mesh: Mesh) -> RolloutWeights:
    """Every weight whole on every device."""
    return jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), weights)


def layers_per_merge(num_layers: int) -> int:
    """Layers merged by one batched matmul: at most 8 (a temporary of at most 8 layers'
    weights), the largest such divisor of the depth when it is at least 4 (every group's
    matmuls of one shape: 28 layers merge as 4 groups of 7)."""
    size = max(d for d in range(1, min(8, num_layers) + 1) if num_layers % d == 0)
    return size if size >= min(4, num_layers) else min(8, num_layers)


def rollout_weights(model, params: dict[str, Any], lora: LoraParams | None = None) -> RolloutWeights:
    """The policy ``params`` (+ ``lora``) as :class:`RolloutWeights` in ``model.dtype``.

    Each LoRA delta is added in fp32 before the cast (``merged_kernel``). A projection is
    merged for :func:`layers_per_merge` layers at once, one batched matmul over the stacked
    layers, and then cut into per-layer buffers: merged layer by layer, a 28-layer program
    held 196 small matmuls for XLA's GPU compiler to autotune; merged over all layers at
    once, it held a temporary as large as the weights. The groups merge one after another
    (an optimization barrier): left free, XLA's GPU compiler cast every group's bf16 kernels
    to fp32 in one fusion, a temporary of 87 % of the 1.5B's weights. Pure: jit it with
    :func:`weights_shardings` as the output shardings.
    """
    cfg, dt = model.config, model.dtype
    stacked, adapters = params["layers"], (lora.weights.get("layers", {}) if lora is not None else {})

    def matrices(group: str, name: str, n_in: int, layers: slice) -> jax.Array:
        """The ``[in, out]`` matrices of one projection in ``layers``, ``[Y', in, out]`` in ``dt``."""
        k = stacked[group][name]["kernel"][layers]
        ab = adapters.get(group, {}).get(name)
        if ab is not None:
            k = merged_kernel(k, jax.tree.map(lambda x: x[layers], ab), lora.scale)
        return k.astype(dt).reshape(k.shape[0], math.prod(k.shape[1:1 + n_in]), -1)

    layers = []
    size = layers_per_merge(cfg.num_layers)
    for first in range(0, cfg.num_layers, size):
        group = slice(first, min(first + size, cfg.num_layers))
        if layers and adapters:  # after the last group is cut out: one group's fp32 LoRA merges at a time
            (stacked, adapters), _ = jax.lax.optimization_barrier(((stacked, adapters), layers))
        qkv = jnp.concatenate([matrices("attn", p, 1, group) for p in ("q", "k", "v")], axis=-1)
        gate_up = jnp.concatenate([matrices("mlp", "gate", 1, group), matrices("mlp", "up", 1, group)], axis=-1)
        o, down = matrices("attn", "o", 2, group), matrices("mlp", "down", 1, group)
        bias = None
        if cfg.qkv_bias:
            bias = jnp.concatenate([stacked["attn"][p]["bias"][group].reshape(qkv.shape[0], -1)
                                    for p in ("q", "k", "v")], axis=-1).astype(dt)
        attn_norm, mlp_norm = (stacked[n]["scale"][group].astype(dt) for n in ("attn_norm", "mlp_norm"))
        layers += [LayerWeights(attn_norm=attn_norm[y], qkv=qkv[y], qkv_bias=None if bias is None else bias[y],
                                o=o[y], mlp_norm=mlp_norm[y], gate_up=gate_up[y], down=down[y])
                   for y in range(qkv.shape[0])]
    layers = tuple(layers)
    head = None if cfg.tie_word_embeddings else params["lm_head"]["kernel"].T.astype(dt)
    return RolloutWeights(embed_VD=params["embed"]["embedding"].astype(dt),
                          final_norm=params["final_norm"]["scale"].astype(dt), head_VD=head, layers=layers)


def _norm(x_BLD: jax.Array, scale: jax.Array, eps: float, dt: Any) -> jax.Array:
    """:class:`~podsjax.models.decoder.RMSNorm`'s arithmetic: fp32 statistics, scaled in ``dt``."""
    x32 = x_BLD.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return scale.astype(dt) * normed.astype(dt)


def forward(model, weights: RolloutWeights, ids_BL: jax.Array, mask_BL: jax.Array,
            cache: RolloutCache | GroupedCache, *, last_only: bool = False
            ) -> tuple[jax.Array, RolloutCache | GroupedCache]:
    """:class:`~podsjax.models.Decoder` with a cache, over rollout weights, layers unrolled.

    Args:
        model: the decoder (its config, compute dtype, mesh and attention choice).
        ids_BL, mask_BL: L new tokens per row (a whole prompt, or one decode token) and
            their mask (0: a token later steps must not attend to).
        cache: the cache the tokens are written into, at each row's ``index_B``; a
            :class:`GroupedCache` takes one decode token per row, written into its ``rows``.
        last_only: logits of the last position only.

    Returns:
        ``(logits_BLV fp32, cache)``.
    """
    cfg, dt, mesh = model.config, model.dtype, model.mesh
    h, k, e = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    b, length = ids_BL.shape
    mask_BL = mask_BL.astype(bool)
    grouped = cache if isinstance(cache, GroupedCache) else None
    if grouped is not None:
        if length != 1:
            raise ValueError(f"a GroupedCache takes one decode token per row; got {length}")
        cache = grouped.rows
    slots = dec.cache_slots(cache, mask_BL)
    platform = mesh_lib.platform(mesh)
    implementation = dec.attention_implementation(model.attention, dt, e, platform)
    rope = dec.rope_tables(slots.positions_BL, dec.rope_inv_freq(cfg), dt)
    use_kernel = grouped is not None and decode_kernel_fits(implementation, e, cache.keys[0].dtype)
    if use_kernel:  # the kernel rotates the step's queries and keys itself
        factors = decode_kernel.rope_factors(rope[0][:, 0], rope[1][:, 0])

    def rows(x):
        return mesh_lib.constrain(x, mesh, ("batch",) + (None,) * (x.ndim - 1))

    x_BLD = rows(jnp.take(weights.embed_VD, ids_BL, axis=0).astype(dt))
    keys, values = list(cache.keys), list(cache.values)
    for y, layer in enumerate(weights.layers):
        hidden = _norm(x_BLD, layer.attn_norm, cfg.rms_norm_eps, dt)
        qkv = dec.matmul(hidden, layer.qkv, 1)
        if grouped is not None:
            prompt_kv = (grouped.prompts.keys[y], grouped.prompts.values[y], grouped.prompts.mask_BS)
        if use_kernel:  # the kernel adds the bias, rotates the token's query and key and writes key and value
            # (a Triton GEMM without split-K left the bias add to a kernel of its own)
            out_BLHE, (keys[y], values[y]) = attend_grouped_kernel(
                qkv.reshape(b, h + 2 * k, e), *factors, *prompt_kv, keys[y], values[y], slots.allowed_BLS,
                slots.slots_BL[:, 0] + 1, mesh, bias_N=layer.qkv_bias)
        else:
            if layer.qkv_bias is not None:
                qkv = qkv + layer.qkv_bias
            q_BLHE = qkv[..., : h * e].reshape(b, length, h, e)
            k_BLKE = qkv[..., h * e: (h + k) * e].reshape(b, length, k, e)
            v_BLKE = qkv[..., (h + k) * e:].reshape(b, length, k, e)
            q_BLHE, k_BLKE = dec.apply_rope(q_BLHE, rope), dec.apply_rope(k_BLKE, rope)
            keys[y], values[y] = write_kv(keys[y], values[y], k_BLKE, v_BLKE, slots.slots_BL,
                                          values_slots_last=grouped is not None)
            if grouped is not None:
                out_BLHE = attend_grouped(q_BLHE, *prompt_kv, keys[y], values[y], slots.allowed_BLS)
            elif length == 1:
                out_BLHE = dec.attend_cached(q_BLHE, keys[y], values[y], slots.allowed_BLS, platform)
            else:
                k_BSKE, v_BSKE = (c.transpose(0, 2, 1, 3).astype(dt) for c in (keys[y], values[y]))
                out_BLHE = dec.attend(q_BLHE, k_BSKE, v_BSKE, slots.allowed_BLS, implementation, mesh)
        x_BLD = rows(x_BLD + dec.matmul(out_BLHE.reshape(b, length, h * e), layer.o, 1))
        hidden = _norm(x_BLD, layer.mlp_norm, cfg.rms_norm_eps, dt)
        gate_up = dec.matmul(hidden, layer.gate_up, 1)
        f = layer.down.shape[0]
        x_BLD = rows(x_BLD + dec.matmul(jax.nn.silu(gate_up[..., :f]) * gate_up[..., f:], layer.down, 1))
    if last_only:
        x_BLD = x_BLD[:, -1:]
    x_BLD = _norm(x_BLD, weights.final_norm, cfg.rms_norm_eps, dt)
    head = weights.embed_VD if weights.head_VD is None else weights.head_VD
    cache = cache.replace(keys=tuple(keys), values=tuple(values), **slots.bookkeeping(cache, mask_BL))
    if grouped is not None:
        cache = grouped.replace(rows=cache)
    return dec.lm_logits(x_BLD, head), cache


def write_kv(keys: jax.Array, values: jax.Array, k_BLKE: jax.Array, v_BLKE: jax.Array, slots_BL: jax.Array,
             values_slots_last: bool) -> tuple[jax.Array, jax.Array]:
    """The tokens' keys and values written at ``slots_BL`` of one layer's cache, in place;
    out-of-range slots are dropped. Values are ``[B, K, E, T]`` with ``values_slots_last``
    (a grouped cache's completions), else ``[B, K, T, E]``."""
    rows_B1 = jnp.arange(k_BLKE.shape[0])[:, None]
    keys = keys.at[rows_B1, :, slots_BL].set(k_BLKE.astype(keys.dtype))
    at = values.at[rows_B1, :, :, slots_BL] if values_slots_last else values.at[rows_B1, :, slots_BL]
    return keys, at.set(v_BLKE.astype(values.dtype))


def attend_grouped(q_B1HE: jax.Array, prompt_k_PKSE: jax.Array, prompt_v_PKSE: jax.Array, prompt_mask_PS: jax.Array,
                   k_BKTE: jax.Array, v_BKET: jax.Array, allowed_B1T: jax.Array) -> jax.Array:
    """One decode query per row over its prompt's keys (shared by the group's n rows) and its
    own completion's keys: one softmax over both, summed in fp32.

    Every part is a sum of products that XLA fuses with its reads of the cache
    (:func:`~podsjax.models.decoder.attend_cached`'s one-query form). A prompt's keys and
    values, one copy for its n rows, are a few MB per layer: the rows re-read them from the
    GPU's L2 cache, not from HBM. The completions' values are stored slots last, so their
    sum runs along contiguous memory (slots second to last, the H100 compiler wrote a
    transposed fp32 copy of every layer's values each step).
    """
    b, _, h, e = q_B1HE.shape
    p, k = prompt_k_PKSE.shape[:2]
    n, g = b // p, h // k
    floor = jnp.finfo(jnp.float32).min
    q_PNKGE = q_B1HE.reshape(p, n, k, g, e).astype(jnp.float32) * (e ** -0.5)
    prompt_PNKGS = jnp.sum(q_PNKGE[:, :, :, :, None, :] * prompt_k_PKSE[:, None, :, None].astype(jnp.float32), axis=-1)
    prompt_PNKGS = jnp.where(prompt_mask_PS[:, None, None, None, :], prompt_PNKGS, floor)
    q_BKGE = q_PNKGE.reshape(b, k, g, e)
    own_BKGT = jnp.sum(q_BKGE[:, :, :, None, :] * k_BKTE[:, :, None].astype(jnp.float32), axis=-1)
    own_BKGT = jnp.where(allowed_B1T[:, :, None, :], own_BKGT, floor)
    top_BKG = jnp.maximum(prompt_PNKGS.max(axis=-1).reshape(b, k, g), own_BKGT.max(axis=-1))
    prompt_PNKGS = jnp.exp(prompt_PNKGS - top_BKG.reshape(p, n, k, g)[..., None])
    own_BKGT = jnp.exp(own_BKGT - top_BKG[..., None])
    total_BKG = prompt_PNKGS.sum(axis=-1).reshape(b, k, g) + own_BKGT.sum(axis=-1)
    from_prompt_PNKGE = jnp.sum(prompt_PNKGS[..., None] * prompt_v_PKSE[:, None, :, None].astype(jnp.float32), axis=-2)
    from_own_BKGE = jnp.sum(own_BKGT[:, :, :, None, :] * v_BKET[:, :, None].astype(jnp.float32), axis=-1)
    out_BKGE = (from_prompt_PNKGE.reshape(b, k, g, e) + from_own_BKGE) / total_BKG[..., None]
    return out_BKGE.reshape(b, 1, h, e).astype(q_B1HE.dtype)


def decode_kernel_fits(implementation: str, head_dim: int, cache_dtype) -> bool:
    """Whether grouped decode runs :mod:`~podsjax.models.decode_kernel`: where prefill runs
    cuDNN (a GPU, 16-bit; ``attention="xla"`` opts out of both), with a 16-bit cache and a
    head size Triton tiles (a power of two, at least 16)."""
    return (implementation == "cudnn" and jnp.dtype(cache_dtype).itemsize == 2
            and head_dim >= 16 and head_dim & (head_dim - 1) == 0)


def attend_grouped_token(qkv_BNE: jax.Array, cos_BE: jax.Array, sin_BE: jax.Array, prompt_k_PKSE: jax.Array,
                         prompt_v_PKSE: jax.Array, prompt_mask_PS: jax.Array, k_BKTE: jax.Array, v_BKET: jax.Array,
                         allowed_B1T: jax.Array, length_B: jax.Array,
                         bias_N: jax.Array | None = None) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """:func:`attend_grouped_kernel`'s work in XLA ops: bias, RoPE, :func:`write_kv`, :func:`attend_grouped`."""
    q_BHE, cache = write_token(qkv_BNE, cos_BE, sin_BE, k_BKTE, v_BKET, length_B, bias_N, values_slots_last=True)
    out = attend_grouped(q_BHE[:, None], prompt_k_PKSE, prompt_v_PKSE, prompt_mask_PS, *cache, allowed_B1T)
    return out, cache


def write_token(qkv_BNE: jax.Array, cos_BE: jax.Array, sin_BE: jax.Array, keys: jax.Array, values: jax.Array,
                length_B: jax.Array, bias_N: jax.Array | None, values_slots_last: bool
                ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """The step's token from the qkv heads (H queries and K keys before RoPE, then K values;
    ``bias_N`` not yet added): its rotated queries ``[B, H, E]``, and the completions' cache
    with its key and value written at slot ``length_B - 1`` (:func:`write_kv`)."""
    b, heads, e = qkv_BNE.shape
    k = keys.shape[1]
    h = heads - 2 * k
    if bias_N is not None:
        qkv_BNE = qkv_BNE + bias_N.reshape(heads, e)
    raw = qkv_BNE[:, :h + k]
    rotated = decode_kernel.rotate_half(raw, jnp.roll(raw, e // 2, -1), cos_BE[:, None], sin_BE[:, None])
    cache = write_kv(keys, values, rotated[:, None, h:], qkv_BNE[:, None, h + k:], (length_B - 1)[:, None],
                     values_slots_last=values_slots_last)
    return rotated[:, :h], cache


def attend_grouped_kernel(qkv_BNE: jax.Array, cos_BE: jax.Array, sin_BE: jax.Array, prompt_k_PKSE: jax.Array,
                          prompt_v_PKSE: jax.Array, prompt_mask_PS: jax.Array, k_BKTE: jax.Array, v_BKET: jax.Array,
                          allowed_B1T: jax.Array, length_B: jax.Array, mesh: Mesh | None,
                          bias_N: jax.Array | None = None) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """RoPE on the step's queries and keys, :func:`write_kv` and :func:`attend_grouped` as one
    fused kernel per layer (:mod:`~podsjax.models.decode_kernel`): returns the output
    ``[B, 1, H, E]`` and the completions' cache.

    ``qkv_BNE``: the qkv projection's heads (H queries and K keys before RoPE, K values),
    ``bias_N`` its bias (``[(H + 2K) * E]``, not yet added) or None;
    ``cos_BE, sin_BE``: ``decode_kernel.rope_factors``. Each row's key and value are written at
    its slot ``length_B - 1`` (``length_B``: the completion slots each row reads). On a mesh the
    kernel runs per device on its rows (``shard_map``). Its prompts are local when the
    prompt count divides over the rows' axes, as :func:`cache_shardings` places them; when
    it does not, the prompts are whole on every device and a device whose rows all sample
    one prompt slices that prompt out; any other split takes :func:`attend_grouped`.
    """
    b, heads, e = qkv_BNE.shape
    p, k = prompt_k_PKSE.shape[:2]
    n, h = b // p, heads - 2 * k

    def call(qkv, cos, sin, pk, pv, pmask, keys, values, allowed, length, *bias):
        out, cache = decode_kernel.grouped_decode_attention(None, pk, pv, pmask, keys, values, allowed[:, 0], length,
                                                            (qkv, cos, sin, *bias))
        return out.reshape(qkv.shape[0], 1, h, e).astype(qkv.dtype), cache

    by_rows = (qkv_BNE, cos_BE, sin_BE, prompt_k_PKSE, prompt_v_PKSE, prompt_mask_PS, k_BKTE, v_BKET, allowed_B1T,
              length_B)  # split with the rows (the prompts, 3-5, where they can)
    bias = () if bias_N is None else (bias_N,)
    args = by_rows + bias
    if mesh is None or mesh.size == 1:
        return call(*args)
    rows = mesh_lib.logical_to_spec(("batch",), mesh, (b,))
    prompts = mesh_lib.logical_to_spec(("batch",), mesh, (p,))
    shards = math.prod(mesh.shape[a] for a in mesh_lib.spec_axes(rows[0]))
    local_rows = b // shards
    if prompts != rows and n % local_rows != 0:
        return attend_grouped_token(*args)
    row_spec = lambda x: PartitionSpec(*rows, *[None] * (x.ndim - 1))  # noqa: E731
    # Prompts split as their rows are stay local; otherwise each device takes them whole
    # (a small gather where they were split over fewer axes) and slices out its one prompt.
    prompt_spec = row_spec if prompts == rows else (lambda x: PartitionSpec())
    specs = tuple(prompt_spec(x) if i in (3, 4, 5) else row_spec(x) for i, x in enumerate(by_rows))
    specs += (PartitionSpec(),) * len(bias)  # the bias, whole on every device

    def per_device(qkv, cos, sin, pk, pv, pmask, *rest):
        if prompts != rows:  # this device's rows all sample one prompt
            first = jax.lax.axis_index(mesh_lib.spec_axes(rows[0])) * local_rows // n
            pk, pv, pmask = (jax.lax.dynamic_slice_in_dim(x, first, 1, axis=0) for x in (pk, pv, pmask))
        return call(qkv, cos, sin, pk, pv, pmask, *rest)

    out_specs = (PartitionSpec(*rows, None, None, None), (specs[6], specs[7]))
    return jax.shard_map(per_device, mesh=mesh, in_specs=specs, out_specs=out_specs, check_vma=False)(*args)
