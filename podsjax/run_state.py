"""A run on its host: what a checkpoint keeps besides the arrays, and the signals
(SIGTERM, SIGINT) that stop a run early."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
from typing import Any


@dataclasses.dataclass
class HostState:
    """The host-side progress of a run, saved as JSON in every checkpoint.

    Attributes:
        data_position: training examples drawn so far (``loop.DataStream``).
        elapsed_train_s: the training clock (generation, scoring, selection and update;
            evaluation and checkpoint writes excluded).
        last_eval_s: the training clock at the last evaluation (None: none yet).
        nonfinite_in_a_row: updates skipped for a non-finite loss or gradient, in a row.
        best_step, best_accuracy: the best evaluation so far (``podsjax.best``).
        log_sizes: each log's size in bytes at this checkpoint, which a resume cuts back to.
    """

    data_position: int = 0
    elapsed_train_s: float = 0.0
    last_eval_s: float | None = None
    nonfinite_in_a_row: int = 0
    best_step: int | None = None
    best_accuracy: float | None = None
    log_sizes: dict[str, int] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, values: dict[str, Any]) -> HostState:
        """From a checkpoint's JSON; fields an older checkpoint lacks keep their defaults."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})


# -- stopping on a signal ------------------------------------------------------------------

class StopRequested(KeyboardInterrupt):
    """The run stopped at SIGTERM or SIGINT after its last whole step, checkpointed.

    Attributes:
        signal: the signal's name ("SIGTERM"), or None when another process of the run got it.
        step: the last whole step.
        checkpoint: the newest checkpointed step (None: none yet).
    """

    def __init__(self, signal_name: str | None, step: int, checkpoint: int | None):
        super().__init__(signal_name, step, checkpoint)
        self.signal, self.step, self.checkpoint = signal_name, step, checkpoint

    def __str__(self) -> str:
        by = self.signal or "a signal to another process of the run"
        kept = "no checkpoint yet" if self.checkpoint is None else f"checkpoint of step {self.checkpoint} saved"
        return f"stopped by {by} after step {self.step} ({kept})"


class StepDropped(KeyboardInterrupt):
    """A stop cut short work that changes nothing the run keeps (see :meth:`StopSignals.droppable`)."""


class StopSignals:
    """SIGTERM (what SLURM and spot-VM preemption send first) and SIGINT, as a stop request.

    The first signal asks the run to stop. Inside :meth:`droppable` (generation, scoring,
    evaluation: nothing the run keeps has changed yet) the work is dropped at once
    (:class:`StepDropped`); elsewhere (the update, logging, a checkpoint) it runs to its end
    and the loop stops at the next step boundary, reading :attr:`requested`. Either way the
    run can checkpoint a whole step within a preemption's grace period. A second signal
    raises KeyboardInterrupt at once.

    ``drop_at_once=False`` (multi-host runs) never drops: the processes must agree on where
    they stop, so they do at a step boundary.

    Handlers are installed while the object is entered, and only from the main thread
    (Python runs handlers there); entered from another thread it changes nothing.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, drop_at_once: bool = True):
        self.requested: str | None = None
        self.drop_at_once = drop_at_once
        self._received = 0
        self._dropping = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for number in self.SIGNALS:
                self._previous[number] = signal.signal(number, self._on_signal)
        return self

    def __exit__(self, *exc_info) -> None:
        previous, self._previous = self._previous, {}
        for number, handler in previous.items():
            signal.signal(number, handler)

    def _on_signal(self, number, frame) -> None:
        self._received += 1
        if self._received > 1:
            raise KeyboardInterrupt(signal.Signals(number).name)
        self.requested = signal.Signals(number).name
        if self._dropping and self.drop_at_once:
            raise StepDropped(self.requested)

    @contextlib.contextmanager
    def droppable(self):
        """Work a stop may cut short: it changes nothing that a checkpoint keeps."""
        if self.requested is not None and self.drop_at_once:
            raise StepDropped(self.requested)
        outer, self._dropping = self._dropping, True
        try:
            yield
        finally:
            self._dropping = outer
