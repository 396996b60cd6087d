"""--overwrite deletes only a podsjax run directory, never the run's model, data, config file,
the current directory or a parent of any of them."""

import json
import os
import shutil

import pytest

from experiments import cli, config_decoding, flags, run_dir, runner
from podsjax.run.run_state import LOCK_FILE

pytestmark = pytest.mark.cpu_mesh

HF_CONFIG = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 256}


def tree(directory):
    """Every file under ``directory`` with its bytes."""
    found = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, directory)] = f.read()
    return found


def write(directory, files):
    for name, text in files.items():
        path = os.path.join(directory, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)


@pytest.fixture
def never_trains(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the run went on")

    monkeypatch.setattr(runner, "_train_and_export", never)


def podsjax_run(out):
    """A directory as a run leaves it: the config.json it writes first."""
    _, config = flags.parse("gsm8k", ["--out", str(out), "--max-steps", "1"])
    write(out, {"config.json": json.dumps(config_decoding.as_json(config))})


def refused(args, capsys):
    """Runs the CLI, which must refuse with one line; returns that line."""
    assert cli.main("gsm8k", [*args, "--overwrite", "--max-steps", "1", "--no-compile-cache"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --overwrite: refusing to delete "), err
    return err


def test_a_folder_of_user_files_is_not_deleted(tmp_path, data_dir, capsys, never_trains):
    out = tmp_path / "mine"
    shutil.copytree(os.path.join(data_dir, "gsm8k"), out / "dataset")
    write(out, {"thesis.txt": "four years of work"})
    before = tree(out)
    err = refused(["--out", str(out)], capsys)
    assert str(out) in err and "dataset, thesis.txt" in err and "no podsjax run directory" in err
    assert tree(out) == before


def test_a_folder_of_run_entries_without_a_run_config_is_not_deleted(tmp_path, capsys, never_trains):
    # A run log beside them does not make it a run: only the config.json a run writes first.
    out = tmp_path / "looks_like_a_run"
    write(out, {"run.log": "", "metrics.jsonl": "{}\n", "checkpoints/7/x": ""})
    before = tree(out)
    err = refused(["--out", str(out)], capsys)
    assert "no podsjax run directory" in err
    assert tree(out) == before


def test_the_model_directory_is_not_deleted(tmp_path, data_dir, capsys, never_trains):
    model = tmp_path / "model"
    write(model, {"config.json": json.dumps(HF_CONFIG), "model.safetensors": "weights", "tokenizer.json": "{}"})
    before = tree(model)
    gsm8k = os.path.join(data_dir, "gsm8k")
    err = refused(["--model", str(model), "--out", str(model), "--data", os.path.join(gsm8k, "train.jsonl"),
                   "--eval-data", os.path.join(gsm8k, "test.jsonl")], capsys)
    assert f"{model} (it holds config.json, model.safetensors, tokenizer.json): it is the model (--model)" in err
    assert tree(model) == before


def test_the_dataset_directory_is_not_deleted(tmp_path, data_dir, capsys, never_trains):
    dataset, model = tmp_path / "dataset", tmp_path / "model"
    shutil.copytree(os.path.join(data_dir, "gsm8k"), dataset)
    write(model, {"config.json": json.dumps(HF_CONFIG)})
    before = tree(dataset)
    err = refused(["--model", str(model), "--dataset", str(dataset), "--out", str(dataset)], capsys)
    assert f"{dataset / 'train.jsonl'} inside it is the train data" in err and "test.jsonl, train.jsonl" in err
    assert tree(dataset) == before


@pytest.mark.parametrize("out, cwd", [(".", ""), ("..", "src")])
def test_the_current_directory_and_its_parents_are_not_deleted(tmp_path, capsys, never_trains, monkeypatch,
                                                                out, cwd):
    project = tmp_path / "project"
    write(project, {"notes.md": "ideas", "src/train.py": "print('mine')"})
    before = tree(project)
    monkeypatch.chdir(project / cwd)
    err = refused(["--out", out], capsys)
    assert "the current directory" in err and "notes.md, src" in err
    assert tree(project) == before


def test_a_run_that_holds_its_own_model_or_config_file_is_not_deleted(tmp_path, capsys, never_trains):
    out = tmp_path / "run"
    podsjax_run(out)
    write(out, {"final_model/config.json": json.dumps(HF_CONFIG), "my.yaml": "run:\n  max_steps: 1\n"})
    before = tree(out)
    err = refused(["--model", str(out / "final_model"), "--out", str(out)], capsys)
    assert f"{out / 'final_model'} inside it is the model (--model)" in err
    err = refused(["--config", str(out / "my.yaml"), "--out", str(out)], capsys)
    assert "inside it is the config file (--config)" in err
    assert tree(out) == before


def new_names(directory):
    """What the new run sees: the old run waits aside in a .replaced-* folder."""
    return sorted(n for n in os.listdir(directory) if n != LOCK_FILE and not n.startswith(run_dir.REPLACED_PREFIX))


def test_a_podsjax_run_is_replaced(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    podsjax_run(out)
    write(out, {"metrics.jsonl": "{}\n", "checkpoints/1/state": "state"})
    seen = []
    monkeypatch.setattr(runner, "_train_and_export", lambda config, out_dir, *a: seen.append(new_names(out_dir)) or 0)
    assert cli.main("gsm8k", ["--out", str(out), "--overwrite", "--no-compile-cache", "--max-steps", "1"]) == 0
    assert seen == [["config.json"]]
    assert sorted(tree(out)) == ["config.json"]  # the old run went once the new one ended


def test_a_run_holding_files_no_run_writes_is_not_replaced(tmp_path, capsys):
    out = tmp_path / "run"
    podsjax_run(out)
    write(out, {"metrics.jsonl": '{"step": 3}\n', "my_notes.txt": "precious", "analysis/plot.py": "code",
                "events.out.tfevents.1.host.2.3": "scalars", "run.log": "log"})
    before = tree(out)
    line = refused(["--out", str(out)], capsys)
    assert line == (f"error: --overwrite: refusing to delete {out}: it holds analysis, my_notes.txt, which no "
                    "podsjax run writes; move them out or choose another --out\n")
    assert tree(out) == before


def test_files_of_the_user_inside_a_run_s_folders_are_not_deleted(tmp_path, capsys):
    # A model card in the exported model, notes beside the checkpoints: only the top level had
    # been checked, and these went with the old run.
    out = tmp_path / "run"
    podsjax_run(out)
    write(out, {"final_model/model.safetensors": "weights", "final_model/README.md": "model card",
                "checkpoints/3/state": "state", "checkpoints/3.corrupt1/state": "damaged twice",
                "checkpoints/mine/a.txt": "notes", "best/notes.txt": "notes",
                "final_adapter/adapter_model.safetensors": "adapter"})
    before = tree(out)
    line = refused(["--out", str(out)], capsys)
    assert "it holds best/notes.txt, checkpoints/mine, final_model/README.md, which no podsjax run writes" in line
    assert tree(out) == before


def test_an_old_run_a_killed_overwrite_left_aside_is_named(tmp_path, capsys, monkeypatch):
    # A kill before the new run's first step cannot put the old run back: a later start there
    # had said nothing of it, and the next --overwrite deleted it unseen.
    out = tmp_path / "run"
    podsjax_run(out)
    write(out, {".replaced-abc/config.json": "{}", ".replaced-abc/metrics.jsonl": '{"step": 9}\n'})
    run_dir.say_replaced_leftovers(str(out), overwrite=False)
    assert capsys.readouterr().err == (f"note: {out / '.replaced-abc'} holds the run that an --overwrite killed before "
                                       "its first step was to replace; move its files back to restore it, or delete it\n")
    monkeypatch.setattr(runner, "_train_and_export", lambda *args: 0)
    assert cli.main("gsm8k", ["--out", str(out), "--overwrite", "--no-compile-cache", "--max-steps", "1"]) == 0
    assert "this --overwrite deletes it with the rest at its first step" in capsys.readouterr().err


def old_run(out):
    podsjax_run(out)
    write(out, {"metrics.jsonl": '{"step": 3}\n', "checkpoints/3/state": "state",
                "final_model/model.safetensors": "weights",
                "run.log": "old run's log\n"})
    return tree(out)


@pytest.mark.parametrize("stop", [cli.UsageError("bad weights"), KeyboardInterrupt()])
def test_a_new_run_that_stops_before_its_first_step_puts_the_old_run_back(tmp_path, capsys, monkeypatch, stop):
    # As a checkpoint that fails to load, or a Ctrl-C while the new run compiles.
    out = tmp_path / "run"
    before = old_run(out)

    def starts_then_stops(config, out_dir, *args):  # a stop saves step 0's checkpoint, which trained nothing
        write(out_dir, {"metrics.jsonl": '{"step": 0}\n', "run.log": "new run's log\n", "samples.jsonl": "{}\n",
                        "checkpoints/0/x": "step 0", "checkpoints/0.orbax-checkpoint-tmp-1/x": "saving"})
        raise stop

    monkeypatch.setattr(runner, "_train_and_export", starts_then_stops)
    code = cli.main("gsm8k", ["--out", str(out), "--overwrite", "--no-compile-cache", "--max-steps", "1"])
    assert code == (2 if isinstance(stop, Exception) else 130)
    err = capsys.readouterr().err
    assert f"--overwrite: the new run stopped before its first step; {out} holds the run it was to replace" in err
    if isinstance(stop, KeyboardInterrupt):  # not "--resume", which would train the old run further
        assert err.splitlines()[-1] == (f"interrupted; {out} holds the run --overwrite was to replace: run the same "
                                        "command again to replace it")
    after = tree(out)
    assert after.pop("run.log") == b"old run's log\nnew run's log\n"  # the new log says why it stopped
    assert after == {k: v for k, v in before.items() if k != "run.log"}


def test_a_new_run_that_fails_after_a_step_has_replaced_the_old_one(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    old_run(out)

    def steps_then_fails(config, out_dir, *args):
        write(out_dir, {"metrics.jsonl": '{"step": 1}\n'})
        raise cli.UsageError("a later error")

    monkeypatch.setattr(runner, "_train_and_export", steps_then_fails)
    assert cli.main("gsm8k", ["--out", str(out), "--overwrite", "--no-compile-cache", "--max-steps", "1"]) == 2
    assert sorted(tree(out)) == ["config.json", "metrics.jsonl"]


def test_the_old_run_goes_at_the_new_run_s_first_step(tmp_path):
    out = tmp_path / "run"
    old_run(out)
    replaced = run_dir.ReplacedRun(str(out))
    assert new_names(out) == [] and os.path.isdir(replaced.path)
    runner._DropReplacedRun(replaced).on_step(1, None)
    assert os.listdir(out) == [] and replaced.path is None


def test_a_dry_run_with_overwrite_deletes_nothing(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    before = old_run(out)

    def plans(config, out_dir, *args):
        write(out_dir, {"dry_run.json": "{}"})
        return 0

    monkeypatch.setattr(runner, "_dry_run", plans)
    assert cli.main("gsm8k", ["--out", str(out), "--overwrite", "--dry-run", "--no-compile-cache",
                              "--max-steps", "2"]) == 0
    assert tree(out) == {**before, "dry_run.json": b"{}"}  # its config.json too: the run it planned is not this one


def test_a_dry_run_never_replaces_a_dry_run_json_it_did_not_write(tmp_path, capsys, monkeypatch):
    out = tmp_path / "mine"
    write(out, {"dry_run.json": '{"mine": "important"}', "other.txt": "x"})
    before = tree(out)
    monkeypatch.setattr(runner, "_dry_run", lambda *a: pytest.fail("the dry run started"))
    assert cli.main("gsm8k", ["--out", str(out), "--dry-run", "--no-compile-cache", "--max-steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: --dry-run: {out / 'dry_run.json'} is not a podsjax dry run's, and the dry run would "
                   "replace it; choose another --out\n")
    assert tree(out) == before
    ours = {"params": 1, "total": 2, "device_kind": "cpu", "limit": None}
    write(out, {"dry_run.json": json.dumps(ours)})  # an earlier podsjax dry run's: replaced as before
    assert not run_dir.foreign_dry_run_file(str(out)) and not run_dir.foreign_dry_run_file(str(tmp_path))


def test_the_runner_refuses_too(tmp_path, never_trains):
    """run_experiment, called without the CLI, makes the same check before it writes anything."""
    out = tmp_path / "mine"
    write(out, {"thesis.txt": "four years of work"})
    _, config = flags.parse("gsm8k", ["--out", str(out), "--max-steps", "1"])
    with pytest.raises(cli.UsageError, match="thesis.txt.*no podsjax run directory"):
        runner.run_experiment(config, str(out), overwrite=True, resume=False)
    assert tree(out) == {"thesis.txt": b"four years of work"}


def test_without_a_flag_a_folder_of_files_is_no_run_and_a_run_needs_resume_or_overwrite(tmp_path, capsys):
    mine, run = tmp_path / "mine", tmp_path / "run"
    write(mine, {"thesis.txt": "four years of work"})
    podsjax_run(run)
    lines = {}
    for out in (mine, run, ""):
        assert cli.main("gsm8k", ["--out", str(out), "--max-steps", "1", "--no-compile-cache"]) == 2
        lines[str(out)] = capsys.readouterr().err
    assert "holds no podsjax run" in lines[str(mine)] and "--resume" not in lines[str(mine)]
    assert "pass --resume to continue it or --overwrite to replace it" in lines[str(run)]
    assert lines[""] == "error: --out is empty; name the run directory\n"
    assert tree(mine) == {"thesis.txt": b"four years of work"}
