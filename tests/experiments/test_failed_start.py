"""A run that fails before its first step leaves nothing in --out (but its run log), so the
corrected rerun is accepted; a run that got somewhere keeps everything."""

import json
import os

import pytest

from experiments import cli, runner

pytestmark = pytest.mark.cpu_mesh

ARGS = ["--max-steps", "1", "--no-compile-cache"]


def failing(writes):
    """A stand-in for training that writes ``writes`` (name -> text) into the run directory, then fails."""
    def train(config, out_dir, *args):
        for name, text in writes.items():
            path = os.path.join(out_dir, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
        raise ValueError("this run failed")

    return train


def test_a_failed_start_leaves_no_directory_and_the_rerun_is_accepted(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setattr(runner, "_train_and_export", failing({"metrics.jsonl": json.dumps({"step": 0}) + "\n",
                                                              "events.out.tfevents.1": "x"}))
    assert cli.main("gsm8k", [*ARGS, "--out", str(out)]) == 1
    assert not out.exists()
    capsys.readouterr()
    monkeypatch.setattr(runner, "_train_and_export", lambda *args: 0)
    assert cli.main("gsm8k", [*ARGS, "--out", str(out)]) == 0
    assert sorted(os.listdir(out)) == ["config.json"]


def test_a_failed_start_keeps_what_was_there_and_its_run_log(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    monkeypatch.setattr(runner, "_train_and_export", failing({"config.json": "{}", "run.log": "orbax said\n",
                                                              "events.out.tfevents.1": ""}))
    assert cli.main("gsm8k", [*ARGS, "--out", str(out)]) == 1
    assert sorted(os.listdir(out)) == ["run.log"]
    capsys.readouterr()
    monkeypatch.setattr(runner, "_train_and_export", lambda *args: 0)
    assert cli.main("gsm8k", [*ARGS, "--out", str(out)]) == 0  # a run log does not make it "not empty"


def test_a_failed_start_keeps_the_empty_directory_the_user_made(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    monkeypatch.setattr(runner, "_train_and_export", failing({"config.json": "{}"}))
    assert cli.main("gsm8k", [*ARGS, "--out", str(out)]) == 1
    assert out.is_dir() and os.listdir(out) == []


@pytest.mark.parametrize("progress", [{"checkpoints/1/x": ""}, {"metrics.jsonl": json.dumps({"step": 1}) + "\n"}])
def test_a_run_that_got_somewhere_keeps_everything(tmp_path, capsys, monkeypatch, progress):
    out = tmp_path / "run"
    monkeypatch.setattr(runner, "_train_and_export", failing({**progress, "samples.jsonl": "{}\n"}))
    assert cli.main("gsm8k", [*ARGS, "--out", str(out)]) == 1
    assert {"config.json", "samples.jsonl"} <= set(os.listdir(out))


def test_a_failed_resume_removes_nothing(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setattr(runner, "_train_and_export", lambda *args: 0)
    assert cli.main("gsm8k", [*ARGS, "--out", str(out)]) == 0
    (out / "metrics.jsonl").write_text(json.dumps({"step": 0}) + "\n")
    monkeypatch.setattr(runner, "_train_and_export", failing({}))
    assert cli.main("gsm8k", ["--no-compile-cache", "--out", str(out), "--resume"]) == 1
    assert sorted(os.listdir(out)) == ["config.json", "metrics.jsonl"]


def test_a_failed_start_after_a_dry_run_leaves_the_dry_run_and_the_rerun_is_accepted(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    (out / "dry_run.json").write_text("{}")
    monkeypatch.setattr(runner, "_train_and_export", failing({"metrics.jsonl": json.dumps({"step": 0}) + "\n"}))
    assert cli.main("gsm8k", [*ARGS, "--out", str(out)]) == 1
    assert sorted(os.listdir(out)) == ["dry_run.json"]  # the dry run's figures were there before: not progress
    capsys.readouterr()
    monkeypatch.setattr(runner, "_train_and_export", lambda *args: 0)
    assert cli.main("gsm8k", [*ARGS, "--out", str(out)]) == 0
