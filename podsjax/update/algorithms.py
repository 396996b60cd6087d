"""The algorithms an update trains: GRPO, GRPO-GA and GRPO-PODS as one validated
``AlgorithmConfig``, and the optimizer. Each method's preset sizes are experiment
knowledge: ``experiments.paper_settings.method_config``.

m is always the number of rollouts per prompt that the update trains, as in the paper.
GRPO is n = m (no selection); GRPO-GA is n = m as well, with more rollouts per prompt
accumulated over ``grad_accum`` micro-batches; GRPO-PODS generates n and trains the m a
rule selects.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import optax

from podsjax.core import grpo, selection

ALGORITHMS = ("grpo", "grpo-ga", "pods")
SCHEDULES = ("constant", "cosine")
OLD_LOGPROBS = ("recompute", "sampler")


# Optimizer steps one generated batch may take: the update program holds each (a loop of them
# unrolled), so 2,000 had traced for minutes before compiling. TRL's num_iterations is 1 to 4.
MAX_UPDATES_PER_GENERATION = 64
_SMALLEST_TEMPERATURE = 2.0 ** -126  # float32's smallest normal number
_INT_FIELDS = ("n", "m", "grad_accum", "groups_per_prompt", "num_iterations", "steps_per_generation", "total_steps",
               "top_k", "max_sampling_rounds")
_FLOAT_FIELDS = ("beta", "epsilon", "epsilon_high", "temperature", "logprob_temperature", "top_p", "learning_rate",
                 "warmup_ratio", "max_grad_norm", "weight_decay", "adam_b1", "adam_b2", "advantage_eps", "tis_cap")


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
    """Everything that decides what one update does (validated, hashable). One comment per field."""

    n: int = 16  # rollouts generated per prompt
    m: int = 16  # rollouts trained per prompt: n for grpo and grpo-ga, the m of n a rule selects for pods
    algorithm: str = "grpo"  # grpo (n = m), grpo-ga (n = m in grad_accum micro-batches) or pods (m of n)
    rule: str = "max_variance"  # pods selection rule: max_variance, max_reward, random, percentile
    grad_accum: int = 1  # micro-batches each update is split into (gradients accumulate over them)
    # groups of n rollouts drawn per prompt each step, each selected and normalized on its own
    # (the authors' 8-GPU trainer draws one per accumulation micro-batch)
    groups_per_prompt: int = 1
    beta: float = 0.0  # k3 KL weight (0: no reference model is evaluated)
    epsilon: float = 0.2  # clip range of the ratio
    epsilon_high: float | None = None  # upper clip range (null: epsilon)
    num_iterations: int = 1  # passes over each generated batch (1 with one step per generation: the ratio is 1)
    steps_per_generation: int = 1  # optimizer steps per pass: the batch splits into this many mini-batches
    # the ratio's old policy: recompute (the update program's log-probs before the first
    # optimizer step; with one step, the current ones) or sampler (the rollouts' own log-probs)
    old_logprobs: str = "recompute"
    # truncated importance sampling: weight each token's policy term by
    # min(pi_old / pi_sampler, tis_cap) (null: off; TRL's default cap is 3)
    tis_cap: float | None = None
    tis_level: str = "token"  # TIS ratio per token, or per sequence (the product of its tokens' ratios)
    log_mismatch: bool = False  # log the sampler/update log-prob mismatch (train/mismatch_*) each step
    # DAPO's dynamic sampling: drop groups whose n rewards all agree before selection and draw
    # more prompts until the step's groups are full (at most max_sampling_rounds draws; then
    # dropped groups fill the rest, so the update's shapes never change)
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 4  # dynamic sampling: draws of prompts_per_step prompts per step, at most
    # the update computes each prompt once for its m trained rows (forward, backward, old and
    # reference log-probs); off: every row runs as prompt + completion. Same numbers either way
    # on build_batch's batches, whose rows come in groups of m sharing one prompt; turn it off
    # for batches laid out otherwise
    shared_prefix: bool = True
    # loss aggregation: token-mean, seq-mean-token-mean, seq-mean-token-sum-norm, or group-token-mean
    # (each group's m trained rows a token mean, then the mean over groups)
    aggregation: str = "token-mean"
    # policy loss: grpo (clipped token ratio), gspo (clipped sequence ratio) or cispo (capped token weight)
    loss_type: str = "grpo"
    # The rollout policy; the update recomputes log-probs unfiltered, at logprob_temperature.
    temperature: float = 0.9  # sampling temperature of the rollouts
    logprob_temperature: float | None = None  # temperature of the update's log-probs (null: temperature)
    top_p: float = 1.0  # nucleus sampling mass kept (1: off)
    top_k: int = 0  # sample among the k most likely tokens (0: off)
    learning_rate: float = 5e-6  # peak learning rate
    schedule: str = "constant"  # learning-rate schedule: constant or cosine
    warmup_ratio: float = 0.0  # cosine: fraction of total_steps spent warming up (rounded up, as transformers)
    total_steps: int = 1000  # cosine: the schedule's length in updates
    max_grad_norm: float = 0.1  # gradients are clipped to this global norm
    weight_decay: float = 0.1  # AdamW weight decay
    adam_b1: float = 0.9  # AdamW beta1
    adam_b2: float = 0.99  # AdamW beta2
    advantage_eps: float = 1e-4  # added to the group's reward std before dividing
    std_scaling: str = "group"  # advantage scale: group (the group's std), batch or none

    def __post_init__(self):
        def bad(message):
            raise ValueError(f"AlgorithmConfig: {message}")

        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in _INT_FIELDS and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
                bad(f"{field.name} must be an integer; got {value!r}")
            if field.name in _INT_FIELDS:  # NumPy's ints too, held as Python's (the config is hashed)
                object.__setattr__(self, field.name, value := int(value))
            if field.name in _FLOAT_FIELDS and value is not None:
                if isinstance(value, bool) or not isinstance(value, numbers.Real):
                    bad(f"{field.name} must be a number; got {value!r}")
                object.__setattr__(self, field.name, value := float(value) if not isinstance(value, int) else value)
                if not math.isfinite(value):  # an inf lr or beta would silently poison every weight
                    bad(f"{field.name} must be finite; got {value}")
        if self.algorithm not in ALGORITHMS:
            bad(f"algorithm must be one of {ALGORITHMS}; got {self.algorithm!r}")
        if not 2 <= self.m <= self.n:  # a group's advantage is its rewards less their mean: one rollout's is 0
            bad(f"need 2 <= m <= n (a group of one rollout has advantage 0 and trains nothing); "
                f"got n={self.n}, m={self.m}")
        if self.algorithm in ("grpo", "grpo-ga") and self.m != self.n:
            split = " (split the update into micro-batches with grad_accum)" if self.algorithm == "grpo-ga" else ""
            bad(f"{self.algorithm} trains every rollout, so m must equal n{split}; got n={self.n}, m={self.m}")
        if self.algorithm == "pods":
            selection.get_rule(self.rule)  # unknown names raise, listing the known ones
        if self.grad_accum < 1:
            bad(f"grad_accum must be >= 1; got {self.grad_accum}")
        if self.groups_per_prompt < 1:
            bad(f"groups_per_prompt must be >= 1; got {self.groups_per_prompt}")
        if self.num_iterations < 1:
            bad(f"num_iterations must be >= 1; got {self.num_iterations}")
        if self.steps_per_generation < 1:
            bad(f"steps_per_generation must be >= 1; got {self.steps_per_generation}")
        if self.num_iterations * self.steps_per_generation > MAX_UPDATES_PER_GENERATION:  # each is traced anew
            bad(f"num_iterations x steps_per_generation must be at most {MAX_UPDATES_PER_GENERATION} optimizer steps "
                f"per generated batch (each is one more copy of the update in the compiled step); got "
                f"{self.num_iterations} x {self.steps_per_generation}")
        if self.old_logprobs not in OLD_LOGPROBS:
            bad(f"old_logprobs must be one of {OLD_LOGPROBS}; got {self.old_logprobs!r}")
        if self.tis_cap is not None and self.old_logprobs == "sampler":
            bad("tis_cap corrects the sampler against the update's own old log-probs; with old_logprobs='sampler' "
                "the ratio is already against the sampler: set one of them")
        for name in ("log_mismatch", "dynamic_sampling", "shared_prefix"):
            if not isinstance(getattr(self, name), bool):
                bad(f"{name} must be true or false; got {getattr(self, name)!r}")
        if self.max_sampling_rounds < 1:
            bad(f"max_sampling_rounds must be >= 1; got {self.max_sampling_rounds}")
        if self.schedule not in SCHEDULES:
            bad(f"schedule must be one of {SCHEDULES}; got {self.schedule!r}")
        if not 0 <= self.warmup_ratio < 1:
            bad(f"warmup_ratio must be in [0, 1); got {self.warmup_ratio}")
        if self.total_steps < 1:
            bad(f"total_steps must be >= 1; got {self.total_steps}")
        if not self.learning_rate > 0:
            bad(f"learning_rate must be > 0; got {self.learning_rate}")
        # float32's smallest normal: XLA flushes a smaller one to 0, and divides by it.
        if not self.temperature >= _SMALLEST_TEMPERATURE:
            bad(f"training temperature must be > 0 (and at least {_SMALLEST_TEMPERATURE:.4g}); got {self.temperature}")
        if self.logprob_temperature is not None and not self.logprob_temperature >= _SMALLEST_TEMPERATURE:
            bad(f"logprob_temperature must be > 0 (and at least {_SMALLEST_TEMPERATURE:.4g}), or null for the "
                f"sampling temperature; got {self.logprob_temperature}")
        if self.sampler_logprobs and self.update_temperature != self.temperature:
            bad(f"{self.sampler_logprobs_reason} compares the sampler's log-probs with the update's, which needs "
                f"them at one temperature: logprob_temperature {self.logprob_temperature} is not the sampling "
                f"temperature {self.temperature} (leave logprob_temperature null)")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1]; got {self.top_p}")
        if self.top_k < 0:
            bad(f"top_k must be >= 0 (0: off); got {self.top_k}")
        if not self.max_grad_norm > 0:
            bad(f"max_grad_norm must be > 0; got {self.max_grad_norm}")
        if not self.weight_decay >= 0:
            bad(f"weight_decay must be >= 0; got {self.weight_decay}")
        for name in ("adam_b1", "adam_b2"):
            if not 0 <= getattr(self, name) < 1:
                bad(f"{name} must be in [0, 1); got {getattr(self, name)}")
        if not self.advantage_eps >= 0:
            bad(f"advantage_eps must be >= 0; got {self.advantage_eps}")
        if self.std_scaling not in grpo.STD_SCALINGS:
            bad(f"std_scaling must be one of {grpo.STD_SCALINGS}; got {self.std_scaling!r}")
        self.loss_config  # validates epsilon, beta, aggregation, loss_type, tis_cap, tis_level

    @property
    def update_temperature(self) -> float:
        """The temperature the update's log-probs divide by."""
        return self.temperature if self.logprob_temperature is None else self.logprob_temperature

    @property
    def warmup_steps(self) -> int:
        """Cosine warm-up updates: ``ceil(warmup_ratio x total_steps)``, as transformers'
        ``get_warmup_steps`` counts them, short of the whole schedule."""
        if self.schedule != "cosine":
            return 0
        return min(math.ceil(self.warmup_ratio * self.total_steps), self.total_steps - 1)

    @property
    def updates_per_step(self) -> int:
        """Optimizer steps each generated batch takes: ``num_iterations x steps_per_generation``."""
        return self.num_iterations * self.steps_per_generation

    @property
    def sampler_logprobs_reason(self) -> str | None:
        """The option that needs the sampler's log-probs in the update, or None."""
        if self.tis_cap is not None:
            return f"tis_cap={self.tis_cap}"
        if self.old_logprobs == "sampler":
            return "old_logprobs='sampler'"
        return "log_mismatch" if self.log_mismatch else None

    @property
    def sampler_logprobs(self) -> bool:
        """Whether the sampler returns its log-probs and the batch carries them to the update."""
        return self.sampler_logprobs_reason is not None

    @property
    def loss_config(self) -> grpo.LossConfig:
        group_size = self.m if self.aggregation == "group-token-mean" else None  # a group's trained rows
        return grpo.LossConfig(epsilon=self.epsilon, epsilon_high=self.epsilon_high, beta=self.beta,
                               aggregation=self.aggregation, group_size=group_size, loss_type=self.loss_type,
                               tis_cap=self.tis_cap, tis_level=self.tis_level)


def make_optimizer(config: AlgorithmConfig) -> optax.GradientTransformation:
    """Clip by global norm, then AdamW on the configured schedule."""
    if not isinstance(config, AlgorithmConfig):
        raise TypeError(f"make_optimizer takes an AlgorithmConfig; got {type(config).__name__}")
    return optax.chain(
        optax.clip_by_global_norm(config.max_grad_norm),
        optax.adamw(
            learning_rate_schedule(config), b1=config.adam_b1, b2=config.adam_b2, weight_decay=config.weight_decay
        ),
    )


def learning_rate_schedule(config: AlgorithmConfig) -> optax.Schedule:
    if config.schedule == "constant":
        return optax.constant_schedule(config.learning_rate)
    warmup = config.warmup_steps
    if warmup == 0:
        return optax.cosine_decay_schedule(config.learning_rate, config.total_steps)
    return optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, warmup, config.total_steps)
