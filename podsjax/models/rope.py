"""Rotary position embeddings (RoPE), llama3 frequency rescaling included."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from podsjax.models.model_config import ModelConfig


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


def rope_tables(positions_BL: jax.Array, inv_freq: np.ndarray, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """``(cos, sin)`` ``[B, L, E/2]`` of the RoPE angles, computed once for every layer."""
    angles_BLF = positions_BL[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)
    return jnp.cos(angles_BLF).astype(dtype), jnp.sin(angles_BLF).astype(dtype)


def apply_rope(x_BLNE: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotates ``x_BLNE`` (N = H or K heads) by :func:`rope_tables` in the "rotate_half" layout."""
    cos, sin = (t[:, :, None, :].astype(x_BLNE.dtype) for t in rope)
    x1, x2 = jnp.split(x_BLNE, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
