"""Token ids checked on the host before they index an embedding: an id past the vocabulary
embeds as NaN and a negative one wraps around to the table's end, both without a word.
Checked where the ids are at hand: not under a trace, nor when spread over several processes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def concrete(*arrays) -> bool:
    """Whether every array is a value on this host (not a tracer, not partly another process's)."""
    return not any(isinstance(x, jax.core.Tracer) or not getattr(x, "is_fully_addressable", True) for x in arrays)


def as_ids(ids_BL, vocab: int, what: str) -> jax.Array:
    """``ids_BL`` as a JAX array, integer [B, L] ids checked (:func:`check_in_vocab`) as given:
    a host array before JAX's int32 would wrap an int64 id of 2**32 + 7 to 7. Other kinds and
    shapes are left to the caller's own one-line checks."""
    given = ids_BL if isinstance(ids_BL, (jax.Array, jax.core.Tracer)) else np.asarray(ids_BL)
    if np.issubdtype(given.dtype, np.integer) and given.ndim == 2:
        check_in_vocab(given, vocab, what)
    return jnp.asarray(ids_BL)


def check_in_vocab(ids_BL, vocab: int, what: str) -> None:
    """Raises a one-line ValueError naming the first id outside ``[0, vocab)``, pads' too (a
    NaN embedded there reaches the attention's values), unless the ids are traced."""
    if not concrete(ids_BL):
        return
    ids = np.asarray(ids_BL)
    bad = (ids < 0) | (ids >= vocab)
    if bad.any():
        row, col = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{what} token ids must be in [0, {vocab}) (the model's vocabulary); row {row} holds "
                         f"{int(ids[row, col])} at position {col}")
