"""The package's lazy top-level names are the modules and functions they name."""

import importlib

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
