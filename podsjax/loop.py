"""The RL loop: prompts -> generate -> score -> select -> update, with eval, checkpoints, metrics.

The training clock counts generation, scoring, selection and update time only;
evaluation and checkpoint writes are excluded, as in the paper's wall-clock plots.

Resume is exact: a run killed at any point and resumed from its newest checkpoint
trains the same steps with the same data, RNG keys and optimizer state as a run that
was never stopped. The logs (metrics, samples, eval history) are cut back to their
sizes at that checkpoint, so the steps redone after the restore are logged once; the
cut records are kept in ``<log>.superseded``.

SIGTERM (a preemption's first word) and SIGINT stop a run at its last whole step:
generation, scoring and evaluation in flight are dropped, an update in flight finishes,
and that step is checkpointed before :class:`~podsjax.run_state.StopRequested` is raised
(see :class:`~podsjax.run_state.StopSignals`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from podsjax import best as best_lib
from podsjax import checkpoint as ckpt_lib
from podsjax import compilation
from podsjax import data as data_lib
from podsjax import hosts
from podsjax import log_backends
from podsjax import mesh as mesh_lib
from podsjax import metrics as metrics_lib
from podsjax import prompts as prompts_lib
from podsjax import rewards as rewards_lib
from podsjax import run_state
from podsjax import train
from podsjax.run_state import HostState
from podsjax.models import LoraConfig, init_lora
from podsjax.sampling import generate


# Streams folded into ``jax.random.key(seed)``, so each use of randomness draws its own keys.
_LORA_INIT_STREAM = 1
_EVAL_STREAM = 2
# A step's rollouts draw from key(seed + _ROLLOUT_SEED_OFFSET) folded with the step, and its
# selection from that key folded with _SELECTION_STREAM.
_ROLLOUT_SEED_OFFSET = 1
_SELECTION_STREAM = 7
# eval_metric -> the reward-breakdown entries whose product scores one completion.
# "accuracy_and_format" is the Llama runs' "answer and format both correct" (the authors'
# both_acc): the task's accuracy times the authors' strict format check.
EVAL_METRICS: dict[str, tuple[str, ...]] = {
    "accuracy": ("accuracy",),
    "accuracy_and_format": ("accuracy", "strict_format"),
}


def prompt_rows(run: "RunConfig", algo: train.AlgorithmConfig) -> int:
    """Prompt rows one step generates for: each prompt once per group (``groups_per_prompt``)."""
    return run.prompts_per_step * algo.groups_per_prompt


def batch_program(mesh, rows: int):
    """``train.build_batch`` over flat rollouts ``[P * N, T]``, jitted.

    With a mesh the batch comes out split over its batch axes (replicated when its
    ``rows`` do not divide evenly), so the update takes it as it is, on every host.
    """
    def build_batch(prompt_ids_PL, prompt_mask_PL, tokens_BT, mask_BT, rewards_PN, config, key):  # the compile label
        p, n = rewards_PN.shape
        return train.build_batch(prompt_ids_PL, prompt_mask_PL, tokens_BT.reshape(p, n, -1),
                                 mask_BT.reshape(p, n, -1), rewards_PN, config=config, key=key)

    if mesh is None:
        return jax.jit(build_batch, static_argnames="config")
    replicated = mesh_lib.batch_sharding(mesh, 0)
    return jax.jit(build_batch, static_argnames="config", out_shardings=(batch_shardings(mesh, rows), replicated))


def batch_shardings(mesh, rows: int) -> train.TrainBatch:
    """Where the update's input batch lives: rows over the mesh's batch axes when they
    divide evenly, else replicated; the whole-batch scalars replicated."""
    def sharding(ndim):
        return mesh_lib.rows_sharding(mesh, rows, ndim)

    return train.TrainBatch(input_ids=sharding(2), attention_mask=sharding(2), completion_mask=sharding(2),
                            advantages=sharding(1), loss_denominator=sharding(0), advantage_mean=sharding(0))


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """How long to train, how to sample, evaluate, checkpoint and log.

    Evaluation decodes every eval example once per repeat: ``eval_repeats`` passes at
    ``eval_temperature`` (0 = greedy, which allows one pass only), scored by
    ``eval_metric`` (a key of ``EVAL_METRICS``) and averaged over the passes. The
    paper's settings a-d sample 5 passes at 0.9 (see ``podsjax.paper_settings``).

    A non-finite loss or gradient skips its update (params and moments stay as they
    were; ``train/skipped`` counts it); ``max_nonfinite_updates`` of them in a row stop
    the run with :class:`TrainingDiverged`, leaving the last checkpoint as it was.

    With ``keep_best`` every evaluation that beats the earlier ones saves the policy
    (``podsjax.best``), so the run can export its best policy as well as its last.
    """

    out_dir: str  # the run directory
    task: str = "gsm8k"  # gsm8k, math or chemistry
    prompts_per_step: int = 1  # prompts drawn per step
    max_prompt_length: int = 512  # longer prompts are skipped (never cut), tokens
    max_new_tokens: int = 512  # completion length limit, tokens
    time_budget_s: float | None = None  # seconds of training clock (evaluation excluded)
    max_steps: int | None = None  # steps (with or instead of a time budget)
    eval_every_s: float | None = 120.0  # seconds of training clock between evaluations (null: never)
    eval_limit: int | None = None  # evaluate on the first N test examples (null: all)
    eval_batch_size: int | None = None  # rows per evaluation chunk (null: a step's rollout rows)
    eval_repeats: int = 1  # evaluation passes averaged (needs eval_temperature > 0 for more than 1)
    eval_temperature: float = 0.0  # evaluation sampling temperature (0: greedy)
    eval_metric: str = "accuracy"  # accuracy, or accuracy_and_format (the answer and the strict format)
    checkpoint_every_steps: int | None = None  # also checkpoint every N steps
    checkpoint_every_s: float | None = 1800.0  # checkpoint every this many seconds of training clock
    keep_last: int = 3  # checkpoints kept
    seed: int = 0  # seeds the data order, sampling, selection and LoRA init
    reward_workers: int = 2  # reward-scoring processes
    reward_timeout_s: float = 10.0  # a reward call slower than this scores 0 and its worker is replaced
    log_samples: int = 8  # evaluation completions written to samples.jsonl per evaluation
    progress: bool = True  # draw a progress bar on a terminal
    console: bool = True  # print progress lines
    progress_every_s: float = 30.0  # seconds between progress lines without a bar
    max_nonfinite_updates: int = 3  # non-finite updates in a row that stop the run
    keep_best: bool = True  # save each new best evaluated policy and export it as best_model/
    system_prompt: str | None = prompts_lib.DEFAULT_SYSTEM_PROMPT  # instructions before each question (null: none)
    log: tuple[str, ...] = log_backends.DEFAULT_BACKENDS  # metric backends: jsonl (always), tensorboard, wandb
    wandb_project: str | None = None  # W&B project (null: $WANDB_PROJECT, else podsjax)

    def __post_init__(self):
        try:
            object.__setattr__(self, "log", log_backends.parse_backends(self.log))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"RunConfig.log: {exc}") from None
        for name in ("time_budget_s", "eval_every_s", "checkpoint_every_s", "reward_timeout_s", "progress_every_s",
                     "eval_temperature"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value)):
                raise ValueError(f"RunConfig.{name} must be a finite number; got {value!r}")
        for name in ("prompts_per_step", "max_prompt_length", "max_new_tokens", "max_steps", "eval_limit",
                     "eval_batch_size", "eval_repeats", "checkpoint_every_steps", "keep_last", "seed",
                     "reward_workers", "log_samples", "max_nonfinite_updates"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"RunConfig.{name} must be an integer; got {value!r}")
        for name in ("checkpoint_every_s", "reward_timeout_s"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"RunConfig.{name} must be > 0; got {getattr(self, name)}")
        if self.eval_every_s is not None and self.eval_every_s < 0:
            raise ValueError(f"RunConfig.eval_every_s must be >= 0; got {self.eval_every_s}")
        if self.max_nonfinite_updates < 1:
            raise ValueError(f"RunConfig.max_nonfinite_updates must be >= 1; got {self.max_nonfinite_updates}")
        if self.time_budget_s is None and self.max_steps is None:
            raise ValueError("RunConfig needs a budget: a time budget (run.time_budget_s, --time-budget) or a "
                             "step limit (run.max_steps, --max-steps)")
        if self.time_budget_s is not None and not self.time_budget_s > 0:
            raise ValueError(f"RunConfig.time_budget_s must be > 0 seconds; got {self.time_budget_s}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"RunConfig.max_steps must be >= 1; got {self.max_steps}")
        for name in ("prompts_per_step", "max_prompt_length", "max_new_tokens", "eval_batch_size", "reward_workers",
                     "eval_limit", "checkpoint_every_steps", "keep_last"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"RunConfig.{name} must be >= 1; got {getattr(self, name)}")
        if self.eval_repeats < 1:
            raise ValueError(f"RunConfig.eval_repeats must be >= 1; got {self.eval_repeats}")
        if not 0 <= self.eval_temperature < float("inf"):
            raise ValueError(f"RunConfig.eval_temperature must be >= 0 (0 = greedy); got {self.eval_temperature}")
        if self.eval_temperature == 0 and self.eval_repeats > 1:
            raise ValueError(f"RunConfig.eval_repeats {self.eval_repeats} needs eval_temperature > 0: greedy "
                             "decoding repeats the same completions")
        if self.eval_metric not in EVAL_METRICS:
            raise ValueError(f"RunConfig.eval_metric must be one of {', '.join(EVAL_METRICS)}; "
                             f"got {self.eval_metric!r}")
        if not self.progress_every_s >= 0:
            raise ValueError(f"RunConfig.progress_every_s must be >= 0; got {self.progress_every_s}")


class TrainingDiverged(RuntimeError):
    """Several updates in a row had a non-finite loss or gradient."""


class LogDamaged(ValueError):
    """A run log is damaged before the restored checkpoint; resuming would lose its records."""


class DataStream:
    """An endless, seeded shuffle of examples; its position is all that resume needs."""

    def __init__(self, examples: Sequence[data_lib.Example], seed: int, position: int = 0):
        if not examples:
            raise ValueError("the training set is empty")
        self.examples, self.seed, self.position = list(examples), seed, position

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))

    def take(self, count: int) -> list[data_lib.Example]:
        out = []
        for _ in range(count):
            epoch, offset = divmod(self.position, len(self.examples))
            out.append(self.examples[int(self._order(epoch)[offset])])
            self.position += 1
        return out


def update_program(model, algo: train.AlgorithmConfig, lora: LoraConfig | None):
    """The optimizer and the jitted update ``update(state, batch, frozen)`` (the state is donated).

    ``--dry-run`` compiles this same function ahead of time, so its figures are the run's.
    """
    optimizer = train.make_optimizer(algo)
    policy, reference = train.lora_apply_fn(model) if lora is not None else train.full_apply_fn(model)
    step = train.make_train_step(policy, optimizer, algo, reference)

    def update(state, batch, frozen):  # the name compile reports use
        return step(state, batch, frozen)

    return optimizer, jax.jit(update, donate_argnums=0)


def _policy_copy_program(params: Any) -> Callable[[Any], Any] | None:
    """A jitted cast of master weights back to ``params``' dtypes and shardings, or None
    when ``train.master_weights`` keeps every leaf as it is."""
    leaves, treedef = jax.tree.flatten(params)
    dtypes = [x.dtype for x in leaves]  # not the arrays: the program must not keep them alive
    if dtypes == [x.dtype for x in jax.tree.leaves(jax.eval_shape(train.master_weights, params))]:
        return None
    shardings = treedef.unflatten([x.sharding for x in leaves])

    def policy_copy(master):  # the name compile reports use
        return treedef.unflatten([x.astype(d) for x, d in zip(jax.tree.leaves(master), dtypes)])

    return jax.jit(policy_copy, out_shardings=shardings)


class Trainer:
    """Owns the state, the jitted step, the reward pool, checkpoints and metrics of one run.

    Args:
        model, base_params, tokenizer: the policy to train and its tokenizer.
        train_examples, eval_examples: the task's splits.
        algo, run: what to train and how long.
        lora: train LoRA adapters on a frozen base (None: full fine-tune).
        rewards: reward specs (see ``podsjax.rewards.as_weighted``; default: the task's at
            weight 1). One must be named "accuracy": evaluation reads it.
        log: prints one console line (default: stdout when ``run.console``, else nothing).
        started_at: ``time.time()`` when the process started, for the first step's report.

    Attributes:
        compile_log: every compile of generate, selection and the update (see
            :class:`podsjax.compilation.CompileLog`); ``compile_counts`` is its counts.
    """

    def __init__(self, model, base_params, tokenizer, train_examples, eval_examples,
                 algo: train.AlgorithmConfig, run: RunConfig, lora: LoraConfig | None = None, rewards=None,
                 log: Callable[[str], None] | None = None, started_at: float | None = None):
        self.model, self.base_params, self.tokenizer = model, base_params, tokenizer
        self.algo, self.run_config, self.lora_config = algo, run, lora
        self.eval_examples = list(eval_examples)
        self.rewards = rewards_lib.as_weighted(rewards or rewards_lib.default_rewards(run.task))
        self.eval_rewards = _with_strict_format(self.rewards)
        self.eos_ids = prompts_lib.eos_token_ids(tokenizer)
        # Process 0 speaks for a multi-host run; the others print nothing.
        self._print = log or (metrics_lib.print_line if run.console and hosts.is_primary() else None)
        self._bar: metrics_lib.Progress | None = None
        self.started_at = time.time() if started_at is None else started_at
        self.compile_log = compilation.CompileLog(self.log)
        self.optimizer, self.step_fn = update_program(model, algo, lora)
        key = jax.random.key(run.seed)
        if lora is not None:
            trainable = init_lora(jax.random.fold_in(key, _LORA_INIT_STREAM), model, lora, mesh=model.mesh)
            self.frozen = base_params
        else:
            trainable = base_params
            # The KL reference of a full fine-tune is a frozen copy of the start weights.
            self.frozen = jax.tree.map(jnp.copy, base_params) if algo.beta > 0 else None
        self._policy_copy = _policy_copy_program(base_params) if lora is None else None
        self._policy_step = 0  # the update step base_params' policy copy was cast at
        if model.mesh is not None:
            shardings = jax.tree.map(lambda x: x.sharding, trainable)
        else:  # committed, as the sampler's compiled programs return arrays: one update signature from step 1
            device = next(iter(jax.tree.leaves(base_params)[0].devices()))
            trainable, shardings = jax.device_put(trainable, device), None

        def init(trainable):
            return self._init_state(trainable, shardings)

        with self.compile_log.label("init"):
            state = jax.jit(init)(trainable)
        if lora is None and self._policy_copy is None:
            self.base_params = None  # the state's params are the policy: no second copy stays
        self.batch_fn = batch_program(model.mesh, prompt_rows(run, algo) * algo.m)
        os.makedirs(run.out_dir, exist_ok=True)
        self.host = HostState()  # replaced by a checkpoint's, if one is restored below
        self.checkpointer = ckpt_lib.Checkpointer(ckpt_lib.CheckpointConfig(
            os.path.join(run.out_dir, "checkpoints"), save_every_steps=run.checkpoint_every_steps,
            save_every_seconds=run.checkpoint_every_s, keep_last=run.keep_last),
            clock=lambda: self.host.elapsed_train_s)  # the training clock, eval excluded
        found = self.checkpointer.restore_latest(jax.tree.map(mesh_lib.abstract, state), warn=self.log)
        if found is not None:
            state, saved, restored = found
            self.host = HostState.from_json(saved)
            if "log_sizes" in saved:  # absent in checkpoints from before log rewinding
                try:
                    _resume_logs(run.out_dir, self.host.log_sizes, restored)
                except LogDamaged:
                    self.checkpointer.close()
                    raise
            self.log(f"resumed from the checkpoint of step {restored} (training clock "
                     f"{self.host.elapsed_train_s:.0f} s); what was logged after it moved to *.superseded")
        else:
            # No checkpoint committed (a first run, or one killed before its first save):
            # the run starts over, so logs from a killed attempt go.
            restored = None
            if hosts.is_primary():
                _rewind_logs(run.out_dir, dict.fromkeys(_LOGS, 0))
        self.state = state
        self.stream = DataStream(train_examples, run.seed, self.host.data_position)
        self.best = best_lib.BestPolicy(run.out_dir, self.host, restored) if run.keep_best else None
        self.writer = metrics_lib.MetricsWriter(
            run.out_dir, backends=run.log, config={"algorithm": dataclasses.asdict(algo), "run": dataclasses.asdict(run)},
            wandb_project=run.wandb_project, resume_step=restored, enabled=hosts.is_primary())
        # Decided from the config, not the writer: in a multi-host run every process joins the fetch.
        self._histograms = log_backends.draws_histograms(run.log)
        self.pool = rewards_lib.RewardPool(run.reward_workers, timeout_s=run.reward_timeout_s)
        # Installed while run() runs; multi-host runs stop where every process agrees (a step boundary).
        self.signals = run_state.StopSignals(drop_at_once=hosts.count() == 1)
        self._compiled_once = False
        self._skips_reported = False

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

    def _init_state(self, trainable, shardings) -> train.TrainState:
        """The first state, with optimizer moments born in their params' shardings.

        Without the constraint XLA creates the moments replicated; the first step
        then reshards them and compiles twice, and a big full fine-tune may not fit.
        """
        state = train.init_state(trainable, self.optimizer)
        if shardings is None:
            return state
        params = jax.tree.map(jax.lax.with_sharding_constraint, state.params, shardings)
        opt_state = optax.tree_utils.tree_map_params(
            self.optimizer, lambda x, s: jax.lax.with_sharding_constraint(x, s), state.opt_state, shardings)
        return state.replace(params=params, opt_state=opt_state)

    # -- one step ---------------------------------------------------------------------

    def policy_params(self):
        """(params, lora) to sample from: the current policy, in the model's dtype.

        A full fine-tune of bf16 weights trains fp32 master weights (``train.master_weights``);
        the sampler reads a bf16 copy of them, cast once per update into ``base_params``.
        """
        if self.lora_config is not None:
            return self.base_params, self.state.params
        if self._policy_copy is None:  # the weights are trained in their own dtype
            return self.state.params, None
        step = int(self.state.step)
        if step != self._policy_step:
            self.base_params = None  # the old copy goes before the new one is made
            with self.compile_log.label("policy copy"):
                self.base_params = self._policy_copy(self.state.params)
            self._policy_step = step
        return self.base_params, None

    def train_step(self) -> dict[str, float]:
        run, algo = self.run_config, self.algo
        timer = metrics_lib.PhaseTimer()
        # Until the update, the state and the host state are as the last step left them: a stop drops this work.
        with self.signals.droppable():
            with timer.phase("generation"):
                examples, prompts, skipped = self._draw_prompts()
                params, lora = self.policy_params()
                key = jax.random.fold_in(jax.random.key(run.seed + _ROLLOUT_SEED_OFFSET), int(self.state.step))
                ids, prompt_mask = (hosts.place_rows(x, self.model.mesh) for x in (prompts.ids_PL, prompts.mask_PL))
                with self.compile_log.label("generate", _shape(prompts.ids_PL, algo.n, run.max_new_tokens)):
                    rollouts = generate(self.model, params, ids, prompt_mask, key, num_samples=algo.n,
                                        max_new_tokens=run.max_new_tokens, temperature=algo.temperature,
                                        top_p=algo.top_p, top_k=algo.top_k, eos_token_ids=self.eos_ids,
                                        pad_token_id=prompts.pad_id, lora=lora)
                start, tokens = hosts.local_rows(rollouts.tokens)
                mask, truncated = (hosts.local_rows(x)[1] for x in (rollouts.mask, rollouts.truncated))
            with timer.phase("scoring"):
                scored = self._score(examples, start, tokens, mask, truncated)
            p = len(examples)
            rewards_PN = scored["total"].reshape(p, algo.n)
            with timer.phase("selection"):
                select_key = jax.random.fold_in(key, _SELECTION_STREAM)
                with self.compile_log.label("select"):
                    # The rollouts stay on device: only the rewards come from the host.
                    batch, idx_PM = self.batch_fn(ids, prompt_mask, rollouts.tokens, rollouts.mask, rewards_PN,
                                                  config=algo, key=select_key)
        with timer.phase("update"):
            rows, length = batch.input_ids.shape
            with self.compile_log.label("update", f"{rows} rows x {length} tokens"):
                self.state, step_metrics = self.step_fn(self.state, batch, self.frozen)
                # The indices are only logged: fetched with the metrics, so the update is
                # dispatched right behind the selection with no host sync between them.
                step_metrics, idx_PM = jax.device_get((step_metrics, idx_PM))
        phases = timer.totals()
        if self._compiled_once:
            self.host.elapsed_train_s += hosts.agree(sum(phases.values()))
        # The first step of a process compiles generation and the update; JAX's
        # one-time compile is left off the clock (later steps reuse the programs).
        self._compiled_once = True
        self.host.data_position = self.stream.position
        if self._histograms:
            self.writer.histograms(int(self.state.step), {"reward/total": scored["total"],
                                                          "train/advantages": hosts.fetch(batch.advantages)})
        selected = np.zeros((p, algo.n), bool)
        np.put_along_axis(selected, idx_PM, True, axis=1)
        return {
            **{f"train/{k}": float(v) for k, v in dataclasses.asdict(step_metrics).items()},
            **_reward_stats(scored, rewards_PN, selected, p, algo.n),
            "data/prompts_skipped": float(skipped),
            "completion/length_mean": float(scored["length"].mean()),
            "completion/truncated_frac": float(scored["truncated"].mean()),
            **{f"time/{k}": v for k, v in phases.items()},
            "time/tokens_per_s": metrics_lib.tokens_per_second(int(scored["length"].sum()), phases["generation"]),
            "time/elapsed_train_s": self.host.elapsed_train_s,
        }

    def _score(self, examples, start: int, tokens, mask, truncated) -> dict[str, np.ndarray]:
        """Scores this process's rollout rows (global rows ``start`` on) and gathers every host's.

        Returns the whole step's per-row ``total``, ``length``, ``truncated`` and
        ``reward/<function>`` arrays, and the reward pool's failure counts summed over hosts
        (``count/<metric>``, one entry each).
        """
        n, end = self.algo.n, start + len(tokens)
        completions = prompts_lib.decode_completions(self.tokenizer, tokens, mask)
        columns = {name: values[start:end] for name, values in data_lib.reward_columns(examples, n).items()}
        scores = self.pool.score(completions, self.rewards, **columns)
        rows = {"total": np.asarray(scores.total_B, np.float32), "length": mask.sum(1).astype(np.int32),
                "truncated": np.asarray(truncated, np.float32),
                **{f"reward/{k}": np.asarray(v, np.float32) for k, v in scores.per_function.items()}}
        scored = hosts.gather_rows(start, rows, len(examples) * n)
        counts = {k: v for k, v in scores.metrics.items() if k.endswith(("timeouts", "crashes", "errors"))}
        scored.update({f"count/{k}": np.float64(v) for k, v in hosts.sum_over_processes(counts).items()})
        return scored

    def _draw_prompts(self) -> tuple[list[data_lib.Example], prompts_lib.PromptBatch, int]:
        """The next ``prompts_per_step`` training examples whose prompts fit, and how many were skipped.

        A prompt longer than ``max_prompt_length`` is skipped (never cut: a cut question
        rewards the wrong answer) and another is drawn, so every step has the same rows:
        no new shape to compile, and no step left with nothing to score. With
        ``groups_per_prompt`` g > 1 each example appears g times in a row, one group each.

        Raises:
            PromptError: two passes' worth of draws (which hold every example at least
                once) were too long to fill one step.
        """
        run = self.run_config
        wanted, limit = run.prompts_per_step, 2 * len(self.stream.examples)
        kept: list[data_lib.Example] = []
        skipped = 0
        while len(kept) < wanted:
            drawn = self.stream.take(wanted - len(kept))
            batch = self._prompts(drawn)
            kept += [drawn[i] for i in batch.kept_P]
            skipped += batch.num_dropped
            if len(kept) < wanted and skipped >= limit:
                raise prompts_lib.PromptError(
                    f"too few training prompts fit in max_prompt_length {run.max_prompt_length} tokens: "
                    f"{skipped} of {skipped + len(kept)} drawn for one step of {wanted} were longer; "
                    "raise --max-prompt-length or filter the training set")
        if skipped and not self._skips_reported:
            self.log(f"skipped {skipped} training prompt(s) longer than max_prompt_length "
                     f"{run.max_prompt_length} tokens and drew others (each step's count: data/prompts_skipped)")
            self._skips_reported = True
        groups = self.algo.groups_per_prompt
        if skipped or groups > 1:
            kept = [example for example in kept for _ in range(groups)]
            batch = self._prompts(kept)
        return kept, batch, skipped

    def _prompts(self, examples) -> prompts_lib.PromptBatch:
        """The examples' questions, templated and tokenized as every step and evaluation feeds them."""
        run = self.run_config
        return prompts_lib.prepare_prompts(self.tokenizer, [e.prompt for e in examples],
                                           max_prompt_length=run.max_prompt_length, system_prompt=run.system_prompt)

    def _batch_shards(self) -> int:
        return mesh_lib.shard_count(self.model.mesh, "batch")

    # -- evaluation -------------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """The eval split's ``eval_metric``, averaged over ``eval_repeats`` passes at ``eval_temperature``.

        Each pass decodes every example once. Every evaluation draws the same keys (one per
        pass and chunk, from the run's seed): common random numbers, so two evaluations, or
        two methods run with one seed, differ by their policies rather than their draws.

        Returns:
            ``eval/accuracy``: the metric, mean over passes; ``eval/accuracy_std``: its
            standard deviation over passes (ddof 1; 0 with one pass); ``eval/answer_accuracy``
            and ``eval/format_accuracy``: the task's accuracy and the authors' strict format
            check, means over passes; ``eval/examples``: examples per pass (prompts longer
            than ``max_prompt_length`` are left out).
        """
        run = self.run_config
        repeats = run.eval_repeats
        examples = self.eval_examples[: run.eval_limit] if run.eval_limit else self.eval_examples
        params, lora = self.policy_params()
        eval_key = jax.random.fold_in(jax.random.key(run.seed), _EVAL_STREAM)
        parts: dict[str, list[np.ndarray]] = {name: [] for name in _EVAL_PARTS}  # name -> chunks of [R, e]
        samples = []
        # As many rows as a training step's rollouts by default, so evaluation decodes
        # with the rollouts' compiled program (temperature is an input of it, not a constant).
        size = run.eval_batch_size or prompt_rows(run, self.algo) * self.algo.n
        with self.signals.droppable():  # nothing is written until every pass is scored
            for index, start in enumerate(range(0, len(examples), size)):
                chunk = examples[start : start + size]
                prompts = self._prompts(chunk)
                chunk = [chunk[i] for i in prompts.kept_P]
                if not chunk:
                    continue
                # Every chunk has the same rows (a short last one or dropped prompts would be a new
                # shape, so a new compile), split evenly over the mesh's batch shards: repeat the
                # last prompt and drop its copies' results.
                rows = -(-size // self._batch_shards()) * self._batch_shards()
                ids, prompt_mask = (hosts.place_rows(x, self.model.mesh) for x in prompts.padded_rows(rows))
                padded = chunk + [chunk[-1]] * (rows - len(chunk))
                breakdowns = []  # [R] of name -> [e]
                for repeat in range(repeats):
                    key = jax.random.fold_in(jax.random.fold_in(eval_key, repeat), index)
                    with self.compile_log.label("generate", _shape(ids, 1, run.max_new_tokens)):
                        r = generate(self.model, params, ids, prompt_mask, key, num_samples=1,
                                     max_new_tokens=run.max_new_tokens, temperature=run.eval_temperature,
                                     eos_token_ids=self.eos_ids, pad_token_id=prompts.pad_id, lora=lora)
                    first, tokens = hosts.local_rows(r.tokens)
                    mask = hosts.local_rows(r.mask)[1]
                    mine = padded[first : first + len(tokens)]
                    texts = prompts_lib.decode_completions(self.tokenizer, tokens, mask)
                    columns = data_lib.reward_columns(mine, 1)
                    scores = self.pool.score(texts, self.eval_rewards, **columns).per_function
                    local = {name: np.asarray(scores[name], np.float64) for name in _EVAL_PARTS}
                    breakdowns.append({name: values[: len(chunk)]
                                       for name, values in hosts.gather_rows(first, local, rows).items()})
                    if repeat == 0:  # this host's rows of the chunk (process 0's are the first)
                        real = max(0, min(len(tokens), len(chunk) - first))
                        samples.extend({"prompt": e.prompt, "completion": t, "answer": e.answer, "accuracy": float(a),
                                        "format_correct": float(f)}
                                       for e, t, a, f in zip(mine[:real], texts, scores["accuracy"],
                                                             scores["strict_format"]))
                for name in _EVAL_PARTS:
                    parts[name].append(np.stack([np.asarray(b[name], np.float64) for b in breakdowns]))
        step = int(self.state.step)
        self.writer.write_samples(step, samples[: run.log_samples])
        values_RE = {name: np.concatenate(chunks, axis=1) if chunks else np.zeros((repeats, 0))
                     for name, chunks in parts.items()}
        return _eval_scalars(values_RE, EVAL_METRICS[run.eval_metric])

    # -- the loop ---------------------------------------------------------------------

    def done(self) -> bool:
        run = self.run_config
        if run.max_steps is not None and int(self.state.step) >= run.max_steps:
            return True
        return run.time_budget_s is not None and self.host.elapsed_train_s >= run.time_budget_s

    def eval_due(self) -> bool:
        every, last = self.run_config.eval_every_s, self.host.last_eval_s
        return every is not None and (last is None or self.host.elapsed_train_s - last >= every)

    def run(self) -> list[dict[str, float]]:
        """Trains until the budget is spent; returns the eval history (one dict per eval).

        Raises:
            StopRequested: SIGTERM or SIGINT came (in the main thread); the last whole step
                is checkpointed first (see ``podsjax.run_state.StopSignals``).
        """
        history = read_history(self.run_config.out_dir)
        run = self.run_config
        enabled = None if run.progress else False
        if run.max_steps is not None:
            bar = metrics_lib.Progress(run.max_steps, unit="step", initial=int(self.state.step), enabled=enabled)
        else:
            bar = metrics_lib.Progress(run.time_budget_s, unit="s", initial=self.host.elapsed_train_s,
                                       enabled=enabled)
        self._bar = bar
        # Without a bar (no TTY: logs, nohup, SLURM) one line every progress_every_s says how it goes.
        lines = metrics_lib.ProgressLog(self.log, every_s=run.progress_every_s)
        first = True
        stopped = False
        try:
            with self.signals:
                try:
                    while True:
                        if self._stop_agreed():
                            stopped = True
                            break
                        if self.eval_due():
                            evaluation = {**self.evaluate(), "time/elapsed_train_s": self.host.elapsed_train_s}
                            self.host.last_eval_s = self.host.elapsed_train_s
                            self.writer.write(int(self.state.step), evaluation)
                            evaluation["step"] = int(self.state.step)
                            history.append(evaluation)
                            if hosts.is_primary():
                                _append_history(self.run_config.out_dir, evaluation)
                            self.log(_eval_line(evaluation, run))
                            if self.best is not None:
                                self.best.offer(evaluation["step"], evaluation["eval/accuracy"], self.state.params)
                        if self.done():
                            break
                        scalars = self.train_step()
                        step = int(self.state.step)
                        self.writer.write(step, scalars)
                        self._check_finite(step, scalars)
                        position = step if run.max_steps is not None else self.host.elapsed_train_s
                        accuracy = history[-1]["eval/accuracy"] if history else float("nan")
                        bar.update(position, step=step, reward=scalars["reward/mean"], acc=accuracy)
                        if first:
                            since = time.time() - self.started_at
                            lines.update(step, lambda: f"first step done {since:.1f} s after start: "
                                                       f"{_phases_text(scalars)}", force=True)
                            first = False
                        elif not bar.enabled:
                            lines.update(step, lambda: self._progress_line(step, scalars, accuracy),
                                         force=self.done())
                        # Saved before the next step donates the state's buffers.
                        self._save_checkpoint(step)
                except run_state.StepDropped:
                    stopped = True
                # The last whole step is kept, whether the budget is spent or a stop came.
                self._save_checkpoint(int(self.state.step), force=True)
                if stopped or self._stop_agreed():
                    raise run_state.StopRequested(self.signals.requested, int(self.state.step),
                                                  self.checkpointer.latest_step())
        finally:
            bar.close()
            self._bar = None
            self.close()
        return history

    def _stop_agreed(self) -> bool:
        """Whether SIGTERM or SIGINT reached this process (any process, in a multi-host run)."""
        asked = self.signals.requested is not None
        if hosts.count() > 1:
            asked = hosts.sum_over_processes({"stop": float(asked)})["stop"] > 0
        return asked

    def _save_checkpoint(self, step: int, force: bool = False) -> None:
        if self.checkpointer.save(step, self.state, self._host_with_log_sizes(), force=force) and self.best is not None:
            self.best.checkpoint_started()

    def _check_finite(self, step: int, scalars: dict[str, float]) -> None:
        """Counts skipped (non-finite) updates in a row; too many stop the run before the next save."""
        in_a_row = self.host.nonfinite_in_a_row + 1 if scalars["train/skipped"] else 0
        self.host.nonfinite_in_a_row = in_a_row
        if in_a_row >= self.run_config.max_nonfinite_updates:
            last = self.checkpointer.latest_step()
            kept = "no checkpoint was saved yet" if last is None else f"the last checkpoint is step {last}"
            raise TrainingDiverged(
                f"{in_a_row} updates in a row had a non-finite loss or gradient (step {step}: loss "
                f"{scalars['train/loss']}, grad norm {scalars['train/grad_norm']}); stopped. The weights were not "
                f"changed by them; {kept}. Lower the learning rate or check the rewards")

    def _progress_line(self, step: int, scalars: dict[str, float], accuracy: float) -> str:
        run = self.run_config
        of = f"/{run.max_steps}" if run.max_steps is not None else ""
        budget = f"/{run.time_budget_s:.0f}" if run.time_budget_s is not None else ""
        acc = "-" if accuracy != accuracy else f"{accuracy:.1%}"
        return (f"step {step}{of} | train clock {self.host.elapsed_train_s:.0f}{budget} s | "
                f"reward {scalars['reward/mean']:.3f} | eval acc {acc} | {_phases_text(scalars)}")

    def _host_with_log_sizes(self) -> dict[str, Any]:
        """The host state plus each log's size now, which a resume from this checkpoint cuts back to."""
        self.host.log_sizes = _log_sizes(self.run_config.out_dir)
        return self.host.to_json()

    def close(self):
        # The reward workers go first: a second signal may cut the rest (waiting for a save) short.
        try:
            self.pool.close()
        finally:
            self.checkpointer.close()
            if self.best is not None:
                self.best.checkpoints_committed()
                self.best.close()
            self.writer.close()


# The breakdown entries evaluation keeps: whatever some EVAL_METRICS entry multiplies.
_EVAL_PARTS = tuple(dict.fromkeys(name for names in EVAL_METRICS.values() for name in names))


def _with_strict_format(rewards: tuple[rewards_lib.WeightedReward, ...]) -> tuple[rewards_lib.WeightedReward, ...]:
    """``rewards`` plus the strict format check at weight 0: scored for evaluation, never in the total."""
    if any(w.name == "strict_format" for w in rewards):
        return rewards
    return (*rewards, rewards_lib.WeightedReward(rewards_lib.strict_format_reward, 0.0, "strict_format"))


def _eval_scalars(values_RE: dict[str, np.ndarray], metric: tuple[str, ...]) -> dict[str, float]:
    """Evaluation's scalars from each part's [R passes, E examples] values (see ``Trainer.evaluate``)."""
    repeats, count = values_RE[metric[0]].shape
    metric_RE = np.prod([values_RE[name] for name in metric], axis=0)
    per_pass_R = metric_RE.mean(axis=1) if count else np.zeros(repeats)
    return {
        "eval/accuracy": float(per_pass_R.mean()),
        "eval/accuracy_std": float(per_pass_R.std(ddof=1)) if repeats > 1 else 0.0,
        "eval/answer_accuracy": float(values_RE["accuracy"].mean()) if count else 0.0,
        "eval/format_accuracy": float(values_RE["strict_format"].mean()) if count else 0.0,
        "eval/examples": float(count),
    }


def _eval_line(evaluation: dict[str, float], run: RunConfig) -> str:
    """``eval at step 3: accuracy 41.2% (mean of 5 passes at temperature 0.9, std 1.1%) on 1319 examples``."""
    what = "accuracy" if run.eval_metric == "accuracy" else "answer and format correct"
    line = f"eval at step {evaluation['step']}: {what} {evaluation['eval/accuracy']:.1%}"
    if run.eval_repeats > 1:
        line += (f" (mean of {run.eval_repeats} passes at temperature {run.eval_temperature:g}, "
                 f"std {evaluation['eval/accuracy_std']:.1%})")
    return f"{line} on {int(evaluation['eval/examples'])} examples"


def _shape(ids_PL, samples: int, new_tokens: int) -> str:
    """``"8 prompts x 16 samples, 128 + 48 tokens"``: what a generate compile is for."""
    prompts, length = np.shape(ids_PL)
    return f"{prompts} prompts x {samples} samples, {length} + {new_tokens} tokens"


def _phases_text(scalars: dict[str, float]) -> str:
    phases = [(name, scalars.get(f"time/{name}")) for name in ("generation", "scoring", "selection", "update")]
    total = sum(v for _, v in phases if v is not None)
    return f"step {total:.2f} s (" + ", ".join(f"{n} {v:.2f}" for n, v in phases if v is not None) + ")"


def _reward_stats(scored: dict[str, np.ndarray], rewards_PN, selected_PN, p, n) -> dict[str, float]:
    out = {"reward/mean": float(rewards_PN.mean()), "reward/std": float(rewards_PN.std()),
           "reward/selected_mean": float(rewards_PN[selected_PN].mean()),
           "reward/selected_std": float(rewards_PN[selected_PN].std()),
           "reward/zero_std_groups": float(np.mean(rewards_PN.std(axis=1) == 0))}
    for name, values in scored.items():
        if name.startswith("reward/"):
            values_PN = values.reshape(p, n)
            out[name] = float(values_PN.mean())
            out[f"{name}_selected"] = float(values_PN[selected_PN].mean())
        elif name.startswith("count/"):
            out[name.removeprefix("count/")] = float(values)
    return out


HISTORY_FILE = "eval_history.jsonl"
_LOGS = ("metrics.jsonl", "samples.jsonl", HISTORY_FILE)


def _log_sizes(out_dir) -> dict[str, int]:
    paths = {name: os.path.join(out_dir, name) for name in _LOGS}
    return {name: os.path.getsize(path) for name, path in paths.items() if os.path.exists(path)}


def _resume_logs(out_dir, sizes: dict[str, int], step: int) -> None:
    """Checks the logs up to the restored checkpoint, then rewinds them to it (process 0; all agree).

    Raises:
        LogDamaged: a log holds less than, or something else than, whole records up to its
            size at the checkpoint.
    """
    problem = None
    if hosts.is_primary():
        problem = _damaged_log(out_dir, sizes, step)
        if problem is None:
            _rewind_logs(out_dir, sizes)
    if hosts.sum_over_processes({"damaged": float(problem is not None)})["damaged"]:  # the others stop too
        raise LogDamaged(problem or "process 0 found a run log damaged before the restored checkpoint (its error "
                         "names the file)")


def _damaged_log(out_dir, sizes: dict[str, int], step: int) -> str | None:
    """The one line for the first log whose part before the checkpoint is not whole records, or None.

    A checkpoint keeps each log's size, not its records, so records lost before it cannot be
    rebuilt from it; resuming over the damage (a line cut short, garbage, the file cut back)
    would leave steps missing from the log with no sign of it. So the resume is refused, and
    the line says what to do. A log that is gone (moved aside) is not damaged: it starts over.
    """
    for name in _LOGS:
        path, size = os.path.join(out_dir, name), sizes.get(name, 0)
        what = _first_damage(path, size) if size and os.path.exists(path) else None
        if what is not None:
            return (f"run log {path} is damaged before the checkpoint of step {step}: {what}; resuming would lose "
                    "the records it logged, so move the file aside (the resumed run starts a new one) or put back "
                    "a whole copy, then rerun with --resume")
    return None


def _first_damage(path: str, size: int) -> str | None:
    """What is wrong with the first ``size`` bytes of a log, or None when they are whole JSON records."""
    read = number = 0
    with open(path, "rb") as f:
        while read < size:
            line = f.readline(size - read)
            if not line:
                return f"it ends after line {number} ({read} of the {size} bytes it had then)"
            read += len(line)
            number += 1
            if not line.endswith(b"\n"):
                return f"line {number} is cut short"
            try:
                record = json.loads(line)
            except ValueError:  # not JSON, or not UTF-8
                record = None
            if not isinstance(record, dict):
                return f"line {number} is not a JSON record"
    return None


def _rewind_logs(out_dir, sizes: dict[str, int]) -> None:
    """Cuts each log back to its size at the restored checkpoint, keeping the cut tail.

    Whatever a killed run logged after that checkpoint is redone by the resumed run;
    leaving it in place would log those steps (and evaluations) twice.
    """
    for name in _LOGS:
        path = os.path.join(out_dir, name)
        if not os.path.exists(path):
            continue
        size = sizes.get(name, 0)  # a log born after the checkpoint is all tail
        with open(path, "rb+") as f:
            f.seek(size)
            tail = f.read()
            if tail:
                with open(path + ".superseded", "ab") as kept:
                    kept.write(tail if tail.endswith(b"\n") else tail + b"\n")  # a torn line stays one line
                f.truncate(size)


def history_path(out_dir) -> str:
    """The run's evaluation history: one JSON line per evaluation."""
    return os.path.join(out_dir, HISTORY_FILE)


def read_history(out_dir) -> list[dict[str, float]]:
    """Every evaluation of the run in ``out_dir`` so far (none before the first)."""
    path = history_path(out_dir)
    return metrics_lib.read_jsonl(path) if os.path.exists(path) else []


def _append_history(out_dir, record):
    with open(history_path(out_dir), "a") as f:
        f.write(json.dumps(record) + "\n")
