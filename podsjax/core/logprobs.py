"""Log-probs and entropies of tokens from logits, and from hidden states through the LM head in chunks.

Pure JAX, jit/vmap/grad-able, and imports nothing else from podsjax.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def _check_temperature(temperature: float, *, static: bool = False) -> None:
    if isinstance(temperature, jax.core.Tracer):
        if static:
            raise TypeError("head_logprobs takes temperature as a Python number (static under jit); got a traced value")
        return  # a traced temperature: keeping it > 0 is the caller's
    if temperature is None or isinstance(temperature, (bool, str)) or np.ndim(temperature) != 0:
        raise TypeError(f"temperature must be a number > 0; got {temperature!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (log-probs and entropies are of softmax(logits / T)); "
                         f"got {temperature}")


def _check_targets(targets, vocab: int) -> None:
    """Integer ids in [-vocab, vocab): past them the gather gives a NaN without a word. A negative
    id counts from the end, as in NumPy, so an ignore index (-100) that the caller masks is
    allowed. Checked on concrete values only; under jit, the caller's."""
    on_host = not isinstance(targets, jax.core.Tracer) and (
        not isinstance(targets, jax.Array) or targets.is_fully_addressable)  # else another host holds part
    # on the host: under a trace, jnp would stage the check into the program
    ids = np.asarray(targets) if on_host else targets
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"targets must be integer token ids; got dtype {ids.dtype}")
    if not on_host or not ids.size:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < -vocab or high >= vocab:
        bad = low if low < -vocab else high
        raise ValueError(f"target token id {bad} is outside the vocabulary [0, {vocab}) (and its negative "
                         f"indexing from the end, [-{vocab}, 0))")


def token_logprobs(logits_BLV: jax.Array, targets_BL: jax.Array, *, temperature: float = 1.0) -> jax.Array:
    """Log-probability of each target token under softmax(logits / temperature).

    Computed as the target's scaled logit minus a logsumexp, in float32. Under
    jit the scaling and the upcast fuse into the logsumexp reduction, so no
    [B, L, V] softmax or log-softmax copy is materialized.

    Args:
      logits_BLV: [..., L, V] logits of any float dtype.
      targets_BL: [..., L] int token ids in [0, V) (or counted from the end, as in NumPy: an
        ignore index such as -100 is the caller's to mask); past them, checked unless traced.
      temperature: > 0 (a Python number or a traced scalar); the sampler's
        temperature, so the ratio compares the same distribution the rollouts came from.

    Returns:
      [..., L] float32 log-probs.
    """
    _check_temperature(temperature)
    logits_shape, targets_shape = np.shape(logits_BLV), np.shape(targets_BL)
    if len(logits_shape) < 1 or logits_shape[:-1] != targets_shape:
        raise ValueError(f"logits {logits_shape} and targets {targets_shape} disagree on the leading axes")
    _check_targets(targets_BL, logits_shape[-1])  # before jnp: it would wrap int64 ids past int32
    logits_BLV, targets_BL = jnp.asarray(logits_BLV), jnp.asarray(targets_BL)
    x, top, lse = _shifted_logsumexp(logits_BLV, temperature)
    picked = jnp.take_along_axis(x, targets_BL[..., None].astype(jnp.int32), axis=-1)
    return ((picked - top) / temperature - lse)[..., 0]


def _shifted_logsumexp(logits, temperature):
    """The logits in float32, their maximum and the logsumexp of (logits - max) / T. Shifted
    before the division, so a small T sends the other tokens to -inf (their limit) instead of
    overflowing every logit to ±inf (NaN); the shifted maximum is exactly 0, so the logsumexp
    needs no pass of its own for it, and (x - max) / T fuses into the one reduction."""
    x = logits.astype(jnp.float32)
    top = jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    return x, top, jnp.log(jnp.sum(jnp.exp((x - top) / temperature), axis=-1, keepdims=True))


def token_entropy(logits_BLV: jax.Array, *, temperature: float = 1.0) -> jax.Array:
    """Entropy of softmax(logits / temperature) per position, [..., L] float32.

    H = logsumexp(x) - sum softmax(x) * x, written as reductions so XLA fuses it, with x
    shifted by its maximum first: the two terms then stay small and cancel less.
    """
    _check_temperature(temperature)
    logits_BLV = jnp.asarray(logits_BLV)
    if logits_BLV.ndim < 1:
        raise ValueError(f"logits must have a vocabulary axis [..., V]; got shape {logits_BLV.shape}")
    x, top, lse = _shifted_logsumexp(logits_BLV, temperature)
    scaled = (x - top) / temperature
    # A -inf logit (top-k / top-p filtered) has probability 0 and adds 0, not 0 * -inf = NaN;
    # the inner where keeps its gradient finite too.
    kept = scaled > -jnp.inf
    safe = jnp.where(kept, scaled, 0.0)
    return lse[..., 0] - jnp.sum(jnp.where(kept, jnp.exp(safe - lse) * safe, 0.0), axis=-1)


# Largest fp32 logits block [B, chunk, V] the chunked head materialises at once (512 MB).
LOGITS_CHUNK_ELEMENTS = 2**27


def logits_chunk(rows: int, length: int, vocab: int, max_elements: int = LOGITS_CHUNK_ELEMENTS) -> int:
    """The largest divisor of ``length`` whose [rows, chunk, vocab] block fits ``max_elements``."""
    limit = max(1, max_elements // max(1, rows * vocab))
    return max((c for c in range(1, min(limit, length) + 1) if length % c == 0), default=1)  # 1 when length is 0


def head_logprobs(
    hidden_BTD: jax.Array,
    head_VD: jax.Array,
    targets_BT: jax.Array,
    *,
    temperature: float = 1.0,
    max_elements: int = LOGITS_CHUNK_ELEMENTS,
) -> tuple[jax.Array, jax.Array]:
    """Target log-probs and entropies from hidden states, never holding all logits.

    The LM head runs over chunks of positions, forward and backward (a custom VJP that
    recomputes each chunk's logits), so both keep one [B, chunk, V] fp32 block at a time
    instead of the [B, T, V] logits (5 GB for 16 x 512 tokens of a 152k vocabulary). The
    backward multiplies in the head's dtype with fp32 accumulation: the head is never
    upcast (an fp32 copy of a tied 152k x 1536 head per chunk was 22 GB of traffic in a
    Qwen2.5-1.5B update), and its gradient is summed over the chunks in fp32.

    Args:
      hidden_BTD: final normed hidden states of the positions that predict ``targets``.
      head_VD: the LM head matrix (the embedding when tied).
      targets_BT: int token ids.
      temperature: > 0, a Python number (static: the backward pass is specialised to it).
      max_elements: logits elements per chunk.

    Returns:
      ``(logprobs_BT, entropy_BT)`` float32; the entropy carries no gradient.
    """
    _check_temperature(temperature, static=True)
    hidden, head, targets = np.shape(hidden_BTD), np.shape(head_VD), np.shape(targets_BT)
    if len(hidden) != 3 or len(head) != 2 or targets != hidden[:2] or head[1] != hidden[2]:
        raise ValueError(f"head_logprobs wants hidden [B, T, D], head [V, D] and targets [B, T]; got hidden "
                         f"{hidden}, head {head}, targets {targets}")
    _check_targets(targets_BT, head[0])  # before jnp: it would wrap int64 ids past int32
    hidden_BTD, head_VD, targets_BT = (jnp.asarray(x) for x in (hidden_BTD, head_VD, targets_BT))
    vocab = head_VD.shape[0]
    targets_BT = jnp.where(targets_BT < 0, targets_BT + vocab, targets_BT)  # the backward pass one-hots them
    b, t, _ = hidden_BTD.shape
    chunk = logits_chunk(b, t, vocab, max_elements)
    return _chunked_head(hidden_BTD, head_VD, targets_BT, float(temperature), chunk)


def _head_logits(h_BCD: jax.Array, head_VD: jax.Array) -> jax.Array:
    return jnp.einsum("bcd,vd->bcv", h_BCD, head_VD.astype(h_BCD.dtype), preferred_element_type=jnp.float32)


def _chunks(x: jax.Array, chunk: int) -> jax.Array:
    """[B, T, ...] -> [T / chunk, B, chunk, ...]."""
    b, t = x.shape[:2]
    return x.reshape(b, t // chunk, chunk, *x.shape[2:]).swapaxes(0, 1)


def _unchunk(x: jax.Array) -> jax.Array:
    n, b, c = x.shape[:3]
    return x.swapaxes(0, 1).reshape(b, n * c, *x.shape[3:])


def _explicit(x) -> bool:
    """Whether ``x`` is typed on a mesh with Explicit axes (JAX's sharding in types)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    types = getattr(getattr(sharding, "mesh", None), "axis_types", ())
    return any(t == jax.sharding.AxisType.Explicit for t in types)


def _contraction_spec(operand, like):
    """On a mesh with Explicit axes, a contraction over a sharded axis must name its output's
    sharding: ``like``'s, or replicated. None elsewhere (the compiler chooses)."""
    if not _explicit(operand):
        return None
    # A sharding on the operand's mesh, not a bare spec: that one needs a jax.set_mesh around the call.
    if _explicit(like):
        return jax.typeof(like).sharding
    return jax.sharding.NamedSharding(jax.typeof(operand).sharding.mesh, jax.sharding.PartitionSpec())


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _chunked_head(hidden_BTD, head_VD, targets_BT, temperature: float, chunk: int):
    def block(xs):
        h_BCD, targets_BC = xs
        logits = _head_logits(h_BCD, head_VD)
        logp = token_logprobs(logits, targets_BC, temperature=temperature)
        return logp, token_entropy(logits, temperature=temperature)

    logp, entropy = jax.lax.map(block, (_chunks(hidden_BTD, chunk), _chunks(targets_BT, chunk)))
    return _unchunk(logp), jax.lax.stop_gradient(_unchunk(entropy))


def _chunked_head_fwd(hidden_BTD, head_VD, targets_BT, temperature, chunk):
    return _chunked_head(hidden_BTD, head_VD, targets_BT, temperature, chunk), (hidden_BTD, head_VD, targets_BT)


def _chunked_head_bwd(temperature, chunk, residuals, cotangents):
    hidden_BTD, head_VD, targets_BT = residuals
    g_logp_BT = cotangents[0]  # the entropy carries no gradient
    compute = hidden_BTD.dtype

    def block(d_head, xs):
        h_BCD, targets_BC, g_BC = xs
        x, top, lse = _shifted_logsumexp(_head_logits(h_BCD, head_VD), temperature)
        probs = jnp.exp((x - top) / temperature - lse)
        picked = jax.nn.one_hot(targets_BC, x.shape[-1], dtype=jnp.float32)
        d_logits = ((picked - probs) * (g_BC[..., None] / temperature)).astype(compute)
        d_h = jnp.einsum("bcv,vd->bcd", d_logits, head_VD.astype(compute), preferred_element_type=jnp.float32)
        d_head = d_head + jnp.einsum("bcv,bcd->vd", d_logits, h_BCD, preferred_element_type=jnp.float32,
                                     out_sharding=_contraction_spec(h_BCD, head_VD))
        return d_head, d_h.astype(hidden_BTD.dtype)

    xs = (_chunks(hidden_BTD, chunk), _chunks(targets_BT, chunk), _chunks(g_logp_BT.astype(jnp.float32), chunk))
    d_head, d_h = jax.lax.scan(block, jnp.zeros(head_VD.shape, jnp.float32), xs)
    return _unchunk(d_h), d_head.astype(head_VD.dtype), None


_chunked_head.defvjp(_chunked_head_fwd, _chunked_head_bwd)
