"""Reward plug-ins that hang, kill the pool's process server, print without end, return NaN
or exit: the pool bounds the time, recovers or stops with one line naming the reward, keeps
the console readable, and says so once."""

import os
import signal
import time

import numpy as np
import pytest

from podsjax.rewards import RewardPool, RewardPoolError
from child_env import child_env

# Module level so that worker processes can import them by name.


def sleeps_forever(completions, **_):
    while True:
        time.sleep(1)  # outside Python's CPU time: only the parent's kill ends it


def hangs_on_marker(completions, **_):
    if "HANG" in completions[0]:
        sleeps_forever(completions)
    return [1.0]


def one(completions, **_):
    return [1.0 for _ in completions]


def not_a_number(completions, **_):
    return [float("nan") for _ in completions]


def exits(completions, **_):
    os._exit(3)


def kills_its_parent(completions, **_):
    os.kill(os.getppid(), signal.SIGKILL)  # a worker's parent is the forkserver
    time.sleep(0.2)
    return [1.0]


def kills_its_parent_once(completions, **_):
    if "KILL" in completions[0]:
        return kills_its_parent(completions)
    return [1.0]


def prints_megabytes(completions, **_):
    print("x" * 2_000_000, flush=True)
    return [1.0]


def pool(timeout_s=0.5, kill_grace_s=0.5, **settings):
    return RewardPool(2, timeout_s=timeout_s, kill_grace_s=kill_grace_s, preload=(), warn=WARNINGS.append, **settings)


WARNINGS = []


@pytest.fixture(autouse=True)
def no_warnings_yet():
    WARNINGS.clear()


def test_a_hanging_reward_is_given_up_on_after_a_few_items_named_once_and_counted():
    with pool(kill_grace_s=2) as p:  # a worker has 3 s to reach the hang, even on a loaded host
        start = time.monotonic()
        scores = p.score([f"x {i}" for i in range(64)], [sleeps_forever, one])
        first = time.monotonic() - start
        again = p.score([f"x {i}" for i in range(64)], [sleeps_forever, one])
    # Without giving up: 64 items x (2 x 0.5 s + 2 s) / 2 workers = 96 s. Given up after 4 in a row.
    assert first < 30, first
    # The items killed for hanging lose every function; the others skip it and score the rest.
    # The pool gives up at the 4th timeout in a row, but an item already handed to the other
    # worker by then still runs, and is killed: 4 or 5 items with 2 workers, by scheduling.
    killed = int(np.argmax(scores.per_function["one"] > 0))
    assert 4 <= killed <= 4 + 2 - 1, scores.per_function["one"]
    np.testing.assert_array_equal(scores.per_function["one"], np.r_[np.zeros(killed), np.ones(64 - killed)])
    np.testing.assert_array_equal(scores.per_function["sleeps_forever"], np.zeros(64))
    assert scores.metrics["reward/timeouts"] == 64 and again.metrics["reward/timeouts"] == 64
    gave_up = [w for w in WARNINGS if "'sleeps_forever' timed out on 4 items in a row" in w]
    assert len(gave_up) == 1 and "\n" not in gave_up[0], WARNINGS  # once for the pool, not per batch


def test_a_reward_that_hangs_now_and_then_is_not_given_up_on():
    with pool(kill_grace_s=3) as p:  # an "ok" item has 3.5 s, even on a loaded host
        texts = ["HANG" if i % 4 == 0 else "ok" for i in range(12)]
        scores = p.score(texts, hangs_on_marker)
    np.testing.assert_array_equal(scores.total_B, [0.0 if t == "HANG" else 1.0 for t in texts])
    assert scores.metrics["reward/timeouts"] == 3 and not WARNINGS


def test_rewards_that_all_time_out_stop_in_one_line_in_bounded_time():
    with pool() as p:
        start = time.monotonic()
        with pytest.raises(RewardPoolError) as err:
            p.score(["x"] * 500, sleeps_forever)
        assert time.monotonic() - start < 15
        message = str(err.value)
        assert "\n" not in message and "'sleeps_forever'" in message and "timed out on 4 items in a row" in message
        assert p.score(["x"], one).total_B[0] == 1.0  # the pool still works


def test_a_batch_has_a_wall_clock_deadline_whatever_its_size():
    with RewardPool(2, timeout_s=30, kill_grace_s=0.5, preload=(), warn=WARNINGS.append, batch_timeout_s=2,
                    give_up_after=100) as p:
        p.score(["x", "y"], one)  # both workers import this module now, outside the timed batch
        start = time.monotonic()
        scores = p.score(["x"] * 200, sleeps_forever)
        assert time.monotonic() - start < 10
    assert scores.metrics["reward/timeouts"] == 200
    assert [w for w in WARNINGS if "batch_timeout_s 2 s" in w and "198 items left score 0" in w], WARNINGS


def test_nan_and_a_crash_are_each_one_warning_line_the_first_time():
    with pool() as p:
        for _ in range(2):
            nan = p.score(["a", "b"], not_a_number)
            crashed = p.score(["a", "b"], exits)
    assert nan.metrics["reward/errors"] == 2 and crashed.metrics["reward/crashes"] == 2
    assert len(WARNINGS) == 2, WARNINGS
    assert "reward 'not_a_number' returned nan" in WARNINGS[0] and "reward/errors" in WARNINGS[0]
    assert "while reward 'exits' scored an item (exit code 3)" in WARNINGS[1] and "reward/crashes" in WARNINGS[1]


def test_a_reward_that_kills_the_forkserver_once_is_survived_and_counted():
    with pool() as p:
        scores = p.score(["ok", "KILL", "ok", "ok", "ok", "ok"], kills_its_parent_once)
        assert p.server_restarts == 1
        again = p.score(["ok"] * 4, kills_its_parent_once)
    assert again.total_B.tolist() == [1.0] * 4 and again.metrics["reward/crashes"] == 0
    assert scores.metrics["reward/crashes"] >= 1  # the items in flight when the server died
    assert [w for w in WARNINGS if "process server died" in w and "'kills_its_parent_once'" in w], WARNINGS


def test_a_reward_that_keeps_killing_the_forkserver_stops_in_one_line_naming_it():
    with pool() as p:
        with pytest.raises(RewardPoolError) as err:
            p.score(["x"] * 20, [one, kills_its_parent])
    message = str(err.value)
    assert "\n" not in message and "reward 'kills_its_parent' killed the reward pool's process server" in message


_PRINTING_POOL = """
import sys
sys.path[:0] = sys.argv[2:]
from test_reward_faults import pool, prints_megabytes
with pool(timeout_s=10, kill_grace_s=10, output_budget_bytes=1000, output_log=sys.argv[1]) as p:  # no item is killed
    p.score(["a", "b", "c"], prints_megabytes)
"""


def test_a_worker_prints_to_the_console_up_to_a_budget_and_the_rest_to_the_log(tmp_path):
    # In a process of its own: workers fork from a server that keeps the console of the
    # process's first pool, which in a test process is an earlier test's captured output.
    import subprocess
    import sys

    log = tmp_path / "run.log"
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, "-c", _PRINTING_POOL, str(log), here, os.path.dirname(here)],
                          capture_output=True, text=True, timeout=120, env=child_env())
    assert done.returncode == 0, done.stderr[-2000:]
    shown = done.stdout + done.stderr
    assert len(shown) < 2 * 1000 + 500, len(shown)  # two workers' budgets and their notes
    assert f"output past 1000 bytes goes to {log}" in shown
    assert log.stat().st_size >= 3 * 2_000_000 - 2 * 1000


def test_a_cli_run_sends_reward_output_past_the_budget_to_its_run_log(tmp_path):
    from experiments import flags, runner

    _, config = flags.parse("gsm8k", ["--out", str(tmp_path), "--reward-workers", "1", "--run.reward_timeout_s", "3"])
    scorer = runner._reward_pool(config, str(tmp_path))
    assert scorer.config.output_log == str(tmp_path / "run.log") and scorer.config.output_budget_bytes
    assert (scorer.config.max_workers, scorer.config.timeout_s) == (1, 3.0)


@pytest.mark.slow
def test_the_cli_run_with_a_hanging_and_a_loud_reward_finishes_and_says_so_once(tmp_path, data_dir):
    import subprocess
    import sys

    from tiny_checkpoint import save_tiny_checkpoint

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    (tmp_path / "plugin.py").write_text(
        "import time\n"
        "def hang(completions, **_):\n    while True:\n        time.sleep(1)\n"
        "def loud(completions, **_):\n    print('x' * 4_000_000, flush=True)\n    return [0.0 for _ in completions]\n")
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp_path), env.get("PYTHONPATH")) if p)
    gsm8k = os.path.join(data_dir, "gsm8k")
    out = tmp_path / "run"
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "experiments.gsm8k", "--model", save_tiny_checkpoint(tmp_path / "ckpt"),
         "--data", os.path.join(gsm8k, "train.jsonl"), "--eval-data", os.path.join(gsm8k, "test.jsonl"),
         "--reward", "plugin:hang", "--reward", "plugin:loud", "--run.reward_timeout_s", "0.5", "--n", "4", "--m", "2",
         "--prompts-per-step", "4", "--max-completion-length", "6", "--lora-rank", "2", "--max-steps", "1",
         "--eval-limit", "8", "--eval-every", "1000", "--no-progress", "--reward-workers", "2", "--no-compile-cache",
         "--out", str(out)],
        cwd=os.path.dirname(here), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = done.stdout + done.stderr
    assert printed.count("reward 'plugin:hang' timed out on 4 items in a row") == 1, printed[-3000:]
    assert len(printed) < 200_000  # not the 4 MB a call of loud prints
    assert (out / "run.log").stat().st_size > 4_000_000
    assert time.monotonic() - start < 300


def test_a_batch_gives_up_on_timeouts_in_a_row_not_on_timeouts_in_all():
    from podsjax.rewards import pool_batch, worker_process

    def run(statuses):
        batch = pool_batch.Batch(["r"], len(statuses), give_up_after=4)
        for item, status in enumerate(statuses):
            batch.record(item, [(1.0 if status == worker_process.OK else 0.0, status, "")])
        return batch.given_up

    timeout, ok = worker_process.TIMEOUT, worker_process.OK
    assert run([timeout, ok] * 6) == []  # 6 hangs, never 2 in a row
    assert run([ok, timeout, timeout, timeout, timeout, ok]) == [0]
