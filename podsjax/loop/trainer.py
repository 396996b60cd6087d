"""The Trainer: one run's state, its step loop, resume, checkpoints and divergence."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable

import jax
import numpy as np

from podsjax import best as best_lib
from podsjax import checkpoint as ckpt_lib
from podsjax import compilation
from podsjax import dry_run
from podsjax import hosts
from podsjax import log_backends
from podsjax import mesh as mesh_lib
from podsjax import metrics as metrics_lib
from podsjax import prompts as prompts_lib
from podsjax import rewards as rewards_lib
from podsjax import algorithms, run_state, sampling, train
from podsjax import topology
from podsjax.loop import buckets, dynamic_sampling, perf, programs, reporting, run_files, scoring, start_programs
from podsjax.loop.config import RunConfig
from podsjax.loop.evaluator import Evaluator
from podsjax.loop.prompt_source import DataStream, PromptSource
from podsjax.models import LoraConfig
from podsjax.run_state import HostState


class TrainingDiverged(RuntimeError):
    """Several updates in a row had a non-finite loss or gradient."""


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
        generator: the :class:`podsjax.sampling.Generator` (default: a new one for ``model``).
        scorer: scores completions, ``score(completions, rewards, **columns)`` and ``close()``
            (default: a :class:`podsjax.rewards.RewardPool` of ``run_config.reward_workers``).
        evaluator: ``evaluator(params, lora) -> (scalars, samples)`` (default: an
            :class:`~podsjax.loop.Evaluator` on ``eval_examples``).
        update: ``(optimizer, update)`` as :func:`~podsjax.loop.update_program` makes them (default: made here).

    Attributes:
        compile_log: every compile of generate, selection and the update (see
            :class:`podsjax.compilation.CompileLog`); ``compile_counts`` is its counts.
    """

    def __init__(self, model, base_params, tokenizer, train_examples, eval_examples,
                 algo: algorithms.AlgorithmConfig, run_config: RunConfig, lora: LoraConfig | None = None, rewards=None,
                 log: Callable[[str], None] | None = None, started_at: float | None = None, *,
                 generator: sampling.Generator | None = None, scorer=None, evaluator=None, update=None):
        self.model, self.base_params, self.tokenizer = model, base_params, tokenizer
        self.algo, self.run_config, self.lora_config = algo, run_config, lora
        self.rewards = rewards_lib.as_weighted(rewards or rewards_lib.default_rewards(run_config.task))
        self.eos_ids = prompts_lib.eos_token_ids(tokenizer)
        # Process 0 speaks for a multi-host run; the others print nothing.
        self._print = log or (metrics_lib.print_line if run_config.console and hosts.is_primary() else None)
        self._bar: metrics_lib.Progress | None = None
        self.started_at = time.time() if started_at is None else started_at
        self.compile_log = compilation.CompileLog(self.log)
        self.generator = generator or sampling.Generator(model)
        self.optimizer, self.update_fn = update or programs.update_program(model, algo, lora)
        prompt_rows = programs.prompt_rows(run_config, algo)
        self._update_rows = prompt_rows * algo.m  # the rows of every update batch
        self.batch_fn = programs.batch_program(model.mesh, self._update_rows, algo)
        self.state, self.frozen = self._start_state(base_params)
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
        self.scorer = scorer or rewards_lib.RewardPool(run_config.reward_workers,
                                                       timeout_s=run_config.reward_timeout_s)
        self._buckets = buckets.BucketReuse(run_config.bucket_compile_after)
        self.evaluator = evaluator or Evaluator(
            self.generator, self.prompts, self.scorer, eval_examples, run_config,
            rows=prompt_rows * algo.n, rewards=self.rewards, eos_ids=self.eos_ids,
            compile_log=self.compile_log, buckets=self._buckets)
        self.best = (best_lib.BestPolicy(run_config.out_dir, (self.host.best_step, self.host.best_accuracy), restored)
                     if run_config.keep_best else None)
        self.writer = metrics_lib.MetricsWriter(
            run_config.out_dir, backends=run_config.log,
            config={"algorithm": dataclasses.asdict(algo), "run": dataclasses.asdict(run_config)},
            wandb_project=run_config.wandb_project, resume_step=restored, enabled=hosts.is_primary())
        # Decided from the config, not the writer: in a multi-host run every process joins the fetch.
        self._histograms = log_backends.draws_histograms(run_config.log)
        # Installed while run() runs; multi-host runs stop where every process agrees (a step boundary).
        self.signals = run_state.StopSignals(drop_at_once=hosts.count() == 1)
        self._compiled_once = False
        self._update_shapes: set[tuple[int, int]] = set()  # (rows, prompt length) the update compiled for
        # A step's update compiles behind generation's run on CPUs and TPUs. XLA's GPU compiler
        # times candidate kernels on the device as it compiles (autotuning): beside a running
        # generation those timings are noise and its scratch memory adds to generation's. GPUs,
        # and runs over several hosts (untried), compile it after generation. (The start's
        # compiles, with nothing running yet, overlap on GPUs too: podsjax.loop.start_programs.)
        self._overlap_compiles = mesh_lib.platform(model.mesh) != "gpu" and hosts.count() == 1
        self._pending_compile: compilation.InBackground | None = None  # the update compiling behind generation

    def _start_state(self, base_params):
        """The first ``(state, frozen)``; a full fine-tune of narrow weights keeps a cast copy to sample from."""
        model, lora = self.model, self.lora_config
        trainable, frozen = programs.start_weights(model, self.algo, lora, base_params, self.run_config.seed)
        self._policy_copy = programs.policy_copy_program(base_params) if lora is None else None
        self._policy_step = 0  # the update step base_params' policy copy was cast at
        if model.mesh is not None:
            shardings = jax.tree.map(lambda x: x.sharding, trainable)
        else:  # committed, as the sampler's compiled programs return arrays: one update signature from step 1
            device = next(iter(jax.tree.leaves(base_params)[0].devices()))
            trainable, shardings = jax.device_put(trainable, device), None
        with self.compile_log.label("init"):
            state = programs.state_program(self.optimizer, shardings)(trainable)
        if lora is None and self._policy_copy is None:
            self.base_params = None  # the state's params are the policy: no second copy stays
        return state, frozen

    def _restore(self) -> int | None:
        """Restores the newest checkpoint, if any, and rewinds the logs to it; its step, or None."""
        run_config = self.run_config
        found = self.checkpointer.restore_latest(jax.tree.map(mesh_lib.abstract, self.state), warn=self.log)
        if found is None:
            # No checkpoint committed (a first run, or one killed before its first save):
            # the run starts over, so logs from a killed attempt go.
            if hosts.is_primary():
                run_files.rewind_logs(run_config.out_dir, dict.fromkeys(run_files.LOGS, 0))
            return None
        self.state, saved, restored = found
        self.host = HostState.from_json(saved)
        try:
            moved = run_files.resume_logs(run_config.out_dir, self.host.log_sizes, restored)
        except run_files.LogDamaged:
            self.checkpointer.close()
            raise
        self.log(f"resumed from the checkpoint of step {restored} (training clock {self.host.elapsed_train_s:.0f} s)"
                 + ("; what was logged after it moved to *.superseded" if moved else ""))
        return restored

    @property
    def step(self) -> int:
        """RL steps taken: the state counts optimizer steps, ``algo.updates_per_step`` per RL step."""
        return int(self.state.step) // self.algo.updates_per_step

    @property
    def compile_counts(self) -> dict[str, int]:
        """Compiles so far per program, e.g. ``{"generate[prefill]": 1, "update": 1, ...}``."""
        return dict(self.compile_log.counts)

    def log(self, line: str) -> None:
        """One console line, above the progress bar when one is drawn."""
        if self._print is None:
            return
        if self._bar is not None and self._bar.enabled and self._print is metrics_lib.print_line:
            self._bar.write(line)
        else:
            self._print(line)

    def memory_plan(self) -> dry_run.MemoryPlan:
        """Generation and the update compiled for the run's largest shapes, and their memory.

        Through the Trainer's own generator, update and state, so the first step reuses
        these compiles instead of compiling again. The step-0 evaluation's programs and the
        batch builder compile beside them, ``run_config.compile_threads`` at a time
        (``podsjax.loop.start_programs``).
        """
        prompt_len = programs.padded_prompt_length(self.run_config)
        self._update_shapes.add((self._update_rows, prompt_len))
        self._buckets.compiled(prompt_len)
        return start_programs.plan_and_compile(self, start_programs.compile_threads(self.run_config, hosts.count()))

    def policy_params(self):
        """(params, lora) to sample from: the current policy, in the model's dtype.

        A full fine-tune of bf16 weights trains fp32 master weights (``train.master_weights``);
        the sampler reads a bf16 copy of them, cast once per update into ``base_params``.
        """
        if self.lora_config is not None:
            return self.base_params, self.state.params
        if self._policy_copy is None:  # the weights are trained in their own dtype
            return self.state.params, None
        step = int(self.state.step)  # optimizer steps: the policy changes with each
        if step != self._policy_step:
            self.base_params = None  # the old copy goes before the new one is made
            with self.compile_log.label("policy copy"):
                self.base_params = self._policy_copy(self.state.params)
            self._policy_step = step
        return self.base_params, None

    # -- one step ---------------------------------------------------------------------

    def _draw_and_generate(self, params, lora, key, first_round: bool = True) -> dict:
        """One draw of prompts, generated: ``{"examples", "prompts", "skipped", "ids", "prompt_mask", "rollouts"}``."""
        run_config, algo = self.run_config, self.algo
        examples, prompts, skipped = self.prompts.draw(run_config.prompts_per_step, algo.groups_per_prompt)
        prompts = self._buckets.fit(prompts)
        if first_round:
            self._compile_update_behind(prompts.ids_PL.shape[1])
        ids, prompt_mask = (self.generator.place_rows(x) for x in (prompts.ids_PL, prompts.mask_PL))
        shape = reporting.generate_shape(prompts.ids_PL, algo.n, run_config.max_new_tokens)
        with self.compile_log.label("generate", shape):
            rollouts = self.generator.generate(
                params, ids, prompt_mask, key, temperature=algo.temperature, lora=lora,
                **dry_run.rollout_options(algo, run_config.max_new_tokens, self.eos_ids, prompts.pad_id))
        return {"examples": examples, "prompts": prompts, "skipped": skipped, "ids": ids, "prompt_mask": prompt_mask,
                "rollouts": rollouts}

    def _compile_update_behind(self, prompt_len: int) -> None:
        """Starts compiling the update for this step's batch shape on another thread, to run
        while generation compiles and runs (``_pending_compile``), unless it compiled before.
        Without it the first step of each prompt bucket compiles generation and then the
        update. With dynamic sampling the batch's shape is known only after its draws, so the
        update compiles when it runs."""
        rows = self._update_rows
        if (not self._overlap_compiles or self.algo.dynamic_sampling or (rows, prompt_len) in self._update_shapes
                or not hasattr(self.update_fn, "lower")):  # an update of the caller's own, not jitted
            return
        self._update_shapes.add((rows, prompt_len))
        state = jax.tree.map(mesh_lib.abstract, self.state)
        batch = programs.abstract_batch(self.model.mesh, rows, prompt_len, self.run_config.max_new_tokens, self.algo,
                                        like=jax.tree.leaves(self.state.params)[0])
        detail = f"{rows} rows x {prompt_len + self.run_config.max_new_tokens} tokens"

        def compile_update():
            with self.compile_log.label("update", detail):
                self.update_fn.lower(state, batch, self.frozen).compile()

        self._pending_compile = compilation.InBackground(compile_update)

    def _score(self, drawn: dict) -> dict[str, np.ndarray]:
        rollouts = drawn["rollouts"]
        start, tokens = hosts.local_rows(rollouts.tokens)
        mask, truncated = (hosts.local_rows(x)[1] for x in (rollouts.mask, rollouts.truncated))
        return scoring.score_rollouts(self.tokenizer, self.scorer, self.rewards, drawn["examples"], self.algo.n,
                                      start, tokens, mask, truncated)

    def _merge_draws(self, draws: list[dict], scores: list[dict], zero: np.ndarray) -> tuple[dict, dict, dict]:
        """Dynamic sampling: the step's groups from several draws (``zero``: each drawn group's
        rewards all agree, in draw order), and what it did (``data/*`` scalars)."""
        n, wanted = self.algo.n, len(draws[0]["examples"])
        groups, filled = dynamic_sampling.choose_groups(zero, wanted)
        stats = {"data/sampling_rounds": float(len(draws)), "data/zero_std_groups_drawn": float(zero.mean()),
                 "data/groups_filled": float(filled)}
        if len(draws) == 1:
            return draws[0], scores[0], stats
        examples = [e for d in draws for e in d["examples"]]
        examples = [examples[g] for g in groups]
        prompts = self.prompts.prepare(examples)  # every one fit before: one padded batch of them all
        rows = dynamic_sampling.group_rows(groups, n)
        with self.compile_log.label("dynamic sampling"):
            rollouts = draws[0]["rollouts"].replace(**{
                name: dynamic_sampling.take_rows([getattr(d["rollouts"], name) for d in draws], rows)
                for name in ("tokens", "mask", "truncated", "logprobs", "lengths")})
        ids, prompt_mask = (self.generator.place_rows(x) for x in (prompts.ids_PL, prompts.mask_PL))
        merged = {"examples": examples, "prompts": prompts, "ids": ids, "prompt_mask": prompt_mask,
                  "rollouts": rollouts, "skipped": sum(d["skipped"] for d in draws)}
        return merged, dynamic_sampling.take_scored(scores, rows), stats

    def rl_step(self) -> dict[str, float]:
        """One PODS step: draw prompts, generate, score, select, update. Returns its scalars.

        With ``algo.dynamic_sampling`` the draw, generation and scoring repeat (up to
        ``max_sampling_rounds``) until the step has its groups with reward variance.
        """
        run_config, algo = self.run_config, self.algo
        timer = metrics_lib.PhaseTimer(compile_seconds=self.compile_log.thread_seconds)
        # Until the update, the state and the host state are as the last step left them: a stop drops this work.
        with self.signals.droppable():
            key = jax.random.fold_in(jax.random.key(run_config.seed + programs.ROLLOUT_SEED_OFFSET), self.step)
            draws, scores, zero = [], [], np.zeros(0, bool)
            for round_index in range(algo.max_sampling_rounds if algo.dynamic_sampling else 1):
                with timer.phase("generation"):
                    if round_index == 0:
                        params, lora = self.policy_params()
                    round_key = key if round_index == 0 else jax.random.fold_in(
                        jax.random.fold_in(key, programs.SAMPLING_ROUND_STREAM), round_index)
                    draws.append(self._draw_and_generate(params, lora, round_key, first_round=round_index == 0))
                    # JAX dispatches generation and returns at once; without the wait its time
                    # lands in scoring, which reads the tokens first.
                    jax.block_until_ready(draws[-1]["rollouts"])
                with timer.phase("scoring"):
                    scores.append(self._score(draws[-1]))
                if algo.dynamic_sampling:
                    flat = dynamic_sampling.zero_variance(scores[-1]["total"].reshape(-1, algo.n))
                    zero = np.concatenate([zero, flat])
                    if (~zero).sum() >= len(draws[0]["examples"]):
                        break
            with timer.phase("selection"):
                drawn, scored, sampling_stats = draws[0], scores[0], {}
                if algo.dynamic_sampling:
                    drawn, scored, sampling_stats = self._merge_draws(draws, scores, zero)
                examples, rollouts = drawn["examples"], drawn["rollouts"]
                p = len(examples)
                rewards_PN = scored["total"].reshape(p, algo.n)
                select_key = jax.random.fold_in(key, programs.SELECTION_STREAM)
                with self.compile_log.label("select"):
                    # The rollouts stay on device: only the rewards come from the host.
                    batch, idx_PM = self.batch_fn(drawn["ids"], drawn["prompt_mask"], rollouts.tokens, rollouts.mask,
                                                  rewards_PN, config=algo, key=select_key,
                                                  logprobs_BT=rollouts.logprobs)
        with timer.phase("update"):
            if self._pending_compile is not None:
                pending, self._pending_compile = self._pending_compile, None
                with timer.compiling():
                    pending.result()
            rows, length = batch.input_ids.shape
            with self.compile_log.label("update", f"{rows} rows x {length} tokens"):
                self.state, step_metrics = self.update_fn(self.state, batch, self.frozen)
                # The indices are only logged: fetched with the metrics, so the update is
                # dispatched right behind the selection with no host sync between them.
                step_metrics, idx_PM = jax.device_get((step_metrics, idx_PM))
                train.check_prompt_groups(step_metrics)  # the state is as it was then: stop before logging
        phases = timer.totals()  # without the step's compiles, which are timer.compile_s
        if self._compiled_once:
            self.host.elapsed_train_s += hosts.agree(sum(phases.values()) + timer.compile_s)
        # The first step of a process compiles generation and the update; JAX's
        # one-time compile is left off the clock (later steps reuse the programs).
        self._compiled_once = True
        self.host.data_position = self.prompts.stream.position
        if self._histograms:
            self.writer.histograms(self.step, {"reward/total": scored["total"],
                                               "train/advantages": hosts.fetch(batch.advantages)})
        selected = np.zeros((p, algo.n), bool)
        np.put_along_axis(selected, idx_PM, True, axis=1)
        generated = sum(int(s["length"].sum()) for s in scores)
        return {
            **self._perf(phases, draws, drawn, scored, selected, generated),
            **{f"train/{k}": float(v) for k, v in dataclasses.asdict(step_metrics).items() if v is not None},
            **scoring.reward_stats(scored, rewards_PN, selected),
            **sampling_stats,
            "data/prompts_skipped": float(drawn["skipped"]),
            **scoring.length_stats(scored),
            **{f"time/{k}": v for k, v in phases.items()},
            "time/compile": timer.compile_s,
            "time/tokens_per_s": metrics_lib.tokens_per_second(generated, phases["generation"]),
            "time/elapsed_train_s": self.host.elapsed_train_s,
        }

    def _perf(self, phases, draws, drawn, scored, selected_PN, generated: int) -> dict[str, float]:
        """``perf/*``: the step's time, tokens per second per device and MFU (``podsjax.loop.perf``)."""
        algo, n = self.algo, self.algo.n
        prompt_tokens = sum(int(d["prompts"].lengths_P.sum()) for d in draws)
        trained = int(drawn["prompts"].lengths_P.sum()) * algo.m + int(
            scored["length"].reshape(selected_PN.shape)[selected_PN].sum())
        extra = int(algo.beta > 0) + int(algo.old_logprobs == "recompute" and algo.updates_per_step > 1)
        flops = perf.step_flops(self.model.config.num_params, prompt_tokens=prompt_tokens,
                                completion_tokens=generated, trained_tokens=trained, passes=algo.num_iterations,
                                extra_forwards=extra)
        chip = topology.chip(jax.devices()[0].device_kind)
        devices = 1 if self.model.mesh is None else self.model.mesh.size
        return perf.perf_scalars(seconds=sum(phases.values()), tokens=prompt_tokens * n + generated, flops=flops,
                                 devices=devices, peak_flops=chip.peak_flops if chip else None)

    def evaluate(self) -> dict[str, float]:
        """The evaluator's scalars for the current policy; its samples go to ``samples.jsonl``."""
        with self.signals.droppable():  # nothing is written until every pass is scored
            scalars, samples = self.evaluator(*self.policy_params())
        self.writer.write_samples(self.step, samples[: self.run_config.log_samples])
        return scalars

    # -- the loop ---------------------------------------------------------------------

    def done(self) -> bool:
        run_config = self.run_config
        if run_config.max_steps is not None and self.step >= run_config.max_steps:
            return True
        return run_config.time_budget_s is not None and self.host.elapsed_train_s >= run_config.time_budget_s

    def eval_due(self) -> bool:
        every, last = self.run_config.eval_every_s, self.host.last_eval_s
        return every is not None and (last is None or self.host.elapsed_train_s - last >= every)

    def run(self) -> list[dict[str, float]]:
        """Trains until the budget is spent; returns the eval history (one dict per eval).

        Raises:
            StopRequested: SIGTERM or SIGINT came (in the main thread); the last whole step
                is checkpointed first (see ``podsjax.run_state.StopSignals``).
        """
        run_config = self.run_config
        history = run_files.read_history(run_config.out_dir)
        enabled = None if run_config.progress else False
        if run_config.max_steps is not None:
            bar = metrics_lib.Progress(run_config.max_steps, unit="step", initial=self.step, enabled=enabled)
        else:
            bar = metrics_lib.Progress(run_config.time_budget_s, unit="s", initial=self.host.elapsed_train_s,
                                       enabled=enabled)
        self._bar = bar
        # Without a bar (no TTY: logs, nohup, SLURM) one line every progress_every_s says how it goes.
        lines = metrics_lib.ProgressLog(self.log, every_s=run_config.progress_every_s)
        try:
            with self.signals:
                stopped = self._steps(history, bar, lines)
                # The last whole step is kept, whether the budget is spent or a stop came.
                self._save_checkpoint(self.step, force=True)
                if stopped or self._stop_agreed():
                    raise run_state.StopRequested(self.signals.requested, self.step,
                                                  self.checkpointer.latest_step())
        finally:
            bar.close()
            self._bar = None
            self.close()
        return history

    def _steps(self, history: list[dict[str, float]], bar, lines) -> bool:
        """Evaluates when due and steps until the budget is spent; True when a stop came first."""
        run_config, first = self.run_config, True
        try:
            while not self._stop_agreed():
                if self.eval_due():
                    self._record_evaluation(history)
                if self.done():
                    return False
                scalars = self.rl_step()
                step = self.step
                self.writer.write(step, scalars)
                self._check_finite(step, scalars)
                position = step if run_config.max_steps is not None else self.host.elapsed_train_s
                accuracy = history[-1]["eval/accuracy"] if history else float("nan")
                bar.update(position, step=step, reward=scalars["reward/mean"], acc=accuracy)
                if first:
                    since = time.time() - self.started_at
                    lines.update(step, lambda: f"first step done {since:.1f} s after start: "
                                               f"{reporting.phases_text(scalars)}", force=True)
                    first = False
                elif not bar.enabled:
                    lines.update(step, lambda: reporting.progress_line(step, scalars, accuracy, self.host, run_config),
                                 force=self.done())
                # Saved before the next step donates the state's buffers.
                self._save_checkpoint(step)
        except run_state.StepDropped:
            pass
        return True

    def _record_evaluation(self, history: list[dict[str, float]]) -> None:
        evaluation = {**self.evaluate(), "time/elapsed_train_s": self.host.elapsed_train_s}
        self.host.last_eval_s = self.host.elapsed_train_s
        step = self.step
        self.writer.write(step, evaluation)
        evaluation["step"] = step
        history.append(evaluation)
        if hosts.is_primary():
            run_files.append_history(self.run_config.out_dir, evaluation)
        self.log(reporting.eval_line(evaluation, self.run_config))
        if self.best is not None:
            self.best.offer(step, evaluation["eval/accuracy"], self.state.params)

    def _stop_agreed(self) -> bool:
        """Whether SIGTERM or SIGINT reached this process (any process, in a multi-host run)."""
        asked = self.signals.requested is not None
        if hosts.count() > 1:
            asked = hosts.sum_over_processes({"stop": float(asked)})["stop"] > 0
        return asked

    def _save_checkpoint(self, step: int, force: bool = False) -> None:
        # Each log's size goes with the checkpoint: a resume from it cuts the logs back to them.
        self.host.log_sizes = run_files.log_sizes(self.run_config.out_dir)
        if self.best is not None:  # the best policy the checkpoint records
            self.host.best_step, self.host.best_accuracy = self.best.step, self.best.accuracy
        if self.checkpointer.save(step, self.state, self.host.to_json(), force=force) and self.best is not None:
            self.best.checkpoint_started()

    def _check_finite(self, step: int, scalars: dict[str, float]) -> None:
        """Counts steps in a row with a skipped (non-finite) update; too many stop the run before
        the next save. A step of several optimizer steps counts when any of them was skipped."""
        in_a_row = self.host.nonfinite_in_a_row + 1 if scalars["train/skipped"] else 0
        self.host.nonfinite_in_a_row = in_a_row
        if in_a_row >= self.run_config.max_nonfinite_updates:
            last = self.checkpointer.latest_step()
            kept = "no checkpoint was saved yet" if last is None else f"the last checkpoint is step {last}"
            updates = self.algo.updates_per_step
            skipped = "" if updates == 1 else f", {scalars['train/skipped']:.0f} of its {updates} updates skipped"
            raise TrainingDiverged(
                f"{in_a_row} steps in a row had a non-finite loss or gradient (step {step}: loss "
                f"{scalars['train/loss']}, grad norm {scalars['train/grad_norm']}{skipped}); stopped. Skipped "
                f"updates left the weights as they were; {kept}. Lower the learning rate or check the rewards")

    def close(self):
        if self._pending_compile is not None:  # a step stopped before its update: no compile runs into the exit
            self._pending_compile.wait()
        # The reward workers go first: a second signal may cut the rest (waiting for a save) short.
        try:
            self.scorer.close()
        finally:
            self.checkpointer.close()
            if self.best is not None:
                self.best.checkpoints_committed()
                self.best.close()
            self.writer.close()
