"""A CLI run killed with SIGKILL after a checkpoint and resumed with --resume ends bitwise
equal to a run that was never stopped: the same params and the same per-step metrics,
each step logged exactly once."""

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from safetensors.numpy import load_file
from child_env import child_env

pytestmark = [pytest.mark.slow, pytest.mark.cpu_mesh]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The tiny preset's warm-up of 30 steps (enough of the format to give reward variance) comes
# from the session's warm-up cache (tests/conftest.py), which every test process shares: the
# runs here and in test_experiments_cli (same seed and steps) train it once.
MAX_STEPS = 5
TIMEOUT_S = 300


def cli_args(out):
    # Evaluation before every step: deterministic cadence, interleaved with training.
    return ["--mesh", "8", "--seed", "0", "--warmup-steps", "30",
            "--max-steps", str(MAX_STEPS), "--checkpoint-every-steps", "2", "--eval-every", "0", "--eval-limit", "4",
            "--n", "4", "--m", "2", "--prompts-per-step", "2", "--max-completion-length", "40",
            "--reward-workers", "1", "--no-progress", "--out", out]


def cli_env(tmp_path):
    env = child_env()
    # The three processes compile the same programs; a shared cache compiles them once.
    env.update(JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    return env


def run_cli(args, env):
    done = subprocess.run([sys.executable, "-m", "experiments.gsm8k", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, f"{args}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done.stdout


def records(out, name="metrics.jsonl"):
    """Every line of a log; a torn or unparsable line fails (resume must leave none)."""
    with open(os.path.join(out, name)) as f:
        return [json.loads(line) for line in f]


def logged(out, step):
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            lines = f.readlines()
    except FileNotFoundError:
        return False
    return any(f'"step": {step}, ' in line and "train/loss" in line for line in lines)


def without_timing(rows):
    """The records minus wall-clock fields (wall_time, time/*, perf/*)."""
    return [{k: v for k, v in r.items() if k != "wall_time" and not k.startswith(("time/", "perf/"))} for r in rows]


def tail(path):
    return path.read_text()[-4000:]


def final_params(out):
    files = sorted(glob.glob(os.path.join(out, "final_model", "*.safetensors")))
    assert files, f"no exported model in {out}"
    return {k: v for f in files for k, v in load_file(f).items()}


def uninterrupted_run(tmp_path_factory, env):
    """The run of cli_args that never stops, run once per session for every test that stops one."""
    out = tmp_path_factory.getbasetemp() / "uninterrupted_run"
    if not (out / "final_model").is_dir():
        run_cli([*cli_args(str(out)), "--overwrite"], env)
    return str(out)


def test_killed_run_resumes_to_the_same_params_and_metrics(tmp_path_factory, tmp_path):
    env = cli_env(tmp_path)
    full, killed = uninterrupted_run(tmp_path_factory, env), str(tmp_path / "killed")

    # The same run again, SIGKILLed (with its reward workers: the whole process group) once
    # the step-2 checkpoint is committed (orbax renames its tmp dir to "2") and step 3 is
    # logged, so the kill leaves records past the checkpoint that resume must not duplicate.
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "experiments.gsm8k", *cli_args(killed)], cwd=ROOT,
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not (os.path.isdir(os.path.join(killed, "checkpoints", "2")) and logged(killed, 3)):
            assert proc.poll() is None, "the run ended before it was killed:\n" + tail(tmp_path / "killed.log")
            assert time.monotonic() < deadline, "no step-2 checkpoint in time:\n" + tail(tmp_path / "killed.log")
            time.sleep(0.01)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not os.path.exists(os.path.join(killed, "final_model"))

    resumed = run_cli(["--out", killed, "--resume", "--no-progress"], env)

    # Resume restored a checkpoint before the end and cut off what the killed run logged after it.
    step = next(int(line.split()[6]) for line in resumed.splitlines() if line.startswith("resumed from the checkpoint"))
    assert step in (2, 4), resumed[-2000:]
    if step == 2:
        assert any(r.get("step") == 3 for r in records(killed, "metrics.jsonl.superseded"))

    expected, got = records(full), records(killed)
    train_steps = [r["step"] for r in got if "train/loss" in r]
    eval_steps = [r["step"] for r in got if "eval/accuracy" in r]
    assert train_steps == list(range(1, MAX_STEPS + 1)) and eval_steps == list(range(MAX_STEPS + 1))
    assert without_timing(got) == without_timing(expected)  # losses, rewards, grad norm, lr, kl, lengths, eval
    assert any(r["train/grad_norm"] > 0 for r in expected if "train/loss" in r)  # the updates did something
    for name in ("samples.jsonl", "eval_history.jsonl"):
        assert without_timing(records(killed, name)) == without_timing(records(full, name)), name

    want, have = final_params(full), final_params(killed)
    assert want.keys() == have.keys()
    for name in want:
        assert want[name].dtype == have[name].dtype and want[name].tobytes() == have[name].tobytes(), name
