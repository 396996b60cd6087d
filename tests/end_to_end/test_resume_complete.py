"""--resume of a complete run says so, and how to train it further, and changes nothing."""

import json
import os

import pytest

from experiments import cli, completed, config_decoding, flags, runner

pytestmark = pytest.mark.cpu_mesh


def _complete_run(out, *argv):
    """A run directory as a finished run leaves it (its files' contents do not matter here)."""
    _, config = flags.parse("gsm8k", ["--out", str(out), *argv])
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config_decoding.as_json(config)))
    for name in ("final_model", "best_model"):
        (out / name).mkdir()
        (out / name / "config.json").write_text("{}")
    (out / "metrics.jsonl").write_text(json.dumps({"step": 104, "time/elapsed_train_s": 241.0}) + "\n")
    (out / "events.out.tfevents.1").write_bytes(b"x" * 71)
    (out / "checkpoints" / "104").mkdir(parents=True)
    (out / "exported.json").write_text(json.dumps({"exports": ["final_model", "best_model"]}))
    return out


def _snapshot(out):
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(out.rglob("*"))}


def test_resuming_a_complete_run_says_it_is_complete_and_touches_nothing(tmp_path, monkeypatch, capsys):
    out = _complete_run(tmp_path / "run")
    before = _snapshot(out)

    def fail(*args, **kwargs):
        raise AssertionError("a complete run was started again")

    monkeypatch.setattr(runner, "run_experiment", fail)
    for resume in (["--resume"], ["--resume", "auto"], ["--resume", "--time-budget", "240"]):
        assert cli.main("gsm8k", ["--out", str(out), *resume]) == 0
        printed = capsys.readouterr()
        line = [line for line in printed.out.splitlines() if "complete run" in line]
        assert len(line) == 1, printed
        assert f"{out} holds a complete run (104 steps, 241 s of training clock)" in line[0]
        assert "--time-budget 480" in line[0] and "--max-steps" in line[0] and "superseded" not in printed.out
        assert _snapshot(out) == before and sorted(os.listdir(out)) == sorted(p.name for p in out.iterdir())


def test_a_larger_budget_resumes_a_complete_run(tmp_path, monkeypatch, capsys):
    out = _complete_run(tmp_path / "run", "--max-steps", "104")
    (out / "metrics.jsonl").write_text(json.dumps({"step": 104, "time/elapsed_train_s": 100.0}) + "\n")
    started = []
    monkeypatch.setattr(runner, "run_experiment", lambda config, *args, **kwargs: started.append(config) or 0)
    assert cli.main("gsm8k", ["--out", str(out), "--resume"]) == 0
    printed = capsys.readouterr().out
    assert not started and "--max-steps 208" in printed and "its --max-steps 104 is spent" in printed
    with open(out / "metrics.jsonl", "a") as f:  # a resume with --max-steps 150 trained on
        f.write(json.dumps({"step": 150, "time/elapsed_train_s": 150.0}) + "\n")
    assert cli.main("gsm8k", ["--out", str(out), "--resume"]) == 0
    printed = capsys.readouterr().out
    assert "its --max-steps 104 (a resume trained it on to step 150) is spent" in printed and "--max-steps 208" in printed
    (out / "metrics.jsonl").write_text(json.dumps({"step": 104, "time/elapsed_train_s": 100.0}) + "\n")
    # A larger time budget trains no step of a run its --max-steps ended: it is still complete.
    assert cli.main("gsm8k", ["--out", str(out), "--resume", "--time-budget", "480"]) == 0
    assert not started and "its --max-steps 104 is spent" in capsys.readouterr().out
    assert cli.main("gsm8k", ["--out", str(out), "--resume", "--max-steps", "200"]) == 0
    assert [config.run.max_steps for config in started] == [200]


def test_a_run_whose_both_budgets_are_spent_names_both(tmp_path, monkeypatch, capsys):
    out = _complete_run(tmp_path / "run", "--max-steps", "104")  # step 104 at 241 s of 240
    monkeypatch.setattr(runner, "run_experiment", lambda *a, **k: pytest.fail("a resume that trains no step"))
    for more, spent, command in (
            ([], "its --time-budget 240 and its --max-steps 104 are", "--time-budget 480 --max-steps 208"),
            (["--max-steps", "200"], "its --time-budget 240 is", "--time-budget 480 --max-steps 200"),
            (["--time-budget", "480"], "its --max-steps 104 is", "--time-budget 480 --max-steps 208")):
        assert cli.main("gsm8k", ["--out", str(out), "--resume", *more]) == 0
        printed = capsys.readouterr().out
        assert f"{spent} spent" in printed and printed.strip().endswith(f"--resume {command}"), printed


def test_the_suggested_budget_is_past_what_a_raised_budget_already_trained(tmp_path, monkeypatch, capsys):
    # Started with 240 s, then resumed with --time-budget 480 to 481 s: 480 would train nothing.
    out = _complete_run(tmp_path / "run")
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 200, "time/elapsed_train_s": 481.0}) + "\n")
    monkeypatch.setattr(runner, "run_experiment", lambda *a, **k: pytest.fail("a complete run was started again"))
    assert cli.main("gsm8k", ["--out", str(out), "--resume"]) == 0
    assert "--time-budget 960" in capsys.readouterr().out


def test_a_stopped_resume_that_raised_the_budget_says_the_budget_again(tmp_path):
    out = _complete_run(tmp_path / "run")
    _, raised = flags.parse("gsm8k", ["--out", str(out), "--time-budget", "480", "--max-steps", "900"])
    line = completed.interrupted_line(KeyboardInterrupt("SIGTERM"), "gsm8k", str(out), raised)
    assert line.endswith(f"--out {out} --resume --time-budget 480 --max-steps 900"), line
    _, same = flags.parse("gsm8k", ["--out", str(out)])
    assert completed.interrupted_line(KeyboardInterrupt(), "gsm8k", str(out), same).endswith("--resume"), line


def test_a_run_stopped_during_its_exports_is_resumed_not_called_complete(tmp_path, monkeypatch, capsys):
    out = _complete_run(tmp_path / "run")
    (out / "exported.json").unlink()  # final_model/ written, the exports after it not yet
    started = []
    monkeypatch.setattr(runner, "run_experiment", lambda config, *args, **kwargs: started.append(config) or 0)
    assert cli.main("gsm8k", ["--out", str(out), "--resume"]) == 0
    assert len(started) == 1 and "complete run" not in capsys.readouterr().out


def test_a_resume_without_a_checkpoint_never_trains_again_over_the_run_s_exports(tmp_path, monkeypatch, capsys):
    out = _complete_run(tmp_path / "run", "--max-steps", "104")
    (out / "metrics.jsonl").write_text(json.dumps({"step": 104, "time/elapsed_train_s": 100.0}) + "\n")
    for name in ("checkpoints/104", "checkpoints"):
        (out / name).rmdir()  # e.g. removed to save disk, keeping the exports
    before = _snapshot(out)
    monkeypatch.setattr(runner, "run_experiment", lambda *a, **k: pytest.fail("trained again from step 0"))
    assert cli.main("gsm8k", ["--out", str(out), "--resume", "--max-steps", "200"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no checkpoint to continue from" in err[0] and "final_model, best_model" in err[0], err
    assert _snapshot(out) == before
    # Complete and not extended: it says so, as with a checkpoint.
    assert cli.main("gsm8k", ["--out", str(out), "--resume"]) == 0
    assert "holds a complete run" in capsys.readouterr().out


@pytest.mark.parametrize("best_steps,resumes", [(["0"], True), (["0", "7"], False)])
def test_a_run_killed_before_its_first_checkpoint_resumes_unless_a_trained_best_would_go(
        tmp_path, monkeypatch, capsys, best_steps, resumes):
    # The step-0 evaluation had saved best/0, and --resume then refused every run killed in its
    # first 30 minutes (before the first checkpoint), even with auto.
    out = tmp_path / "run"
    _, config = flags.parse("gsm8k", ["--out", str(out)])
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config_decoding.as_json(config)))
    (out / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/accuracy": 0.1}) + "\n")
    for step in best_steps:
        (out / "best" / step).mkdir(parents=True)
    started = []
    monkeypatch.setattr(runner, "run_experiment", lambda config, *args, **kwargs: started.append(config) or 0)
    for resume in (["--resume"], ["--resume", "auto"]):
        code = cli.main("gsm8k", ["--out", str(out), *resume])
        err = capsys.readouterr().err
        if resumes:
            assert code == 0 and not err, err
        else:
            assert code == 2 and "has no checkpoint to continue from" in err and "step 0 over its best" in err, err
    assert len(started) == (2 if resumes else 0)


def test_a_run_ended_by_a_resume_that_lowered_its_budget_resumes_to_the_budget_it_started_with(
        tmp_path, monkeypatch, capsys):
    # It had been called complete with "its --time-budget 1000 is spent" after 241 s of 1000, so
    # the 300 steps it was started with could not be reached without asking for more.
    out = _complete_run(tmp_path / "run", "--max-steps", "300", "--time-budget", "1000")
    _, lowered = flags.parse("gsm8k", ["--out", str(out), "--max-steps", "100", "--time-budget", "1000"])
    completed.mark_exported(str(out), ["final_model", "best_model"], lowered.run)  # ended under --max-steps 100
    started = []
    monkeypatch.setattr(runner, "run_experiment", lambda config, *args, **kwargs: started.append(config) or 0)
    assert cli.main("gsm8k", ["--out", str(out), "--resume", "--max-steps", "100"]) == 0
    assert "holds a complete run" in capsys.readouterr().out and not started
    for resume in (["--resume"], ["--resume", "--max-steps", "300"]):
        assert cli.main("gsm8k", ["--out", str(out), *resume]) == 0
        assert "complete run" not in capsys.readouterr().out
    assert [config.run.max_steps for config in started] == [300, 300]
