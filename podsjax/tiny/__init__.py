"""The built-in tiny preset: synthetic GSM8K-, MATH- and chemistry-like tasks, a tiny Qwen2 policy, its warm-up.

With no real checkpoint, the experiments run end to end on any CPU on this preset::

    stats = podsjax.tiny.warm_up(os.path.join(run_dir, podsjax.tiny.WARMUP_DIRNAME))
    model, params = podsjax.models.from_pretrained(stats.path, mesh=mesh)
    tokenizer = podsjax.data.prompts.load_tokenizer(stats.path)
    train_examples, test_examples = podsjax.tiny.tiny_tasks(seed=0)

The three tasks (``TASKS``) stand in for the paper's benchmarks and use their reward
paths: ``"gsm8k"`` word problems (final number), ``"math"`` LaTeX answers judged by
math-verify, ``"chemistry"`` numbers in a unit within 5 %. ``warm_up(..., task=...)``
and ``tiny_tasks(seed, task=...)`` pick one.

The checkpoint is an ordinary HF directory, so everything after the warm-up (sampling,
rewards, selection, the sharded step, checkpoints, evaluation) is the real-run code path.
Its RL settings, checked to run quickly on a 2-core CPU, are ``experiments.paper_settings.TINY``.
"""

from podsjax.tiny.build import CHATML_TEMPLATE, TINY_MODEL, build_tiny_checkpoint, build_tokenizer, tiny_model
from podsjax.tiny.problems import (
    MAX_OPERATIONS,
    MAX_TEST_PROBLEMS,
    TASKS,
    TEST_PROBLEMS,
    TRAIN_PROBLEMS,
    TEMPLATES,
    TinyTasks,
    check_task,
    generate_problems,
    iter_problems,
    make_splits,
    sft_completion,
    split_of,
    tiny_tasks,
    worked_steps,
)
from podsjax.tiny.warmup import (
    MARKER_FILE,
    WARMUP_DIRNAME,
    WarmupConfig,
    WarmupError,
    WarmupStats,
    evaluate_greedy,
    load_cached,
    warm_up,
)

__all__ = [
    "CHATML_TEMPLATE", "MARKER_FILE", "MAX_OPERATIONS", "MAX_TEST_PROBLEMS", "TASKS", "TEMPLATES", "TEST_PROBLEMS",
    "TINY_MODEL", "TRAIN_PROBLEMS", "TinyTasks",
    "WARMUP_DIRNAME", "WarmupConfig", "WarmupError", "WarmupStats", "build_tiny_checkpoint", "build_tokenizer",
    "check_task", "evaluate_greedy", "generate_problems", "iter_problems", "load_cached", "make_splits",
    "sft_completion", "split_of", "tiny_model", "tiny_tasks", "warm_up", "worked_steps",
]
