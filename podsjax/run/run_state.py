"""A run on its host: what a checkpoint keeps besides the arrays, the run directory's lock,
and the signals (SIGTERM, SIGINT) that stop a run early."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import threading
import time
import uuid
from typing import Any, Callable


@dataclasses.dataclass
class HostState:
    """The host-side progress of a run, saved as JSON in every checkpoint.

    Attributes:
        data_position: training examples drawn so far (``rl.DataStream``).
        elapsed_train_s: the training clock (generation, scoring, selection and update;
            evaluation and checkpoint writes excluded).
        last_eval_s: the training clock at the last evaluation (None: none yet).
        nonfinite_in_a_row: updates skipped for a non-finite loss or gradient, in a row.
        best_step, best_accuracy: the best evaluation so far (``podsjax.run.best``).
        log_sizes: each log's size in bytes at this checkpoint, which a resume cuts back to.
    """

    data_position: int = 0
    elapsed_train_s: float = 0.0
    last_eval_s: float | None = None
    nonfinite_in_a_row: int = 0
    best_step: int | None = None
    best_accuracy: float | None = None
    log_sizes: dict[str, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        # Each field of its kind: a damaged or edited checkpoint's "5" had failed later, deep in the loop.
        for name in ("data_position", "nonfinite_in_a_row", "best_step"):
            value = getattr(self, name)
            if not (value is None and name == "best_step") and not _count(value):
                raise ValueError(f"host state: {name} must be an integer >= 0; got {value!r}")
        for name in ("elapsed_train_s", "last_eval_s", "best_accuracy"):
            value = getattr(self, name)
            if not (value is None and name != "elapsed_train_s") and (
                    isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ValueError(f"host state: {name} must be a number; got {value!r}")
        if not isinstance(self.log_sizes, dict) or not all(
                isinstance(k, str) and _count(v) for k, v in self.log_sizes.items()):
            raise ValueError(f"host state: log_sizes must map log names to sizes in bytes; got {self.log_sizes!r}")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, values: dict[str, Any]) -> HostState:
        """From a checkpoint's JSON; fields an older checkpoint lacks keep their defaults."""
        if not isinstance(values, dict):
            raise ValueError(f"host state: a checkpoint's host state is a JSON object; got {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# -- one writer per run directory ---------------------------------------------------------

LOCK_FILE = "run.lock"
# The holder touches its lock this often; a lock from another host whose file has not been
# touched for OTHER_HOST_STALE_S is a holder that is gone (killed, or its node lost), and is
# taken over. The margin is 15 beats, so that a slow shared filesystem or a busy host does
# not make a live holder look gone.
HEARTBEAT_S = 60.0
OTHER_HOST_STALE_S = 15 * 60.0


class RunLocked(RuntimeError):
    """Another process holds the run directory's lock."""


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _host_identity() -> dict[str, str | None]:
    """This host as a lock records it: the name, and what tells two machines (or two boots,
    or two containers) of one name apart, so that a pid is only judged where it means something."""
    pid_ns = None
    with contextlib.suppress(OSError):
        pid_ns = os.readlink("/proc/self/ns/pid")
    return {"host": socket.gethostname(), "boot": _read_text("/proc/sys/kernel/random/boot_id"), "pid_ns": pid_ns}


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22): a pid
    that was reused by a later process has another one."""
    text = _read_text(f"/proc/{pid}/stat")
    if text is None or ")" not in text:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return fields[19] if len(fields) > 19 else None


def _alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    now = _process_start(pid)
    return started is None or now is None or now == started


class RunLock:
    """The lock file ``run.lock`` in a run directory: the pid and host of its one writer.

    It is a file created with ``O_CREAT | O_EXCL`` rather than an ``fcntl.flock``: run
    directories of cluster jobs live on shared filesystems, where flock is often local to one
    node (Lustre and GPFS without their flock mount options, FUSE mounts) and would let two
    nodes write one run; exclusive creation is atomic on local disks and NFSv3+. Its price,
    a file left behind by a killed holder, is paid here:

    * a holder on this host (same host name, boot and pid namespace) whose pid is gone, or
      now belongs to a later process, is stale: the lock is taken over with a warning;
    * a holder on another host cannot be asked. It touches its file every ``heartbeat_s``;
      a file untouched for ``stale_s`` (15 minutes) is taken over with a warning, and a
      fresher one is respected: the error names the file to delete if that run is gone.

    Use :meth:`acquire` (or ``with RunLock(directory):``); :meth:`release` deletes the file.
    """

    def __init__(self, directory: str, *, warn: Callable[[str], None] | None = None,
                 heartbeat_s: float = HEARTBEAT_S, stale_s: float = OTHER_HOST_STALE_S):
        self.directory = os.fspath(directory)
        self.path = os.path.join(self.directory, LOCK_FILE)
        self.token = uuid.uuid4().hex
        self._warn = warn or (lambda line: print(line, flush=True))
        self._heartbeat_s, self._stale_s = heartbeat_s, stale_s
        self._stop_beating = threading.Event()
        self._beat: threading.Thread | None = None
        self.held = False

    @classmethod
    def acquire(cls, directory: str, **kwargs: Any) -> RunLock:
        """Creates the directory if needed and takes its lock.

        Raises:
            RunLocked: a live process holds it (one line naming its pid and host).
            OSError: the directory cannot be written.
        """
        lock = cls(directory, **kwargs)
        lock._take()
        return lock

    def _take(self) -> None:
        os.makedirs(self.directory, exist_ok=True)
        me = {"pid": os.getpid(), **_host_identity(), "started": _process_start(os.getpid()),
              "since": time.time(), "token": self.token}
        for _ in range(20):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._judge(me)
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(me, f)
                f.write("\n")
            self.held = True
            if self._heartbeat_s:
                self._beat = threading.Thread(target=self._heartbeat, name="run-lock-heartbeat", daemon=True)
                self._beat.start()
            return
        raise RunLocked(f"the run directory {self.directory} is being locked by other processes at once ({self.path}); "
                        "start one run per directory")

    def _judge(self, me: dict[str, Any]) -> None:
        """Raises RunLocked for a live holder; moves a stale lock out of the way (the caller retries)."""
        verdict, text, why = self._verdict(me)
        if verdict == "live":
            raise RunLocked(why)
        if verdict == "wait":
            time.sleep(0.1)
        elif verdict == "stale" and self._break(text):
            self._warn(f"warning: took over {why} ({self.path})")

    def in_use(self) -> str | None:
        """The line naming the live run that holds this lock, or None; reads the lock file only
        (a stale lock stays where it is, for the run that takes it over to say so)."""
        me = {"pid": os.getpid(), **_host_identity()}
        holder = _read_text(self.path) or ""
        with contextlib.suppress(ValueError, AttributeError):
            held = json.loads(holder)
            if all(held.get(k) == me[k] for k in ("pid", "host", "boot", "pid_ns")):
                return None  # this process holds it (the command line's runner, then its Trainer)
        verdict, _, why = self._verdict(me)
        return why if verdict == "live" else None

    def _verdict(self, me: dict[str, Any]) -> tuple[str, str | None, str | None]:
        """``(verdict, the lock file's text, why)``: "live" (why: the refusal), "stale" (why: whose
        lock), "wait" (created but not yet written, or torn, and young) or "gone" (released)."""
        text = _read_text(self.path)
        try:
            holder = json.loads(text) if text else None
            holder = holder if isinstance(holder, dict) else None
        except json.JSONDecodeError:
            holder = None
        try:
            age = time.time() - os.stat(self.path).st_mtime
        except FileNotFoundError:
            return "gone", text, None
        if holder is None:  # created but not yet written (its writer is between open and write), or torn
            return ("wait", text, None) if age < 10.0 else ("stale", text, "an unreadable lock file")
        pid, host = holder.get("pid"), holder.get("host", "?")
        same_host = all(holder.get(k) == me[k] for k in ("host", "boot", "pid_ns"))
        where = f"pid {pid} on host {host}"
        if same_host and isinstance(pid, int) and pid != me["pid"]:
            if _alive(pid, holder.get("started")):
                return "live", text, (f"the run directory {self.directory} is in use by {where} (lock file "
                                      f"{self.path}); stop that run first, or choose another --out")
            return "stale", text, f"the lock of {where}, which is no longer running"
        if not same_host and age >= self._stale_s:
            return "stale", text, f"the lock of {where}, not refreshed for {age / 60:.0f} min"
        return "live", text, (f"the run directory {self.directory} is in use by {where} (lock file {self.path}, "
                              f"refreshed {age:.0f} s ago); if that run is gone, delete the lock file")

    def _break(self, seen: str | None) -> bool:
        """Removes the stale lock whose content was ``seen``; False when a fresh one replaced it meanwhile."""
        aside = f"{self.path}.stale-{self.token}"
        try:
            os.rename(self.path, aside)  # atomic: of two processes taking over, one moves it
        except FileNotFoundError:
            return False
        if _read_text(aside) != seen:
            # A new holder locked it between our look and the rename: give the lock back.
            with contextlib.suppress(OSError):
                os.link(aside, self.path)
            os.unlink(aside)
            return False
        os.unlink(aside)
        return True

    def _heartbeat(self) -> None:
        while not self._stop_beating.wait(self._heartbeat_s):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        """Deletes the lock file if it is still this lock's; idempotent."""
        self._stop_beating.set()
        if not self.held:
            return
        self.held = False
        text = _read_text(self.path)
        try:
            mine = text is not None and json.loads(text).get("token") == self.token
        except (json.JSONDecodeError, AttributeError):
            mine = False
        if mine:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            except OSError as exc:  # never in place of the error the run is ending on
                self._warn(f"warning: could not remove the run lock {self.path} ({exc.strerror}); the next run "
                           "takes it over once this process has ended")

    def __enter__(self) -> RunLock:
        if not self.held:
            self._take()
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()


# -- stopping on a signal ------------------------------------------------------------------

class StopRequested(KeyboardInterrupt):
    """The run stopped at SIGTERM or SIGINT after its last whole step, checkpointed.

    Attributes:
        signal: the signal's name ("SIGTERM"), or None when another process of the run got it.
        step: the last whole step.
        checkpoint: the newest checkpointed step (None: none yet).
    """

    def __init__(self, signal_name: str | None, step: int, checkpoint: int | None):
        super().__init__(signal_name, step, checkpoint)
        self.signal, self.step, self.checkpoint = signal_name, step, checkpoint

    def __str__(self) -> str:
        by = self.signal or "a signal to another process of the run"
        kept = "no checkpoint yet" if self.checkpoint is None else f"checkpoint of step {self.checkpoint} saved"
        return f"stopped by {by} after step {self.step} ({kept})"


class StepDropped(KeyboardInterrupt):
    """A stop cut short work that changes nothing the run keeps (see :meth:`StopSignals.droppable`)."""


class StopSignals:
    """SIGTERM (what SLURM and spot-VM preemption send first) and SIGINT, as a stop request.

    The first signal asks the run to stop. Inside :meth:`droppable` (generation, scoring,
    evaluation: nothing the run keeps has changed yet) the work is dropped at once
    (:class:`StepDropped`); elsewhere (the update, logging, a checkpoint) it runs to its end
    and the loop stops at the next step boundary, reading :attr:`requested`. Either way the
    run can checkpoint a whole step within a preemption's grace period. A second signal
    raises KeyboardInterrupt at once.

    ``drop_at_once=False`` (multi-host runs) never drops: the processes must agree on where
    they stop, so they do at a step boundary.

    Handlers are installed while the object is entered, and only from the main thread
    (Python runs handlers there); entered from another thread it changes nothing.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, drop_at_once: bool = True):
        self.requested: str | None = None
        self.drop_at_once = drop_at_once
        self._received = 0
        self._dropping = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for number in self.SIGNALS:
                self._previous[number] = signal.signal(number, self._on_signal)
        return self

    def __exit__(self, *exc_info) -> None:
        previous, self._previous = self._previous, {}
        for number, handler in previous.items():
            signal.signal(number, handler)

    def _on_signal(self, number, frame) -> None:
        self._received += 1
        if self._received > 1:
            raise KeyboardInterrupt(signal.Signals(number).name)
        self.requested = signal.Signals(number).name
        if self._dropping and self.drop_at_once:
            raise StepDropped(self.requested)

    @contextlib.contextmanager
    def droppable(self):
        """Work a stop may cut short: it changes nothing that a checkpoint keeps."""
        if self.requested is not None and self.drop_at_once:
            raise StepDropped(self.requested)
        outer, self._dropping = self._dropping, True
        try:
            yield
        finally:
            self._dropping = outer
