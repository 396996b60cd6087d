"""The Trainer: one run's parts, wired together: weights, the RL step, the loop and its hooks."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable

import numpy as np

from podsjax import rewards as rewards_lib
from podsjax.data import prompts as prompts_lib
from podsjax.devices import compilation, dry_run, hosts
from podsjax.models import LoraConfig
from podsjax.rl import buckets, programs, start_programs
from podsjax.rl import hooks as hooks_lib
from podsjax.rl.evaluator import Evaluator
from podsjax.rl.hooks import TrainingDiverged  # noqa: F401 - raised by the loop, named here too
from podsjax.rl.prompt_source import DataStream, PromptSource
from podsjax.rl.rl_step import RLStep
from podsjax.rl.run_config import RunConfig
from podsjax.rl.run_loop import TrainingLoop
from podsjax.rl.step_data import StepResult
from podsjax.rl.weights import Weights
from podsjax.run import best as best_lib
from podsjax.run import checkpoint as ckpt_lib
from podsjax.run import log_backends
from podsjax.run import metrics as metrics_lib
from podsjax.run import run_files
from podsjax.run import run_state
from podsjax.run.run_state import HostState
from podsjax.sampler import sampling
from podsjax.update import algorithms


class Trainer:
    """Owns the state, the step programs, the reward scorer, checkpoints and metrics of one run.

    Args:
        model, base_params, tokenizer: the policy to train and its tokenizer.
        train_examples, eval_examples: the task's splits.
        algo, run_config: what to train and how long.
        lora: train LoRA adapters on a frozen base (None: full fine-tune).
        rewards: reward specs (see ``podsjax.rewards.as_weighted``; default: the task's at
            weight 1). One must be named "accuracy": evaluation reads it.
        log: prints one console line (default: stdout when ``run_config.console``, else nothing).
        started_at: ``time.time()`` when the process started, for the first step's report.
        generator: the :class:`podsjax.sampler.sampling.Generator` (default: a new one for ``model``).
        scorer: ``score(completions, rewards, **columns)`` and ``close()`` (default: a RewardPool).
        evaluator: ``evaluator(params, lora) -> (scalars, samples)``, the scalars with ``eval/accuracy``
            and ``eval/examples`` (default: an :class:`~podsjax.rl.Evaluator` on ``eval_examples``).
        update: ``(optimizer, update)`` as :func:`~podsjax.rl.update_program` makes them (default: made here).
        hooks: :class:`~podsjax.rl.hooks.Hook` s called after the run's own (see :meth:`add_hook`).

    Attributes:
        compile_log: every compile (:class:`podsjax.devices.compilation.CompileLog`; ``compile_counts``).
        weights: the train state and the update (:class:`~podsjax.rl.weights.Weights`).
        stepper: takes one RL step (:class:`~podsjax.rl.rl_step.RLStep`).
    """

    def __init__(self, model, base_params, tokenizer, train_examples, eval_examples,
                 algo: algorithms.AlgorithmConfig, run_config: RunConfig, lora: LoraConfig | None = None, rewards=None,
                 log: Callable[[str], None] | None = None, started_at: float | None = None, *,
                 generator: sampling.Generator | None = None, scorer=None, evaluator=None, update=None, hooks=()):
        run_config.check_positions(model.config.max_position_embeddings)
        self.model, self.tokenizer = model, tokenizer
        self.algo, self.run_config, self.lora_config = algo, run_config, lora
        self.rewards = rewards_lib.as_weighted(rewards or rewards_lib.default_rewards(run_config.task))
        self.eos_ids = prompts_lib.eos_token_ids(tokenizer)
        # Process 0 speaks for a multi-host run; the others print nothing.
        self._print = log or (metrics_lib.print_line if run_config.console and hosts.is_primary() else None)
        self.started_at = time.time() if started_at is None else started_at
        self.compile_log = compilation.CompileLog(self.log)
        self.generator = generator or sampling.Generator(model)
        prompt_rows = programs.prompt_rows(run_config, algo)
        self.batch_fn = programs.batch_program(model.mesh, prompt_rows * algo.m, algo)
        self.weights = Weights(model, base_params, algo, lora, run_config.seed, self.compile_log,
                               update or programs.update_program(model, algo, lora))
        _refuse_if_in_use(run_config.out_dir)
        os.makedirs(run_config.out_dir, exist_ok=True)
        self.host = HostState()  # replaced by a restored checkpoint's
        self.checkpointer = ckpt_lib.Checkpointer(ckpt_lib.CheckpointConfig(
            os.path.join(run_config.out_dir, "checkpoints"), save_every_steps=run_config.checkpoint_every_steps,
            save_every_seconds=run_config.checkpoint_every_s, keep_last=run_config.keep_last),
            clock=lambda: self.host.elapsed_train_s)  # the training clock, eval excluded
        restored = self._restore()
        stream = DataStream(train_examples, run_config.seed, self.host.data_position)
        self.prompts = PromptSource(tokenizer, stream, max_prompt_length=run_config.max_prompt_length,
                                    system_prompt=run_config.system_prompt, log=self.log)
        try:
            self.prompts.check_next(run_config.prompts_per_step)
        except prompts_lib.PromptError:
            self.checkpointer.close()
            raise
        self.scorer = scorer or rewards_lib.RewardPool(run_config.reward_workers,
                                                       timeout_s=run_config.reward_timeout_s)
        self.buckets = buckets.BucketReuse(run_config.bucket_compile_after)
        self.evaluator = evaluator or Evaluator(
            self.generator, self.prompts, self.scorer, eval_examples, run_config,
            rows=prompt_rows * algo.n, rewards=self.rewards, eos_ids=self.eos_ids,
            compile_log=self.compile_log, buckets=self.buckets, log=self.log)
        self.best = (best_lib.BestPolicy(run_config.out_dir, (self.host.best_step, self.host.best_accuracy), restored,
                                         warn=self.log) if run_config.keep_best else None)
        self.writer = metrics_lib.MetricsWriter(
            run_config.out_dir, backends=run_config.log,
            config={"algorithm": dataclasses.asdict(algo), "run": dataclasses.asdict(run_config)},
            wandb_project=run_config.wandb_project, resume_step=restored, enabled=hosts.is_primary())
        # Installed while run() runs; multi-host runs stop where every process agrees (a step boundary).
        self.signals = run_state.StopSignals(drop_at_once=hosts.count() == 1)
        # Decided from the config, not the writer: in a multi-host run every process joins the fetch.
        self.stepper = RLStep(self, histograms=log_backends.draws_histograms(run_config.log))
        self._loop = TrainingLoop(self)
        self._progress = hooks_lib.ProgressHook(self)
        best = [hooks_lib.BestModelHook(self)] if self.best is not None else []
        for hook in (hooks_lib.MetricsHook(self.writer), hooks_lib.DivergenceHook(self),
                     hooks_lib.EvalHistoryHook(run_config.out_dir), self._progress, *best,
                     hooks_lib.CheckpointHook(self), *hooks):  # the order of hooks_lib's docstring
            self._loop.add_hook(hook)

    def _restore(self) -> int | None:
        """Restores the newest checkpoint, if any, and rewinds the logs to it; its step, or None."""
        out_dir = self.run_config.out_dir
        found = self.weights.restore(self.checkpointer, warn=self.log)
        if found is None:
            # No checkpoint committed (a first run, or one killed before its first save):
            # the run starts over, so logs from a killed attempt go.
            if hosts.is_primary():
                run_files.rewind_logs(out_dir, dict.fromkeys(run_files.LOGS, 0))
            return None
        saved, restored = found
        self.host = HostState.from_json(saved)
        try:
            moved = run_files.resume_logs(out_dir, self.host.log_sizes, restored)
        except run_files.LogDamaged:
            self.checkpointer.close()
            raise
        self.log(f"resumed from the checkpoint of step {restored} (training clock {self.host.elapsed_train_s:.0f} s)"
                 + ("; what was logged after it moved to *.superseded" if moved else ""))
        return restored

    # The weights' parts, as attributes of the run.
    state = property(lambda self: self.weights.state, doc="The train state (params, optimizer state, step).")
    frozen = property(lambda self: self.weights.frozen, doc="The frozen weights the update reads.")
    base_params = property(lambda self: self.weights.base_params, doc="See ``Weights.base_params``.")
    optimizer = property(lambda self: self.weights.optimizer, doc="The update's optax optimizer.")
    update_fn = property(lambda self: self.weights.update_fn,
                         lambda self, fn: setattr(self.weights, "update_fn", fn), doc="The update program.")

    @property
    def step(self) -> int:
        """RL steps taken: the state counts optimizer steps, ``algo.updates_per_step`` per RL step."""
        return self.weights.step

    @property
    def compile_counts(self) -> dict[str, int]:
        """Compiles so far per program, e.g. ``{"generate[sample]": 1, "update": 1, ...}``."""
        return dict(self.compile_log.counts)

    def log(self, line: str) -> None:
        """One console line, above the progress bar when one is drawn."""
        if self._print is None:
            return
        bar = getattr(getattr(self, "_progress", None), "bar", None)  # resume logs before the hooks exist
        if bar is not None and bar.enabled and self._print is metrics_lib.print_line:
            bar.write(line)
        else:
            self._print(line)

    def memory_plan(self) -> dry_run.MemoryPlan:
        """Generation and the update compiled for the run's largest shapes, and their memory.

        Through the Trainer's own generator, update and state, so the first step reuses
        these compiles instead of compiling again. The step-0 evaluation's programs and the
        batch builder compile beside them, ``run_config.compile_threads`` at a time
        (``podsjax.rl.start_programs``).
        """
        prompt_len = programs.padded_prompt_length(self.run_config)
        self.weights.update_shapes.add((self.stepper.update_rows, prompt_len))
        self.buckets.compiled(prompt_len)
        return start_programs.plan_and_compile(self, start_programs.compile_threads(self.run_config, hosts.count()))

    def policy_params(self):
        """(params, lora) to sample from: the current policy, in the model's dtype (see ``Weights.policy_params``)."""
        return self.weights.policy_params()

    def rl_step_result(self) -> StepResult:
        """One PODS step (see :class:`~podsjax.rl.rl_step.RLStep`), as the hooks receive it."""
        return self.stepper()

    def rl_step(self) -> dict[str, float]:
        """One PODS step: draw prompts, generate, score, select, update. Returns its scalars.

        With ``algo.dynamic_sampling`` the draw, generation and scoring repeat (up to
        ``max_sampling_rounds``) until the step has its groups with reward variance.
        """
        return self.stepper().scalars

    def evaluate(self) -> dict[str, float]:
        """The evaluator's scalars for the current policy; its samples go to ``samples.jsonl``."""
        with self.signals.droppable():  # nothing is written until every pass is scored
            scalars, samples = self.evaluator(*self.policy_params())
        scalars = _evaluation_scalars(scalars)
        self.writer.write_samples(self.step, samples[: self.run_config.log_samples])
        return scalars

    def add_hook(self, hook: hooks_lib.Hook) -> None:
        """Calls ``hook`` (a :class:`~podsjax.rl.hooks.Hook`) at the loop's events, after the run's own."""
        self._loop.add_hook(hook)

    def done(self) -> bool:
        """Whether the step limit or the training-clock budget is reached."""
        return self._loop.done()

    def eval_due(self) -> bool:
        """Whether an evaluation is due on the training clock."""
        return self._loop.eval_due()

    def run(self) -> list[dict[str, float]]:
        """Trains until the budget is spent; returns the eval history (one dict per eval).

        Raises:
            StopRequested: SIGTERM or SIGINT came (in the main thread); the last whole step
                is checkpointed first (see ``podsjax.run.run_state.StopSignals``).
            TrainingDiverged: ``max_nonfinite_updates`` steps in a row skipped their update.
        """
        return self._loop.run(on_exit=self.close)

    def close(self):
        """Ends the run's work: a compile in flight, the reward workers, then each hook (checkpoints, logs)."""
        self.weights.close()  # a step stopped before its update: no compile runs into the exit
        # The reward workers go first: a second signal may cut the rest (waiting for a save) short.
        try:
            self.scorer.close()
        finally:
            self._loop.close()


def _refuse_if_in_use(out_dir: str) -> None:
    """Another process's run in ``out_dir`` (its lock): its best policies and logs are not this
    run's to rewind. The command line's runner holds the lock itself, which is no refusal."""
    in_use = run_state.RunLock(out_dir).in_use() if hosts.is_primary() else None
    if in_use:
        raise run_state.RunLocked(in_use)


def _evaluation_scalars(scalars) -> dict[str, float]:
    """An evaluator's scalars, checked: the console line, the best policy and the history read
    accuracy and examples; NumPy numbers become floats (the history is JSON)."""
    missing = [k for k in ("eval/accuracy", "eval/examples") if k not in scalars]
    if missing:
        raise ValueError(f"the evaluator's scalars lack {', '.join(missing)}; it must return "
                         "({'eval/accuracy': ..., 'eval/examples': ..., ...}, samples)")
    return {k: float(v) if isinstance(v, np.number) else v for k, v in scalars.items()}
