"""The loop around the steps: when to evaluate, when to stop, and the hooks it calls."""

from __future__ import annotations

from typing import Callable

from podsjax.devices import hosts
from podsjax.rl.hooks import Hook
from podsjax.run import run_files
from podsjax.run import run_state


class TrainingLoop:
    """Steps and evaluates a run until its budget is spent or a stop comes, calling its hooks.

    Args:
        trainer: the run (a :class:`~podsjax.rl.Trainer`): its ``run_config``, ``host``,
            ``signals``, ``checkpointer``, ``step``, ``rl_step_result()`` and ``evaluate()``.
    """

    def __init__(self, trainer):
        self.trainer = trainer
        self.hooks: list[Hook] = []
        self._history: list[dict[str, float]] = []  # the run's evaluations, read when it runs

    def add_hook(self, hook: Hook) -> None:
        """Calls ``hook`` at the loop's events, after the hooks added before it."""
        self.hooks.append(hook)

    def _call(self, event: str, *args) -> None:
        for hook in self.hooks:
            getattr(hook, event)(*args)

    def done(self) -> bool:
        """Whether the step limit or the training-clock budget is reached."""
        run, host = self.trainer.run_config, self.trainer.host
        if run.max_steps is not None and self.trainer.step >= run.max_steps:
            return True
        return run.time_budget_s is not None and host.elapsed_train_s >= run.time_budget_s

    def eval_due(self) -> bool:
        """Whether ``eval_every_s`` of training clock passed since the last evaluation (or none was
        run), and this step has none yet: a checkpoint taken after a step's evaluation resumes
        with it done, even at ``eval_every_s`` 0."""
        every, host = self.trainer.run_config.eval_every_s, self.trainer.host
        if self._history and self._history[-1].get("step") == self.trainer.step:
            return False
        return every is not None and (host.last_eval_s is None or host.elapsed_train_s - host.last_eval_s >= every)

    def run(self, on_exit: Callable[[], None]) -> list[dict[str, float]]:
        """Trains until the budget is spent; returns the eval history (one dict per eval).
        ``on_exit`` runs last, however the loop ends.

        Raises:
            StopRequested: SIGTERM or SIGINT came (in the main thread); the last whole step
                is checkpointed first (see ``podsjax.run.run_state.StopSignals``).
        """
        trainer = self.trainer
        history = self._history = run_files.read_history(trainer.run_config.out_dir)
        try:
            self._call("on_start", trainer.step, history)
            with trainer.signals:
                stopped = self._steps(history)
                self._call("on_end", trainer.step)
                if stopped or self.stop_agreed():
                    raise run_state.StopRequested(trainer.signals.requested, trainer.step,
                                                  trainer.checkpointer.latest_step())
        finally:
            on_exit()
        return history

    def _steps(self, history: list[dict[str, float]]) -> bool:
        """Evaluates when due and steps until the budget is spent; True when a stop came first."""
        try:
            while not self.stop_agreed():
                if self.eval_due():
                    self._evaluate(history)
                if self.done():
                    return False
                result = self.trainer.rl_step_result()
                self._call("on_step", result.step, result)
        except run_state.StepDropped:
            pass
        return True

    def _evaluate(self, history: list[dict[str, float]]) -> None:
        host = self.trainer.host
        evaluation = {**self.trainer.evaluate(), "time/elapsed_train_s": host.elapsed_train_s}
        host.last_eval_s = host.elapsed_train_s
        step = self.trainer.step
        history.append({**evaluation, "step": step})
        self._call("on_eval", step, evaluation)

    def stop_agreed(self) -> bool:
        """Whether SIGTERM or SIGINT reached this process (any process, in a multi-host run)."""
        asked = self.trainer.signals.requested is not None
        if hosts.count() > 1:
            asked = hosts.sum_over_processes({"stop": float(asked)})["stop"] > 0
        return asked

    def close(self) -> None:
        """Each hook's ``on_close``, the last added first; every one runs, the first error is raised."""
        error = None
        for hook in reversed(self.hooks):
            try:
                hook.on_close()
            except BaseException as exc:  # noqa: BLE001 - the others still close; raised below
                error = error or exc
        if error is not None:
            raise error
