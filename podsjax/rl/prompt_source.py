"""Where a run's prompts come from: a seeded, endless shuffle of the training set, tokenized."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from podsjax.data import datasets as data_lib
from podsjax.data import prompts as prompts_lib


class DataStream:
    """An endless, seeded shuffle of examples; its position is all that resume needs."""

    def __init__(self, examples: Sequence[data_lib.Example], seed: int, position: int = 0):
        if not examples:
            raise ValueError("the training set is empty")
        self.examples, self.seed, self.position = list(examples), seed, position
        self._epoch, self._permutation = -1, np.arange(0)  # the last epoch's order, kept: a draw reads it per example

    def _order(self, epoch: int) -> np.ndarray:
        if self._epoch != epoch:
            self._epoch, self._permutation = epoch, np.random.default_rng([self.seed, epoch]).permutation(
                len(self.examples))
        return self._permutation

    def take(self, count: int, avoid: Sequence[int] = ()) -> list[data_lib.Example]:
        """The examples of :meth:`take_indices`."""
        return [self.examples[i] for i in self.take_indices(count, avoid)]

    def take_indices(self, count: int, avoid: Sequence[int] = ()) -> list[int]:
        """The next ``count`` examples' indices, all different and none in ``avoid``: a step that
        runs into the next epoch passes over what it already holds (it had drawn such an example
        twice, as two groups of one step). Indices, not the examples: a list may hold one twice."""
        held = set(avoid)
        if count > len(self.examples) - len(held):
            raise ValueError(f"cannot draw {count} more different examples from {len(self.examples)}, "
                             f"{len(held)} of them drawn already")
        out: list[int] = []
        while len(out) < count:
            epoch, offset = divmod(self.position, len(self.examples))
            index = int(self._order(epoch)[offset])
            self.position += 1
            if index not in held:
                held.add(index)
                out.append(index)
        return out


def check_step_size(examples: int, wanted: int) -> None:
    """A step's ``wanted`` prompts are different examples: a training set of fewer would put
    some into one step twice, each as its own group.

    Raises:
        PromptError: ``wanted`` is more than ``examples``.
    """
    if wanted > examples:
        raise prompts_lib.PromptError(
            f"prompts_per_step {wanted} is more than the training set's {examples} examples, so one step would "
            "draw some of them twice; lower --prompts-per-step or train on more examples")


class PromptSource:
    """Templates and tokenizes questions as every step and evaluation feeds them, and draws
    each step's prompts from a :class:`DataStream`.

    Args:
        tokenizer: the policy's tokenizer (its chat template, if any, is applied).
        stream: the training examples' shuffle.
        max_prompt_length: longer prompts are skipped, never cut.
        system_prompt: instructions before each question (None: none).
        log: prints one console line (the first time prompts are skipped).
    """

    def __init__(self, tokenizer, stream: DataStream, *, max_prompt_length: int, system_prompt: str | None,
                 log: Callable[[str], None]):
        self.tokenizer, self.stream = tokenizer, stream
        self.max_prompt_length, self.system_prompt = max_prompt_length, system_prompt
        self._log = log
        self._skips_reported = False

    def prepare(self, examples: Sequence[data_lib.Example]) -> prompts_lib.PromptBatch:
        """The examples' questions, templated, tokenized and left-padded."""
        return prompts_lib.prepare_prompts(self.tokenizer, [e.prompt for e in examples],
                                           max_prompt_length=self.max_prompt_length, system_prompt=self.system_prompt)

    def draw(self, wanted: int, groups: int = 1) -> tuple[list[data_lib.Example], prompts_lib.PromptBatch, int]:
        """The next ``wanted`` training examples whose prompts fit, and how many were skipped.

        A prompt longer than ``max_prompt_length`` is skipped (never cut: a cut question
        rewards the wrong answer) and another is drawn, so every step has the same rows:
        no new shape to compile, and no step left with nothing to score. With ``groups``
        g > 1 each example appears g times in a row, one group each.

        Raises:
            PromptError: two passes' worth of draws (which hold every example at least
                once) were too long to fill one step.
        """
        limit = 2 * len(self.stream.examples)
        kept: list[int] = []  # indices into the stream's examples
        skipped = 0
        while len(kept) < wanted:
            drawn = self.stream.take_indices(wanted - len(kept), avoid=kept)
            batch = self.prepare([self.stream.examples[i] for i in drawn])
            kept += [drawn[i] for i in batch.kept_P]
            skipped += batch.num_dropped
            if len(kept) < wanted and skipped >= limit:
                raise prompts_lib.PromptError(
                    f"too few training prompts fit in max_prompt_length {self.max_prompt_length} tokens: "
                    f"{skipped} of {skipped + len(kept)} drawn for one step of {wanted} were longer; "
                    "raise --max-prompt-length or filter the training set")
        kept = [self.stream.examples[i] for i in kept]
        if skipped and not self._skips_reported:
            self._log(f"skipped {skipped} training prompt(s) longer than max_prompt_length "
                      f"{self.max_prompt_length} tokens and drew others (each step's count: data/prompts_skipped)")
            self._skips_reported = True
        if skipped or groups > 1:
            kept = [example for example in kept for _ in range(groups)]
            batch = self.prepare(kept)
        return kept, batch, skipped

    def check_next(self, wanted: int) -> None:
        """Draws the next ``wanted`` prompts from a copy of the stream, which does not move: a
        training set too long to fill a step is refused (and skips are said) before anything
        compiles or evaluates.

        Raises:
            PromptError: as :meth:`draw`.
        """
        stream = self.stream
        check_step_size(len(stream.examples), wanted)
        self.stream = DataStream(stream.examples, stream.seed, stream.position)
        try:
            self.draw(wanted)
        finally:
            self.stream = stream
