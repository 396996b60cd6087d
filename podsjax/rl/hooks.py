"""Hooks on the training loop: the protocol, and the ones every run has (metrics, divergence,
the evaluation history, progress, the best model, checkpoints).

A hook's methods are called in the order the hooks were added, except ``on_close``, which
goes in reverse (the last added closes first). The Trainer adds its own in this order:
:class:`MetricsHook`, :class:`DivergenceHook`, :class:`EvalHistoryHook`, :class:`ProgressHook`,
:class:`BestModelHook` (with ``keep_best``), :class:`CheckpointHook`; a user's come after them.
"""

from __future__ import annotations

import math
import time
from typing import Mapping

from podsjax.devices import hosts
from podsjax.rl import reporting
from podsjax.rl.step_data import StepResult
from podsjax.run import metrics as metrics_lib
from podsjax.run import run_files


class TrainingDiverged(RuntimeError):
    """Several updates in a row had a non-finite loss or gradient."""


class Hook:
    """Called by the loop at its events; every method does nothing unless overridden."""

    def on_start(self, step: int, history: list[dict[str, float]]) -> None:
        """The loop starts at ``step``; ``history`` holds the evaluations so far (a resumed run's too)."""

    def on_step(self, step: int, result: StepResult) -> None:
        """An RL step finished; ``step`` counts it."""

    def on_eval(self, step: int, evaluation: Mapping[str, float]) -> None:
        """An evaluation at ``step`` finished: its ``eval/*`` scalars and ``time/elapsed_train_s``."""

    def on_end(self, step: int) -> None:
        """The loop stopped at ``step``: the budget is spent, or a stop came."""

    def on_close(self) -> None:
        """The run closes (after :meth:`on_end`, or without a loop when it never ran)."""


class MetricsHook(Hook):
    """Writes each step's and evaluation's scalars (``metrics.jsonl`` and the run's backends)."""

    def __init__(self, writer: metrics_lib.MetricsWriter):
        self.writer = writer

    def on_step(self, step, result):
        if result.histograms:
            self.writer.histograms(step, result.histograms)
        self.writer.write(step, result.scalars)

    def on_eval(self, step, evaluation):
        self.writer.write(step, evaluation)

    def on_close(self):
        self.writer.close()


class DivergenceHook(Hook):
    """Counts steps in a row with a skipped (non-finite) update; too many stop the run before
    the next save. A step of several optimizer steps counts when any of them was skipped."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_step(self, step, result):
        scalars, host = result.scalars, self.trainer.host
        in_a_row = host.nonfinite_in_a_row + 1 if scalars["train/skipped"] else 0
        host.nonfinite_in_a_row = in_a_row
        if in_a_row >= self.trainer.run_config.max_nonfinite_updates:
            last = self.trainer.checkpointer.latest_step()
            kept = "no checkpoint was saved yet" if last is None else f"the last checkpoint is step {last}"
            updates = self.trainer.algo.updates_per_step
            skipped = "" if updates == 1 else f", {scalars['train/skipped']:.0f} of its {updates} updates skipped"
            raise TrainingDiverged(
                f"{in_a_row} steps in a row had a non-finite loss or gradient (step {step}: loss "
                f"{scalars['train/loss']}, grad norm {scalars['train/grad_norm']}{skipped}); stopped. Skipped "
                f"updates left the weights as they were; {kept}. Lower the learning rate or check the rewards")


class EvalHistoryHook(Hook):
    """Appends each evaluation to ``eval_history.jsonl`` (process 0 only)."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir

    def on_eval(self, step, evaluation):
        if hosts.is_primary():
            run_files.append_history(self.out_dir, {**evaluation, "step": step})


class ProgressHook(Hook):
    """The progress bar, or without one (no TTY) a line every ``progress_every_s``, and the
    evaluation's console line."""

    def __init__(self, trainer):
        self.trainer, self.bar, self._lines, self._accuracy, self._first = trainer, None, None, math.nan, True

    def on_start(self, step, history):
        run, host = self.trainer.run_config, self.trainer.host
        enabled = None if run.progress else False
        if run.max_steps is not None:
            self.bar = metrics_lib.Progress(run.max_steps, unit="step", initial=step, enabled=enabled)
        else:
            self.bar = metrics_lib.Progress(run.time_budget_s, unit="s", initial=host.elapsed_train_s, enabled=enabled)
        # Without a bar (no TTY: logs, nohup, SLURM) one line every progress_every_s says how it goes.
        self._lines = metrics_lib.ProgressLog(self.trainer.log, every_s=run.progress_every_s)
        self._accuracy = history[-1]["eval/accuracy"] if history else math.nan
        self._first = True

    def on_step(self, step, result):
        run, scalars, accuracy = self.trainer.run_config, result.scalars, self._accuracy
        position = step if run.max_steps is not None else self.trainer.host.elapsed_train_s
        self.bar.update(position, step=step, reward=scalars["reward/mean"], acc=accuracy)
        if self._first:
            since = time.time() - self.trainer.started_at
            self._lines.update(step, lambda: f"first step done {since:.1f} s after start: "
                                             f"{reporting.phases_text(scalars)}", force=True)
            self._first = False
        elif not self.bar.enabled:
            self._lines.update(step, lambda: reporting.progress_line(step, scalars, accuracy, self.trainer.host, run),
                               force=self.trainer.done())

    def on_eval(self, step, evaluation):
        self._accuracy = evaluation["eval/accuracy"]
        self.trainer.log(reporting.eval_line({**evaluation, "step": step}, self.trainer.run_config))

    def on_close(self):
        if self.bar is not None:
            bar, self.bar = self.bar, None
            bar.close()


class BestModelHook(Hook):
    """Offers each evaluation's policy to the run's :class:`podsjax.run.best.BestPolicy`."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_eval(self, step, evaluation):
        self.trainer.best.offer(step, evaluation["eval/accuracy"], self.trainer.state.params)

    def on_close(self):
        self.trainer.best.checkpoints_committed()
        self.trainer.best.close()


class CheckpointHook(Hook):
    """Saves the state and host state when due after each step, and the last whole step at the end."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_step(self, step, result):
        self.save(step)  # before the next step donates the state's buffers

    def on_end(self, step):
        self.save(step, force=True)  # the last whole step, whether the budget is spent or a stop came

    def save(self, step: int, force: bool = False) -> None:
        trainer = self.trainer
        host, best = trainer.host, trainer.best
        # Each log's size goes with the checkpoint: a resume from it cuts the logs back to them.
        host.log_sizes = run_files.log_sizes(trainer.run_config.out_dir)
        if best is not None:  # the best policy the checkpoint records
            host.best_step, host.best_accuracy = best.step, best.accuracy
        if trainer.checkpointer.save(step, trainer.state, host.to_json(), force=force) and best is not None:
            best.checkpoint_started()

    def on_close(self):
        self.trainer.checkpointer.close()
