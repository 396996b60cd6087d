"""The update's shared-prefix forward: each prompt through the layers once, its completions
attending to the prompt's keys and values and causally to their own.

GRPO trains several completions of one prompt. Run as rows of prompt + completion, the
prompt goes through every layer once per completion, forward and backward. Here a batch
is G prompt rows ``[G, Lp]`` (left-padded) and ``B = G * s`` completion rows ``[B, T]``:
rows ``g * s .. g * s + s - 1`` continue prompt g. In each layer the prompt rows attend
causally to themselves, exactly as a prompt-only forward; each completion token attends
to its prompt's real tokens and causally to its own row's real tokens, as it would in the
row prompt + completion. Autodiff sums the gradients that the s completions send back
to their prompt's keys and values.

Who attends to what, for one prompt ``p p p`` and two completions ``a a`` and ``b b``::

             keys:  p p p | a a | b b
    prompt   p      x . .
             p      x x .
             p      x x x
    row a    a      x x x   x .
             a      x x x   x x
    row b    b      x x x           x .
             b      x x x           x x

:class:`PrefixDecoder` has the :class:`~podsjax.models.Decoder`'s params (the same
names, the same tree), so one set of weights and LoRA adapters runs either form.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from podsjax.devices import mesh as mesh_lib
from podsjax.models.attention import attend, attention_implementation
from podsjax.models.model_config import ModelConfig
from podsjax.models.decoder import (
    Decoder,
    DecoderOutput,
    Embed,
    LMHead,
    Mlp,
    Projection,
    REMAT_POLICIES,
    RMSNorm,
    _LayerModule,
    scanned_blocks,
)
from podsjax.models.lora import PROJECTION_LOGICAL_AXES, LoraParams
from podsjax.models.rope import apply_rope, rope_inv_freq, rope_tables

_ACTIVATIONS = ("batch", "length", "act_embed")


class PrefixAttention(_LayerModule):
    """GQA self-attention of prompt rows and the completion rows that continue them (params as ``Attention``'s)."""

    @nn.compact
    def __call__(self, prompt_GPD, completion_BTD, rope_prompt, rope_completion, allowed_GPP, allowed_BTS, lora_attn):
        cfg = self.config
        h, k, e, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size

        def projection(name, out_shape):
            in_names, out_names = PROJECTION_LOGICAL_AXES[name]
            bias = cfg.qkv_bias and name != "o"
            module = Projection(out_shape, in_names, out_names, bias, self.dtype, self.param_dtype, name=name)
            return lambda x: module(x, lora_attn.get(name), self.lora_scale)

        q_proj, k_proj, v_proj = projection("q", (h, e)), projection("k", (k, e)), projection("v", (k, e))
        o_proj = projection("o", (d,))

        def queries_keys_values(x_BLD, rope):
            q_BLHE = mesh_lib.constrain(q_proj(x_BLD), self.mesh, ("batch", "length", "q_heads", "head_dim"))
            return apply_rope(q_BLHE, rope), apply_rope(k_proj(x_BLD), rope), v_proj(x_BLD)

        q_GPHE, k_GPKE, v_GPKE = queries_keys_values(prompt_GPD, rope_prompt)
        q_BTHE, k_BTKE, v_BTKE = queries_keys_values(completion_BTD, rope_completion)
        out_GPHE = attend(q_GPHE, k_GPKE, v_GPKE, allowed_GPP, self.implementation, self.mesh)
        # Each completion row reads its prompt's keys/values, then its own: the row's key order.
        rows_per_prompt = completion_BTD.shape[0] // prompt_GPD.shape[0]
        k_BSKE = jnp.concatenate([jnp.repeat(k_GPKE, rows_per_prompt, axis=0), k_BTKE], axis=1)
        v_BSKE = jnp.concatenate([jnp.repeat(v_GPKE, rows_per_prompt, axis=0), v_BTKE], axis=1)
        out_BTHE = attend(q_BTHE, k_BSKE, v_BSKE, allowed_BTS, self.implementation, self.mesh)
        return o_proj(out_GPHE), o_proj(out_BTHE)


class PrefixBlock(_LayerModule):
    """``Block`` over prompt rows and their completion rows, one step of the layer scan (params as ``Block``'s).

    ``carry`` is ``(prompt_GPD, completion_BTD)``; ``layer_index`` and ``lora_layer`` are
    this layer's slices of the scanned inputs; the rest is broadcast to every layer.
    """

    @nn.compact
    def __call__(self, carry, layer_index, lora_layer, rope_prompt, rope_completion, allowed_GPP, allowed_BTS):
        del layer_index  # scanned only to give the scan its length when LoRA is off
        cfg, dt, pdt = self.config, self.dtype, self.param_dtype
        attn_norm = RMSNorm(cfg.rms_norm_eps, dt, pdt, name="attn_norm")
        mlp_norm = RMSNorm(cfg.rms_norm_eps, dt, pdt, name="mlp_norm")
        attn = PrefixAttention(cfg, dt, pdt, self.mesh, self.implementation, self.lora_scale, name="attn")
        mlp = Mlp(cfg, dt, pdt, self.mesh, self.lora_scale, name="mlp")
        prompt_GPD, completion_BTD = carry
        attn_prompt, attn_completion = attn(attn_norm(prompt_GPD), attn_norm(completion_BTD), rope_prompt,
                                            rope_completion, allowed_GPP, allowed_BTS, lora_layer.get("attn", {}))
        out = []
        for x_BLD, attn_out in ((prompt_GPD, attn_prompt), (completion_BTD, attn_completion)):
            x_BLD = mesh_lib.constrain(x_BLD + attn_out, self.mesh, _ACTIVATIONS)
            x_BLD = x_BLD + mlp(mlp_norm(x_BLD), lora_layer.get("mlp", {}))
            out.append(mesh_lib.constrain(x_BLD, self.mesh, _ACTIVATIONS))
        return tuple(out), None


class PrefixDecoder(nn.Module):
    """The :class:`~podsjax.models.Decoder`'s update forward with each prompt computed once.

    Attributes are the Decoder's (:meth:`of` copies them); sampling and every other
    forward stay on the Decoder.
    """

    config: ModelConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    remat: str = "full"
    mesh: Mesh | None = None
    attention: str = "auto"

    @classmethod
    def of(cls, model: Decoder) -> "PrefixDecoder":
        """The shared-prefix form of ``model``, with its settings."""
        return cls(model.config, model.dtype, model.param_dtype, model.remat, model.mesh, model.attention)

    @nn.compact
    def __call__(self, prompt_ids_GP: jax.Array, prompt_mask_GP: jax.Array, completion_ids_BT: jax.Array,
                 completion_mask_BT: jax.Array, lora: LoraParams | None = None) -> DecoderOutput:
        """Hidden states that predict each completion token, and the LM head.

        Args:
            prompt_ids_GP, prompt_mask_GP: G left-padded prompts and their real tokens.
            completion_ids_BT, completion_mask_BT: B = G * s completions, s a prompt, in
                prompt order, and their real tokens.
            lora: LoRA adapters; None runs the base model.

        Returns:
            A :class:`~podsjax.models.DecoderOutput` with ``hidden_BLD`` [B, T, D], the final
            normed hidden state at each position that predicts a completion token (the
            prompt's last one, then the completion's own but its last), and ``head_VD``: the
            Decoder's ``logits_slice=slice(-T - 1, -1), return_hidden=True`` on the rows
            prompt + completion.
        """
        cfg = self.config
        g, prompt_len = prompt_ids_GP.shape
        b, t = completion_ids_BT.shape
        if prompt_mask_GP.shape != (g, prompt_len) or completion_mask_BT.shape != (b, t):
            raise ValueError(f"masks {prompt_mask_GP.shape} and {completion_mask_BT.shape} do not match their ids "
                             f"{(g, prompt_len)} and {(b, t)}")
        if g == 0 or b % g:
            raise ValueError(f"{b} completion rows do not split evenly over {g} prompts")
        rows_per_prompt = b // g
        prompt_mask = prompt_mask_GP.astype(bool)
        completion_mask = completion_mask_BT.astype(bool)
        # RoPE positions count real tokens, as in the row prompt + completion.
        prompt_positions = jnp.maximum(jnp.cumsum(prompt_mask, axis=-1, dtype=jnp.int32) - 1, 0)
        prompt_tokens_B = jnp.repeat(jnp.sum(prompt_mask, axis=-1, dtype=jnp.int32), rows_per_prompt)
        completion_positions = jnp.maximum(
            prompt_tokens_B[:, None] + jnp.cumsum(completion_mask, axis=-1, dtype=jnp.int32) - 1, 0)
        # Causal over real keys; a query always sees itself, so no row is fully masked.
        prompt_ids_P, completion_ids_T = jnp.arange(prompt_len), jnp.arange(t)
        allowed_GPP = ((prompt_ids_P[:, None] >= prompt_ids_P[None, :])[None] & prompt_mask[:, None, :]) | jnp.eye(
            prompt_len, dtype=bool)[None]
        own_BTT = ((completion_ids_T[:, None] >= completion_ids_T[None, :])[None] & completion_mask[:, None, :]) | (
            jnp.eye(t, dtype=bool)[None])
        prompt_keys_BTP = jnp.broadcast_to(jnp.repeat(prompt_mask, rows_per_prompt, axis=0)[:, None, :],
                                           (b, t, prompt_len))
        allowed_BTS = jnp.concatenate([prompt_keys_BTP, own_BTT], axis=-1)

        embed = Embed(cfg.vocab_size, cfg.hidden_size, self.dtype, self.param_dtype, self.mesh, name="embed")
        prompt_GPD = mesh_lib.constrain(embed(prompt_ids_GP), self.mesh, _ACTIVATIONS)
        completion_BTD = mesh_lib.constrain(embed(completion_ids_BT), self.mesh, _ACTIVATIONS)
        inv_freq = rope_inv_freq(cfg)
        rope_prompt = rope_tables(prompt_positions, inv_freq, self.dtype)
        rope_completion = rope_tables(completion_positions, inv_freq, self.dtype)
        implementation = attention_implementation(self.attention, self.dtype, cfg.head_dim, mesh_lib.platform(self.mesh))
        lora_layers = lora.weights.get("layers", {}) if lora is not None else {}
        lora_scale = lora.scale if lora is not None else 1.0
        blocks = scanned_blocks(self.remat, PrefixBlock, _PREFIX_IN_AXES)(
            cfg, self.dtype, self.param_dtype, self.mesh, implementation, lora_scale, name="layers")
        layer_ids_Y = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        (prompt_GPD, completion_BTD), _ = blocks((prompt_GPD, completion_BTD), layer_ids_Y, lora_layers,
                                                 rope_prompt, rope_completion, allowed_GPP, allowed_BTS)
        # The prompt's last position predicts each of its completions' first token.
        last_BD = jnp.repeat(prompt_GPD[:, -1:], rows_per_prompt, axis=0)
        hidden_BTD = jnp.concatenate([last_BD, completion_BTD[:, :-1]], axis=1)
        hidden_BTD = RMSNorm(cfg.rms_norm_eps, self.dtype, self.param_dtype, name="final_norm")(hidden_BTD)
        if cfg.tie_word_embeddings:
            head_VD = embed.head_VD()
        else:
            head_VD = LMHead(cfg.vocab_size, cfg.hidden_size, self.dtype, self.param_dtype, name="lm_head").head_VD()
        return DecoderOutput(hidden_BLD=hidden_BTD, head_VD=head_VD)


_PREFIX_IN_AXES = (0, 0) + (nn.broadcast,) * 4
for _remat in REMAT_POLICIES:  # lifted before any thread traces one (podsjax.models.lifted)
    scanned_blocks(_remat, PrefixBlock, _PREFIX_IN_AXES)
