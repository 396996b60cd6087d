"""Orbax's noise and failures, and damaged run logs.

A full disk and checkpoints that all fail to load end in at most 3 lines on stderr: orbax's
own reports (absl records, tracebacks from its threads and tensorstore's callbacks, warnings
about its coroutines) go to ``<out>/run.log``, and the console gets one note saying so. A run
log damaged before the restored checkpoint stops the resume with one line instead of losing
the steps it logged.
"""

import _thread
import asyncio
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import warnings

import jax
import pytest
from test_faults_cli import checkpointed_run

from experiments import cli
from podsjax.devices import accelerators
from podsjax.run import run_files
from child_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(args, code="from experiments.cli import main; sys.exit(main('gsm8k'))"):
    """The CLI as a program (``main`` reading sys.argv), after ``code``'s own setup."""
    env = child_env()
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    script = f"import sys\nif __name__ == '__main__':\n{textwrap.indent(code, '    ')}\n"
    return subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def _assert_few_lines(done, error_start):
    """At most 3 lines on stderr, the last our error; orbax's reports went to run.log."""
    lines = done.stderr.splitlines()
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    assert len(lines) <= 3 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines[-1].startswith(error_start), lines
    return lines


# What a full disk does to orbax's own writes (its metadata files, in its background threads),
# where a test may not mount a small tmpfs: the step-2 save fails with ENOSPC.
_FULL_AT_STEP_2 = textwrap.dedent("""
    import builtins, errno, io, os
    real_open = io.open

    def full_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+") and f"{os.sep}checkpoints{os.sep}2" in str(file):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
        return real_open(file, mode, *args, **kwargs)

    builtins.open = io.open = full_open
    from experiments.cli import main
    sys.exit(main("gsm8k"))
""")


@pytest.mark.slow
def test_a_full_disk_under_orbax_s_threads_is_one_line_and_its_reports_go_to_run_log(tmp_path_factory, tmp_path,
                                                                                      data_dir):
    _, args = checkpointed_run(tmp_path_factory, data_dir)
    out = tmp_path / "run"
    done = _run([*args, "--max-steps", "2", "--out", str(out)], _FULL_AT_STEP_2)
    lines = _assert_few_lines(done, "error: no space left on device writing")
    assert "--resume" in lines[-1]
    log = (out / "run.log").read_text()
    assert "No space left on device" in log and " absl " in log, log[-3000:]  # orbax's records, kept
    assert len(lines) == 2 and lines[0].startswith("note: ") and lines[0].endswith(
        f"messages from orbax's background threads are in {out / 'run.log'}"), lines
    assert "1" in os.listdir(out / "checkpoints")  # the last complete checkpoint stays


@pytest.mark.slow
def test_every_checkpoint_damaged_is_one_line(tmp_path_factory, tmp_path, data_dir):
    reference, _ = checkpointed_run(tmp_path_factory, data_dir)
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    steps = sorted(n for n in os.listdir(out / "checkpoints") if n.isdigit())
    assert len(steps) == 3
    for step in steps:  # every array's data file gone: tensorstore cannot read them
        data = out / "checkpoints" / step / "state" / "d"
        for name in os.listdir(data):
            os.remove(data / name)
    done = _run(["--out", str(out), "--resume", "--max-steps", "6", "--no-progress", "--no-compile-cache"])
    lines = _assert_few_lines(done, f"error: no checkpoint in {out / 'checkpoints'} loads")
    if len(lines) > 1:  # orbax's reports from tensorstore's callbacks, kept in run.log
        log = (out / "run.log").read_text()
        # each as a log record (asyncio's "Future exception was never retrieved" carries a
        # traceback only when the exception has one), or a traceback printed from a thread
        assert str(out / "run.log") in lines[-2], lines
        assert re.search(r"^\d{4}-\d\d-\d\d \S+ (ERROR|WARNING|CRITICAL) ", log, re.M) or "Traceback" in log, log[-3000:]
    # Nothing loads, and nothing proves the files damaged (a process out of memory fails so too): all stay.
    assert sorted(n for n in os.listdir(out / "checkpoints") if not n.startswith(".")) == steps
    # The warnings (stdout) name each step and what failed, without tensorstore's kilobyte of spec.
    moved = [line for line in done.stdout.splitlines() if line.startswith("warning: checkpoint")]
    assert len(moved) == 3 and not any("tensorstore_spec" in line for line in moved), moved


@pytest.mark.slow
def test_a_metrics_log_cut_before_the_last_checkpoint_stops_the_resume(tmp_path_factory, tmp_path, data_dir, capsys):
    """Cut in the middle of step 3's record while the newest checkpoint is step 4's: resuming
    would lose steps 3 and 4 from the log, so it is refused, naming the file and the line."""
    reference, _ = checkpointed_run(tmp_path_factory, data_dir)
    capsys.readouterr()  # making the tiny model draws a progress bar
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    shutil.rmtree(out / "final_model")  # a run not finished: its exports not written
    (out / "exported.json").unlink()
    metrics = out / "metrics.jsonl"
    text = metrics.read_text()
    lines = text.splitlines(keepends=True)
    assert [line.split(",")[0] for line in lines] == ['{"step": 0', *(f'{{"step": {s}' for s in range(1, 5))]
    cut = text[: len("".join(lines[:3])) + len(lines[3]) // 2]  # line 4 is step 3's
    metrics.write_text(cut)
    files = sorted(os.listdir(out))
    assert cli.main("gsm8k", ["--out", str(out), "--resume", "--no-progress", "--no-compile-cache"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"run log {metrics} is damaged before the checkpoint of step 4: line 4 is cut short" in err, err
    assert "move the file aside" in err
    assert metrics.read_text() == cut and sorted(os.listdir(out)) == files  # no log touched, nothing added
    assert sorted(os.listdir(out / "checkpoints")) == ["2", "3", "4"]


@pytest.mark.parametrize("name", ["metrics.jsonl", "samples.jsonl", "eval_history.jsonl"])
def test_each_log_is_checked_up_to_the_checkpoint_and_only_there(tmp_path, name):
    def damage(content, size):
        (tmp_path / name).write_bytes(content)
        return run_files.damaged_log(str(tmp_path), {name: size}, 7)

    whole = b'{"step": 1}\n{"step": 2}\n'
    assert damage(whole, len(whole)) is None
    assert damage(whole + b'{"step": 3}\n{"ste', len(whole)) is None  # after the checkpoint: rewound, kept aside
    assert damage(whole, 0) is None  # a log born after the checkpoint
    problems = {
        "cut short": damage(whole[:-4], len(whole)),
        "cut back": damage(whole[:12], len(whole)),
        "garbage": damage(b'{"step": 1}\n' + b"\x00" * 11 + b"\n", len(whole)),
        "not a record": damage(b'{"step": 1}\n[' + b" " * 9 + b"]\n", len(whole)),  # a JSON list
    }
    assert "line 2 is cut short" in problems["cut short"]
    assert f"it ends after line 1 (12 of the {len(whole)} bytes it had then)" in problems["cut back"]
    assert "line 2 is not a JSON record" in problems["garbage"] and "line 2 is not" in problems["not a record"]
    for line in problems.values():
        assert line.startswith(f"run log {tmp_path / name} is damaged before the checkpoint of step 7: ")
        assert "\n" not in line and "move the file aside" in line
    os.remove(tmp_path / name)
    assert run_files.damaged_log(str(tmp_path), {name: len(whole)}, 7) is None  # moved aside: starts over


class _FailsWhenCollected:
    def __del__(self):
        raise RuntimeError(f"Event loop is closed ({self.whose})")


def _collect(whose):
    garbage = _FailsWhenCollected()
    garbage.whose = whose
    del garbage  # the error goes to sys.unraisablehook, in this thread


def test_orbax_s_reports_go_to_the_run_log_and_everything_else_where_it_went(tmp_path, capsys, caplog, monkeypatch):
    # The hooks in place before (pytest's own, here) get everything that is not orbax's.
    before = {"unraisable": [], "thread": [], "warning": []}
    monkeypatch.setattr(sys, "unraisablehook", lambda u: before["unraisable"].append(str(u.exc_value)))
    monkeypatch.setattr(threading, "excepthook", lambda a: before["thread"].append(str(a.exc_value)))
    monkeypatch.setattr(warnings, "showwarning", lambda message, *args: before["warning"].append(str(message)))
    previous = (sys.unraisablehook, sys.excepthook, threading.excepthook, warnings.showwarning)
    output = cli.LibraryOutput()
    output.out = str(tmp_path)
    output.install()
    try:
        logging.getLogger("absl").error("orbax: a save failed")
        logging.getLogger("asyncio").error("Task exception was never retrieved")
        logging.getLogger("someones.reward").warning("the user's own record")

        def in_a_library_thread():  # an orbax thread calling into a closed event loop
            closed = asyncio.new_event_loop()
            closed.close()
            closed.call_soon_threadsafe(print)

        def in_the_user_s_thread():
            raise ValueError("the user's own bug")

        for target in (in_a_library_thread, in_the_user_s_thread):
            thread = threading.Thread(target=target)
            thread.start()
            thread.join()
        # A thread Python did not start (as tensorstore's are) reports an error nobody can catch.
        done = threading.Event()
        _thread.start_new_thread(lambda: (_collect("tensorstore's callback"), done.set()), ())
        assert done.wait(10)
        _collect("the user's own object")
        warnings.warn_explicit("coroutine 'write' was never awaited", RuntimeWarning, "sys", 1)
        warnings.warn_explicit("the user's own warning", UserWarning, "rewards.py", 3)
        output.print_note()
    finally:
        output.uninstall()
    assert (sys.unraisablehook, sys.excepthook, threading.excepthook, warnings.showwarning) == previous
    log = (tmp_path / "run.log").read_text()
    for kept in ("orbax: a save failed", "Task exception was never retrieved", "RuntimeError: Event loop is closed",
                 "Event loop is closed (tensorstore's callback)", "was never awaited"):
        assert kept in log
    assert "the user's own" not in log and output.kept == 5
    assert before == {"unraisable": ["Event loop is closed (the user's own object)"],
                      "thread": ["the user's own bug"], "warning": ["the user's own warning"]}
    assert [r.getMessage() for r in caplog.records] == ["the user's own record"]  # the root's handlers got it
    assert capsys.readouterr().err == f"note: 5 messages from orbax's background threads are in {tmp_path}/run.log\n"


def test_an_explicit_jax_platforms_is_obeyed(monkeypatch):
    """On a host with no accelerator the CLI starts JAX on the CPU alone, unless JAX_PLATFORMS says otherwise."""
    monkeypatch.setattr(cli, "_jax_started", lambda: False)
    monkeypatch.setattr(cli, "has_accelerator", lambda: False)
    monkeypatch.setenv("XLA_FLAGS", "")
    updates = []
    monkeypatch.setattr(jax.config, "update", lambda *args: updates.append(args))
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    cli.prepare_devices(None)
    assert os.environ["JAX_PLATFORMS"] == "cuda" and updates == []
    monkeypatch.delenv("JAX_PLATFORMS")
    cli.prepare_devices(None)
    assert os.environ["JAX_PLATFORMS"] == "cpu" and updates == [("jax_platforms", "cpu")]


@pytest.mark.parametrize("nvidia, topology", [(True, None), (False, None), (False, "h100"), (True, "v5e:2x4")])
def test_runs_for_nvidia_gpus_compile_their_gemms_as_cublas_calls(monkeypatch, nvidia, topology):
    # On a host with an NVIDIA GPU, or compiling for one; not for a TPU, where the flag means nothing.
    monkeypatch.setattr(cli, "_jax_started", lambda: False)
    monkeypatch.setattr(cli, "has_accelerator", lambda: True)
    monkeypatch.setattr(accelerators, "has_nvidia_gpu", lambda: nvidia)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/x")
    cli.prepare_devices(None, topology=topology)
    added = "--xla_gpu_enable_triton_gemm=false" in os.environ["XLA_FLAGS"]
    assert added == (nvidia and topology is None or topology == "h100"), os.environ["XLA_FLAGS"]
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/x --xla_gpu_enable_triton_gemm=true")
    cli.prepare_devices(None, topology=topology)
    flags = os.environ["XLA_FLAGS"]
    assert flags.startswith("--xla_dump_to=/x --xla_gpu_enable_triton_gemm=true"), flags
    # The user's own choice stands on a GPU; compiling for one without it (h100), nothing can tune.
    assert flags.endswith("--xla_gpu_enable_triton_gemm=false") == (topology == "h100"), flags
