"""MetricsWriter (JSONL, TensorBoard events, samples), Progress and timers."""

import functools
import glob
import io
import json
import math
import struct
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from child_env import child_env
from podsjax.run.metrics import (MetricsWriter, PhaseTimer, Progress, flatten_metrics, read_jsonl, to_jsonable, tokens_per_second)


def read_events(path):
    """Decodes an event file with tensorboardX's protobuf classes and CRC, independently of ours."""
    tbx = pytest.importorskip("tensorboardX")
    from tensorboardX.proto import event_pb2
    from tensorboardX.record_writer import masked_crc32c

    events = []
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos < len(data):
        header = data[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[pos + 8:pos + 12])[0] == masked_crc32c(header)
        body = data[pos + 12:pos + 12 + length]
        assert struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])[0] == masked_crc32c(body)
        events.append(event_pb2.Event.FromString(body))
        pos += 16 + length
    assert tbx is not None
    return events


def scalars_of(events):
    return [(e.step, v.tag, v.simple_value) for e in events if e.HasField("summary") for v in e.summary.value]


def test_jsonl_lines_convert_jax_numpy_and_nonfinite(tmp_path):
    clock = iter([1000.0, 1001.5]).__next__
    with MetricsWriter(tmp_path, backends=("jsonl",), clock=clock) as w:
        w.write(1, {"loss": jnp.float32(0.25), "reward": {"mean": np.float64(0.5), "std": 0.125},
                    "skipped": jnp.int32(0), "truncated": np.bool_(True)})
        w.write(2, {"loss": float("nan"), "grad_norm": jnp.array(float("inf")), "lr": 5e-6})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    assert json.loads(lines[0]) == {"step": 1, "wall_time": 1000.0, "loss": 0.25, "reward/mean": 0.5,
                                    "reward/std": 0.125, "skipped": 0, "truncated": 1}
    assert isinstance(json.loads(lines[0])["skipped"], int)
    assert "NaN" not in lines[1] and "Infinity" not in lines[1]  # strict JSON
    assert json.loads(lines[1]) == {"step": 2, "wall_time": 1001.5, "loss": None, "grad_norm": None, "lr": 5e-6}


def test_bad_scalars_raise_one_line(tmp_path):
    with MetricsWriter(tmp_path, backends=("jsonl",)) as w:
        with pytest.raises(ValueError, match=r"metric 'x' must be a real scalar") as e:
            w.write(1, {"x": jnp.ones(3)})
        assert "\n" not in str(e.value)
        with pytest.raises(ValueError, match="metric 'name' must be a real scalar"):
            w.write(1, {"name": "abc"})
        with pytest.raises(ValueError, match="'step' is reserved"):
            w.write(1, {"step": 3})
    assert not (tmp_path / "metrics.jsonl").exists() or (tmp_path / "metrics.jsonl").read_text() == ""


def test_tensorboard_event_file_holds_the_scalars(tmp_path):
    with MetricsWriter(tmp_path) as w:
        w.write(3, {"reward": {"mean": jnp.float32(0.75)}, "lr": 2e-5})
        w.write(4, {"reward": {"mean": 0.5}, "loss": float("nan"), "huge": 1e300})
    files = glob.glob(str(tmp_path / "events.out.tfevents.*"))
    assert len(files) == 1
    events = read_events(files[0])
    assert events[0].file_version == "brain.Event:2"
    got = scalars_of(events)
    assert [(s, t) for s, t, _ in got] == [(3, "reward/mean"), (3, "lr"), (4, "reward/mean"), (4, "loss"), (4, "huge")]
    assert got[0][2] == 0.75 and got[1][2] == np.float32(2e-5) and got[2][2] == 0.5
    assert math.isnan(got[3][2]) and got[4][2] == math.inf
    assert events[1].wall_time > 1e9


def test_a_resumed_writer_appends_and_purges_tensorboard_from_the_resume(tmp_path):
    with MetricsWriter(tmp_path) as w:
        for step in (1, 2, 3):
            w.write(step, {"r": step / 10})
    # Killed mid-line: a torn record at the end. (The loop cuts the logs back to the
    # checkpoint before a resumed writer opens them; the writer itself only appends.)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "r": 0.')
    with MetricsWriter(tmp_path, resume_step=2) as w:
        w.write(3, {"r": 0.33})
    raw = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert raw[3] == '{"step": 4, "r": 0.' and len(raw) == 5  # the torn line stays one line of its own
    assert [(r["step"], r["r"]) for r in read_jsonl(tmp_path / "metrics.jsonl")] == [(1, 0.1), (2, 0.2), (3, 0.3),
                                                                                      (3, 0.33)]
    with open(tmp_path / "metrics.jsonl", "ab") as f:  # a damaged block: bytes that are no UTF-8
        f.write(b'\xff\xfe\n{"step": 5, "r": 0.5}\n')
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 3, 5]  # it had raised
    # TensorBoard: two event files; the second purges steps >= 3 of the first.
    files = sorted(glob.glob(str(tmp_path / "events.out.tfevents.*")))  # name order is creation order
    assert len(files) == 2
    second = read_events(files[1])
    assert second[1].step == 3 and second[1].session_log.status == second[1].session_log.START
    assert [(s, t) for s, t, _ in scalars_of(second)] == [(3, "r")]


def test_samples_jsonl(tmp_path):
    records = [
        {"prompt": "1+1?", "completion": "<answer>2</answer>", "rewards": {"accuracy": np.float32(1.0), "format": 0.5},
         "selected": np.bool_(True), "logprobs": jnp.array([-0.5, -1.0])},
        {"prompt": "1+1?", "completion": "3", "rewards": {"accuracy": 0.0, "format": float("nan")},
         "selected": False, "logprobs": np.array([-2.0, -0.25])},
    ]
    with MetricsWriter(tmp_path, backends=("jsonl",)) as w:
        w.write_samples(5, records)
        w.write_samples(5, records[:1])  # same step again (e.g. after a resume): kept, not overwritten
        with pytest.raises(ValueError, match="sample 0 has a 'step' field"):
            w.write_samples(6, [{"step": 1}])
    rows = read_jsonl(tmp_path / "samples.jsonl")
    assert len(rows) == 3
    assert rows[0] == {"step": 5, "prompt": "1+1?", "completion": "<answer>2</answer>",
                       "rewards": {"accuracy": 1.0, "format": 0.5}, "selected": True, "logprobs": [-0.5, -1.0]}
    assert rows[1]["rewards"] == {"accuracy": 0.0, "format": None} and rows[1]["selected"] is False


def test_disabled_writer_writes_nothing(tmp_path):
    with MetricsWriter(tmp_path / "off", enabled=False) as w:
        record = w.write(1, {"x": 1.5})
        w.write_samples(1, [{"a": 1}])
    assert record["x"] == 1.5
    assert not (tmp_path / "off").exists()


def test_progress_bar_shows_postfix_and_is_off_without_tty():
    stream = io.StringIO()
    with Progress(100, unit="step", enabled=True, file=stream, mininterval=0) as bar:
        bar.update(10, step=10, reward=jnp.float32(0.123456), acc=0.5)
        bar.update(20, step=20, reward=0.25, acc="n/a")
    out = stream.getvalue()
    assert "step=20" in out and "reward=0.25" in out and "acc=n/a" in out and "reward=0.1235" in out
    assert "20/100step" in out
    quiet = io.StringIO()  # not a TTY: auto mode draws nothing
    with Progress(3600.0, unit="s", file=quiet) as bar:
        assert not bar.enabled
        bar.update(60.0, step=1)
    assert quiet.getvalue() == ""
    with pytest.raises(ValueError, match="total must be > 0"):
        Progress(0)


def test_timers_and_throughput():
    ticks = iter([0.0, 1.5, 10.0, 10.25, 20.0, 21.0, 30.0, 31.0]).__next__
    timer = PhaseTimer(clock=ticks)
    with timer.phase("generation"):
        pass
    with timer.phase("update"):
        pass
    with pytest.raises(RuntimeError):
        with timer.phase("generation"):
            raise RuntimeError("boom")  # still timed
    assert timer.totals() == {"generation": 2.5, "update": 0.25}
    assert tokens_per_second(jnp.int32(300), 1.5) == 200.0
    assert math.isnan(tokens_per_second(10, 0.0))


def test_helpers():
    assert flatten_metrics({"a": {"b": 1, "c": {"d": 2}}, "e": 3}) == {"a/b": 1, "a/c/d": 2, "e": 3}
    with pytest.raises(ValueError, match="non-empty strings"):
        flatten_metrics({"": 1})
    assert to_jsonable({"x": (np.int64(2), np.float32(float("inf")))}) == {"x": [2, None]}
    with pytest.raises(ValueError, match="cannot store a object"):
        to_jsonable({"x": object()})


def test_a_phase_s_compiles_are_counted_as_compiles_not_as_the_phase():
    import time

    import jax

    from podsjax.devices.compilation import CompileLog

    log = CompileLog()
    timer = PhaseTimer(compile_seconds=log.thread_seconds)
    with timer.phase("selection"):
        with log.label("select"):  # a function of its own: it compiles here
            jax.jit(lambda x: jnp.cumsum(x * 3.0 + 1.0) ** 2)(jnp.ones(13)).block_until_ready()
    compiled = sum(log.seconds.values())
    assert compiled > 0 and timer.compile_s == pytest.approx(compiled)
    wait = 0.5
    with timer.phase("update"):
        with timer.compiling():  # waiting for a compile on another thread
            time.sleep(wait)
    assert timer.compile_s >= compiled + wait
    assert timer.totals()["update"] < wait / 2 and timer.totals()["selection"] >= 0


def test_the_compile_log_counts_again_after_another_library_clears_jax_s_listeners():
    import jax

    from podsjax.devices.compilation import CompileLog

    log, x = CompileLog(), jnp.ones(11)
    with log.label("first"):
        jax.jit(lambda x: jnp.sin(x) * 5.0 - 2.0)(x).block_until_ready()
    jax.monitoring.clear_event_listeners()  # as tunix's metrics logger does when it closes
    with log.label("second"):
        jax.jit(lambda x: jnp.cos(x) * 7.0 + 3.0)(x).block_until_ready()
    assert log.counts == {"first[<lambda>]": 1, "second[<lambda>]": 1}, log.counts


def test_a_long_compile_is_said_while_it_runs_and_a_short_one_is_not(tmp_path, monkeypatch):
    # A cold start's compiles of minutes had shown nothing until each ended.
    import time

    import jax

    from podsjax.devices import compilation

    lines = []
    log = compilation.CompileLog(lines.append, min_report_s=0.0)
    slow_body = jax.jit(lambda x: functools.reduce(lambda y, i: jnp.sin(y) * (i + 1.5), range(300), x))
    compilation.disable_compile_cache()
    compilation.enable_compile_cache(tmp_path / "cache", min_compile_time_s=0)
    try:
        monkeypatch.setattr(compilation, "STILL_COMPILING_S", 0.01)
        with log.label("slow", "300 ops"):
            slow_body(jnp.ones(7)).block_until_ready()
        monkeypatch.setattr(compilation, "STILL_COMPILING_S", 1.0)
        with log.label("quick"):
            jax.jit(lambda x: x * 2.0 + 1.0)(jnp.ones(9)).block_until_ready()
        time.sleep(1.5)  # the quick compile's timer, had it not been stopped, would have fired by now
    finally:
        compilation.disable_compile_cache()
    assert "compiling slow (300 ops): 0 s so far" in lines, lines
    assert not any(line.startswith("compiling quick") for line in lines), lines
    assert lines.index("compiling slow (300 ops): 0 s so far") < next(
        i for i, line in enumerate(lines) if line.startswith("compiled slow"))


def test_compiles_ending_on_several_threads_at_once_are_each_counted():
    import sys
    import threading

    import jax

    from podsjax.devices.compilation import BACKEND_COMPILE_EVENT, CompileLog

    log, ends = CompileLog(), 5000

    def compiles():  # what JAX reports as each compile ends, on the compiling thread
        with log.label("update"):
            for _ in range(ends):
                jax.monitoring.record_event_duration_secs(BACKEND_COMPILE_EVENT, 0.001, fun_name="jit(update)")

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between any two bytecodes, as they may on a busy host
    try:
        threads = [threading.Thread(target=compiles) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert log.counts == {"update": 4 * ends} and len(log.events) == 4 * ends


def test_the_step_line_reports_compiles_apart_from_the_phases():
    from podsjax.rl import reporting

    scalars = {"time/generation": 0.8, "time/scoring": 0.1, "time/selection": 0.01, "time/update": 0.32,
               "time/compile": 12.25}
    assert reporting.phases_text(scalars) == ("step 13.48 s (generation 0.80, scoring 0.10, selection 0.01, "
                                              "update 0.32; compiles 12.25)")
    assert reporting.phases_text({**scalars, "time/compile": 0.0}).endswith("update 0.32)")


@pytest.mark.parametrize("step,scalars,message", [
    (1, {"a/b": 1, "a": {"b": 2}}, "metric 'a/b' is given twice"),  # one of the two had been kept
    (7.9, {"x": 1}, "step must be an integer; got 7.9"),  # logged as step 7
    ("8", {"x": 1}, "step must be an integer"),
    (5, {"x": 10**400}, "metric 'x' is an integer past 64 bits"),  # JSONL written, then TensorBoard failed
])
def test_a_record_that_would_be_logged_wrong_is_refused_before_it_is_written(tmp_path, step, scalars, message):
    with MetricsWriter(tmp_path, backends=("jsonl", "tensorboard")) as w:
        with pytest.raises(ValueError, match=message):
            w.write(step, scalars)
        w.write(np.int64(2), {"x": 1})  # NumPy and JAX integers are steps
        w.write(jnp.int32(3), {"x": 1})
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [2, 3]


def test_backends_are_names_and_the_logs_stay_inside_the_run_folder(tmp_path):
    with pytest.raises(ValueError, match="log backends are names"):  # an AttributeError from inside had said so
        MetricsWriter(tmp_path, backends=["jsonl", 3])
    for name in (str(tmp_path.parent / "elsewhere.jsonl"), "../up.jsonl"):
        with pytest.raises(ValueError, match="jsonl_name must be a file name inside out_dir"):
            MetricsWriter(tmp_path, backends=("jsonl",), jsonl_name=name)


def test_a_sample_that_is_no_dict_is_one_line(tmp_path):
    with MetricsWriter(tmp_path, backends=("jsonl",)) as w:
        with pytest.raises(ValueError, match="sample 0 must be a dict of fields; got str"):
            w.write_samples(1, ["abc"])


_FULL_DISK = """
import os, resource, signal, sys
from podsjax.run.metrics import MetricsWriter
out = sys.argv[1]
with open(os.path.join(out, "metrics.jsonl"), "w") as f:
    f.write('{"step": 0, "r": 0.')  # a torn line from a killed run
w = MetricsWriter(out, backends=("jsonl",))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (60, resource.RLIM_INFINITY))
failed = []
for step in range(1, 6):
    try:
        w.write(step, {"long_name_to_fill_the_file": float(step)})
    except OSError:
        failed.append(step)
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
for step in failed:  # the disk has room again: the caller retries
    w.write(step, {"long_name_to_fill_the_file": float(step)})
w.close()
print("failed", failed)
"""


def test_a_step_retried_after_a_full_disk_is_written_once_and_whole(tmp_path):
    # Python's buffer had kept the failed record and written it again before the retry's: two
    # records of one step, and the torn line of a killed run had swallowed the next record.
    script = tmp_path / "full_disk.py"
    script.write_text(_FULL_DISK)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], env=child_env(JAX_PLATFORMS="cpu"),
                          capture_output=True, text=True, timeout=120)
    assert "failed [" in proc.stdout and "failed []" not in proc.stdout, proc.stdout + proc.stderr[-2000:]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert lines[0] == '{"step": 0, "r": 0.' and all(json.loads(line) for line in lines[1:])
    assert sorted(r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")) == [1, 2, 3, 4, 5]
