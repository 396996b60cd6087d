"""How long a run trains, how it samples, evaluates, checkpoints and logs: :class:`RunConfig`."""

from __future__ import annotations

import dataclasses
import math
import os

from podsjax.data import datasets as data_lib
from podsjax.data import prompts as prompts_lib
from podsjax.rewards.pool_workers import MAX_SECONDS
from podsjax.run import log_backends

# Longest prompt + completion a run takes: 32x Qwen2.5's 32k context. Far past it (1e8 tokens)
# XLA's compiler aborted the whole process instead of raising.
MAX_SEQUENCE = 2**20

# Reward-scoring processes a run may start: scoring is CPU work, and past the host's cores more
# processes only take memory (each imports the graders); 100,000 of them would take the host down.
MAX_REWARD_WORKERS = 256

# eval_metric -> the reward-breakdown entries whose product scores one completion.
# "accuracy_and_format" is the Llama runs' "answer and format both correct" (the authors'
# both_acc): the task's accuracy times the authors' strict format check.
EVAL_METRICS: dict[str, tuple[str, ...]] = {
    "accuracy": ("accuracy",),
    "accuracy_and_format": ("accuracy", "strict_format"),
}


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """How long to train, how to sample, evaluate, checkpoint and log.

    Evaluation decodes every eval example once per repeat: ``eval_repeats`` passes at
    ``eval_temperature`` (0 = greedy, which allows one pass only) among the ``eval_top_k``
    most likely tokens (0: all), scored by
    ``eval_metric`` (a key of ``EVAL_METRICS``) and averaged over the passes. The
    paper's settings a-d sample 5 passes at 0.9 (see ``experiments.paper_settings``). For each
    k in ``eval_k`` the passes also give ``eval/pass_at_<k>`` and ``eval/maj_at_<k>``
    (:mod:`podsjax.rl.pass_at_k`).

    A non-finite loss or gradient skips its update (params and moments stay as they
    were; ``train/skipped`` counts it); ``max_nonfinite_updates`` of them in a row stop
    the run with :class:`TrainingDiverged`, leaving the last checkpoint as it was.

    With ``keep_best`` every evaluation that beats the earlier ones saves the policy
    (``podsjax.run.best``), so the run can export its best policy as well as its last.
    """

    out_dir: str  # the run directory
    task: str = "gsm8k"  # gsm8k, math or chemistry
    prompts_per_step: int = 1  # prompts drawn per step
    max_prompt_length: int = 512  # longer prompts are skipped (never cut), tokens
    max_new_tokens: int = 512  # completion length limit, tokens
    bucket_compile_after: int = 8  # a prompt bucket compiles at its Nth draw; before, its prompts pad to a compiled one
    compile_threads: int = 4  # programs the fit check compiles side by side before the first step (1: one at a time)
    time_budget_s: float | None = None  # seconds of training clock (evaluation excluded)
    max_steps: int | None = None  # steps (with or instead of a time budget)
    eval_every_s: float | None = 120.0  # seconds of training clock between evaluations (null: never)
    eval_limit: int | None = None  # evaluate on the first N test examples (null: all)
    eval_batch_size: int | None = None  # rows (prompts x eval_repeats) per evaluation chunk, at least; rounded up to whole prompts and a multiple of 8 (null: a step's rollout rows)
    eval_repeats: int = 1  # evaluation passes averaged (needs eval_temperature > 0 for more than 1)
    eval_temperature: float = 0.0  # evaluation sampling temperature (0: greedy)
    eval_top_k: int = 0  # evaluation samples among the k most likely tokens (0: off)
    eval_metric: str = "accuracy"  # accuracy, or accuracy_and_format (the answer and the strict format)
    eval_k: tuple[int, ...] = ()  # log pass@k and maj@k for these k (each 1..eval_repeats) from the passes; () off
    checkpoint_every_steps: int | None = None  # also checkpoint every N steps
    checkpoint_every_s: float | None = 1800.0  # checkpoint every this many seconds of training clock
    keep_last: int = 3  # checkpoints kept
    seed: int = 0  # seeds the data order, sampling, selection and LoRA init
    reward_workers: int = 2  # reward-scoring processes
    reward_timeout_s: float = 10.0  # a reward call past this CPU time scores 0 (a worker stuck past it is replaced)
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
        if not isinstance(self.out_dir, (str, os.PathLike)):
            raise ValueError(f"RunConfig.out_dir must be the run directory's path; got {self.out_dir!r}")
        if self.task not in data_lib.TASKS:
            raise ValueError(f"RunConfig.task must be one of {', '.join(data_lib.TASKS)}; got {self.task!r}")
        for name in ("progress", "console", "keep_best"):  # "no" would read as true
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"RunConfig.{name} must be true or false; got {getattr(self, name)!r}")
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
        for name in ("prompts_per_step", "max_prompt_length", "max_new_tokens", "bucket_compile_after",
                     "compile_threads", "max_steps",
                     "eval_limit", "eval_batch_size", "eval_repeats", "eval_top_k", "checkpoint_every_steps", "keep_last", "seed",
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
        for name in ("prompts_per_step", "max_prompt_length", "max_new_tokens", "bucket_compile_after",
                     "compile_threads", "eval_batch_size", "reward_workers", "eval_limit", "checkpoint_every_steps", "keep_last"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"RunConfig.{name} must be >= 1; got {getattr(self, name)}")
        if self.reward_timeout_s > MAX_SECONDS:  # the reward workers' timers overflow past it
            raise ValueError(f"RunConfig.reward_timeout_s must be at most {MAX_SECONDS:.0e} s; got "
                             f"{self.reward_timeout_s}")
        if self.reward_workers > MAX_REWARD_WORKERS:
            raise ValueError(f"RunConfig.reward_workers must be at most {MAX_REWARD_WORKERS} (scoring is CPU work: "
                             f"one process a core is enough); got {self.reward_workers}")
        if self.eval_repeats < 1:
            raise ValueError(f"RunConfig.eval_repeats must be >= 1; got {self.eval_repeats}")
        if self.max_prompt_length + self.max_new_tokens > MAX_SEQUENCE:  # past it XLA aborts the process
            raise ValueError(f"RunConfig.max_prompt_length + max_new_tokens must be at most {MAX_SEQUENCE} tokens; "
                             f"got {self.max_prompt_length} + {self.max_new_tokens}")
        if not 0 <= self.seed < 2**32:  # NumPy's generators refuse negative seeds
            raise ValueError(f"RunConfig.seed must be an integer from 0 to 2**32 - 1; got {self.seed}")
        object.__setattr__(self, "eval_k", tuple(self.eval_k) if isinstance(self.eval_k, list) else self.eval_k)
        if not isinstance(self.eval_k, tuple):
            raise ValueError(f"RunConfig.eval_k must be a list of integers; got {self.eval_k!r}")
        for k in self.eval_k:
            if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.eval_repeats:
                raise ValueError(f"RunConfig.eval_k: each k must be an integer from 1 to eval_repeats "
                                 f"({self.eval_repeats}); got {k!r}")
        if len(set(self.eval_k)) != len(self.eval_k):
            raise ValueError(f"RunConfig.eval_k repeats a k: {list(self.eval_k)}")
        if not 0 <= self.eval_temperature < float("inf"):
            raise ValueError(f"RunConfig.eval_temperature must be >= 0 (0 = greedy); got {self.eval_temperature}")
        if self.eval_top_k < 0:
            raise ValueError(f"RunConfig.eval_top_k must be >= 0 (0: off); got {self.eval_top_k}")
        if self.log_samples < 0:
            raise ValueError(f"RunConfig.log_samples must be >= 0 (0: none); got {self.log_samples}")
        if self.eval_temperature == 0 and self.eval_repeats > 1:
            raise ValueError(f"RunConfig.eval_repeats {self.eval_repeats} needs eval_temperature > 0: greedy "
                             "decoding repeats the same completions")
        if self.eval_metric not in EVAL_METRICS:
            raise ValueError(f"RunConfig.eval_metric must be one of {', '.join(EVAL_METRICS)}; "
                             f"got {self.eval_metric!r}")
        if not self.progress_every_s >= 0:
            raise ValueError(f"RunConfig.progress_every_s must be >= 0; got {self.progress_every_s}")

    def check_positions(self, max_position_embeddings: int, model: str = "the model") -> None:
        """A prompt and its completion fit the positions ``model`` was trained on (its config's
        ``max_position_embeddings``): RoPE past them computes, but on angles the model never saw.

        Raises:
            ValueError: ``max_prompt_length + max_new_tokens`` is more.
        """
        total = self.max_prompt_length + self.max_new_tokens
        if total > max_position_embeddings:
            raise ValueError(f"max_prompt_length {self.max_prompt_length} + max_new_tokens {self.max_new_tokens} = "
                             f"{total} tokens is more than {model}'s max_position_embeddings "
                             f"{max_position_embeddings}; lower --max-prompt-length or --max-completion-length")
