"""Which compiled prompt length a step's prompts run at: a new bucket compiles when it pays.

Each prompt bucket costs a compile of sampling and of the update: tens of seconds each
on a GPU, where XLA autotunes its kernels. A bucket drawn once or twice costs more to
compile than its shorter padding saves. So a step whose prompts fall in a bucket not yet
compiled runs at the smallest compiled length that holds them (more left padding, which
every program masks), until that bucket has been drawn ``compile_after`` times; then it
compiles. The first step runs at the length the fit check compiled.
"""

from __future__ import annotations

import collections

import numpy as np

from podsjax.data import prompts as prompts_lib


def left_pad(batch: prompts_lib.PromptBatch, width: int) -> prompts_lib.PromptBatch:
    """``batch`` with its rows left-padded to ``width`` tokens (at least its own width)."""
    extra = width - batch.ids_PL.shape[1]
    if extra < 0:
        raise ValueError(f"cannot pad prompts of {batch.ids_PL.shape[1]} tokens to {width}")
    if extra == 0:
        return batch
    pad = ((0, 0), (extra, 0))
    return prompts_lib.PromptBatch(np.pad(batch.ids_PL, pad, constant_values=batch.pad_id), np.pad(batch.mask_PL, pad),
                                   batch.lengths_P, batch.kept_P, batch.num_dropped, batch.pad_id)


class BucketReuse:
    """Prompt lengths compiled so far, and how often each bucket that is not was drawn.

    Args:
        compile_after: draws of a bucket before it compiles (1: at its first draw, as
            without this policy).
    """

    def __init__(self, compile_after: int):
        if isinstance(compile_after, bool) or not isinstance(compile_after, int) or compile_after < 1:
            raise ValueError(f"compile_after must be an integer >= 1; got {compile_after!r}")
        self.compile_after = compile_after
        self.lengths: set[int] = set()
        self.draws: collections.Counter = collections.Counter()

    def compiled(self, length: int) -> None:
        """Programs for prompts of ``length`` tokens exist (the fit check compiled them)."""
        self.lengths.add(int(length))

    def fit(self, batch: prompts_lib.PromptBatch, count: bool = True) -> prompts_lib.PromptBatch:
        """``batch`` at the length it will run at; a length returned is taken as compiled.

        ``count=False`` (evaluation): the draw does not count towards compiling its bucket,
        so evaluation runs at lengths that training compiled, or compiles the one it needs."""
        width = batch.ids_PL.shape[1]
        if width in self.lengths:
            return batch
        self.draws[width] += count
        wider = [length for length in self.lengths if length > width]
        if wider and (not count or self.draws[width] < self.compile_after):
            return left_pad(batch, min(wider))
        self.lengths.add(width)
        return batch
