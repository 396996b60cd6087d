"""Where a run's metrics go besides ``metrics.jsonl``: TensorBoard and Weights & Biases.

Each backend takes scalars, histograms (rewards, advantages) and text (sample
completions) at a step. TensorBoard events are encoded by tensorboardX; W&B is the
optional ``wandb`` package (``pip install 'podsjax[wandb]'``), online or offline as its
own settings say (``WANDB_MODE=offline`` keeps everything on disk).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

# "jsonl" is metrics.jsonl, which every run writes: evaluation history, resume and
# experiments.compare read it.
BACKENDS = ("jsonl", "tensorboard", "wandb")
DEFAULT_BACKENDS = ("jsonl", "tensorboard")


def parse_backends(spec: str | Sequence[str]) -> tuple[str, ...]:
    """``"jsonl,tensorboard,wandb"`` (or a sequence of names) checked: known names, jsonl among them."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    odd = next((n for n in items if not isinstance(n, str)), None)
    if odd is not None:
        raise ValueError(f"log backends are names ({', '.join(BACKENDS)}); got {odd!r}")
    names = tuple(n.strip() for n in items if n.strip())
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown log backend {unknown[0]!r}; choose from {', '.join(BACKENDS)}")
    if "jsonl" not in names:
        raise ValueError("log backends must include jsonl: the evaluation history, --resume and "
                         "experiments.compare read metrics.jsonl")
    return tuple(dict.fromkeys(names))


def draws_histograms(backends) -> bool:
    """Whether any of ``backends`` draws histograms (TensorBoard and W&B do)."""
    return any(name in backends for name in ("tensorboard", "wandb"))


def samples_markdown(records: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """Sample records as a markdown table (TensorBoard's text plugin renders it)."""
    def cell(value):
        return str(value).replace("|", "\\|").replace("\n", "<br>")

    rows = [" | ".join(columns), " | ".join("---" for _ in columns)]
    rows += [" | ".join(cell(r.get(c, "")) for c in columns) for r in records]
    return "\n".join(rows)


class TensorBoard:
    """A TensorBoard event file written in the caller's thread.

    tensorboardX's own ``SummaryWriter`` writes from a background thread; when that thread
    dies (a full disk), the next ``add_scalar`` blocks forever on its queue. Here a failed
    write raises in the training loop, which stops with one line. The encoding (Event
    protos, TFRecord framing with CRC32C) is tensorboardX's.
    """

    def __init__(self, logdir: str, purge_step: int | None):
        from tensorboardX.proto.event_pb2 import Event, SessionLog
        from tensorboardX.record_writer import RecordWriter

        # TensorBoard reads a directory's files in name order: seconds, then the suffix.
        secs, nanos = divmod(time.time_ns(), 10**9)
        name = f"events.out.tfevents.{secs}.{socket.gethostname()}.{os.getpid()}.{nanos:09d}"
        self._event = Event
        self._writer = RecordWriter(os.path.join(logdir, name))
        now = time.time()
        self._write(Event(wall_time=now, step=0, file_version="brain.Event:2"))
        if purge_step is not None:
            # A SessionLog START at step S: TensorBoard hides the earlier run's events from S on.
            self._write(Event(wall_time=now, step=purge_step, session_log=SessionLog(status=SessionLog.START)))

    def _write(self, event) -> None:
        self._writer.write(event.SerializeToString())
        self._writer.flush()

    def _summary(self, step: int, summary, wall_time: float) -> None:
        self._write(self._event(wall_time=wall_time, step=step, summary=summary))

    def scalars(self, step: int, values: Mapping[str, float], wall_time: float) -> None:
        from tensorboardX.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=tag, simple_value=value) for tag, value in values.items()])
        self._summary(step, summary, wall_time)

    def histograms(self, step: int, arrays: Mapping[str, np.ndarray], wall_time: float) -> None:
        from tensorboardX import summary

        for tag, values in arrays.items():
            values = np.asarray(values, np.float64)
            values = values[np.isfinite(values)]  # tensorboardX refuses non-finite values
            if values.size:
                self._summary(step, summary.histogram(tag, values, bins="auto"), wall_time)

    def text(self, step: int, tag: str, markdown: str, wall_time: float) -> None:
        from tensorboardX import summary

        self._summary(step, summary.text(tag, markdown), wall_time)

    def close(self) -> None:
        self._writer.close()


class LoggerError(RuntimeError):
    """A logging backend could not start (W&B without credentials, say): the run stops before
    it trains, in one line."""


class WandB:
    """A Weights & Biases run for one start of a podsjax run.

    A resumed run starts a new W&B run in the same group (the run directory's name), so
    steps redone after a restore are never merged into, or dropped from, the first one.

    Args:
        out_dir: the run directory; W&B's files go under ``<out_dir>/wandb``.
        config: the run's resolved config, shown as the W&B run's config.
        resume_step: the checkpoint step a resumed run restarted from (None: a fresh start).
        project: W&B project (default ``$WANDB_PROJECT``, else "podsjax").
    """

    def __init__(self, out_dir: str, config: Mapping[str, Any] | None = None, resume_step: int | None = None,
                 project: str | None = None):
        try:
            import wandb
        except ImportError:
            raise ImportError("--log wandb needs the wandb package: pip install 'podsjax[wandb]'") from None
        self._wandb = wandb
        group = os.path.basename(os.path.abspath(out_dir))
        name = group if resume_step is None else f"{group}-resumed-at-{resume_step}"
        try:
            self._run = wandb.init(project=project or os.environ.get("WANDB_PROJECT") or "podsjax", group=group,
                                   name=name, dir=out_dir, config=dict(config or {}), reinit="create_new")
        except wandb.errors.Error as exc:  # no API key, no network, a project refused: its words, one line
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise LoggerError(f"W&B could not start a run ({why}); log in with `wandb login` or set WANDB_API_KEY, "
                              "or set WANDB_MODE=offline to keep its files in the run directory") from None

    def scalars(self, step: int, values: Mapping[str, float], wall_time: float) -> None:
        self._run.log(dict(values), step=step)

    def histograms(self, step: int, arrays: Mapping[str, np.ndarray], wall_time: float) -> None:
        histograms = {}
        for tag, values in arrays.items():
            values = np.asarray(values, np.float64)
            values = values[np.isfinite(values)]
            if values.size:
                histograms[tag] = self._wandb.Histogram(values)
        if histograms:
            self._run.log(histograms, step=step)

    def table(self, step: int, tag: str, records: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> None:
        def cell(value):  # W&B tables hold scalars and text; nested values go in as JSON
            return value if value is None or isinstance(value, (str, int, float, bool)) else json.dumps(value)

        data = [[cell(r.get(c)) for c in columns] for r in records]
        self._run.log({tag: self._wandb.Table(columns=list(columns), data=data)}, step=step)

    def close(self) -> None:
        self._run.finish()
