"""One writer per run directory: run.lock names its holder; a live holder refuses a second
writer, a dead one is taken over, and every way out of a run releases it."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from experiments import cli, config_decoding, flags, runner
from podsjax.run import run_state
from podsjax.run.run_state import LOCK_FILE, RunLock, RunLocked

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOST = socket.gethostname()


def hold_in_child(directory, then="sleep"):
    """A second process that takes the lock of ``directory``, then sleeps (a live holder) or
    dies with os._exit (a holder killed before it could release)."""
    code = ("import os, sys, time\n"
            "from podsjax.run.run_state import RunLock\n"
            f"lock = RunLock.acquire({str(directory)!r})\n"
            "print('locked', flush=True)\n"
            + ("time.sleep(120)\n" if then == "sleep" else "os._exit(0)\n"))
    child = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "locked"
    return child


def holder(directory):
    with open(os.path.join(directory, LOCK_FILE)) as f:
        return json.load(f)


def test_a_live_holder_refuses_a_second_writer_with_one_line_naming_it(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    child = hold_in_child(out)
    try:
        with pytest.raises(RunLocked, match=f"in use by pid {child.pid} on host {HOST}"):
            RunLock.acquire(out)

        # The CLI: --overwrite must not wipe a live run; the refusal comes before anything is written.
        def never(*args, **kwargs):
            raise AssertionError("the run went on without the lock")

        monkeypatch.setattr(runner, "_train_and_export", never)
        assert cli.main("gsm8k", ["--overwrite", "--max-steps", "1", "--no-compile-cache", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"pid {child.pid} on host {HOST}" in err and LOCK_FILE in err, err
        assert os.listdir(out) == [LOCK_FILE] and holder(out)["pid"] == child.pid
        # Without a flag: the live run is named, not "pass --resume or --overwrite" (both refused).
        (out / "metrics.jsonl").write_text('{"step": 1}\n')
        assert cli.main("gsm8k", ["--max-steps", "1", "--no-compile-cache", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"in use by pid {child.pid} on host {HOST}" in err, err
        assert holder(out)["pid"] == child.pid
        # --resume of a complete run its holder is training further: named, not "complete, nothing changed".
        _, config = flags.parse("gsm8k", ["--out", str(out), "--max-steps", "1"])
        (out / "config.json").write_text(json.dumps(config_decoding.as_json(config)))
        (out / "exported.json").write_text(json.dumps({"exports": []}))
        assert cli.main("gsm8k", ["--out", str(out), "--resume"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"in use by pid {child.pid} on host {HOST}" in err, err
    finally:
        child.kill()
        child.wait()


def test_the_start_s_look_at_a_lock_only_reads_it(tmp_path, capsys):
    # A dead holder's lock in a directory the start refuses stays as it was (the look had taken
    # it over, with a second line); so does a file of that name in a folder that is no run.
    out = tmp_path / "run"
    dead = hold_in_child(out, then="exit")
    dead.wait()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    before = (out / LOCK_FILE).read_text()
    assert cli.main("gsm8k", ["--max-steps", "1", "--no-compile-cache", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not empty" in err, err
    assert (out / LOCK_FILE).read_text() == before
    assert RunLock(out).in_use() is None


def test_a_stale_lock_on_this_host_is_taken_over_with_a_warning(tmp_path):
    out = tmp_path / "run"
    dead = hold_in_child(out, then="exit")
    dead.wait()
    warnings = []
    lock = RunLock.acquire(out, warn=warnings.append)
    assert holder(out)["pid"] == os.getpid()
    assert warnings == [f"warning: took over the lock of pid {dead.pid} on host {HOST}, which is no longer "
                        f"running ({out / LOCK_FILE})"]
    lock.release()
    assert not os.path.exists(out / LOCK_FILE)

    # A pid that now belongs to a later process (here: this one) is no holder either.
    lock = RunLock.acquire(out)
    recycled = {**holder(out), "pid": os.getppid(), "token": "earlier"}
    lock.release()
    (out / LOCK_FILE).write_text(json.dumps({**recycled, "started": "1"}))
    warnings = []
    RunLock.acquire(out, warn=warnings.append).release()
    assert len(warnings) == 1 and "no longer running" in warnings[0]


def test_a_lock_that_cannot_be_removed_warns_instead_of_replacing_the_run_s_error(tmp_path, monkeypatch):
    # In an unwritable run directory the unlink's PermissionError had replaced the write error
    # the run was ending on, so the line named run.lock instead of the file that failed.
    out = tmp_path / "run"
    warnings = []
    lock = RunLock.acquire(out, warn=warnings.append)

    def refuse(path):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(os, "unlink", refuse)
    with pytest.raises(OSError, match="eval_history.jsonl"):
        try:
            raise OSError("cannot write eval_history.jsonl")
        finally:
            lock.release()
    assert warnings == [f"warning: could not remove the run lock {out / LOCK_FILE} (Permission denied); the next "
                        "run takes it over once this process has ended"]


def test_a_lock_from_another_host_is_respected_until_it_goes_stale(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    path = out / LOCK_FILE
    path.write_text(json.dumps({"pid": 4242, "host": "node-7", "boot": "x", "pid_ns": "y", "token": "theirs"}))
    with pytest.raises(RunLocked) as refused:
        RunLock.acquire(out)
    line = str(refused.value)
    assert "in use by pid 4242 on host node-7" in line and "delete the lock file" in line and str(path) in line
    assert "\n" not in line
    # Untouched for longer than its holder's heartbeat would allow: the holder is gone.
    old = time.time() - run_state.OTHER_HOST_STALE_S - 60
    os.utime(path, (old, old))
    warnings = []
    lock = RunLock.acquire(out, warn=warnings.append)
    assert len(warnings) == 1 and "pid 4242 on host node-7, not refreshed for 16 min" in warnings[0]
    lock.release()


def test_the_holder_refreshes_its_lock(tmp_path):
    lock = RunLock.acquire(tmp_path, heartbeat_s=0.05)
    old = time.time() - 3600
    os.utime(lock.path, (old, old))
    deadline = time.monotonic() + 10
    while os.stat(lock.path).st_mtime < time.time() - 60:
        assert time.monotonic() < deadline, "the heartbeat never touched the lock"
        time.sleep(0.05)
    lock.release()


@pytest.mark.parametrize("ending,code", [("normal", 0), ("user error", 2), ("bug", 1), ("interrupt", 130)])
def test_the_cli_holds_the_lock_while_it_runs_and_releases_it_however_it_ends(tmp_path, capsys, monkeypatch,
                                                                              ending, code):
    out = tmp_path / "run"
    seen = []

    def stand_in(config, out_dir, *args):
        seen.append(holder(out_dir))
        if ending == "user error":
            raise cli.UsageError("a user's mistake")
        if ending == "bug":
            raise RuntimeError("a bug")
        if ending == "interrupt":
            raise KeyboardInterrupt("SIGTERM")
        return 0

    monkeypatch.setattr(runner, "_train_and_export", stand_in)
    assert cli.main("gsm8k", ["--max-steps", "1", "--no-compile-cache", "--out", str(out)]) == code
    capsys.readouterr()
    assert seen and seen[0]["pid"] == os.getpid() and seen[0]["host"] == HOST
    if code in (0, 130):  # done, or interrupted: its line says to --resume
        assert sorted(os.listdir(out)) == ["config.json"]  # the lock is gone; the run's config stays
    else:
        assert not out.exists()  # the lock is gone, and a run that failed before its first step left nothing
