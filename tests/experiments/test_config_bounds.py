"""Reading a config is bounded and strict, and a relaunched command continues its run.

A config file, a flag's value and a run's config.json are read with bounds on their size,
nesting and YAML alias expansion, and never copied to disk; a value of the wrong kind is one
line naming the field. ``--resume`` takes the run's own command again (a job script that
relaunches it), and ``--resume auto`` starts the run the first time and continues it after.
"""

import json
import os
import signal
import tempfile
import time
import tracemalloc

import pytest

from experiments import cli, config_decoding, flags, launch_checks, run_dir
from experiments.usage import UsageError


class _Slow(Exception):
    pass


@pytest.fixture
def deadline():
    """Turns a parse that runs past its seconds into a failure instead of a hang."""
    def alarm(signum, frame):
        raise _Slow("still parsing")

    previous = signal.signal(signal.SIGALRM, alarm)
    yield lambda seconds: signal.setitimer(signal.ITIMER_REAL, seconds)
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)


# ---------------------------------------------------------------- the relaunched command

def _run_dir(tmp_path, argv):
    """A run directory as the runner leaves it: the command's config in config.json."""
    out = tmp_path / "run"
    _, config = flags.parse("gsm8k", [*argv, "--out", str(out)])
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config_decoding.as_json(config), indent=2, sort_keys=True))
    return out, config


@pytest.fixture
def command(tmp_path):
    """A full first command: a checkpoint, a setting, a method, a config file, a dataset, a reward."""
    dataset = tmp_path / "data"
    dataset.mkdir()
    for split in ("train", "test"):
        (dataset / f"{split}.jsonl").write_text("")
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text("algorithm: {learning_rate: 2.0e-6}\nrewards: {extra: ['my_rewards:brevity=0.1']}\n")
    return ["--model", str(tmp_path), "--setting", "a", "--method", "pods", "--n", "32", "--config", str(run_yaml),
            "--dataset", str(dataset), "--reward", "my_rewards:length=0.5", "--max-steps", "2"]


def test_resume_accepts_the_run_s_own_command_again(tmp_path, command):
    out, config = _run_dir(tmp_path, command)
    args, none = flags.parse("gsm8k", [*command, "--out", str(out), "--resume"])
    assert none is None and args.resume is True
    resumed = config_decoding.read_run_config(str(out), args.field_flags)
    assert config_decoding.as_json(resumed) == config_decoding.as_json(config) and resumed.run.out_dir == str(out)
    # What a resume may change, it changes, on the same command line.
    args, _ = flags.parse("gsm8k", [*command, "--max-steps", "5", "--out", str(out), "--resume"])
    assert config_decoding.read_run_config(str(out), args.field_flags).run.max_steps == 5
    # Part of the command is the run's own values too.
    args, _ = flags.parse("gsm8k", ["--out", str(out), "--resume", "--n", "32", "--model", str(tmp_path)])
    resumed = config_decoding.read_run_config(str(out), args.field_flags)
    assert config_decoding.as_json(resumed) == config_decoding.as_json(config)


@pytest.mark.parametrize("change,message", [
    (["--n", "16"], "--algorithm.n cannot change from 32 to 16"),
    (["--lr", "1e-5"], "--algorithm.learning_rate cannot change from 2e-06 to 1e-05"),
    (["--method", "grpo"], "--algorithm.algorithm cannot change from \"pods\" to \"grpo\""),
])
def test_resume_refuses_a_different_value_naming_the_field_and_both_values(tmp_path, capsys, command, change,
                                                                           message):
    out, _ = _run_dir(tmp_path, command)
    before = sorted(p.name for p in out.iterdir())
    assert cli.main("gsm8k", [*command, *change, "--out", str(out), "--resume", "--no-compile-cache"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--resume keeps the run's config; {message}" in err, err
    assert sorted(p.name for p in out.iterdir()) == before


def test_resume_auto_starts_the_run_then_continues_it(tmp_path, one_line):
    out = tmp_path / "run"
    command = ["--method", "pods", "--n", "8", "--m", "4", "--max-steps", "2", "--out", str(out), "--resume", "auto"]
    args, config = flags.parse("gsm8k", command)  # no run there yet: a new one
    assert args.resume is False and config.algorithm.n == 8 and config.run.out_dir == str(out)
    launch_checks.check_out(args)
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config_decoding.as_json(config)))  # what the runner writes first
    args, none = flags.parse("gsm8k", command)  # the requeued job: the same line continues it
    assert none is None and args.resume is True
    launch_checks.check_out(args)
    resumed = config_decoding.read_run_config(str(out), args.field_flags)
    assert config_decoding.as_json(resumed) == config_decoding.as_json(config)
    # Plain --resume still wants a run to continue.
    err = one_line(["--resume"], tmp_path / "empty")
    assert "holds no run to resume" in err and "--resume auto" in err
    # A folder of the user's own files: --resume auto would refuse it too, so no hint to it.
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    with pytest.raises(UsageError) as refused:
        flags.parse("gsm8k", ["--resume", "--out", str(tmp_path / "mine")])
    err = str(refused.value)
    assert "holds no run to resume" in err and "--resume auto" not in err and "new or empty directory" in err
    assert os.listdir(tmp_path / "mine") == ["notes.txt"]
    # A folder holding only a stale lock is one --resume auto takes: the hint says so.
    (tmp_path / "locked").mkdir()
    (tmp_path / "locked" / run_dir.LOCK_FILE).write_text("")
    with pytest.raises(UsageError, match="--resume auto starts it there"):
        flags.parse("gsm8k", ["--resume", "--out", str(tmp_path / "locked")])


def test_a_directory_holding_only_a_lock_counts_as_empty(tmp_path):
    # A run killed before it wrote anything leaves its lock alone; the next start takes it over.
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.lock").write_text("{}")
    for extra in ([], ["--resume", "auto"]):
        args, config = flags.parse("gsm8k", ["--out", str(out)] + extra)
        assert config is not None and not args.resume
        launch_checks.check_out(args)


# ---------------------------------------------------------------- bounded config files

def _bomb(path):
    """Billion laughs: nine levels of nine aliases, 9**9 strings once expanded, in 306 bytes."""
    lines = ["a: &a [x,x,x,x,x,x,x,x,x]"]
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_yaml_alias_bomb_is_refused_at_once_in_bounded_memory(tmp_path, one_line, deadline, monkeypatch):
    bomb = _bomb(tmp_path / "bomb.yaml")
    assert bomb.stat().st_size == 306
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the old copy of the tree went
    deadline(5)
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(UsageError, match="more than 10000 values once its YAML aliases are expanded"):
            flags.parse("gsm8k", ["--config", str(bomb), "--out", str(tmp_path / "never")])
        took = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert took < 1.0 and peak < 32 << 20, (took, peak)
    err = one_line(["--config", str(bomb)], tmp_path / "never")
    assert f"--config {bomb}: " in err
    # The same bomb as a flag's value.
    flow = "[" + ",".join(["&a [x,x,x,x,x,x,x,x,x]"] + [f"&{n} [" + ",".join([f"*{p}"] * 9) + "]"
                                                           for p, n in zip("abcdefgh", "bcdefghi")]) + "]"
    err = one_line(["--rewards.extra", flow], tmp_path / "never")
    assert "--rewards.extra: " in err and "more than 10000 values" in err


@pytest.mark.parametrize("text,message", [
    ("run: {log: " + "[" * 40 + "]" * 40 + "}\n", "nested deeper than 32 levels"),
    ("run: {log: " + "[" * 20000 + "]" * 20000 + "}\n", "nested deeper than 32 levels"),
    ("a: &a [*a]\n", "nested deeper than 32 levels"),  # an alias inside its own anchor
    # (max_steps 0 would be refused too, but the size is looked at first)
    ("run: {max_steps: 0}\n#" + "x" * (1 << 20) + "\n", "larger than 1 MiB"),
    # PyYAML kept the last of two keys silently: a typo's copy would have won unseen.
    ("algorithm:\n  n: 8\n  n: 16\nrun: {max_steps: 2}\n", "'n' is given twice in one mapping"),
])
def test_a_config_file_too_deep_or_too_large_is_one_line_naming_the_limit(tmp_path, one_line, deadline, text,
                                                                          message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    deadline(5)
    err = one_line(["--config", str(path)], tmp_path / "never")
    assert f"--config {path}: {message}" in err, err


def test_no_copy_of_a_config_is_written_to_disk(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a config was written to a temporary file")

    for name in ("NamedTemporaryFile", "mkstemp", "TemporaryFile", "SpooledTemporaryFile"):
        monkeypatch.setattr(tempfile, name, refuse)
    path = tmp_path / "c.yaml"
    path.write_text("algorithm: {n: 8, m: 4}\nrun: {max_steps: 3}\n")
    config = flags.parse("gsm8k", ["--config", str(path), "--seed", "7", "--out", str(tmp_path / "o")])[1]
    assert (config.algorithm.n, config.algorithm.m, config.run.max_steps, config.run.seed) == (8, 4, 3, 7)


# ---------------------------------------------------------------- values of the wrong kind

HUGE = "1" * 5001


@pytest.mark.parametrize("where", ["file", "flag"])
def test_an_integer_python_cannot_convert_is_one_line_naming_the_field(tmp_path, one_line, where):
    path = tmp_path / "c.yaml"
    path.write_text(f"run: {{seed: {HUGE}}}\n")
    argv = ["--config", str(path)] if where == "file" else ["--seed", HUGE]
    err = one_line(argv, tmp_path / "never")
    assert "run.seed: an integer of 5001 digits" in err and len(err) < 300, err


def test_an_integer_python_cannot_convert_in_config_json_is_one_line(tmp_path, capsys, command):
    out, _ = _run_dir(tmp_path, command)
    saved = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(saved).replace('"seed": 0', f'"seed": {HUGE}'))
    before = sorted(p.name for p in out.iterdir())
    assert cli.main("gsm8k", ["--resume", "--out", str(out), "--no-compile-cache"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run.seed: an integer of 5001 digits" in err and str(out) in err, err
    assert sorted(p.name for p in out.iterdir()) == before


@pytest.mark.parametrize("text,section,kind", [
    ("run: 5\n", "run", "int"),
    ("model: 5\n", "model", "int"),
    ("algorithm: [1, 2]\n", "algorithm", "list"),
    ("rewards: strict\n", "rewards", "str"),
])
def test_a_section_that_is_not_a_mapping_is_one_line_naming_it(tmp_path, one_line, text, section, kind):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    err = one_line(["--config", str(path)], tmp_path / "never")
    assert f"--config {path}: section {section!r} must be a mapping of its fields, got {kind}" in err, err


@pytest.mark.parametrize("source,field", [
    ("algorithm: {temperature: true}\n", "algorithm.temperature"),
    ("run: {max_steps: false}\n", "run.max_steps"),
    (["--algorithm.temperature", "true"], "algorithm.temperature"),
    (["--temperature", "yes"], "algorithm.temperature"),  # YAML 1.1 reads yes as true
    (["--max-steps", "true"], "run.max_steps"),
])
def test_a_boolean_where_a_number_belongs_is_one_line_naming_the_field(tmp_path, one_line, source, field):
    if isinstance(source, str):
        path = tmp_path / "c.yaml"
        path.write_text(source)
        source = ["--config", str(path)]
    err = one_line(source, tmp_path / "never")
    assert f"{field} must be a number, not a boolean" in err, err


@pytest.mark.parametrize("argv,message", [
    (["--algorithm.n"], "--algorithm.n: expected one argument"),
    (["--algorithm.n", "[1"], "--algorithm.n: not a YAML value"),
    (["--seed", "-1"], "RunConfig.seed must be an integer from 0 to 2**32 - 1; got -1"),
    (["--max-steps", "2", "--data", "tests/data/gsm8k/train.jsonl"], "data.* settings need --model: the tiny preset"),
    (["--max-steps", "2", "--prompt-column", "q"], "data.* settings need --model"),
    (["--model", "tests", "--max-steps", "2", "--data", "tests/data/gsm8k"],  # its test split had been the Hub's
     "--data tests/data/gsm8k is a directory of splits: pass --dataset tests/data/gsm8k for both, or name the "
     "other split with --eval-data"),
    (["--max-steps", "2", "--prompt-column", "q", "--answer-column", "q"],
     "data.prompt_column and data.answer_column both name column 'q'"),
])
def test_a_flag_without_a_value_or_with_broken_yaml_is_one_line(tmp_path, one_line, argv, message):
    err = one_line(argv, tmp_path / "never")
    assert message in err, err


@pytest.mark.parametrize("text", ["include the units in the answer", "Answer: a number", "!include /etc/hostname",
                                  "yes", "0x10"])
def test_a_string_field_takes_the_flag_s_text(text):
    """The text itself unless it reads as a YAML string or null: never a file (draccus's include),
    a mapping's repr or a number's."""
    assert flags.parse("gsm8k", ["--system-prompt", text])[1].run.system_prompt == text
    assert flags.parse("gsm8k", ["--system-prompt", "'quoted'"])[1].run.system_prompt == "quoted"
    assert flags.parse("gsm8k", ["--system-prompt", "null"])[1].run.system_prompt is None


@pytest.mark.parametrize("text,message", [
    ("[1, 2]", "config.json holds a JSON list, not a model's config"),
    ('{"model_type": "qwen2", ', "cannot read config.json"),
])
def test_a_model_whose_config_json_is_no_object_is_one_line(tmp_path, one_line, text, message):
    # The tokenizer loads first, and reported a list as its own TypeError.
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(text)
    err = one_line(["--model", str(model), "--max-steps", "2"], tmp_path / "never")
    assert f"--model {model}: {message}" in err, err


def test_a_list_field_given_one_value_is_the_list_of_it(tmp_path):
    # A config file's "log: jsonl" had been the backends j, s, o, n, l; "eval_k: 1" a parse failure.
    path = tmp_path / "c.yaml"
    path.write_text("run:\n  log: jsonl\n  eval_k: 1\n  max_steps: 2\n")
    run = flags.parse("gsm8k", ["--config", str(path)])[1].run
    assert (run.log, run.eval_k) == (("jsonl",), (1,))
    run = flags.parse("gsm8k", ["--run.log", "jsonl, wandb", "--max-steps", "1"])[1].run
    assert run.log == ("jsonl", "wandb")
    path.write_text("run:\n  log: jsonl,j\n  max_steps: 2\n")
    with pytest.raises(UsageError, match="unknown log backend 'j'"):
        flags.parse("gsm8k", ["--config", str(path)])
