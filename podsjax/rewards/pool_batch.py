"""One ``RewardPool.score`` call's results as they arrive, and what it has learned about its
reward functions: which returned NaN, raised, crashed, or timed out so often in a row that
the batch gives up on them; and the pool's warnings, each shown once."""

from __future__ import annotations

import collections
import math
from typing import Callable

import numpy as np

from podsjax.rewards import worker_process

# Warned about once per pool: (key, line). The key says which warnings are the same one.
Note = tuple[str, str]


class Warnings:
    """Passes each warning line on once per pool.

    Args:
        warn: takes each line (default: print).
    """

    def __init__(self, warn: Callable[[str], None] | None = None):
        self._warn = warn or (lambda line: print(line, flush=True))
        self._warned: set[str] = set()

    def once(self, note: Note) -> None:
        key, line = note
        if key not in self._warned:
            self._warned.add(key)
            self._warn(line)

    def drain(self, notes: list[Note]) -> None:
        """Warns about each of ``notes`` not yet warned about, and empties the list."""
        for note in notes:
            self.once(note)
        notes.clear()


class Batch:
    """Scores of a batch's items as they arrive.

    Args:
        names: the reward functions' names, in order.
        num_items: the batch's size.
        give_up_after: timeouts in a row of one function after which the batch stops calling
            it: its remaining items score 0 for it, counted in ``timeouts``.
    """

    _COUNTER = {worker_process.TIMEOUT: "timeouts", worker_process.MEMORY: "memory_errors", worker_process.ERROR: "errors"}

    def __init__(self, names: list[str], num_items: int, give_up_after: int):
        self.values_FB = np.zeros((len(names), num_items), np.float64)
        self.failed_B = np.zeros(num_items, bool)
        self.counts: collections.Counter = collections.Counter()
        self.names = names
        self.done = 0
        self.give_up_after = give_up_after
        self.timeouts_in_a_row = [0] * len(names)
        self.given_up: list[int] = []
        self.notes: list[Note] = []  # for the pool to warn about, once each
        self.server_deaths: collections.Counter = collections.Counter()  # function index -> deaths seen in it

    def name(self, function: int | None) -> str:
        return repr(self.names[function]) if function is not None and 0 <= function < len(self.names) else "?"

    def record(self, item: int, results: list[tuple[float, str, str]]) -> None:
        kinds = set()
        for f, (value, status, message) in enumerate(results):
            self.values_FB[f, item] = value
            if status == worker_process.OK:
                self.timeouts_in_a_row[f] = 0
                if not math.isfinite(value):  # summarize() scores it 0 and counts it
                    self.notes.append(("nan", f"warning: reward {self.name(f)} returned {value} on an item; "
                                              "a NaN or inf reward scores 0 and counts in reward/errors (this "
                                              "warning is shown once)"))
                continue
            kinds.add(self._COUNTER[status])
            if status == worker_process.ERROR:
                self.notes.append(("error", f"warning: reward {self.name(f)} raised on an item ({message}); it "
                                            "scores 0 and counts in reward/errors (this warning is shown once)"))
            elif status == worker_process.TIMEOUT and message not in (worker_process.SKIPPED, worker_process.OWN_BUDGET):
                self._timed_out(f)
        for kind in kinds:
            self.counts[kind] += 1
        self.failed_B[item] = bool(kinds)
        self.done += 1

    def fail(self, item: int, kind: str, function: int | None = None, exit_code: int | None = None) -> None:
        """The whole item scores 0: its worker was killed (``timeouts``) or died (``crashes``)
        while running ``function``."""
        self.values_FB[:, item] = 0.0
        self.failed_B[item] = True
        self.counts[kind] += 1
        self.done += 1
        if kind == "timeouts" and function is not None and 0 <= function < len(self.names):
            self._timed_out(function)
        elif kind == "crashes":
            how = f" (exit code {exit_code})" if exit_code is not None else ""
            self.notes.append(("crash", f"warning: a reward worker died while reward {self.name(function)} scored "
                                        f"an item{how}; the item scores 0 and counts in reward/crashes, and the "
                                        "worker is replaced (this warning is shown once)"))

    def _timed_out(self, f: int) -> None:
        self.timeouts_in_a_row[f] += 1
        if self.timeouts_in_a_row[f] >= self.give_up_after and f not in self.given_up:
            self.given_up.append(f)
            self.notes.append((f"gave up {self.names[f]}",
                               f"warning: reward {self.name(f)} timed out on {self.timeouts_in_a_row[f]} items in a "
                               "row; it scores 0 for the rest of this batch (counted in reward/timeouts), and "
                               "again in any batch where it does the same"))

    @property
    def all_given_up(self) -> bool:
        return len(self.given_up) == len(self.names)
