"""The CLI's one error path: a user's mistake is one line and status 2, a bug a traceback and status 1;
nothing is written for a bad config; a full disk stops the run with one line and resume is exact."""

import errno
import json
import os
import shutil
import subprocess
import sys

import pytest
from tiny_checkpoint import save_tiny_checkpoint

from experiments import cli, run_dir, runner
from podsjax import rl
from podsjax.run import checkpoint
from child_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("args,message", [
    # 8 prompts x 4 rollouts fit, 1 x 4 do not divide over 8 devices: refused before any warm-up or write.
    pytest.param(["--method", "pods", "--n", "4", "--m", "2", "--prompts-per-step", "1", "--mesh", "8"],
                 "rollout rows must divide evenly over the mesh's 8 batch shards", marks=pytest.mark.cpu_mesh),
    (["--time-budget", "inf"], "time_budget_s must be a finite number; got inf"),
    (["--time-budget", ".inf"], "time_budget_s must be a finite number; got inf"),
    (["--method", "pods", "--n", "4", "--m", "8"], "need 2 <= m <= n"),
    (["--method", "grpo-ga", "--n", "8", "--prompts-per-step", "1", "--grad-accum", "3"],
     "8 trained rows per update (prompt rows x --m) do not split into --grad-accum 3 micro-batches"),
    (["--method", "pods", "--n", "8", "--m", "2", "--prompts-per-step", "2", "--grad-accum", "2",
      "--algorithm.steps_per_generation", "3"],
     "4 trained rows per step (prompt rows x --m) do not split into --algorithm.steps_per_generation 3 "
     "mini-batches of --grad-accum 2 micro-batches"),
    # 3 groups of 4 rows make 12 rows, 2 micro-batches of 6: no micro-batch of whole groups.
    (["--method", "grpo-ga", "--n", "4", "--prompts-per-step", "3", "--grad-accum", "2",
      "--algorithm.aggregation", "group-token-mean"],
     "group-token-mean averages whole groups, but an update's 3 groups (prompts_per_step x groups_per_prompt) "
     "do not split into its 2 micro-batches"),
    (["--beta", "-1"], "beta must be >= 0 and finite; got -1.0"),
    (["--groups-per-prompt", "0"], "groups_per_prompt must be >= 1; got 0"),
    (["--max-prompt-length", "100000000", "--dry-run"],  # XLA's compiler had aborted the process
     "max_prompt_length + max_new_tokens must be at most 1048576 tokens; got 100000000 + "),
])
def test_a_bad_config_is_one_line_before_anything_is_written(tmp_path, capsys, args, message):
    out = tmp_path / "never"
    assert cli.main("gsm8k", [*args, "--out", str(out), "--no-compile-cache"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not out.exists()


@pytest.mark.parametrize("content,message", [
    ("{not json", "cannot read"),
    (b"\xff\xfe\x00binary", "cannot read"),
    ("[1, 2]", "holds a JSON list"),
    ('{"task": "gsm8k"}', "is no podsjax run's config (no 'run' section; it holds 'task')"),
    ('{"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}', "it holds 'model_type', 'architectures'"),
    ('{"task": "gsm8k", "model_path": null, "algorithm": {}, "run": {}, "model": {}}', "an older layout"),
    ('{"run": {"max_steps": 1}, "algorithm": []}', "'algorithm' must be an object of fields, got list"),
    ('{"run": {"max_steps": 1}, "model": {"dtype": "float16"}}', "model.dtype must be one of float32, bfloat16"),
    ('{"run": {"max_steps": "two"}}', "max_steps"),
])
def test_resume_with_a_broken_config_json_is_one_line(tmp_path, capsys, content, message):
    out = tmp_path / "run"
    out.mkdir()
    path = out / "config.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert cli.main("gsm8k", ["--resume", "--out", str(out), "--no-compile-cache"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and str(path) in err, err


def test_a_config_json_with_a_field_no_config_has_is_one_line(tmp_path, capsys):
    config = {"algorithm": {"n": 4, "m": 2, "algorithm": "pods", "nosuch": 1}, "run": {"max_steps": 1},
              "model": {"mesh": None, "dtype": "float32", "lora_rank": None, "lora_alpha": 64}}
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    assert cli.main("gsm8k", ["--resume", "--out", str(out), "--no-compile-cache"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nosuch" in err, err


@pytest.mark.parametrize("error,message", [
    (rl.TrainingDiverged("3 updates in a row had a non-finite loss"), "3 updates in a row"),
    (checkpoint.CheckpointCorrupt("no checkpoint in /x loads"), "no checkpoint in /x loads"),
    (OSError(errno.ENOSPC, "No space left on device", "/runs/x/metrics.jsonl"),  # no run in --out: nothing to resume
     "no space left on device writing /runs/x/metrics.jsonl; free some space, then rerun the same command"),
    (RuntimeError("tensorstore: RESOURCE_EXHAUSTED: No space left on device"), "no space left on device writing"),
    (OSError(errno.EROFS, "Read-only file system", "/ro/run"), "cannot write /ro/run: Read-only file system"),
])
def test_the_library_s_user_errors_and_a_full_disk_are_one_line(monkeypatch, tmp_path, capsys, error, message):
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(runner, "run_experiment", fail)
    assert cli.main("gsm8k", ["--out", str(tmp_path / "run"), "--max-steps", "1", "--no-compile-cache"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_a_full_disk_says_resume_only_where_a_run_was_kept(tmp_path):
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "metrics.jsonl"))
    assert cli.user_error_line(full, str(tmp_path)).endswith("free some space, then rerun the same command")
    (tmp_path / "config.json").write_text("{}")
    assert cli.user_error_line(full, str(tmp_path)).endswith("the last complete checkpoint is intact: free some "
                                                             "space, then rerun with --resume")
    run_dir.ReplacedRun.restored.add(os.path.realpath(tmp_path))  # --overwrite put the old run back
    try:  # --resume would train the old run further
        assert cli.user_error_line(full, str(tmp_path)).endswith("free some space, then rerun the same command")
    finally:
        run_dir.ReplacedRun.restored.discard(os.path.realpath(tmp_path))


def test_a_bug_shows_its_traceback_then_one_summary_line_and_exit_1(monkeypatch, tmp_path, capsys):
    def fail(*args, **kwargs):
        raise KeyError("boom")

    monkeypatch.setattr(runner, "run_experiment", fail)
    assert cli.main("gsm8k", ["--out", str(tmp_path / "run"), "--max-steps", "1", "--no-compile-cache"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and "in fail" in err
    assert err.rstrip("\n").splitlines()[-1] == ("error: unexpected KeyError: 'boom' (a bug: the traceback above "
                                                  "says where)")


# ------------------------------------------------------------- a full disk, for real

def _mount_tmpfs(path, size_kb):
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(path)],
                          capture_output=True)
    return done.returncode == 0


def _run_cli(args):
    env = child_env()
    return subprocess.run([sys.executable, "-m", "experiments.gsm8k", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def _losses(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return {r["step"]: r["train/loss"] for r in map(json.loads, f) if "train/loss" in r}


def _size_kb(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(path) for f in names) // 1024


def run_args(model, data_dir, compile_cache):
    """A 4-step PODS run of the tiny random model with a checkpoint at every step; its runs
    share ``compile_cache``, so each program compiles once."""
    gsm8k = os.path.join(data_dir, "gsm8k")
    return ["--model", model, "--data", os.path.join(gsm8k, "train.jsonl"), "--eval-data",
            os.path.join(gsm8k, "test.jsonl"), "--eval-limit", "4", "--method", "pods", "--n", "4", "--m", "2",
            "--prompts-per-step", "2", "--max-completion-length", "8", "--lora-rank", "2", "--eval-every", "1000",
            "--checkpoint-every-steps", "1", "--max-steps", "4", "--no-progress", "--reward-workers", "1",
            "--compile-cache-dir", str(compile_cache)]


def checkpointed_run(tmp_path_factory, data_dir):
    """The run of run_args, finished (checkpoints of steps 2-4 kept), made once per session for
    every test that needs one; returns (its directory, its arguments). Copy it before changing it."""
    base = tmp_path_factory.getbasetemp()
    args = run_args(str(base / "faults_tiny_model"), data_dir, base / "faults_compile_cache")
    out = base / "faults_checkpointed_run"
    if not (out / "final_model").is_dir():
        save_tiny_checkpoint(base / "faults_tiny_model")
        done = _run_cli([*args, "--out", str(out), "--overwrite"])
        assert done.returncode == 0, done.stderr[-3000:]
    return out, args


@pytest.mark.slow
def test_every_entry_a_finished_run_writes_is_one_overwrite_may_delete(tmp_path_factory, data_dir):
    # --overwrite refuses a run directory holding anything else (the user's notes, say).
    out, _ = checkpointed_run(tmp_path_factory, data_dir)
    names = sorted(os.listdir(out))
    assert {"config.json", "checkpoints", "final_model", "metrics.jsonl"} <= set(names), names
    assert all(run_dir.is_run_entry(name) for name in names), [n for n in names if not run_dir.is_run_entry(n)]
    assert run_dir.foreign_files(str(out)) == []  # the exported models' and the checkpoints' files too


@pytest.mark.slow
def test_a_full_disk_stops_with_one_line_and_resume_is_exact(tmp_path_factory, data_dir):
    """--out on a tmpfs too small for the run: one line, status 2; after room is made, --resume
    finishes with the same per-step losses as a run that never stopped."""
    reference, common = checkpointed_run(tmp_path_factory, data_dir)
    disk = tmp_path_factory.mktemp("full") / "disk"
    if not _mount_tmpfs(disk, max(_size_kb(reference) // 2, 64)):
        pytest.skip("cannot mount a tmpfs here (needs root); the simulated full disk is tested above "
                    "and in test_faults_orbax.py")
    try:
        out = disk / "run"
        full = _run_cli([*common, "--out", str(out)])
        assert full.returncode == 2, (full.returncode, full.stderr[-3000:])
        # Our one line, after at most a note on orbax's own reports (kept in run.log when there is room).
        lines = full.stderr.splitlines()
        assert len(lines) <= 3 and "Traceback" not in full.stderr, full.stderr[-3000:]
        errors = [line for line in lines if line.startswith("error: ")]
        assert len(errors) == 1 and lines[-1] == errors[0], full.stderr[-3000:]
        assert errors[0].startswith("error: no space left on device writing") and "--resume" in errors[0]
        subprocess.run(["mount", "-o", "remount,size=65536k", str(disk)], check=True)
        resumed = _run_cli(["--out", str(out), "--resume", "--no-progress", *common[-2:]])  # the same cache
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert _losses(out) == _losses(reference)
        assert os.path.isfile(out / "final_model" / "config.json")
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
        shutil.rmtree(disk, ignore_errors=True)


def test_host_devices_start_with_the_flags_that_keep_cpu_collectives_from_deadlocking():
    flags = cli.host_device_flags(8, "--xla_dump_to=/tmp/x")
    assert flags.split() == ["--xla_dump_to=/tmp/x", "--xla_force_host_platform_device_count=8",
                             "--xla_cpu_multi_thread_eigen=false",
                             "--xla_cpu_collective_call_terminate_timeout_seconds=300"]
    assert cli.host_device_flags(1, "") == ""  # one device: nothing to add
    mine = "--xla_force_host_platform_device_count=4 --xla_cpu_multi_thread_eigen=true"
    assert cli.host_device_flags(8, mine) == mine + " --xla_cpu_collective_call_terminate_timeout_seconds=300"
    assert "xla_cpu_multi_thread_eigen=false" in os.environ["XLA_FLAGS"]  # the tests run this way too
