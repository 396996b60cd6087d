"""Modules that moved when the package was arranged by role, and the alias that keeps their old paths working.

``import podsjax.selection`` and ``from podsjax.loop import Trainer`` still work: the old name
is the new module itself (one module object, so patches and ``isinstance`` see one thing),
with a ``DeprecationWarning`` naming the new path. CHANGELOG.md lists the same moves.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

# Old dotted path -> new one. A package's entry also covers its submodules
# (``podsjax.loop.trainer`` -> ``podsjax.rl.trainer``); the longest matching entry wins.
MOVED = {
    "podsjax.selection": "podsjax.core.selection",
    "podsjax.grpo": "podsjax.core.grpo",
    "podsjax.logprobs": "podsjax.core.logprobs",
    "podsjax.accelerators": "podsjax.devices.accelerators",
    "podsjax.mesh_spec": "podsjax.devices.mesh_spec",
    "podsjax.mesh": "podsjax.devices.mesh",
    "podsjax.hosts": "podsjax.devices.hosts",
    "podsjax.compilation": "podsjax.devices.compilation",
    "podsjax.hlo_cost": "podsjax.devices.hlo_cost",
    "podsjax.topology": "podsjax.devices.topology",
    "podsjax.tpu_topology": "podsjax.devices.tpu_topology",
    "podsjax.gpu_topology": "podsjax.devices.gpu_topology",
    "podsjax.dry_run": "podsjax.devices.dry_run",
    "podsjax.metrics": "podsjax.run.metrics",
    "podsjax.log_backends": "podsjax.run.log_backends",
    "podsjax.run_state": "podsjax.run.run_state",
    "podsjax.checkpoint": "podsjax.run.checkpoint",
    "podsjax.best": "podsjax.run.best",
    "podsjax.prompts": "podsjax.data.prompts",
    "podsjax.data_files": "podsjax.data.data_files",
    "podsjax.sampling": "podsjax.sampler.sampling",
    "podsjax.decoding": "podsjax.sampler.decoding",
    "podsjax.sampler_programs": "podsjax.sampler.sampler_programs",
    "podsjax.algorithms": "podsjax.update.algorithms",
    "podsjax.update_forward": "podsjax.update.update_forward",
    "podsjax.train_batch": "podsjax.update.train_batch",
    "podsjax.step_metrics": "podsjax.update.step_metrics",
    "podsjax.train": "podsjax.update.train_step",
    "podsjax.update_programs": "podsjax.update.update_programs",
    "podsjax.pass_at_k": "podsjax.rl.pass_at_k",
    "podsjax.loop.config": "podsjax.rl.run_config",
    "podsjax.loop.run_files": "podsjax.run.run_files",
    "podsjax.loop": "podsjax.rl",
    "podsjax.models.config": "podsjax.models.model_config",
    "podsjax.rewards.gsm8k": "podsjax.rewards.gsm8k_grader",
    "podsjax.rewards.chemistry": "podsjax.rewards.chemistry_grader",
    "podsjax.paper_settings": "experiments.paper_settings",
    "podsjax.analysis": "experiments.analysis",
}


def new_path(old: str) -> str | None:
    """Where the module once at ``old`` lives now, or None if it never moved."""
    parts = old.split(".")
    for cut in range(len(parts), 0, -1):
        head = ".".join(parts[:cut])
        if head in MOVED:
            return ".".join([MOVED[head], *parts[cut:]])
    return None


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module already imported at its new one."""

    def __init__(self, target):
        self.target = target
        self.spec = target.__spec__

    def create_module(self, spec):
        return self.target

    def exec_module(self, module):
        module.__spec__ = self.spec  # the import system stamped the old name's spec on it


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Resolves the old paths in :data:`MOVED`."""

    def find_spec(self, fullname, path=None, target=None):
        new = new_path(fullname)
        if new is None:
            return None
        warnings.warn(f"{fullname} moved to {new}; import it from there", DeprecationWarning, stacklevel=3)
        module = importlib.import_module(new)
        return importlib.machinery.ModuleSpec(fullname, _Alias(module), is_package=hasattr(module, "__path__"))


def install() -> None:
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())  # before a stale folder of an old package is taken for a namespace
