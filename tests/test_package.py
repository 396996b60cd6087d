"""The package's lazy top-level names resolve."""

import importlib

import pytest

import podsjax


@pytest.mark.parametrize("name", podsjax.__all__)
def test_every_public_name_resolves(name):
    assert getattr(podsjax, name) is not None


def test_submodules_are_the_modules_and_unknown_names_fail_clearly():
    assert podsjax.selection is importlib.import_module("podsjax.selection")
    assert podsjax.select is podsjax.selection.select
    with pytest.raises(AttributeError, match="module 'podsjax' has no attribute 'nope'"):
        podsjax.nope  # noqa: B018
