"""The experiment config: one typed tree, the single source of every default and rule of a run.

Sections: ``model`` (checkpoint, dtype, remat, LoRA, mesh), ``algorithm``
(:class:`podsjax.train.AlgorithmConfig`), ``run`` (:class:`podsjax.loop.RunConfig`:
budget, sampling, evaluation, checkpoints, logging), ``rewards``, ``data`` and ``tiny``.
Every field is a command-line flag (``--algorithm.epsilon_high 0.28``) and a key of a
YAML config file (``--config run.yaml``); draccus builds both from these dataclasses
and their field comments.

Named settings are entries of :data:`SETTINGS`: each gives the fields it sets, for a
method. A run's config is the dataclass defaults, then the method's
(:func:`podsjax.train.method_config`), then the named setting's, then the config file, then
the flags.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from podsjax import paper_settings, train
from podsjax.loop import RunConfig
from podsjax.mesh_spec import parse_mesh_spec

DTYPES = ("float32", "bfloat16")
METHODS = train.ALGORITHMS


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """The policy: which checkpoint, how its weights are held, and what of it trains."""

    path: str | None = None  # local Hugging Face checkpoint directory; null: the built-in tiny preset
    hub_name: str | None = None  # the checkpoint's Hub name, recorded in exports (never downloaded)
    dtype: str = "float32"  # parameter dtype: float32 or bfloat16
    remat: str = "full"  # what each layer keeps for the backward pass: full (recompute), dots, none
    lora_rank: int | None = 64  # LoRA rank; null: full fine-tune
    lora_alpha: float = 64.0  # LoRA alpha (the update is scaled by alpha / rank)
    mesh: str | None = None  # devices: "8" (all fsdp), "data=2,fsdp=4", "fsdp=4,tensor=2"; null: one

    def __post_init__(self):
        from podsjax.models.decoder import REMAT_POLICIES

        if self.dtype not in DTYPES:
            raise ValueError(f"model.dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"model.remat must be one of {', '.join(REMAT_POLICIES)}; got {self.remat!r}")
        if self.lora_rank is not None and (isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int)
                                           or self.lora_rank < 1):
            raise ValueError(f"model.lora_rank must be an integer >= 1, or null for a full fine-tune; "
                             f"got {self.lora_rank!r}")
        if not (isinstance(self.lora_alpha, (int, float)) and math.isfinite(self.lora_alpha) and self.lora_alpha > 0):
            raise ValueError(f"model.lora_alpha must be a finite number > 0; got {self.lora_alpha!r}")
        if self.mesh is not None:
            try:
                parse_mesh_spec(self.mesh, None)
            except ValueError as exc:
                raise ValueError(f"model.mesh: {exc}") from None


@dataclasses.dataclass(frozen=True)
class RewardSection:
    """What a completion earns: the task's own rewards, weighted, and your own."""

    accuracy: float = 1.0  # weight of the task's answer check (0 keeps it as a metric only)
    format: float = 1.0  # weight of the <think>/<answer> format reward
    tag_count: float = 1.0  # weight of the tag-count reward (0.25 per tag)
    # the reward family: exact, score, authors-release, authors-llama or open-r1 (podsjax.rewards.FORMAT_STYLES)
    format_style: str = "exact"
    # your rewards, each "name" or "name=weight": a registered name or package.module:function
    extra: tuple[str, ...] = ()

    def __post_init__(self):
        from podsjax.rewards.combine import FORMAT_STYLES

        for name in ("accuracy", "format", "tag_count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"rewards.{name} must be a finite number; got {value!r}")
        if self.format_style not in FORMAT_STYLES:
            raise ValueError(f"rewards.format_style must be one of {', '.join(FORMAT_STYLES)}; "
                             f"got {self.format_style!r}")
        object.__setattr__(self, "extra", tuple(self.extra))
        for spec in self.extra:
            parse_reward(spec)

    def weights(self) -> dict[str, Any]:
        """``podsjax.rewards.default_rewards``' keyword arguments."""
        return {"accuracy": self.accuracy, "format": self.format, "tag_count": self.tag_count,
                "format_style": self.format_style}

    def extras(self) -> list[tuple[str, float]]:
        """Your rewards as (name, weight)."""
        return [parse_reward(spec) for spec in self.extra]


def parse_reward(spec: str) -> tuple[str, float]:
    """``"name"`` or ``"name=weight"`` -> (name, weight); weight 1 unless given."""
    if not isinstance(spec, str):
        raise ValueError(f"rewards.extra entries are strings like 'my_rewards:brevity=0.1'; got {spec!r}")
    name, equals, value = spec.partition("=")
    try:
        weight = float(value) if equals else 1.0
    except ValueError:
        raise ValueError(f"reward {spec!r}: the weight after '=' must be a number") from None
    if not math.isfinite(weight):
        raise ValueError(f"reward {spec!r}: the weight must be finite")
    if not name:
        raise ValueError(f"reward {spec!r}: give a reward name or package.module:function")
    return name, weight


@dataclasses.dataclass(frozen=True)
class DataSection:
    """Where the task's examples come from (default: the task's Hub dataset)."""

    train: str | None = None  # local .jsonl/.json/.parquet file or directory for the train split
    test: str | None = None  # local file or directory for the test split
    hub: str | None = None  # a Hub dataset "owner/name" or "owner/name:config" (default: the task's own)
    train_split: str = "train"  # the train split's name (a directory's file stem, or the Hub split)
    test_split: str = "test"  # the test split's name
    prompt_column: str | None = None  # your column holding the prompt (default: the task's own)
    answer_column: str | None = None  # your column holding the gold answer (default: answer)

    def columns(self, task: str) -> dict[str, str]:
        """The task's fields read from your columns (``podsjax.data.load_task(columns=...)``)."""
        from podsjax.data import PROMPT_FIELD

        wanted = {PROMPT_FIELD[task]: self.prompt_column, "answer": self.answer_column}
        return {field: column for field, column in wanted.items() if column}


@dataclasses.dataclass(frozen=True)
class TinySection:
    """The built-in tiny preset (no model.path): its in-process supervised warm-up."""

    warmup_dir: str | None = None  # where the warmed-up start checkpoint is cached (default: <out>/tiny_warmup)
    warmup_steps: int | None = None  # cap on the warm-up's steps

    def __post_init__(self):
        steps = self.warmup_steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ValueError(f"tiny.warmup_steps must be an integer >= 1; got {steps!r}")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """One run, complete: written to ``<out>/config.json`` and read back by ``--resume``."""

    run: RunConfig  # no defaults for all of it: a run needs its directory and its budget
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    algorithm: train.AlgorithmConfig = dataclasses.field(default_factory=train.AlgorithmConfig)
    rewards: RewardSection = dataclasses.field(default_factory=RewardSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    tiny: TinySection = dataclasses.field(default_factory=TinySection)

    def __post_init__(self):
        if self.model.path is not None and self.tiny != TinySection():
            raise ValueError("tiny.warmup_dir and tiny.warmup_steps belong to the tiny preset; they mean nothing "
                             "with a model.path")

    @property
    def task(self) -> str:
        return self.run.task

    @property
    def lora(self):
        """The LoRA config, or None for a full fine-tune."""
        from podsjax.models import LoraConfig

        rank = self.model.lora_rank
        return LoraConfig(rank=rank, alpha=self.model.lora_alpha) if rank else None


# -- named settings ----------------------------------------------------------------------

def _method(method: str, task: str) -> dict[str, Any]:
    """The paper's three algorithms with its single-GPU n / m (``train.method_config``)."""
    return {"algorithm": dataclasses.asdict(train.method_config(method))}


def _tiny(method: str, task: str) -> dict[str, Any]:
    """The built-in tiny preset's settings (``podsjax.tiny.TINY_RL_DEFAULTS``)."""
    from podsjax.tiny import TINY_RL_DEFAULTS as d

    # GRPO trains every rollout it generates, as many as PODS trains; GRPO-GA trains all of
    # PODS's n in micro-batches of PODS's m.
    sizes = {"grpo": dict(n=d["m"], m=d["m"]), "grpo-ga": dict(n=d["n"], m=d["n"], grad_accum=d["n"] // d["m"]),
             "pods": dict(n=d["n"], m=d["m"])}[method]
    algorithm = dataclasses.asdict(train.method_config(method, **sizes, learning_rate=d["learning_rate"],
                                                       temperature=d["temperature"]))
    run = {key: d[key] for key in ("prompts_per_step", "max_new_tokens", "max_prompt_length", "time_budget_s",
                                   "eval_every_s", "eval_limit")}
    return {"algorithm": algorithm, "run": run,
            "model": {"lora_rank": None if d["full_finetune"] else 64, "dtype": "float32"}}


def _paper(letter: str) -> Callable[[str, str], dict[str, Any]]:
    def overrides(method: str, task: str) -> dict[str, Any]:
        setting = paper_settings.get_setting(letter)
        if setting.task != task:
            raise ValueError(f"setting {setting.name} is a {setting.task} setting; run experiments.{setting.task}")
        return {"algorithm": setting.algorithm_config(method), "run": dict(setting.run),
                "rewards": dict(setting.rewards),
                "model": {"lora_rank": setting.lora_rank, "dtype": setting.dtype, "mesh": setting.mesh,
                          "hub_name": setting.model}}

    overrides.__doc__ = f"The paper's setting ({letter}) (``podsjax.paper_settings``)."
    return overrides


# name -> (method, task) -> the fields the setting sets. "tiny" is the default without a
# model; a-f are the paper's settings and need one.
SETTINGS: dict[str, Callable[[str, str], dict[str, Any]]] = {
    "tiny": _tiny, **{letter: _paper(letter) for letter in paper_settings.SETTINGS},
}


def base_values(task: str, method: str, setting: str | None) -> dict[str, Any]:
    """The nested values under a run's file and flags: the method's, then the setting's."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    values = merge({"run": {"task": task}}, _method(method, task))
    if setting is not None:
        key = setting.lower()
        if key not in SETTINGS:
            raise ValueError(f"unknown setting {setting!r}; choose one of {', '.join(SETTINGS)}")
        values = merge(values, SETTINGS[key](method, task))
    return values


def merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``, section by section (a new dict)."""
    out = dict(base)
    for key, value in top.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
