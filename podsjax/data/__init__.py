"""Datasets (GSM8K, MATH, chemistry: :mod:`~podsjax.data.datasets`), chat-template prompts with
length buckets (:mod:`~podsjax.data.prompts`) and bounded reads of row files
(:mod:`~podsjax.data.data_files`).

The datasets' names are also here, loaded on first use: ``from podsjax.data import Example, load_task``.
"""

import importlib

_DATASETS_NAMES = ("CHEMISTRY_DATA_HINT", "DataError", "Example", "LOCAL_ONLY_TASKS", "MATH_TRAIN_SUBJECTS",
                   "MAX_ROW_CHARS", "PROMPT_FIELD", "Task", "chemistry_question", "load_task", "reward_columns")
__all__ = list(_DATASETS_NAMES)


def __getattr__(name):
    if name in _DATASETS_NAMES:
        return getattr(importlib.import_module("podsjax.data.datasets"), name)
    raise AttributeError(f"module 'podsjax.data' has no attribute {name!r}")
