"""Preemption: SIGTERM stops a run at its last whole step with a checkpoint, leaves no reward
worker behind, and relaunching the same command continues it to the losses of a run that
never stopped."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from test_resume_killed import (ROOT, TIMEOUT_S, cli_args, cli_env, records, run_cli, tail,
                                uninterrupted_run, without_timing)

from podsjax.rewards import RewardPool, WeightedReward
from podsjax.run import run_state

pytestmark = [pytest.mark.slow, pytest.mark.cpu_mesh]

# Reward workers import this module for `hang`: JAX and the models are imported in the tests only.


@pytest.fixture(scope="module")
def setup(tmp_path_factory, data_dir):
    """test_loop's tiny model and GSM8K rows."""
    import jax.numpy as jnp
    from tiny_checkpoint import save_tiny_checkpoint

    from podsjax.data import datasets as data, prompts
    import podsjax.models as pm

    checkpoint = save_tiny_checkpoint(tmp_path_factory.mktemp("relaunch_ckpt"))
    model, params = pm.from_pretrained(checkpoint, dtype=jnp.float32)
    gsm8k = os.path.join(data_dir, "gsm8k")
    train_set = data.load_task("gsm8k", "train", path=os.path.join(gsm8k, "train.jsonl"), limit=8).examples
    test_set = data.load_task("gsm8k", "test", path=os.path.join(gsm8k, "test.jsonl"), limit=2).examples
    return model, params, prompts.load_tokenizer(checkpoint), train_set, test_set


def hang(completions, **_):
    """A reward that never returns in time (asleep in C: no CPU-time alarm fires)."""
    time.sleep(300)
    return [0.0] * len(completions)


def alive(pids):
    """Those of ``pids`` still running (zombies count as gone)."""
    left = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if state not in ("Z", "X"):
            left.append(pid)
    return left


def session_processes(session):
    """Pids of every process in the session ``session`` (a run started with start_new_session)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[3]) == session and fields[0] not in ("Z", "X"):
                found.append(int(name))
    return found


def wait_gone(find, seconds=15):
    deadline = time.monotonic() + seconds
    while (left := find()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def train_losses(out):
    return {r["step"]: r["train/loss"] for r in records(out) if "train/loss" in r}


@pytest.mark.parametrize("during", ["update", "scoring"])
def test_sigterm_finishes_an_update_or_drops_scoring_then_checkpoints_the_last_whole_step(setup, tmp_path, during):
    import podsjax.models as pm
    from test_loop import make_trainer

    from podsjax import rl
    from experiments import paper_settings

    lora = pm.LoraConfig(rank=2, alpha=4.0)
    pool = RewardPool(1, timeout_s=10.0)
    workers = []
    algo = paper_settings.method_config("pods", n=4, m=2, learning_rate=1e-3)
    optimizer, update = rl.update_program(setup[0], algo, lora)

    def signalled_update(state, batch, frozen):  # the signal lands while step 2's update runs: the step finishes
        if int(state.step) == 1:
            workers.extend(pool.worker_pids)
            os.kill(os.getpid(), signal.SIGTERM)
        return update(state, batch, frozen)

    class SignalledScorer:  # a reward of step 2 hangs, and the signal comes while it does: the step is dropped
        def score(self, completions, rewards, **columns):
            if rewards is trainer.rewards and int(trainer.state.step) == 1:
                workers.extend(pool.worker_pids)
                threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
                rewards = (*rewards, WeightedReward(hang, 0.0, "hang"))
            return pool.score(completions, rewards, **columns)

        def close(self):
            pool.close()

    if during == "update":
        trainer = make_trainer(setup, tmp_path / "run", max_steps=4, lora=lora, scorer=pool,
                               update=(optimizer, signalled_update))
        expected_step = 2
    else:
        trainer = make_trainer(setup, tmp_path / "run", max_steps=4, lora=lora, scorer=SignalledScorer())
        expected_step = 1
    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(run_state.StopRequested) as stopped:
        trainer.run()
    assert signal.getsignal(signal.SIGTERM) is previous  # the trainer's handler is gone with it
    stop = stopped.value
    assert (stop.signal, stop.step, stop.checkpoint) == ("SIGTERM", expected_step, expected_step)
    assert str(stop) == f"stopped by SIGTERM after step {expected_step} (checkpoint of step {expected_step} saved)"
    assert sorted(train_losses(tmp_path / "run")) == list(range(1, expected_step + 1))
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == [str(s) for s in range(1, expected_step + 1)]
    assert workers and not wait_gone(lambda: alive(workers), 10), "reward workers outlived the stop"

    resumed = make_trainer(setup, tmp_path / "run", max_steps=4, lora=lora)
    assert int(resumed.state.step) == expected_step
    resumed.close()


def test_reward_workers_die_with_a_parent_killed_while_a_reward_hangs(tmp_path):
    # The pool's parent is SIGKILLed (no handler, no atexit) while both workers sit in a
    # reward that sleeps: the workers, and so the forkserver, must go by themselves.
    script = ("import sys\n"
              "from podsjax.rewards import RewardPool\n"
              "from test_relaunch import hang\n"
              "pool = RewardPool(2, preload=(), timeout_s=300).start()\n"
              "print(*pool.worker_pids, flush=True)\n"
              "pool.score(['a', 'b'], [hang])\n")
    here = os.path.dirname(os.path.abspath(__file__))  # this module; the test helpers one folder up
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.path.dirname(here), ROOT])}
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        workers = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(workers) == 2
        time.sleep(1.0)  # both items handed out
        assert len(session_processes(parent.pid)) >= 4  # parent, forkserver, two workers
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)
        left = wait_gone(lambda: session_processes(parent.pid))
        assert not left, f"processes of the killed pool still run: {left}"
    finally:
        for pid in session_processes(parent.pid):
            os.kill(pid, signal.SIGKILL)


def test_a_pool_closed_mid_reward_kills_its_busy_workers_at_once(tmp_path):
    pool = RewardPool(1, preload=(), timeout_s=300).start()
    workers = pool.worker_pids
    caller = threading.Thread(target=lambda: pytest.raises(Exception, pool.score, ["a"], [hang]), daemon=True)
    caller.start()
    time.sleep(1.0)
    started = time.monotonic()
    pool.close()
    assert time.monotonic() - started < 2.0 and not wait_gone(lambda: alive(workers), 5)


def test_a_sigtermed_cli_run_relaunched_with_the_same_command_matches_a_run_never_stopped(tmp_path_factory, tmp_path):
    env = cli_env(tmp_path)
    full = uninterrupted_run(tmp_path_factory, env)
    out = str(tmp_path / "preempted")
    command = [*cli_args(out), "--resume", "auto"]  # one job-script line for the start and the requeue

    # SIGTERM to the run's main process alone (as `kill` or a preemption notice handler sends
    # it) once its step-2 checkpoint is committed.
    with open(tmp_path / "stopped.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "experiments.gsm8k", *command], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not os.path.isdir(os.path.join(out, "checkpoints", "2")):
            assert proc.poll() is None, "the run ended before it was stopped:\n" + tail(tmp_path / "stopped.log")
            assert time.monotonic() < deadline, "no step-2 checkpoint in time:\n" + tail(tmp_path / "stopped.log")
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    printed = (tmp_path / "stopped.log").read_text()
    assert proc.returncode == 130, printed[-3000:]
    last = printed.strip().splitlines()[-1]
    assert last.startswith("stopped by SIGTERM after step ") and last.endswith(f"--out {out} --resume"), last
    step = int(last.split()[5])
    assert step >= 2 and f"(checkpoint of step {step} saved)" in last, last
    assert os.path.isdir(os.path.join(out, "checkpoints", str(step)))
    assert not os.path.exists(os.path.join(out, "final_model"))
    assert not os.path.exists(os.path.join(out, run_state.LOCK_FILE))
    left = wait_gone(lambda: session_processes(proc.pid))
    assert not left, f"processes of the stopped run still run (reward workers, forkserver): {left}"

    resumed = run_cli(command, env)
    assert f"resumed from the checkpoint of step {step} " in resumed, resumed[-2000:]
    assert train_losses(out) == train_losses(full) and len(train_losses(full)) == 5
    assert without_timing(records(out)) == without_timing(records(full))  # rewards, grad norms, evaluations too
    assert os.path.isfile(os.path.join(out, "final_model", "config.json"))
    assert not os.path.exists(os.path.join(out, run_state.LOCK_FILE))
