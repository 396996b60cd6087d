"""Grouped decode attention as one GPU kernel (Pallas, lowered through Triton).

:func:`~podsjax.models.rollout.attend_grouped` in XLA writes each layer's fp32 scores to
memory and reads them back three times (the softmax's maximum, its sum, the weighted sum
of values): at 256 rows of Qwen2.5-1.5B that is a third of a decode step's bytes beyond
its floor. This kernel keeps the scores in registers (flash decoding): one program per
row and kv head streams that row's prompt keys and values (shared by the group's n rows,
so re-read from L2, not HBM) and its own completion, with an online softmax over both.
HBM traffic is the KV cache once, plus the queries and the output.

Each row stops reading its completion at its write slot, so a step reads the completion
written so far, not the whole buffer.

Numerics: scores and the weighted sum of values are fp32 (the values are upcast in
registers, the dots run in full fp32), as on the XLA path; the two agree to fp32 rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_MIN_DOT = 16  # Triton's dots take tiles of at least 16 along each dimension
_BLOCK = 64  # cache slots per loop iteration
_NEG = 0.7 * float(jnp.finfo(jnp.float32).min)  # masked scores: exp underflows to 0, no inf - inf


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _kernel(q_ref, pk_ref, pv_ref, pmask_ref, k_ref, v_ref, allowed_ref, length_ref, o_ref, *,
            groups: int, prompt_len: int, slots: int, block: int, scale: float):
    """One row, one kv head. Refs: q ``[GP, E]``; the row's prompt ``pk``/``pv`` ``[S, E]`` and
    ``pmask`` ``[S]``; its completion ``k`` ``[T, E]``, ``v`` ``[E, T]``, ``allowed`` ``[T]``;
    ``length`` ``[1]`` (slots to read); out ``[GP, E]``."""
    gp, e = q_ref.shape
    q_rows = jnp.arange(gp) < groups
    q = plgpu.load(q_ref, mask=q_rows[:, None], other=0).astype(jnp.float32) * scale
    offsets = jnp.arange(block)

    def blocks(keys_ref, values_ref, real_ref, length: int, slots_last: bool):
        """The loop body over one part of the cache: ``length`` slots of ``keys_ref`` ``[.., E]``
        and ``values_ref`` (``[E, ..]`` when ``slots_last``), ``real_ref`` marking those attended."""
        def step(i, carry):
            o, top, total = carry
            start = i * block
            inside = start + offsets < length
            window = pl.ds(start, block)
            keys = plgpu.load(keys_ref.at[window, :], mask=inside[:, None], other=0)
            real = plgpu.load(real_ref.at[window], mask=inside, other=0) != 0
            scores = plgpu.dot(q, keys.astype(jnp.float32), trans_b=True, allow_tf32=False)
            scores = jnp.where(real[None, :], scores, _NEG)
            if slots_last:
                values = plgpu.load(values_ref.at[:, window], mask=inside[None, :], other=0)
            else:
                values = plgpu.load(values_ref.at[window, :], mask=inside[:, None], other=0)
            new_top = jnp.maximum(top, scores.max(axis=-1))
            correction = jnp.exp(top - new_top)
            p = jnp.exp(scores - new_top[:, None])
            pv = plgpu.dot(p, values.astype(jnp.float32), trans_b=slots_last, allow_tf32=False)
            return o * correction[:, None] + pv, new_top, total * correction + p.sum(axis=-1)

        return step

    carry = (jnp.zeros((gp, e), jnp.float32), jnp.full((gp,), _NEG, jnp.float32), jnp.zeros((gp,), jnp.float32))
    carry = jax.lax.fori_loop(0, pl.cdiv(prompt_len, block), blocks(pk_ref, pv_ref, pmask_ref, prompt_len, False),
                              carry)
    own_blocks = pl.cdiv(jnp.minimum(length_ref[0], slots), block)
    o, _, total = jax.lax.fori_loop(0, own_blocks, blocks(k_ref, v_ref, allowed_ref, slots, True), carry)
    out = o / total[:, None]
    plgpu.store(o_ref, out.astype(o_ref.dtype), mask=q_rows[:, None])


@functools.partial(jax.jit, static_argnames=("interpret",))
def grouped_decode_attention(q_BKGE: jax.Array, prompt_k_PKSE: jax.Array, prompt_v_PKSE: jax.Array,
                             prompt_mask_PS: jax.Array, k_BKTE: jax.Array, v_BKET: jax.Array,
                             allowed_BT: jax.Array, length_B: jax.Array, *, interpret: bool = False) -> jax.Array:
    """Softmax attention of one query per head and row over its prompt's KV and its own.

    Args:
        q_BKGE: the queries, G per kv head, in the cache's dtype.
        prompt_k_PKSE, prompt_v_PKSE, prompt_mask_PS: the prompts' cache (row b reads prompt
            ``b // (B // P)``) and which of its slots hold tokens.
        k_BKTE, v_BKET: the rows' completions (values slots last), ``allowed_BT`` the slots
            each row attends to.
        length_B: completion slots to read per row; slots from it on must not be allowed.
        interpret: run Pallas's interpreter (any backend), for tests.

    Returns:
        ``[B, K, G, E]`` in ``q_BKGE``'s dtype.
    """
    b, kv_heads, groups, e = q_BKGE.shape
    p, _, prompt_len, _ = prompt_k_PKSE.shape
    slots = k_BKTE.shape[2]
    n = b // p
    gp = max(_MIN_DOT, _next_pow2(groups))
    block = min(_BLOCK, max(_MIN_DOT, _next_pow2(max(prompt_len, slots))))
    kernel = functools.partial(_kernel, groups=groups, prompt_len=prompt_len, slots=slots, block=block,
                               scale=e ** -0.5)
    return pl.pallas_call(
        kernel,
        grid=(b, kv_heads),
        in_specs=[
            pl.BlockSpec((None, None, gp, e), lambda r, k: (r, k, 0, 0)),
            pl.BlockSpec((None, None, prompt_len, e), lambda r, k: (r // n, k, 0, 0)),
            pl.BlockSpec((None, None, prompt_len, e), lambda r, k: (r // n, k, 0, 0)),
            pl.BlockSpec((None, prompt_len), lambda r, k: (r // n, 0)),
            pl.BlockSpec((None, None, slots, e), lambda r, k: (r, k, 0, 0)),
            pl.BlockSpec((None, None, e, slots), lambda r, k: (r, k, 0, 0)),
            pl.BlockSpec((None, slots), lambda r, k: (r, 0)),
            pl.BlockSpec((None, 1), lambda r, k: (r, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, gp, e), lambda r, k: (r, k, 0, 0)),
        out_shape=jax.ShapeDtypeStruct(q_BKGE.shape, q_BKGE.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="grouped_decode_attention",
    )(q_BKGE, prompt_k_PKSE, prompt_v_PKSE, prompt_mask_PS.astype(jnp.int32), k_BKTE, v_BKET,
      allowed_BT.astype(jnp.int32), length_B.astype(jnp.int32)[:, None])
