"""Token ids checked on the host before they index an embedding: an id past the vocabulary
embeds as NaN and a negative one wraps around to the table's end, both without a word.
Checked where the ids are at hand: not under a trace, nor when spread over several processes.
"""

from __future__ import annotations

import jax
import numpy as np


def concrete(*arrays) -> bool:
    """Whether every array is a value on this host (not a tracer, not partly another process's)."""
    return not any(isinstance(x, jax.core.Tracer) or not getattr(x, "is_fully_addressable", True) for x in arrays)


def check_in_vocab(ids_BL, vocab: int, what: str, mask_BL=None) -> None:
    """Raises a one-line ValueError naming the first id outside ``[0, vocab)`` (where ``mask_BL``
    is 1, when given), unless the ids are traced."""
    if not concrete(ids_BL, *([] if mask_BL is None else [mask_BL])):
        return
    ids = np.asarray(ids_BL)
    bad = (ids < 0) | (ids >= vocab)
    if mask_BL is not None:
        bad &= np.asarray(mask_BL) != 0
    if bad.any():
        row, col = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{what} token ids must be in [0, {vocab}) (the model's vocabulary); row {row} holds "
                         f"{int(ids[row, col])} at position {col}")
