"""The package's lazy top-level names are the modules and functions they name."""

import importlib
import pathlib
import subprocess
import sys

import pytest

from podsjax.moved import MOVED
import podsjax

# What users reach as podsjax.<name>.
SUBMODULES = ["core", "data", "devices", "models", "rewards", "rl", "run", "sampler", "tiny", "update"]
SELECTION_NAMES = ["select", "select_flat", "flat_rows", "register_rule", "indices_to_mask"]


def test_the_public_names_are_the_documented_ones():
    assert sorted(podsjax.__all__) == sorted(SUBMODULES + SELECTION_NAMES)


@pytest.mark.parametrize("name", SUBMODULES)
def test_each_submodule_name_is_that_module(name):
    assert getattr(podsjax, name) is importlib.import_module(f"podsjax.{name}")


@pytest.mark.parametrize("name", SELECTION_NAMES)
def test_each_selection_name_is_the_selection_function(name):
    assert getattr(podsjax, name) is getattr(podsjax.core.selection, name)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_is_the_new_module_with_a_warning(old, monkeypatch):
    new = MOVED[old]
    monkeypatch.delitem(sys.modules, old, raising=False)  # an earlier test's import of the old path
    parent, _, name = old.rpartition(".")
    vars(sys.modules[parent]).pop(name, None)  # (hasattr would import it through podsjax.__getattr__)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert module.__name__ == new and module.__spec__.name == new  # one module, its own name


def test_old_paths_reach_names_and_submodules_of_the_moved_packages(monkeypatch):
    for old in ("podsjax.loop", "podsjax.loop.trainer", "podsjax.train"):  # earlier tests' imports of them
        monkeypatch.delitem(sys.modules, old, raising=False)
    vars(podsjax).pop("loop", None)
    vars(podsjax).pop("train", None)
    with pytest.warns(DeprecationWarning, match="podsjax.loop.trainer moved to podsjax.rl.trainer"):
        from podsjax.loop.trainer import Trainer
    assert Trainer is importlib.import_module("podsjax.rl").Trainer
    with pytest.warns(DeprecationWarning, match="podsjax.train moved to podsjax.update.train_step"):
        assert podsjax.train is importlib.import_module("podsjax.update.train_step")
    from podsjax.data import Example
    assert Example is importlib.import_module("podsjax.data.datasets").Example


def test_the_changelog_lists_every_moved_module():
    changelog = (pathlib.Path(__file__).resolve().parents[2] / "CHANGELOG.md").read_text()
    missing = [f"{old} -> {new}" for old, new in MOVED.items() if f"`{old}` | `{new}`" not in changelog]
    assert not missing, f"CHANGELOG.md's table of moved modules lacks: {', '.join(missing)}"


def test_unknown_names_fail_clearly():
    with pytest.raises(AttributeError, match="module 'podsjax' has no attribute 'nope'"):
        podsjax.nope  # noqa: B018


@pytest.mark.slow
def test_the_installed_package_wins_in_the_directory_above_a_clone_named_podsjax(tmp_path):
    # There Python finds the clone's folder first and, but for its __init__.py, would take it for
    # a namespace package whose podsjax.data.datasets is the top-level data/ folder.
    root = pathlib.Path(__file__).resolve().parents[2]
    (tmp_path / "podsjax").symlink_to(root, target_is_directory=True)
    code = "import podsjax; from podsjax.data.datasets import Example; print(podsjax.__file__, Example.__module__)"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    where, module = result.stdout.split()
    assert pathlib.Path(where).resolve() == root / "podsjax" / "__init__.py" and module == "podsjax.data.datasets"
