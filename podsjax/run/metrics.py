"""Training metrics: JSONL + TensorBoard files, a progress bar, and phase timers.

Files under ``out_dir``, appended to. A resume cuts the JSONL logs back to their sizes at
the restored checkpoint and moves the cut records to ``<log>.superseded``
(``podsjax.rl``), so nothing is lost and no step is logged twice:

- ``metrics.jsonl``: one JSON object per :meth:`MetricsWriter.write` call,
  ``{"step": s, "wall_time": t, "<name>": value, ...}``. Nested dicts are flattened with
  ``/`` (``{"reward": {"mean": 1}}`` -> ``"reward/mean"``). Non-finite floats (NaN, +-inf)
  are written as ``null`` so every line is strict JSON; TensorBoard gets the real value.
- ``samples.jsonl``: completion samples.
- ``events.out.tfevents.*``: TensorBoard scalars, histograms and sample text
  (``podsjax.run.log_backends``), when the backends include ``tensorboard``; ``wandb/``, when
  they include ``wandb``.

The JSONL logs are the loop's to cut back on a resume; a writer opened with
``resume_step=S`` only starts its new TensorBoard file with a purge event at S + 1 (an
event file cannot be cut back) and names its W&B run after the resume.

Time phases with :class:`PhaseTimer`; JAX dispatch is asynchronous, so block on a phase's
outputs (``jax.block_until_ready``) inside the phase or it measures only the dispatch.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from podsjax.run import log_backends

# -- value conversion ------------------------------------------------------------------


def flatten_metrics(tree: Mapping[str, Any], sep: str = "/", prefix: str = "") -> dict[str, Any]:
    """Flattens nested dicts of metrics into ``{"a/b": value}``."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"metric names must be non-empty strings, got {key!r}")
        name = f"{prefix}{sep}{key}" if prefix else key
        inner = flatten_metrics(value, sep, name) if isinstance(value, Mapping) else {name: value}
        twice = next((n for n in inner if n in out), None)
        if twice is not None:  # {"a/b": 1, "a": {"b": 2}}: one would be lost
            raise ValueError(f"metric {twice!r} is given twice (as a name and as a nested one)")
        out.update(inner)
    return out


def to_scalar(name: str, value: Any) -> int | float:
    """A Python int/float from a Python, NumPy or JAX scalar (int kinds stay int)."""
    if isinstance(value, (bool, np.bool_, int, np.integer)):
        if not -2**63 <= int(value) < 2**63:  # a float() past it fails after the JSON line is written
            raise ValueError(f"metric {name!r} is an integer past 64 bits: {str(int(value))[:20]}...")
        return int(value)
    if isinstance(value, float):
        return value
    try:
        arr = np.asarray(value)  # also fetches a jax.Array from its device
    except Exception:  # noqa: BLE001 - any unconvertible object gets the same clear error
        arr = np.asarray(None)
    if arr.size != 1 or arr.dtype.kind not in "biuf":
        raise ValueError(f"metric {name!r} must be a real scalar, got {type(value).__name__} {getattr(arr, 'shape', '')}")
    return int(arr.item()) if arr.dtype.kind in "biu" else float(arr.item())


def _finite_or_none(x: int | float) -> int | float | None:
    return x if isinstance(x, int) or math.isfinite(x) else None


def to_jsonable(value: Any, where: str = "value") -> Any:
    """Recursively converts arrays/NumPy types to JSON types; non-finite floats -> None."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v, where) for v in value]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, float, np.integer, np.floating)):
        return _finite_or_none(to_scalar(where, value))
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        arr = np.asarray(value)
        if arr.dtype.kind in "biuf":
            return to_jsonable(arr.tolist(), where)
    raise ValueError(f"{where}: cannot store a {type(value).__name__} in JSON")


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a JSONL log a run wrote (metrics, samples, eval history), in file order.

    A torn last line from a killed process is skipped, as is any line that is no JSON (or no
    UTF-8: a damaged disk block).
    """
    records: list[dict[str, Any]] = []
    with open(path, "rb") as f:
        for line in f:
            try:
                record = json.loads(line.decode("utf-8"))
            except ValueError:  # JSONDecodeError, UnicodeDecodeError
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


# -- writer ----------------------------------------------------------------------------


class MetricsWriter:
    """Appends per-step scalars to JSONL and the other backends, and samples to JSONL.

    Args:
        out_dir: directory for all files (created if missing).
        backends: names from ``podsjax.run.log_backends.BACKENDS``; "jsonl" must be one.
        config: the run's config, for backends that show it (W&B).
        wandb_project: W&B project (default ``$WANDB_PROJECT``, else "podsjax").
        jsonl_name: metrics file name inside ``out_dir``.
        samples_name: samples file name inside ``out_dir``.
        resume_step: the checkpoint step a resumed run restarted from (see module doc).
        enabled: False makes every method a no-op; pass ``jax.process_index() == 0`` so
            only one host of a multi-host run writes.
        clock: wall clock for the ``wall_time`` field.
    """

    def __init__(self, out_dir: str | os.PathLike, *, backends: Sequence[str] = log_backends.DEFAULT_BACKENDS,
                 config: Mapping[str, Any] | None = None, wandb_project: str | None = None, jsonl_name: str = "metrics.jsonl",
                 samples_name: str = "samples.jsonl", resume_step: int | None = None, enabled: bool = True,
                 clock: Callable[[], float] = time.time):
        self.out_dir = os.fspath(out_dir)
        self.enabled = enabled
        self.backends = log_backends.parse_backends(backends)
        self._clock = clock
        self._files: dict[str, Any] = {}
        self._tensorboard: log_backends.TensorBoard | None = None
        self._wandb: log_backends.WandB | None = None
        self._closed = False
        for what, name in (("jsonl_name", jsonl_name), ("samples_name", samples_name)):  # never outside out_dir
            if os.path.isabs(name) or os.path.normpath(name).startswith(os.pardir):
                raise ValueError(f"{what} must be a file name inside out_dir; got {name!r}")
        self.metrics_path = os.path.join(self.out_dir, jsonl_name)
        self.samples_path = os.path.join(self.out_dir, samples_name)
        if not enabled:
            return
        os.makedirs(self.out_dir, exist_ok=True)
        if "tensorboard" in self.backends:
            self._tensorboard = log_backends.TensorBoard(self.out_dir,
                                                         None if resume_step is None else int(resume_step) + 1)
        if "wandb" in self.backends:
            self._wandb = log_backends.WandB(self.out_dir, config, resume_step, project=wandb_project)

    @property
    def wants_histograms(self) -> bool:
        """Whether some backend draws histograms (so the caller need not fetch their data)."""
        return self.enabled and log_backends.draws_histograms(self.backends)

    def _others(self):
        return [b for b in (self._tensorboard, self._wandb) if b is not None]

    def _append(self, path: str, record: Mapping[str, Any]) -> None:
        if self._closed:
            raise RuntimeError(f"MetricsWriter for {self.out_dir} is closed")
        data = (json.dumps(record, allow_nan=False) + "\n").encode("utf-8")
        f = self._files.get(path)
        if f is None:
            # A process killed mid-line leaves a torn last line; start on a fresh line so
            # that only the torn record is unreadable, never the next one.
            if os.path.exists(path) and os.path.getsize(path) > 0:
                with open(path, "rb") as existing:
                    existing.seek(-1, os.SEEK_END)
                    data = (b"\n" if existing.read(1) != b"\n" else b"") + data
            f = self._files[path] = open(path, "ab", buffering=0)  # each record reaches the OS: a SIGKILL keeps it
        start = os.fstat(f.fileno()).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[f.write(view):]
        except OSError:
            # A full disk: cut the part that landed, so a retry of this step writes it once, whole
            # (and reopens, to check the last line again).
            try:
                os.ftruncate(f.fileno(), start)
            except OSError:
                pass
            self._files.pop(path).close()
            raise

    def write(self, step: int, scalars: Mapping[str, Any]) -> dict[str, Any]:
        """Appends one step's scalars (nested dicts are flattened with ``/``).

        Args:
            step: training step.
            scalars: name -> Python/NumPy/JAX scalar, possibly nested.

        Returns:
            The JSON record written (non-finite values as None).

        Raises:
            ValueError: a value is not a real scalar, or a name is ``step``/``wall_time``.
        """
        if isinstance(step, (bool, np.bool_)) or not isinstance(step, (int, np.integer)):
            if not (hasattr(step, "dtype") and np.ndim(step) == 0 and np.asarray(step).dtype.kind in "iu"):
                raise ValueError(f"step must be an integer; got {step!r}")  # 7.9 had been logged as 7
        flat = {name: to_scalar(name, v) for name, v in flatten_metrics(scalars).items()}
        for reserved in ("step", "wall_time"):
            if reserved in flat:
                raise ValueError(f"metric name {reserved!r} is reserved")
        wall_time = self._clock()
        record = {"step": int(step), "wall_time": wall_time, **{k: _finite_or_none(v) for k, v in flat.items()}}
        if self.enabled:
            self._append(self.metrics_path, record)
            if flat:
                for backend in self._others():
                    backend.scalars(int(step), {k: float(v) for k, v in flat.items()}, wall_time)
        return record

    def histograms(self, step: int, arrays: Mapping[str, Any]) -> None:
        """Distributions at ``step`` (name -> array of values) for the backends that draw them."""
        if not self.wants_histograms:
            return
        wall_time = self._clock()
        for backend in self._others():
            backend.histograms(int(step), {k: np.asarray(v) for k, v in arrays.items()}, wall_time)

    def write_samples(self, step: int, records: Sequence[Mapping[str, Any]]) -> None:
        """Appends completion samples (e.g. prompt, completion, rewards, selected).

        Args:
            step: training step the samples come from; added to every record.
            records: dicts of JSON-able values, arrays or scalars.
        """
        rows = []
        for i, r in enumerate(records):
            if not isinstance(r, Mapping):  # a text had failed inside dict()
                raise ValueError(f"sample {i} must be a dict of fields; got {type(r).__name__}")
            if "step" in r:
                raise ValueError(f"sample {i} has a 'step' field; the step is added by write_samples")
            rows.append({"step": int(step), **to_jsonable(dict(r), f"sample {i}")})
        if not self.enabled or not rows:
            return
        for row in rows:
            self._append(self.samples_path, row)
        columns = list(dict.fromkeys(k for r in rows for k in r if k != "step"))
        if self._tensorboard is not None:
            self._tensorboard.text(int(step), "samples", log_backends.samples_markdown(rows, columns), self._clock())
        if self._wandb is not None:
            self._wandb.table(int(step), "samples", rows, columns)

    def close(self) -> None:
        """Flushes and closes all files. Idempotent."""
        self._closed = True
        for f in self._files.values():
            f.close()
        self._files.clear()
        for backend in self._others():
            backend.close()
        self._tensorboard = self._wandb = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


# -- progress and timing ---------------------------------------------------------------


class Progress:
    """A tqdm bar over training steps or seconds, with step/reward/accuracy and ETA.

    Args:
        total: steps (``unit="step"``) or training seconds (``unit="s"``) of the run.
        unit: what ``position`` counts.
        initial: starting position (a resumed run's step or elapsed seconds).
        enabled: True/False forces the bar on/off; None shows it only on a TTY.
        file: stream to draw on (default stderr).
        desc: label at the left of the bar.
        mininterval: least seconds between redraws.
    """

    def __init__(self, total: float, *, unit: str = "step", initial: float = 0, enabled: bool | None = None,
                 file: Any = None, desc: str = "train", mininterval: float = 0.5):
        from tqdm import tqdm

        if not total > 0:
            raise ValueError(f"Progress total must be > 0, got {total!r}")
        fmt = "{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f}{unit} [{elapsed}<{remaining}{postfix}]"
        self._bar = tqdm(total=total, initial=initial, unit=unit, desc=desc, file=file or sys.stderr,
                         disable=None if enabled is None else not enabled, bar_format=fmt,
                         mininterval=mininterval, dynamic_ncols=True)

    @property
    def enabled(self) -> bool:  # False when disabled by the caller or by having no TTY
        return not self._bar.disable

    def update(self, position: float, **postfix: Any) -> None:
        """Moves the bar to ``position`` and shows ``postfix`` (e.g. step=, reward=, acc=)."""
        if self._bar.disable:
            return
        shown = {}
        for key, value in postfix.items():
            try:
                v = to_scalar(key, value)
                shown[key] = v if isinstance(v, int) else f"{v:.4g}"
            except ValueError:
                shown[key] = str(value)
        self._bar.set_postfix(shown, refresh=False)
        self._bar.update(min(position, self._bar.total) - self._bar.n)

    def write(self, line: str) -> None:
        """Prints ``line`` above the bar (or plainly when the bar is off)."""
        if self._bar.disable:
            print(line, file=sys.stdout, flush=True)
        else:
            self._bar.write(line, file=sys.stdout)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class ProgressLog:
    """Decides when to print a one-line progress report, for consoles without a bar.

    Logs, ``nohup`` and batch schedulers get no TTY, so the tqdm bar is hidden there;
    these lines tell the user that the run is alive: the first step, then one line
    every ``every_s`` seconds or ``every_steps`` steps, whichever comes first.

    Args:
        log: prints one line.
        every_s: least seconds between lines (0: every step).
        every_steps: also print every N steps (None: by time only).
        clock: monotonic seconds.
    """

    def __init__(self, log: Callable[[str], None], *, every_s: float = 30.0, every_steps: int | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if every_s < 0 or (every_steps is not None and every_steps < 1):
            raise ValueError(f"ProgressLog needs every_s >= 0 and every_steps >= 1; got {every_s}, {every_steps}")
        self._log, self._every_s, self._every_steps, self._clock = log, every_s, every_steps, clock
        self._last: float | None = None
        self.lines = 0

    def update(self, step: int, line: Callable[[], str], *, force: bool = False) -> bool:
        """Prints ``line()`` when due (or ``force``); returns whether it printed."""
        now = self._clock()
        due = (force or self._last is None or now - self._last >= self._every_s
               or (self._every_steps is not None and step % self._every_steps == 0))
        if due:
            self._log(line())
            self._last = now
            self.lines += 1
        return due


def print_line(line: str) -> None:
    """Prints one console line to the current stdout, flushed (pipes buffer otherwise)."""
    print(line, file=sys.stdout, flush=True)


class PhaseTimer:
    """Accumulates seconds per named phase (generation, scoring, selection, update), and the
    compiles inside them apart: a first step's compile is reported as a compile, not as its phase.

    Args:
        clock: seconds now.
        compile_seconds: seconds of compiling done on this thread so far (e.g.
            ``podsjax.devices.compilation.CompileLog.thread_seconds``); the compiles in a phase are
            taken off its time and added to ``compile_s``. None: nothing is taken off.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 compile_seconds: Callable[[], float] | None = None):
        self._clock = clock
        self._compile_seconds = compile_seconds
        self._seconds: dict[str, float] = {}
        self._waited = 0.0  # in compiling() blocks
        self.compile_s = 0.0

    def _compiled(self) -> float:
        return (self._compile_seconds() if self._compile_seconds is not None else 0.0) + self._waited

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Times the ``with`` body (also when it raises) and adds it to ``name``, less its compiles."""
        start, compiled = self._clock(), self._compiled()
        try:
            yield
        finally:
            compiling = self._compiled() - compiled
            self.compile_s += compiling
            self.add(name, self._clock() - start - compiling)

    @contextlib.contextmanager
    def compiling(self) -> Iterator[None]:
        """Inside a phase: the ``with`` body is compile time (waiting for a compile that another
        thread runs), not the phase's."""
        start = self._clock()
        try:
            yield
        finally:
            self._waited += self._clock() - start

    def add(self, name: str, seconds: float) -> None:
        self._seconds[name] = self._seconds.get(name, 0.0) + float(seconds)

    def totals(self) -> dict[str, float]:
        """Seconds per phase, its compiles left out (they are in ``compile_s``)."""
        return dict(self._seconds)


def tokens_per_second(num_tokens: Any, seconds: float) -> float:
    """Throughput; NaN (written as null) when ``seconds`` is not positive."""
    seconds = float(seconds)
    return float(to_scalar("num_tokens", num_tokens)) / seconds if seconds > 0 else math.nan
