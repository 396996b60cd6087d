"""`pip install podsjax` (no extras) is enough for the library's pure parts.

The selector, the GRPO loss and the models must import with only the core dependencies
and what they require. A subprocess blocks every installed top-level module whose
distribution is outside that closure, then imports them.
"""

import importlib.metadata as metadata
import json
import pathlib
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CORE_MODULES = ("podsjax", "podsjax.core.selection", "podsjax.core.grpo", "podsjax.core.logprobs", "podsjax.models")
# What the issue that split the core named as too heavy for someone else's stack.
NEVER_IN_CORE = ("transformers", "datasets", "math-verify", "matplotlib", "pyarrow", "draccus", "tensorboardx", "torch")


def requirement_closure(requirements):
    """Canonical names of the installed distributions these requirements pull in, no extras."""
    seen, todo = set(), [Requirement(text) for text in requirements]
    while todo:
        requirement = todo.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(requirement.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            todo += [Requirement(text) for text in metadata.requires(name) or ()]
        except metadata.PackageNotFoundError:
            pass  # an optional dependency not installed here imports nothing
    return seen


CORE_CLOSURE = requirement_closure(PYPROJECT["project"]["dependencies"])


def test_the_core_dependencies_are_jax_own_stack():
    assert CORE_CLOSURE.isdisjoint(NEVER_IN_CORE), CORE_CLOSURE & set(NEVER_IN_CORE)
    assert {"jax", "flax", "optax", "numpy"} <= CORE_CLOSURE
    # The experiments' dependencies live in the run extra, which the test extra pulls in.
    run = {canonicalize_name(Requirement(text).name) for text in PYPROJECT["project"]["optional-dependencies"]["run"]}
    assert {"transformers", "datasets", "math-verify", "draccus"} <= run
    assert "podsjax[run]" in PYPROJECT["project"]["optional-dependencies"]["test"]


BLOCKING_IMPORT = """
import importlib.abc, json, sys
blocked = set(json.loads(sys.argv[1]))
at_start = set(sys.modules)  # site hooks (setuptools' _distutils_hack) load before any import

class BlockOutsideCore(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in blocked:
            raise ImportError(f"{name} is outside the core install")
        return None

sys.meta_path.insert(0, BlockOutsideCore())
for module in json.loads(sys.argv[2]):
    __import__(module)
print(json.dumps(sorted({name.partition(".")[0] for name in set(sys.modules) - at_start} & blocked)))
"""


@pytest.mark.slow
def test_selection_grpo_and_models_import_with_the_core_alone():
    outside = {
        module
        for module, distributions in metadata.packages_distributions().items()
        if not any(canonicalize_name(d) in CORE_CLOSURE | {"podsjax"} for d in distributions)
    }
    assert {"transformers", "datasets", "torch"} <= outside  # the block is real here
    result = subprocess.run(
        [sys.executable, "-c", BLOCKING_IMPORT, json.dumps(sorted(outside)), json.dumps(CORE_MODULES)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.splitlines()[-1]) == []
