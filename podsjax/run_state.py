"""Where a run is, on the host: what a checkpoint keeps besides the arrays."""

from __future__ import annotations

import dataclasses
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
