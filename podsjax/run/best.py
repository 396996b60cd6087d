"""The best policy a run has evaluated, kept on disk so the run can export it at the end.

Each evaluation that beats every earlier one saves the trainable params (the LoRA tree,
or the full params) into ``<out>/best/<step>``, synchronously (see ``__init__``). The run's own
checkpoints record the best step (``HostState.best_step``), so a resumed run knows which
saved policy is its best:

- a best saved after the checkpoint the run resumes from was never recorded, and goes;
- older bests go once a checkpoint that records a newer one has been committed, which a
  checkpointer's next save guarantees (orbax finishes one save before it starts another).
"""

from __future__ import annotations

import math
import os
import shutil
from typing import Any, Callable

import jax

from podsjax.devices import hosts
from podsjax.devices import mesh as mesh_lib
from podsjax.run import checkpoint as ckpt_lib
from podsjax.run import checkpoint_integrity as integrity
from podsjax.run import checkpoint_layout

BEST_DIRNAME = "best"


class BestPolicy:
    """Saves each new best policy and finds the recorded one again.

    Args:
        out_dir: the run directory.
        recorded: ``(step, accuracy)`` of the best policy the restored checkpoint records
            (``HostState.best_step``, ``best_accuracy``), or ``(None, None)``.
        resumed_step: the step the run resumed from (None: a fresh start).

    Attributes:
        step, accuracy: the best evaluation so far, which the run's next checkpoint records.
    """

    def __init__(self, out_dir: str, recorded: tuple[int | None, float | None], resumed_step: int | None,
                 warn: Callable[[str], None] = print):
        self.step, self.accuracy = recorded
        self.directory = directory = os.path.join(out_dir, BEST_DIRNAME)
        if resumed_step is None and hosts.is_primary() and os.path.isdir(directory):
            for name in os.listdir(directory):  # a killed first attempt's bests belong to no run; nothing else goes
                if checkpoint_layout.ENTRY.fullmatch(name):
                    shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
        hosts.barrier("best policy directory")
        # Saved synchronously (fake CPU devices: docs/reliability.md, "Not promised"); a save
        # happens right after an evaluation, off the training clock.
        self._checkpointer = ckpt_lib.Checkpointer(ckpt_lib.CheckpointConfig(directory, keep_last=None,
                                                                             async_save=False))
        recorded = self.step
        for step in self._checkpointer.all_steps():
            if resumed_step is not None and step > resumed_step or recorded is None or step < recorded:
                self._checkpointer.delete(step)
        self._recorded_by_last_checkpoint = recorded
        self._warn = warn
        if resumed_step is not None and recorded is not None and recorded not in self._checkpointer.all_steps():
            self._forget(FileNotFoundError(f"{os.path.join(directory, str(recorded))} is gone"),
                         "a best is chosen again from the evaluations after this resume")

    def _forget(self, problem: BaseException, then: str) -> None:
        """Warns that the recorded best does not load, and forgets it."""
        why = integrity.first_line(problem) or type(problem).__name__
        self._warn(f"warning: the best policy of step {self.step} ({self.accuracy:.1%}) does not load ({why}); {then}")
        self.step = self.accuracy = self._recorded_by_last_checkpoint = None

    def offer(self, step: int, accuracy: float, params: Any) -> bool:
        """Saves ``params`` as the new best when ``accuracy`` beats every earlier evaluation (a
        NaN one never does: it would stay the best, as nothing compares greater)."""
        accuracy = float(accuracy)  # a NumPy scalar too; its host state must be JSON
        earlier = self.accuracy if self.accuracy is not None and not math.isnan(self.accuracy) else None
        if math.isnan(accuracy) or earlier is not None and not accuracy > earlier:  # a NaN recorded before: none
            return False
        self._checkpointer.save(step, {"params": params}, {"accuracy": accuracy}, force=True)
        self.step, self.accuracy = step, accuracy
        return True

    def checkpoint_started(self) -> None:
        """Call when a run checkpoint (recording ``step``) has started: the one before it is
        now committed, so bests older than the one it records are no longer needed."""
        self.checkpoints_committed()
        self._recorded_by_last_checkpoint = self.step

    def checkpoints_committed(self) -> None:
        """Call once every run checkpoint started is committed (the run's checkpointer closed)."""
        keep_from = self._recorded_by_last_checkpoint
        for step in self._checkpointer.all_steps():
            if keep_from is not None and step < keep_from:
                self._checkpointer.delete(step)

    def restore(self, like_params: Any) -> Any | None:
        """The best params (shaped and sharded like ``like_params``), or None when none was saved,
        or the saved one is gone or proven damaged (a warning says so).

        Raises:
            CheckpointCorrupt: it fails to load without proof of damage (which may be this
                process's memory or devices): the line says how to export without it.
        """
        if self.step is None:
            return None
        self._checkpointer.close()  # waits for a pending save; a fresh one reads it back
        abstract = {"params": jax.tree.map(mesh_lib.abstract, like_params)}
        try:
            with ckpt_lib.Checkpointer(ckpt_lib.CheckpointConfig(self.directory, keep_last=None)) as reader:
                return reader.restore(abstract, self.step)[0]["params"]
        except FileNotFoundError as exc:
            problem = exc
        except integrity.CheckpointCorrupt as exc:
            if not exc.proven:
                raise integrity.CheckpointCorrupt(
                    f"{integrity.first_line(exc)}; if its files are damaged, move "
                    f"{os.path.join(self.directory, str(self.step))} aside and resume again to finish without a "
                    "best_model export", proven=False) from None
            problem = exc
        self._forget(problem, "the run ends without a best_model export")
        return None

    def close(self) -> None:
        self._checkpointer.close()
