"""Decoding's attention call built from JAX's own Pallas GPU kernels, for comparison.

``jax.experimental.pallas.ops.gpu.decode_attention.mqa`` is flash decoding: a program per
block of 16 query heads and ``k_splits`` share of one key sequence, the parts merged by
their log-sum-exp. It masks by a start and a length, and reads one key sequence per batch
entry. The call that decoding makes (:func:`podsjax.models.rollout.attend_grouped_kernel`)
maps onto it as two calls and a merge:

- the prompt: per prompt and kv head, the group's n rows x G query heads are one batch
  entry's queries against the prompt's keys, which the group reads once;
- the completion: per row and kv head, its G query heads against its own completion, up
  to its length.

The bias, RoPE and the cache write are XLA ops before them, as in
:func:`~podsjax.models.rollout.attend_grouped_token`. The completions' values are kept
``[B, K, T, E]``, the kernel's layout (``v_BKTE``, :func:`kernel_layout`), so no call reads a
transposed copy. The kernel masks by a start and a length, not by a mask: prompts must be
left-padded (the start stands for their mask), and a row attends to every completion slot
below its length (``allowed_B1T`` is not read; decoding's holes come only after a row's EOS).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import decode_attention

from podsjax.models import decode_kernel, rollout

PLAN, DEFAULT = "the plan's", "mqa's default"  # k_splits as decode_kernel.plan splits, or mqa's own 16
CACHE = ("k_BKTE", "v_BKTE")  # the inputs a call writes
_QUERY_BLOCK, _MAX_KEY_BLOCK, _DEFAULT_SPLITS = 16, 256, 16  # mqa's block_h, block_k and k_splits defaults


def kernel_layout(x: dict) -> dict:
    """The inputs of ``rollout.attend_grouped_kernel`` with the completions' values ``[B, K, T, E]``."""
    y = {name: v for name, v in x.items() if name != "v_BKET"}
    return dict(y, v_BKTE=jnp.swapaxes(x["v_BKET"], 2, 3))


def _dims(x: dict) -> tuple[int, ...]:
    """(rows, prompts, kv heads, query heads per kv head, prompt slots, completion slots)."""
    b, heads, _ = x["qkv_BNE"].shape
    p, k, prompt_len, _ = x["prompt_k_PKSE"].shape
    return b, p, k, (heads - 2 * k) // k, prompt_len, x["k_BKTE"].shape[2]


def splits(x: dict, choice: str) -> tuple[int, int]:
    """``k_splits`` of the prompt's call and the completion's; mqa takes 16 slots a split at least."""
    b, p, k, g, prompt_len, slots = _dims(x)
    if choice == DEFAULT:
        return tuple(max(1, min(_DEFAULT_SPLITS, length // 16)) for length in (prompt_len, slots))
    if choice != PLAN:
        raise ValueError(f"k_splits choice must be {PLAN!r} or {DEFAULT!r}; got {choice!r}")
    split = decode_kernel.plan(b, p, k, g, prompt_len, slots)
    return split.prefix_splits, split.own_splits


def programs(x: dict, choice: str) -> tuple[int, int, int, int]:
    """The two calls' programs (prompt, completion), and the longest walk: key blocks, slots a block."""
    b, p, k, g, prompt_len, slots = _dims(x)
    prompt_splits, own_splits = splits(x, choice)
    longest = max(prompt_len // prompt_splits, slots // own_splits)
    block = min(_MAX_KEY_BLOCK, longest)
    return (p * k * -(-b // p * g // _QUERY_BLOCK) * prompt_splits, b * k * -(-g // _QUERY_BLOCK) * own_splits,
            longest // block, block)


@functools.partial(jax.jit, static_argnames=("choice", "interpret"))
def attend(x: dict, choice: str = PLAN, interpret: bool = False):
    """``rollout.attend_grouped_kernel``'s work on :func:`kernel_layout`'s inputs: the output
    ``[B, 1, H, E]`` and the cache ``(k [B, K, T, E], v [B, K, T, E])``."""
    b, p, k, g, prompt_len, slots = _dims(x)
    qkv, e = x["qkv_BNE"], x["qkv_BNE"].shape[2]
    n, h = b // p, k * g
    prompt_splits, own_splits = splits(x, choice)
    length = x["length_B"]
    q, cache = rollout.write_token(qkv, x["cos_BE"], x["sin_BE"], x["k_BKTE"], x["v_BKTE"], length, x.get("bias_N"),
                                   values_slots_last=False)
    run = functools.partial(decode_attention.mqa, sm_scale=e ** -0.5, return_residuals=True, normalize_output=False,
                            interpret=interpret)
    first = prompt_len - x["prompt_mask_PS"].sum(-1).astype(jnp.int32)  # left padding
    o_pre, (l_pre, m_pre) = run(q.reshape(p, n, k, g, e).transpose(0, 2, 1, 3, 4).reshape(p * k, n * g, e),
                                x["prompt_k_PKSE"].reshape(p * k, prompt_len, e),
                                x["prompt_v_PKSE"].reshape(p * k, prompt_len, e),
                                start_idx=jnp.repeat(first, k), k_splits=prompt_splits)
    o_own, (l_own, m_own) = run(q.reshape(b * k, g, e), cache[0].reshape(b * k, slots, e),
                                cache[1].reshape(b * k, slots, e), kv_seq_len=jnp.repeat(length, k),
                                k_splits=own_splits)

    def per_row(y):  # the prompt call's [P * K, n * G, ...] as [B, K, G, ...]
        return jnp.moveaxis(y.reshape(p, k, n, g, *y.shape[2:]), 2, 1).reshape(b, k, g, *y.shape[2:])

    o_pre, l_pre, m_pre = per_row(o_pre), per_row(l_pre), per_row(m_pre)
    o_own, l_own, m_own = (y.reshape(b, k, g, *y.shape[2:]) for y in (o_own, l_own, m_own))
    top = jnp.maximum(m_pre, m_own)
    w_pre, w_own = jnp.exp(m_pre - top), jnp.exp(m_own - top)
    out = o_pre.astype(jnp.float32) * w_pre[..., None] + o_own.astype(jnp.float32) * w_own[..., None]
    out = out / (l_pre * w_pre + l_own * w_own)[..., None]
    return out.reshape(b, 1, h, e).astype(qkv.dtype), cache
