"""The experiment config: one typed tree, the single source of every default and rule of a run.

Sections: ``model`` (checkpoint, dtype, remat, LoRA, mesh), ``algorithm``
(:class:`podsjax.update.algorithms.AlgorithmConfig`), ``run`` (:class:`podsjax.rl.RunConfig`:
budget, sampling, evaluation, checkpoints, logging), ``rewards``, ``data`` and ``tiny``.
Every field is a command-line flag (``--algorithm.epsilon_high 0.28``) and a key of a
YAML config file (``--config run.yaml``); draccus builds both from these dataclasses
and their field comments.

A run's config is the dataclass defaults, then the method's n / m
(:func:`experiments.paper_settings.method_config`), then the named setting's
(``experiments.paper_settings.PRESETS``: tiny and the paper's a-f), then the config file, then
the flags. Each is a :class:`Layer`, and :func:`stack` says which one each value came from;
:func:`settings_table` is docs/paper_settings.md's table of every preset value.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

from podsjax.update import algorithms
from experiments import paper_settings
from podsjax.data.prompts import DEFAULT_SYSTEM_PROMPT
from podsjax.devices.mesh_spec import parse_mesh_spec
from podsjax.rl import RunConfig

DTYPES = ("float32", "bfloat16")
METHODS = algorithms.ALGORITHMS


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
    # the reward family: exact, score, authors-release, authors-llama or open-r1 (podsjax.rewards.combine.FORMAT_STYLES)
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
        names = [parse_reward(spec)[0] for spec in self.extra]
        twice = next((name for i, name in enumerate(names) if name in names[:i]), None)
        if twice is not None:  # both would be scored and summed: one reward counted twice
            raise ValueError(f"rewards.extra names reward {twice!r} twice; give it once, with its weight "
                             f"({twice}=WEIGHT)")

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

    def __post_init__(self):
        if self.prompt_column is not None and self.prompt_column == self.answer_column:
            raise ValueError(f"data.prompt_column and data.answer_column both name column {self.prompt_column!r}; "
                             "the prompt and the gold answer come from two columns")

    def columns(self, task: str) -> dict[str, str]:
        """The task's fields read from your columns (``podsjax.data.datasets.load_task(columns=...)``)."""
        from podsjax.data.datasets import PROMPT_FIELD

        wanted = {PROMPT_FIELD[task]: self.prompt_column, "answer": self.answer_column}
        return {field: column for field, column in wanted.items() if column}


@dataclasses.dataclass(frozen=True)
class TinySection:
    """The built-in tiny preset (no model.path): its in-process supervised warm-up."""

    warmup_dir: str | None = None  # where the warmed-up start checkpoint is kept (default: the shared cache)
    warmup_steps: int | None = None  # cap on the warm-up's steps (default: 1000)
    max_operations: int | None = None  # gsm8k only: at most this many operations a problem (1: an easier task)

    def __post_init__(self):
        steps = self.warmup_steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ValueError(f"tiny.warmup_steps must be an integer >= 1; got {steps!r}")

    def check(self, task: str) -> None:
        from podsjax.tiny.problems import check_task

        try:
            check_task(task, self.max_operations)
        except ValueError as exc:
            raise ValueError(f"tiny.{exc}") from None


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """One run, complete: written to ``<out>/config.json`` and read back by ``--resume``."""

    run: RunConfig  # no defaults for all of it: a run needs its directory and its budget
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    algorithm: algorithms.AlgorithmConfig = dataclasses.field(default_factory=algorithms.AlgorithmConfig)
    rewards: RewardSection = dataclasses.field(default_factory=RewardSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    tiny: TinySection = dataclasses.field(default_factory=TinySection)

    def __post_init__(self):
        if self.model.path is not None and self.tiny != TinySection():
            raise ValueError("tiny.warmup_dir, tiny.warmup_steps and tiny.max_operations belong to the tiny preset; "
                             "they mean nothing with a model.path")
        self.tiny.check(self.task)
        algo = self.algorithm
        groups = self.run.prompts_per_step * algo.groups_per_prompt
        micro_batches = algo.grad_accum * algo.steps_per_generation
        if algo.aggregation == "group-token-mean" and groups % micro_batches:
            raise ValueError(f"algorithm.aggregation group-token-mean averages whole groups, but an update's {groups} "
                             f"groups (prompts_per_step x groups_per_prompt) do not split into its {micro_batches} "
                             "micro-batches (grad_accum x steps_per_generation)")

    @property
    def task(self) -> str:
        return self.run.task

    @property
    def lora(self):
        """The LoRA config, or None for a full fine-tune."""
        from podsjax.models import LoraConfig

        rank = self.model.lora_rank
        return LoraConfig(rank=rank, alpha=self.model.lora_alpha) if rank else None


# -- where each value comes from ------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Layer:
    """Values a run takes from one place, over the layers before it.

    Attributes:
        name: the place, as a listing names it: "method pods", "setting a", "--config run.yaml".
        values: section -> field -> value.
        sources: dotted field -> what the place took it from (a setting's citation, the flag
            that gave it), added to ``name``.
    """

    name: str
    values: dict[str, dict[str, Any]]
    sources: dict[str, str] = dataclasses.field(default_factory=dict)

    def origins(self) -> dict[str, str]:
        """dotted field -> where its value comes from, for every field this layer sets."""
        return {dotted: f"{self.name} {self.sources.get(dotted, '')}".strip()
                for dotted in (f"{section}.{key}" for section, fields in self.values.items() for key in fields)}


def preset_layers(task: str, method: str, setting: str | None) -> list[Layer]:
    """What a run starts from: the method's n / m (``paper_settings.method_config``), then the
    named setting's values."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    layers = [Layer(f"method {method}", {"algorithm": dict(paper_settings.GSM8K_METHODS[method])})]
    if setting is not None:
        preset = paper_settings.get_setting(setting)
        if preset.task is not None and preset.task != task:
            raise ValueError(f"setting {preset.name} is a {preset.task} setting; run experiments.{preset.task}")
        values = preset.values(method)
        dotted = [f"{section}.{key}" for section, fields in values.items() for key in fields]
        layers.append(Layer(f"setting {preset.name}", values, {key: preset.source(key, method) for key in dotted}))
    return layers


def stack(layers: list[Layer]) -> tuple[dict[str, Any], dict[str, str]]:
    """The values of ``layers``, each over the ones before it, and where each set field's value comes from."""
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for layer in layers:
        values = merge(values, layer.values)
        origins.update(layer.origins())
    return values, origins


def default_values() -> dict[str, dict[str, Any]]:
    """section -> field -> its dataclass default (``run.out_dir``, which has none, left out)."""
    defaults = {}
    for section in dataclasses.fields(ExperimentConfig):
        fields = dataclasses.fields(typing.get_type_hints(ExperimentConfig)[section.name])
        defaults[section.name] = {
            f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in fields if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}
    return defaults


def describe_setting(setting: str, method: str, config: ExperimentConfig,
                     origins: dict[str, str] | None = None) -> str:
    """The setting's headline, then each value of ``config`` with where it comes from.

    ``origins`` (``args.origins`` of ``experiments.flags.parse``) names the config file or
    flag of each value; without it, a value that is neither the setting's nor the default is
    "a flag or --config". A value set over the setting's says so and shows the setting's
    too. The defaults come last, one line a section; ``run.out_dir`` is ``--out``, left out."""
    preset = paper_settings.get_setting(setting)
    own, defaults = preset.values(method), default_values()
    show = paper_settings.show_value
    lines, kept = [preset.headline], []
    for section in dataclasses.fields(config):
        fields = dataclasses.asdict(getattr(config, section.name))
        set_here = own.get(section.name, {})
        default_here = []
        for key, value in fields.items():
            dotted = f"{section.name}.{key}"
            if dotted == "run.out_dir":
                continue
            origin = _origin(dotted, value, preset, method, set_here, defaults[section.name], origins)
            if origin == "default":
                default_here.append(f"{key} = {show(value)}")
                continue
            if key in set_here and not origin.startswith("setting "):
                lines.append(f"  set over the setting: {dotted} = {show(value)} (setting: {show(set_here[key])})  "
                             f"{origin}")
            else:
                lines.append(f"  {dotted} = {show(value)}  {origin}")
        if default_here:
            kept.append(f"  {section.name} defaults: {', '.join(default_here)}")
    return "\n".join(lines + kept)


def _origin(dotted: str, value: Any, preset: paper_settings.Setting, method: str, set_here: dict[str, Any],
            defaults: dict[str, Any], origins: dict[str, str] | None) -> str:
    """Where ``dotted``'s value comes from: as ``origins`` says, else told from the setting and the default."""
    if origins is not None:
        return origins.get(dotted, "default")
    key = dotted.split(".")[1]
    if dotted == "run.task":
        return "the task's module"
    if key in set_here and value == set_here[key]:
        return f"setting {preset.name} {preset.source(dotted, method)}".strip()
    if key not in set_here and key in defaults and value == defaults[key]:
        return "default"
    return "a flag or --config"


# -- the table of every preset value (docs/paper_settings.md) ----------------------------------

# Texts too long for a table cell, by the name that holds them.
_TEXT_NAMES = {paper_settings.AUTHORS_SYSTEM_PROMPT: "AUTHORS_SYSTEM_PROMPT",
               paper_settings.RECIPE_SYSTEM_PROMPT: "RECIPE_SYSTEM_PROMPT",
               DEFAULT_SYSTEM_PROMPT: "prompts.DEFAULT_SYSTEM_PROMPT"}
# Columns that repeat another's value and source say "as <that one>" instead.
_SAME_AS = {"b": "a", "c": "a", "d": "a", "f": "e"}


def _cell(value: Any) -> str:
    name = _TEXT_NAMES.get(value) if isinstance(value, str) else None
    return f"`{name or paper_settings.show_value(value)}`"


def settings_table() -> str:
    """Markdown: every field a preset sets, one row each (n, m and the like one per method),
    with each preset's value and where it comes from.

    The "no setting" column is what a run without ``--setting`` gets: the dataclass default,
    or the method's n / m. A dash: the preset leaves the field as that column has it."""
    presets, defaults = paper_settings.PRESETS, default_values()
    per_method = {("algorithm", key) for preset in presets.values() for fields in preset.methods.values()
                  for key in fields}
    per_method |= {("run", key) for preset in presets.values() for fields in preset.method_run.values()
                   for key in fields}
    rows: dict[tuple[str, str, str], dict[str, str]] = {}  # (section, field, method or "") -> preset -> cell
    for name, preset in presets.items():
        for method in preset.methods:
            for section, fields in preset.values(method).items():
                for key, value in fields.items():
                    if (section, key) == ("algorithm", "algorithm"):
                        continue  # the method itself
                    row = (section, key, method if (section, key) in per_method else "")
                    source = preset.source(f"{section}.{key}", method)
                    rows.setdefault(row, {})[name] = f"{_cell(value)} {source}".strip()

    def position(row):
        section, key, method = row
        return paper_settings.SECTIONS.index(section), list(defaults[section]).index(key), method

    lines = ["| field | no setting | " + " | ".join(presets) + " |", "|---" * (len(presets) + 2) + "|"]
    for section, key, method in sorted(rows, key=position):
        plain = paper_settings.GSM8K_METHODS[method].get(key, defaults[section][key]) \
            if method and section == "algorithm" else defaults[section][key]
        cells = rows[section, key, method]
        shown = [cells.get(name, "-") for name in presets]
        for i, name in enumerate(presets):
            same = _SAME_AS.get(name)
            if same and name in cells and cells[name] == cells.get(same):
                shown[i] = f"as {same}"
        label = f"`{section}.{key}` ({method})" if method else f"`{section}.{key}`"
        lines.append(f"| {label} | {_cell(plain)} | " + " | ".join(shown) + " |")
    return "\n".join(lines)


def merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``, section by section (a new dict)."""
    out = dict(base)
    for key, value in top.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
