"""The named presets of ``--setting``: the paper's settings (a)-(f), with the authors' defaults, and ``tiny``.

Each is a :class:`Setting`: the fields it sets, by section of the config tree, and where
each value comes from. ``TINY`` is the built-in tiny preset (any task, any CPU, the default
without a checkpoint); the paper's are lettered as its setup table:

| setting | task      | model                  | hardware | fine-tuning           |
|---------|-----------|------------------------|----------|-----------------------|
| (a)     | GSM8K     | Qwen2.5-3B-Instruct    | 1 L40S   | LoRA r 64, alpha 64   |
| (b)     | GSM8K     | Llama-3.2-3B-Instruct  | 1 L40S   | LoRA r 64, alpha 64   |
| (c)     | MATH      | Qwen2.5-3B-Instruct    | 1 L40S   | LoRA r 64, alpha 64   |
| (d)     | chemistry | Qwen2.5-3B-Instruct    | 1 L40S   | LoRA r 64, alpha 64   |
| (e)     | GSM8K     | Qwen2.5-3B-Instruct    | 8 H100   | full                  |
| (f)     | GSM8K     | Qwen2.5-7B-Instruct    | 8 A100   | full                  |

Earlier versions used other letters: (b) was Qwen on MATH, (c) Llama on GSM8K and (d)
Llama on MATH, and there was no chemistry setting.

Where each number comes from, as tagged in the comments below:

- [paper]: the paper's setup table above (arXiv 2504.13818): task, model, hardware,
  LoRA rank and alpha.
- [1gpu]: the authors' single-GPU code, YixuanEvenXu/pods: ``config/train.yaml``
  (optimizer, sampling, lengths, budget, checkpoints), ``utils/data.py`` (rewards),
  the result-file names of ``results/`` (n / m per task: ``Instruct-MATH-NF-512-32-8``)
  and ``scripts/plot.py`` (Llama over 1.5 h with checkpoints every 10 min, metric
  ``both_acc``; the rest every 30 min), ``config/test.yaml`` with ``utils/eval.py``
  (evaluation: temperature 0.9, 512 tokens, 5 repeats averaged).
- [8gpu]: the authors' 8-GPU run script ``open-r1/exp.sh`` (8 processes; n as
  ``pods_full_size``, m as ``num_generations``, ``gradient_accumulation_steps``), the
  recipe it names, ``recipes/Qwen2.5-3B-Instruct/config_pods.yaml`` (lr 2e-5, cosine,
  10 % warm-up, 512 + 1024 tokens, one epoch, rewards, system prompt), Hugging Face
  ``TrainingArguments`` defaults where that is silent (Adam beta2 0.999, max grad norm
  1.0, weight decay 0), and its trainer ``grpo_trainer.py`` (evaluation every 120 s of
  training, a stop at 40 min). The result files (W&B exports) record no learning rate;
  the script's latest version names ``config_pods.yaml`` (its first named
  ``recipes/PODS/config.yaml``, in no commit), while ``config.yaml`` (lr 5e-6 constant) is
  named by no script. ``config_pods.yaml`` logs to TensorBoard only and the results are W&B
  exports, so the plotted runs may have used a variant of it. Setting f has no recipe or
  script of its own: n / m / accumulation are the 7B run names of ``scripts/plot-a100s.py``,
  the rest e's.
- [podsjax]: this library's reading where neither source gives a number.

What podsjax runs differently from the authors, on purpose or for now:

- a-d: the base weights are bf16, not 4-bit (the authors also evaluate a 4-bit reload of
  each merged checkpoint), and AdamW keeps fp32 moments, not 8-bit.
- d: the paper's chemistry set is not named in what is reachable; SciBench's chemistry
  problems stand in (``podsjax.data.datasets``), with GSM8K's n / m.
- e-f: the authors' trainer gives each GPU one prompt and ``grad_accum`` groups of n for
  it, one group per micro-batch, generated together once per update, so an update sees 8
  prompts x grad_accum groups. podsjax does the same (``groups_per_prompt = grad_accum``).
- e-f: the learning-rate schedule and the step limit are one epoch as the authors' trainer
  steps it (:func:`epoch_updates`): each method its own length, by its ``grad_accum``.
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Any, Mapping

from podsjax.update import algorithms

# openai/gsm8k "main" train rows, the epoch of settings e-f (epoch_updates). [8gpu]
_GSM8K_TRAIN_ROWS = 7473
_GPUS = 8
# Settings a-d. [1gpu] config/train.yaml: lr 5e-6 "constant" (HF's constant schedule
# ignores the file's warmup_ratio 0.01), AdamW betas (0.9, 0.99), weight decay 0.1, max
# grad norm 0.1, temperature 0.9, beta 0. The loss is per-sequence token mean, then the
# mean over sequences. [1gpu] trainer/maxvargrpo_trainer.py computes the loss's log-probs
# from the raw logits: temperature 1, whatever the sampling temperature.
_SINGLE_COMMON = dict(learning_rate=5e-6, schedule="constant", warmup_ratio=0.0, adam_b1=0.9, adam_b2=0.99,
                      weight_decay=0.1, max_grad_norm=0.1, temperature=0.9, logprob_temperature=1.0, beta=0.0,
                      aggregation="seq-mean-token-mean")
# [1gpu] results/: GSM8K GRPO 16/16 vs PODS 64/16. GRPO-GA trains all 64 in 4 micro-batches of 16. [podsjax]
# Also the methods of a run with no setting (:func:`method_config`).
GSM8K_METHODS = {
    "grpo": dict(algorithm="grpo", n=16, m=16),
    "grpo-ga": dict(algorithm="grpo-ga", n=64, m=64, grad_accum=4),
    "pods": dict(algorithm="pods", n=64, m=16, rule="max_variance"),
}
# [1gpu] results/Instruct-MATH-NF-512-{8-8,32-8}: MATH GRPO 8/8 vs PODS 32/8.
_MATH_METHODS = {
    "grpo": dict(algorithm="grpo", n=8, m=8),
    "grpo-ga": dict(algorithm="grpo-ga", n=32, m=32, grad_accum=4),
    "pods": dict(algorithm="pods", n=32, m=8, rule="max_variance"),
}
# [1gpu] one prompt per step, 512 + 512 tokens, 6 h (max_time 21600), a checkpoint every
# 30 min (save_interval 1800), each evaluated on GSM8K test / MATH-500 by sampling 5
# passes at temperature 0.9 with 512 new tokens, averaged (config/test.yaml repeat_cnt 5,
# temperature 0.9, max_tokens 512; utils/eval.py).
# [1gpu] utils/data.py SYSTEM_PROMPT_INSTRUCT, the system message of every instruct prompt
# (its leading and trailing newlines included).
AUTHORS_SYSTEM_PROMPT = (
    "\nYou will be given a math question.\nReason about the question and correct your own mistakes if you make "
    "any.\n\nRespond in the following format:\n<think>\nReason here. Decide to answer when you are confident as "
    "your response length is limited.\n</think>\n<answer>\nAnswer here.\n</answer>\n")
_SINGLE_RUN = dict(prompts_per_step=1, max_prompt_length=512, max_new_tokens=512, time_budget_s=6 * 3600.0,
                   checkpoint_every_s=1800.0, eval_every_s=1800.0, eval_repeats=5, eval_temperature=0.9,
                   eval_metric="accuracy", system_prompt=AUTHORS_SYSTEM_PROMPT)
# [1gpu] release 3fc107e, utils/data.py and train.py: correctness 1/0 by their grader (the
# whole text, the answer tag or the last integer), and for wrong answers only the format
# score 0.1 - 0.001 per character outside the span and 0.025 per tag (podsjax.rewards.authors).
_SINGLE_REWARDS = dict(accuracy=1.0, format=1.0, tag_count=1.0, format_style="authors-release")
# [1gpu] release 3fc107e: MATH trains on correctness alone by their grader (result names "NF": no format);
# the format rewards stay as metrics at weight 0.
_MATH_REWARDS = dict(accuracy=1.0, format=0.0, tag_count=0.0, format_style="authors-release")
# [1gpu] commit 0c453d2 (Llama): their grader with that commit's last number (digits, dots
# and commas), and 0.01 x format_score (1 - 0.01 per character outside) and 0.01 x the tag
# count (0.25 a tag) on every completion.
_LLAMA_REWARDS = dict(accuracy=1.0, format=0.01, tag_count=0.01, format_style="authors-llama")

# Settings e-f. [8gpu] config_pods.yaml: lr 2e-5 on a cosine over the epoch's updates with
# 10 % warm-up (cut off by the 40-minute stop), Adam (0.9, 0.999), weight decay 0,
# max grad norm 1.0, beta 0; temperature 0.9 (TRL's GRPOConfig default then). [8gpu] GRPO-GA
# n = m = 32 with 16 accumulation steps against PODS n = 128, m = 32 with 4, each
# micro-batch a new group of the GPU's one prompt: groups_per_prompt = grad_accum, so an
# update holds 8 x 16 groups of 32 (GRPO-GA) or 8 x 4 groups of 128 down-sampled to 32
# (PODS), 4096 rollouts either way. Each micro-batch is one group of m (grpo_trainer.py
# splits the accumulated batch by group), and TRL's bnpo loss is its token mean, averaged
# over the micro-batches and GPUs: group-token-mean.
# [8gpu] grpo_trainer.py divides the logits by the sampling temperature before its log-probs,
# and samples with TRL's top_k 50 of that commit (use_vllm is false, so generate gets it).
_MULTI_COMMON = dict(learning_rate=2e-5, schedule="cosine", warmup_ratio=0.1, adam_b1=0.9, adam_b2=0.999,
                     weight_decay=0.0, max_grad_norm=1.0, temperature=0.9, logprob_temperature=None, top_k=50,
                     beta=0.0, aggregation="group-token-mean")


def epoch_updates(rows: int, processes: int, grad_accum: int, num_iterations: int = 1) -> int:
    """Optimizer updates in one epoch of ``rows`` prompts, as the authors' 8-GPU trainer and
    Hugging Face's loop count them.

    ``grpo_trainer.py``'s sampler hands each of the ``processes`` one prompt a batch (a last
    round of fewer prompts is dropped), ``num_iterations`` times over; a process's batch is
    that prompt's ``pods_full_size x gradient_accumulation_steps`` rollouts; Hugging Face's
    Trainer (the commit open-r1 pins) counts ``len(dataloader) // gradient_accumulation_steps``
    updates an epoch, at least 1. The trainer generates from the first batch of each
    update only, so an epoch trains on one prompt in ``grad_accum``.
    """
    return max(rows // processes * num_iterations // grad_accum, 1)


def _epoch_source(grad_accum: int) -> str:
    updates = epoch_updates(_GSM8K_TRAIN_ROWS, _GPUS, grad_accum)
    warmup = math.ceil(_MULTI_COMMON["warmup_ratio"] * updates)  # transformers' get_warmup_steps
    return (f"[8gpu] one epoch as grpo_trainer.py and HF's Trainer step it: {_GSM8K_TRAIN_ROWS} // {_GPUS} "
            f"= {_GSM8K_TRAIN_ROWS // _GPUS} batches // grad_accum {grad_accum} = {updates} updates, "
            f"{warmup} of them warm-up (ceil(0.1 x {updates}))")


_MULTI_METHODS = {
    "grpo-ga": dict(algorithm="grpo-ga", n=32, m=32, grad_accum=16, groups_per_prompt=16,
                    total_steps=epoch_updates(_GSM8K_TRAIN_ROWS, _GPUS, 16)),
    "pods": dict(algorithm="pods", n=128, m=32, rule="max_variance", grad_accum=4, groups_per_prompt=4,
                 total_steps=epoch_updates(_GSM8K_TRAIN_ROWS, _GPUS, 4)),
}
# [8gpu] one epoch (config_pods.yaml num_train_epochs 1) is each method's step limit too.
_MULTI_METHOD_RUN = {method: {"max_steps": fields["total_steps"]} for method, fields in _MULTI_METHODS.items()}
# [8gpu] 8 prompts per update (one per GPU), 512 + 1024 tokens, one epoch capped at 40 min
# of training clock (grpo_trainer.py stops there), evaluation every 120 s of training
# (evaluation time not counted), one pass sampled at temperature 0.9 with top-k 50:
# my_evaluate generates with the training GenerationConfig (do_sample, TRL's top_k 50).
# Checkpoints every 30 min. [podsjax] The recipe's system prompt. [8gpu]
RECIPE_SYSTEM_PROMPT = (
    "You are a helpful AI Assistant that provides well-reasoned and detailed responses. You first think about the "
    "reasoning process as an internal monologue and then provide the user with the answer. Respond in the following "
    "format: <think>\n...\n</think>\n<answer>\n...\n</answer>")
_MULTI_RUN = dict(prompts_per_step=_GPUS, max_prompt_length=512, max_new_tokens=1024, eval_every_s=120.0,
                  eval_temperature=0.9, eval_top_k=50, eval_repeats=1, checkpoint_every_s=1800.0,
                  time_budget_s=40 * 60.0, system_prompt=RECIPE_SYSTEM_PROMPT)
# [8gpu] reward_funcs accuracy, format, tag_count of open-r1's rewards.py with reward_weights
# 1, 1, 1: LaTeX-only math-verify accuracy, newline-exact format and tags.
_MULTI_REWARDS = dict(accuracy=1.0, format=1.0, tag_count=1.0, format_style="open-r1")


SECTIONS = ("model", "algorithm", "run", "rewards")  # the config tree's sections a setting sets


@dataclasses.dataclass(frozen=True)
class Setting:
    """One named preset: a row of the paper's setup table, or the built-in tiny preset.

    Each section holds the fields it sets, by their names in the config tree; a field it
    leaves out keeps its dataclass default. The tests build every setting's configs, so a
    name or a value that no config takes fails there.

    Attributes:
        name: the letter, a-f, or "tiny".
        model: Hugging Face Hub name of the checkpoint to fetch beforehand; None: the
            built-in tiny model.
        task: "gsm8k", "math" or "chemistry" (the ``experiments.<task>`` module); None: any.
        lora_rank: LoRA rank (alpha equals it, the CLI's default 64); None = full fine-tune.
        dtype: parameter dtype.
        methods: method -> the AlgorithmConfig fields of that method.
        common: AlgorithmConfig fields shared by the methods.
        run: RunConfig fields, the evaluation protocol among them (``eval_repeats``,
            ``eval_temperature``, ``eval_top_k``, ``eval_metric``: see ``podsjax.rl.RunConfig``).
        method_run: method -> the RunConfig fields of that method, over ``run``.
        mesh: the ``--mesh`` spec; None: the setting leaves it.
        hardware: what it ran on (for ``describe``).
        rewards: keyword arguments of ``podsjax.rewards.default_rewards(task, **rewards)``.
        sources: where each value comes from, by ``section.key (method)`` for one method's,
            ``section.key``, or, for the rest of a section, by ``section`` (:meth:`source`).
    """

    name: str
    model: str | None
    task: str | None
    lora_rank: int | None
    dtype: str
    methods: Mapping[str, Mapping[str, Any]]
    common: Mapping[str, Any]
    run: Mapping[str, Any]
    mesh: str | None = "1"
    hardware: str = ""
    rewards: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict)
    method_run: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.lora_rank is not None and self.lora_rank < 1:
            raise ValueError(f"Setting {self.name}: lora_rank must be >= 1 or None; got {self.lora_rank}")
        # Read-only views: settings share their section dicts, so one edit would change several.
        for name in ("common", "run", "rewards", "sources"):
            object.__setattr__(self, name, types.MappingProxyType(dict(getattr(self, name))))
        for name in ("methods", "method_run"):
            per_method = {method: types.MappingProxyType(dict(fields)) for method, fields in getattr(self, name).items()}
            object.__setattr__(self, name, types.MappingProxyType(per_method))

    def algorithm_config(self, method: str) -> dict[str, Any]:
        """The AlgorithmConfig fields of ``method``: ``common`` overlaid with the method's own."""
        if method not in self.methods:
            raise ValueError(f"setting {self.name} has no method {method!r}; "
                             f"choose one of {', '.join(self.methods)}")
        return {**self.common, **self.methods[method]}

    def values(self, method: str) -> dict[str, dict[str, Any]]:
        """Every field the setting sets for ``method``, by section of the config tree (:data:`SECTIONS`)."""
        model = {"hub_name": self.model, "lora_rank": self.lora_rank, "dtype": self.dtype, "mesh": self.mesh}
        model = {key: value for key, value in model.items() if value is not None or key == "lora_rank"}
        return {"model": model, "algorithm": self.algorithm_config(method),
                "run": {**self.run, **self.method_run.get(method, {})}, "rewards": dict(self.rewards)}

    def source(self, key: str, method: str | None = None) -> str:
        """Where ``key`` ("algorithm.learning_rate") comes from: the method's own entry, the key's, else its section's."""
        own = self.sources.get(f"{key} ({method})") if method else None
        return own or self.sources.get(key) or self.sources.get(key.split(".")[0], "")

    @property
    def headline(self) -> str:
        """One line: task, model, fine-tuning, hardware and mesh, with the model's source."""
        tuning = "full fine-tune" if self.lora_rank is None else f"LoRA r {self.lora_rank}"
        parts = [self.task or "any task", self.model or "the built-in tiny model", tuning, self.hardware,
                 f"mesh {self.mesh}" if self.mesh else ""]
        return f"setting {self.name}: {' / '.join(p for p in parts if p)}  {self.source('model')}".rstrip()

    def describe(self, method: str) -> str:
        """What ``--setting <name> --method <method>`` sets, one ``key = value  [source]`` per line."""
        lines = [self.headline]
        for section, fields in self.values(method).items():
            for key, value in fields.items():
                source = self.source(f"{section}.{key}", method)
                lines.append(f"  {section}.{key} = {show_value(value)}  {source}".rstrip())
        return "\n".join(lines)


def show_value(value: Any) -> str:
    """A value on one line, as a flag takes it: null, true, [a, b]; a text with spaces or
    commas (a system prompt) as its repr."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, (list, tuple)):
        return f"[{', '.join(show_value(item) for item in value)}]"
    quoted = isinstance(value, str) and (not value or "," in value or any(c.isspace() for c in value))
    return repr(value) if quoted else str(value)


_QWEN_3B = "Qwen/Qwen2.5-3B-Instruct"
_LORA = 64  # [paper] LoRA r 64, alpha 64 on q, k, v, o, gate, up, down ([1gpu] target_modules)


_SINGLE_SOURCES = {
    "model": "[paper]", "model.dtype": "[podsjax] bf16 weights (the authors' are 4-bit)",
    "algorithm": "[1gpu] config/train.yaml",
    "algorithm.algorithm": "[1gpu] results/ file names", "algorithm.n": "[1gpu] results/ file names",
    "algorithm.m": "[1gpu] results/ file names", "algorithm.rule": "[1gpu] trainer/maxvargrpo_trainer.py",
    "algorithm.grad_accum": "[podsjax] GRPO-GA's micro-batches",
    "algorithm.logprob_temperature": "[1gpu] trainer/maxvargrpo_trainer.py",
    "algorithm.aggregation": "[1gpu] trainer/maxvargrpo_trainer.py",
    "run": "[1gpu] config/train.yaml",
    "run.eval_repeats": "[1gpu] config/test.yaml", "run.eval_temperature": "[1gpu] config/test.yaml",
    "run.eval_metric": "[1gpu] utils/eval.py", "run.system_prompt": "[1gpu] utils/data.py",
    "rewards": "[1gpu] release 3fc107e utils/data.py",
}
_SINGLE_SOURCE_CHANGES = {
    "b": {"algorithm.beta": "[1gpu] results/ file names", "run.time_budget_s": "[1gpu] scripts/plot.py",
          "run.eval_every_s": "[1gpu] scripts/plot.py", "run.checkpoint_every_s": "[1gpu] scripts/plot.py",
          "run.eval_metric": "[1gpu] scripts/plot.py (both_acc)", "rewards": "[1gpu] commit 0c453d2 utils/data.py"},
    "c": {"rewards": "[1gpu] release 3fc107e train.py (results NF)"},
    "d": {"algorithm.n": "[podsjax] GSM8K's", "algorithm.m": "[podsjax] GSM8K's",
          "rewards": "[podsjax] setting a's, SciBench's grading"},
}
_MULTI_SOURCES = {
    "model": "[paper]", "model.dtype": "[podsjax] bf16 compute, fp32 master weights and moments",
    "algorithm": "[8gpu] recipes/Qwen2.5-3B-Instruct/config_pods.yaml",
    "algorithm.algorithm": "[8gpu] exp.sh", "algorithm.n": "[8gpu] exp.sh (pods_full_size)",
    "algorithm.m": "[8gpu] exp.sh (num_generations)", "algorithm.grad_accum": "[8gpu] exp.sh",
    "algorithm.groups_per_prompt": "[8gpu] grpo_trainer.py", "algorithm.rule": "[8gpu] grpo_trainer.py",
    **{f"{key} ({method})": _epoch_source(fields["grad_accum"]) for method, fields in _MULTI_METHODS.items()
       for key in ("algorithm.total_steps", "run.max_steps")},
    "algorithm.adam_b1": "[8gpu] TrainingArguments default",
    "algorithm.adam_b2": "[8gpu] TrainingArguments default", "algorithm.weight_decay": "[8gpu] TrainingArguments default",
    "algorithm.max_grad_norm": "[8gpu] TrainingArguments default",
    "algorithm.temperature": "[8gpu] GRPOConfig default", "algorithm.top_k": "[8gpu] TRL generation default",
    "algorithm.logprob_temperature": "[8gpu] grpo_trainer.py",
    "algorithm.aggregation": "[8gpu] grpo_trainer.py (TRL's bnpo on micro-batches of one group)",
    "run": "[8gpu] grpo_trainer.py", "run.prompts_per_step": "[8gpu] exp.sh (8 processes)",
    "run.eval_top_k": "[8gpu] grpo_trainer.py my_evaluate (the training GenerationConfig: TRL top_k 50)",
    "run.max_prompt_length": "[8gpu] config_pods.yaml", "run.max_new_tokens": "[8gpu] config_pods.yaml",
"run.system_prompt": "[8gpu] config_pods.yaml",
    "run.checkpoint_every_s": "[podsjax]",
    "rewards": "[8gpu] open-r1 rewards.py, config_pods.yaml weights",
}
# [8gpu] f: the repository holds no 7B recipe or script. n, m, grad_accum and the 8 processes
# are the names of the runs scripts/plot-a100s.py plots (GR7B-s*-p8-n128-m32-ga4 for PODS,
# GR7B-s*-p8-n32-m32-ga16 for GRPO-GA); the rest is e's 3B recipe and trainer.
_F_SOURCES = {
    **{key: f"{source} (e's 3B recipe; no 7B one)" for key, source in _MULTI_SOURCES.items()
       if "config_pods.yaml" in source or "exp.sh" in source},
    "algorithm.algorithm": "[8gpu] scripts/plot-a100s.py run names",
    "algorithm.n": "[8gpu] scripts/plot-a100s.py run names (n128, n32)",
    "algorithm.m": "[8gpu] scripts/plot-a100s.py run names (m32)",
    "algorithm.grad_accum": "[8gpu] scripts/plot-a100s.py run names (ga4, ga16)",
    "run.prompts_per_step": "[8gpu] scripts/plot-a100s.py run names (p8)",
}
_F_SOURCES = {**_MULTI_SOURCES, **_F_SOURCES}


def _single(name: str, model: str, task: str, methods: dict, **changes: Any) -> Setting:
    """A single-GPU setting (a-d): LoRA, bf16, the [1gpu] defaults, with ``changes`` on top."""
    fields = dict(lora_rank=_LORA, dtype="bfloat16", methods=methods, common=_SINGLE_COMMON, run=_SINGLE_RUN,
                  mesh="1", hardware="1 L40S", rewards=_SINGLE_REWARDS,
                  sources={**_SINGLE_SOURCES, **_SINGLE_SOURCE_CHANGES.get(name, {})})
    return Setting(name=name, model=model, task=task, **{**fields, **changes})


SETTINGS: dict[str, Setting] = {
    "a": _single("a", _QWEN_3B, "gsm8k", GSM8K_METHODS),
    # [1gpu] results/Instruct-Llama-512-{16-16,64-16}-0.04: KL beta 0.04; scripts/plot.py plots
    # 1.5 h with checkpoints (hence evaluations) every 10 min and metric both_acc: the answer
    # correct and utils/data.py format_correct true ("accuracy_and_format").
    "b": _single("b", "meta-llama/Llama-3.2-3B-Instruct", "gsm8k", GSM8K_METHODS,
                 common={**_SINGLE_COMMON, "beta": 0.04},
                 run={**_SINGLE_RUN, "time_budget_s": 1.5 * 3600.0, "eval_every_s": 600.0,
                      "checkpoint_every_s": 600.0, "eval_metric": "accuracy_and_format"}, rewards=_LLAMA_REWARDS),
    "c": _single("c", _QWEN_3B, "math", _MATH_METHODS, rewards=_MATH_REWARDS),
    # [podsjax] the chemistry n / m and rewards are not in reachable sources: GSM8K's, with
    # SciBench's grading (within 5 % relative) in place of theirs.
    "d": _single("d", _QWEN_3B, "chemistry", GSM8K_METHODS),
    "e": Setting("e", _QWEN_3B, "gsm8k", None, "bfloat16", _MULTI_METHODS, _MULTI_COMMON, _MULTI_RUN,
                 mesh=str(_GPUS), hardware="8 H100", rewards=_MULTI_REWARDS, sources=_MULTI_SOURCES,
                 method_run=_MULTI_METHOD_RUN),
    "f": Setting("f", "Qwen/Qwen2.5-7B-Instruct", "gsm8k", None, "bfloat16", _MULTI_METHODS, _MULTI_COMMON,
                 _MULTI_RUN, mesh=str(_GPUS), hardware="8 A100", rewards=_MULTI_REWARDS, sources=_F_SOURCES,
                 method_run=_MULTI_METHOD_RUN),
}


# The built-in tiny preset, the default without a checkpoint: any task, on any CPU. Its
# measured runs are in docs/results. Tuned at 8 prompts a step: lr 3e-4 peaked as high but
# drifted back; 2-4 prompts per step barely moved accuracy; lr 5e-4 with 2 prompts per step
# collapsed the policy. Completions are at most ~35 tokens and prompts at most ~112 (the
# system prompt is ~70 of them). GRPO trains as many rollouts as PODS trains; GRPO-GA trains
# all of PODS's n in micro-batches of its m.
TINY = Setting(
    "tiny", model=None, task=None, lora_rank=None, dtype="float32", mesh=None, hardware="any CPU",
    methods={"grpo": dict(algorithm="grpo", n=4, m=4), "grpo-ga": dict(algorithm="grpo-ga", n=16, m=16, grad_accum=4),
             "pods": dict(algorithm="pods", n=16, m=4, rule="max_variance")},
    common=dict(learning_rate=2e-4, temperature=1.0),
    run=dict(prompts_per_step=32, max_new_tokens=48, max_prompt_length=128, time_budget_s=240.0, eval_every_s=20.0,
             eval_limit=256),
    sources={"model": "[podsjax] the built-in tiny model (podsjax.tiny)",
             "algorithm": "[podsjax] measured on a 2-core CPU", "run": "[podsjax] measured on a 2-core CPU",
             "run.max_new_tokens": "[podsjax] completions of at most ~35 tokens",
             "run.max_prompt_length": "[podsjax] prompts of at most ~112 tokens"},
)
# Every name --setting takes.
PRESETS: dict[str, Setting] = {"tiny": TINY, **SETTINGS}


def get_setting(name: str) -> Setting:
    """The preset named ``name`` (tiny, or the paper's a-f; any case); a ValueError lists the names otherwise."""
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown setting {name!r}; choose one of {', '.join(PRESETS)}") from None


def method_config(name: str, **overrides) -> algorithms.AlgorithmConfig:
    """One of the paper's three algorithms with the n / m of its single-GPU GSM8K settings; override any field.

    The sizes are :data:`GSM8K_METHODS` (docs/paper_settings.md lists them): "grpo" trains
    every rollout, "grpo-ga" too in ``grad_accum`` micro-batches, "pods" the max-variance m of n.
    """
    if name not in GSM8K_METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(GSM8K_METHODS)}")
    return algorithms.AlgorithmConfig(**{**GSM8K_METHODS[name], **overrides})
