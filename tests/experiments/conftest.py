"""Fixtures the command-line tests share."""

import pytest

from experiments import cli, runner


@pytest.fixture
def one_line(capsys, monkeypatch):
    """cli.main on ``argv`` must exit with status 2 and one line on stderr, creating no ``out``;
    returns the line. A command that gets as far as the run fails at once instead."""
    def never(*args, **kwargs):
        raise AssertionError("the command started a run")

    monkeypatch.setattr(runner, "run_experiment", never)

    def main(argv, out):
        assert cli.main("gsm8k", [*argv, "--out", str(out), "--no-compile-cache"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: "), err
        assert not out.exists()
        return err

    return main
