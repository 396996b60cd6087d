"""The package's lazy top-level names are the modules and functions they name."""

import importlib
import pathlib
import subprocess
import sys

import pytest

import podsjax

# What users reach as podsjax.<name>.
SUBMODULES = ["algorithms", "data", "grpo", "logprobs", "loop", "mesh", "models", "prompts", "rewards", "sampling",
              "selection", "train"]
SELECTION_NAMES = ["select", "select_flat", "flat_rows", "register_rule", "indices_to_mask"]


def test_the_public_names_are_the_documented_ones():
    assert sorted(podsjax.__all__) == sorted(SUBMODULES + SELECTION_NAMES)


@pytest.mark.parametrize("name", SUBMODULES)
def test_each_submodule_name_is_that_module(name):
    assert getattr(podsjax, name) is importlib.import_module(f"podsjax.{name}")


@pytest.mark.parametrize("name", SELECTION_NAMES)
def test_each_selection_name_is_the_selection_function(name):
    assert getattr(podsjax, name) is getattr(podsjax.selection, name)


def test_unknown_names_fail_clearly():
    with pytest.raises(AttributeError, match="module 'podsjax' has no attribute 'nope'"):
        podsjax.nope  # noqa: B018


@pytest.mark.slow
def test_the_installed_package_wins_in_the_directory_above_a_clone_named_podsjax(tmp_path):
    # There Python finds the clone's folder first and, but for its __init__.py, would take it for
    # a namespace package whose podsjax.data is the top-level data/ folder.
    root = pathlib.Path(__file__).resolve().parents[1]
    (tmp_path / "podsjax").symlink_to(root, target_is_directory=True)
    code = "import podsjax; from podsjax.data import Example; print(podsjax.__file__, Example.__module__)"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    where, module = result.stdout.split()
    assert pathlib.Path(where).resolve() == root / "podsjax" / "__init__.py" and module == "podsjax.data"
