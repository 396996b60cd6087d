"""Log backends: TensorBoard histograms and sample text, W&B offline, and the backend list."""

import glob
import json
import re
import os
import subprocess
import sys
import time
import struct

import numpy as np
import pytest
from test_metrics import read_events

from podsjax.run.log_backends import parse_backends, samples_markdown
from podsjax.run.metrics import MetricsWriter

SAMPLES = [{"prompt": "1+1?", "completion": "<answer>2</answer>", "accuracy": 1.0},
           {"prompt": "2|3", "completion": "line one\nline two", "accuracy": 0.0}]


def test_backend_lists_are_checked():
    assert parse_backends("jsonl, tensorboard,wandb,jsonl") == ("jsonl", "tensorboard", "wandb")
    with pytest.raises(ValueError, match="unknown log backend 'mlflow'"):
        parse_backends("jsonl,mlflow")
    with pytest.raises(ValueError, match="must include jsonl"):
        parse_backends("tensorboard")


def test_tensorboard_gets_histograms_and_samples_as_a_markdown_table(tmp_path):
    rewards = np.array([0.0, 1.0, 1.0, 2.0, np.nan])
    with MetricsWriter(tmp_path) as w:
        w.write(1, {"loss": 0.5})
        w.histograms(1, {"reward/total": rewards, "train/advantages": np.array([-1.0, 1.0])})
        w.write_samples(1, SAMPLES)
    events = read_events(glob.glob(str(tmp_path / "events.out.tfevents.*"))[0])
    histos = {v.tag: v.histo for e in events if e.HasField("summary") for v in e.summary.value if v.HasField("histo")}
    assert set(histos) == {"reward/total", "train/advantages"}
    h = histos["reward/total"]
    assert (h.num, h.min, h.max, h.sum) == (4, 0.0, 2.0, 4.0)  # the NaN is left out
    assert sum(h.bucket) == 4
    texts = [v.tensor.string_val[0].decode() for e in events if e.HasField("summary") for v in e.summary.value
             if v.tag.startswith("samples")]
    assert texts == [samples_markdown([{"step": 1, **s} for s in SAMPLES], ["prompt", "completion", "accuracy"])]
    assert "2\\|3" in texts[0] and "line one<br>line two" in texts[0]  # a cell stays one cell


def test_a_writer_without_histogram_backends_skips_them(tmp_path):
    with MetricsWriter(tmp_path, backends=("jsonl",)) as w:
        assert not w.wants_histograms
        w.histograms(1, {"x": np.ones(3)})
    assert not glob.glob(str(tmp_path / "events.out.tfevents.*"))


def wandb_history(run_dir):
    """The history records of an offline W&B run, read from its .wandb file (LevelDB-log
    framing of wandb_internal Record protos)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    data = open(path, "rb").read()
    pos, block, pending, history = 7, 32768, b"", []  # 7: the file header
    while pos < len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record.FromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                for item in record.history.item})
    return history


def wait_for_wandb(run_dir, done, seconds=60):
    """The run's history once ``done(history)`` holds (else at the deadline): W&B's service may
    write after ``finish()`` returns, on a busy host."""
    from google.protobuf.message import DecodeError

    deadline = time.monotonic() + seconds
    while True:
        try:
            history = wandb_history(run_dir)
        except (ValueError, struct.error, DecodeError):  # no file yet, or a record half written
            if time.monotonic() >= deadline:
                raise
        else:
            if done(history) or time.monotonic() >= deadline:
                return history
        time.sleep(0.2)


def test_wandb_without_credentials_is_one_line(tmp_path):
    # It had been a traceback from inside wandb.init, which the CLI called a bug. In a process
    # of its own: W&B keeps an earlier init's settings (offline, say) for the rest of a process.
    pytest.importorskip("wandb")
    home = tmp_path / "home"
    env = {**os.environ, "WANDB_MODE": "online", "WANDB_SILENT": "true", "HOME": str(home),
           "WANDB_CONFIG_DIR": str(home), "NETRC": str(home / ".netrc")}  # no key anywhere
    env.pop("WANDB_API_KEY", None)
    code = ("from podsjax.run.log_backends import LoggerError\n"
            "from podsjax.run.metrics import MetricsWriter\n"
            "try:\n"
            f"    MetricsWriter({str(tmp_path / 'run')!r}, backends=('jsonl', 'wandb'))\n"
            "except LoggerError as exc:\n"
            "    print('LoggerError:', exc)\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in done.stdout.splitlines() if line.startswith("LoggerError:")]
    assert len(lines) == 1, (done.stdout, done.stderr[-2000:])
    assert re.match(r"LoggerError: W&B could not start a run \(.+\); log in with `wandb login`", lines[0]), lines


def test_wandb_offline_run_holds_scalars_histograms_and_samples(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run-a"
    with MetricsWriter(out, backends=("jsonl", "wandb"), config={"algorithm": {"n": 16}}) as w:
        w.write(1, {"train": {"loss": 0.25}})
        w.write(2, {"train": {"loss": 0.5}})
        w.histograms(2, {"reward/total": np.array([0.0, 1.0, 1.0])})
        w.write_samples(2, SAMPLES)
    with MetricsWriter(out, backends=("jsonl", "wandb"), resume_step=1) as w:  # a resume: a second W&B run
        w.write(2, {"train": {"loss": 0.75}})
    def resumed(run_dir):  # the resumed run names itself; mtimes are no order (W&B's service writes late)
        return open(glob.glob(os.path.join(run_dir, "run-*.wandb"))[0], "rb").read().count(b"run-a-resumed-at-1") >= 1

    runs = glob.glob(str(out / "wandb" / "offline-run-*"))
    deadline = time.monotonic() + 60  # W&B's service may finish writing after finish() returns, on a busy host
    while not any(resumed(run) for run in runs) and time.monotonic() < deadline:
        time.sleep(0.5)
    first, second = sorted(runs, key=resumed)
    assert not resumed(first) and resumed(second)
    def losses(history):
        return [(h["_step"], h["train/loss"]) for h in history if "train/loss" in h]

    def complete(history):  # every record the first run wrote
        step2 = [h for h in history if h["_step"] == 2]
        return (len(losses(history)) >= 2 and any(h.get("reward/total/_type") == "histogram" for h in step2)
                and any(h.get("samples/_type") == "table-file" for h in step2))

    history = wait_for_wandb(first, complete)
    assert losses(history) == [(1, 0.25), (2, 0.5)]
    step2 = [h for h in history if h["_step"] == 2]
    assert any(h.get("reward/total/_type") == "histogram" for h in step2)
    assert any(h.get("samples/_type") == "table-file" and h.get("samples/nrows") == 2 for h in step2)
    (table,) = glob.glob(os.path.join(first, "files", "media", "table", "samples_*.table.json"))
    assert json.load(open(table))["data"][1][1] == "line one\nline two"
    assert losses(wait_for_wandb(second, losses)) == [(2, 0.75)]
