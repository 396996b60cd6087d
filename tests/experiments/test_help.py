"""--help shows each flag with one default, the one a run of that command would use; a misspelling gets a suggestion."""

import os
import re

import pytest

from experiments import config_decoding, flags, helptext
from experiments.usage import UsageError


def entries(text):
    """flag -> its whole help entry (the lines up to the next flag or heading), on one line."""
    found, current = {}, None
    for line in text.splitlines():
        match = re.match(r"  (-\S+?)(?:,|\s|$)", line)
        if match:
            current = match.group(1) if match.group(1) != "-h" else "--help"
            found[current] = line
        elif line.startswith("      ") and current:
            found[current] += " " + line.strip()
        else:
            current = None
    return {flag: " ".join(entry.split()) for flag, entry in found.items()}


@pytest.fixture(scope="module")
def plain():
    return entries(helptext.help_text("gsm8k", ["--help"]))


def test_every_entry_shows_one_default(plain):
    tree = {f"--{section}.{name}" for section, fields in config_decoding.field_types().items() for name in fields}
    assert tree | set(flags.SHORTCUTS) | {"--method", "--out", "--resume"} <= set(plain)
    several = {flag: entry for flag, entry in plain.items() if flag != "--help" and entry.count("(default") != 1}
    assert not several, several


def test_the_defaults_are_the_ones_a_run_with_no_flags_uses(plain):
    _, config = flags.parse("gsm8k", [])
    assert config.run.prompts_per_step == 32 and config.run.time_budget_s == 240.0
    assert "(default: 32)" in plain["--run.prompts_per_step"] and "(default: 32)" in plain["--prompts-per-step"]
    assert plain["--time-budget"].endswith("= --run.time_budget_s (default: 240.0)")
    assert "(default: 240.0)" in plain["--run.time_budget_s"]
    assert plain["--algorithm.algorithm"].endswith("(default: pods)")
    # Where null means something, the help says what.
    assert plain["--warmup-steps"].endswith("(default: 1000)") and "(default: the shared cache)" in plain["--warmup-dir"]
    assert plain["--data.prompt_column"].endswith("(default: the task's own)")


def test_the_method_given_with_help_shows_its_own_defaults():
    grpo = entries(helptext.help_text("gsm8k", ["--method", "grpo", "--help"]))
    _, config = flags.parse("gsm8k", ["--method", "grpo"])
    assert grpo["--algorithm.algorithm"].endswith("(default: grpo)")
    assert grpo["--n"].endswith(f"(default: {config.algorithm.n})") and config.algorithm.n == config.algorithm.m


def test_flags_that_give_no_run_say_so_before_the_plain_command_s_defaults(tmp_path):
    # --model alone has no budget: the help says so, and whose defaults it then shows.
    model_only = helptext.help_text("gsm8k", ["--model", str(tmp_path), "--help"])
    assert model_only.startswith("note: these flags give no run (RunConfig needs a budget"), model_only[:300]
    assert "the defaults below are the plain command's" in model_only.splitlines()[0]
    # With a budget the same flags give a run: its own defaults (setting-free --model: n 64), no note.
    budgeted = helptext.help_text("gsm8k", ["--model", str(tmp_path), "--time-budget", "100", "--help"])
    _, config = flags.parse("gsm8k", ["--model", str(tmp_path), "--time-budget", "100"])
    assert not budgeted.startswith("note:") and config.algorithm.n == 64
    assert entries(budgeted)["--n"].endswith("(default: 64)")
    assert not helptext.help_text("gsm8k", ["--help"]).startswith("note:")


@pytest.mark.parametrize("argv, suggested", [
    (["--methd", "pods"], "--method"),
    (["--time-budgt", "60"], "--time-budget"),
    (["--run.prompt_per_step", "3"], "--run.prompts_per_step"),
])
def test_a_close_misspelling_gets_a_suggestion(argv, suggested):
    with pytest.raises(UsageError, match=f"unrecognized argument {argv[0]}; did you mean {suggested}\\?"):
        flags.parse("gsm8k", argv)


def test_a_flag_like_none_gets_no_suggestion():
    with pytest.raises(UsageError) as caught:
        flags.parse("gsm8k", ["--zzz", "1"])
    assert "did you mean" not in str(caught.value)


def test_without_torch_the_cli_silences_transformers_advice_only(monkeypatch):
    import importlib.util

    from experiments import cli

    real = importlib.util.find_spec
    monkeypatch.delenv("TRANSFORMERS_NO_ADVISORY_WARNINGS", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: real(name, *a) if name != "torch" else None)
    cli.quiet_transformers()
    assert os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] == "1"
    monkeypatch.delenv("TRANSFORMERS_NO_ADVISORY_WARNINGS")
    monkeypatch.setattr(importlib.util, "find_spec", real)  # torch installed (the test extra): advice stays
    cli.quiet_transformers()
    assert "TRANSFORMERS_NO_ADVISORY_WARNINGS" not in os.environ
