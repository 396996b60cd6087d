"""The reward worker process: scores one item at a time under a CPU-time alarm.

The parent (``pool.RewardPool``) owns the wall-clock deadline and kills a worker
that misses it; this side only adds a cheap soft limit so that a reward stuck in
Python code (a sympy simplification, a regex loop) fails alone without costing a
process restart. A parent that dies without closing the pool (SIGKILL) cannot kill
anything, so a thread here exits the worker when the parent's end of the pipe closes,
even in the middle of a reward that never returns.

Messages from the parent: ``None`` (stop), ``("load", blob)`` (unpickle reward
functions ahead of time, so that their imports do not eat an item's budget), and
``("score", task_id, blob, completion, row, timeout_s, skip)``. Replies: ``("ready",
pid)``, ``("loaded",)``, ``("fatal", message)`` and ``("scored", task_id,
results)``.
"""

from __future__ import annotations

import importlib
import os
import pickle
import resource
import select
import signal
import sys
import threading
import time
from typing import Any, Callable, Sequence

# Statuses of one (item, function) call, reported to the parent.
OK, TIMEOUT, MEMORY, ERROR = "ok", "timeout", "memory", "error"
# Messages of a TIMEOUT: the function was not called (given up on), or hit its own budget.
SKIPPED, OWN_BUDGET = "skipped", "own budget"
_MAX_CACHED_BLOBS = 16


class _SoftTimeout(BaseException):
    # A BaseException, so the `except Exception` blocks in math-verify and sympy
    # cannot swallow it and keep running past the budget.
    pass


_armed = False


def _on_cpu_alarm(signum, frame):
    if _armed:
        raise _SoftTimeout()


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message``, at most 200 characters of message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def run_item(
    fns: Sequence[Callable[..., Sequence[float]]], completion: str, row: dict[str, Any], timeout_s: float,
    skip: Sequence[int] = (), current=None,
) -> list[tuple[float, str, str]]:
    """Calls each reward function on one completion; returns (value, status, message) per function.

    Functions in ``skip`` (given up on for timing out) are not called: (0, TIMEOUT, SKIPPED).
    A timeout of the reward's own budget (math-verify's TimeoutError) says OWN_BUDGET.
    """
    global _armed
    columns = {name: [value] for name, value in row.items()}
    results = []
    for f, fn in enumerate(fns):
        if f in skip:
            results.append((0.0, TIMEOUT, SKIPPED))
            continue
        if current is not None:
            current.value = f
        try:
            # ITIMER_PROF counts CPU time, and it is a different timer from the
            # ITIMER_REAL that math-verify's signal.alarm() arms and cancels, so
            # the two never clobber each other.
            _armed = True
            signal.setitimer(signal.ITIMER_PROF, timeout_s)
            try:
                values = fn([completion], **columns)
            finally:
                signal.setitimer(signal.ITIMER_PROF, 0)
                _armed = False
            values = list(values)
            if len(values) != 1:
                raise ValueError(f"returned {len(values)} values for 1 completion")
            results.append((float(values[0]), OK, ""))
        except _SoftTimeout:
            results.append((0.0, TIMEOUT, ""))
        except TimeoutError:  # the reward's own budget (math-verify's)
            results.append((0.0, TIMEOUT, OWN_BUDGET))
        except MemoryError:
            results.append((0.0, MEMORY, ""))
        except BaseException as exc:  # noqa: BLE001 - a reward's bug must cost one item, not the worker
            results.append((0.0, ERROR, first_line(exc)))
    return results


def _address_space_mib() -> float:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _limit_memory(max_memory_mb: int) -> None:
    # RLIMIT_AS turns a runaway allocation into a MemoryError inside the reward
    # instead of a visit from the kernel's OOM killer to some other process.
    used = _address_space_mib()
    if used >= max_memory_mb:
        raise MemoryError(f"max_memory_mb={max_memory_mb} is below the {used:.0f} MiB the worker maps at start")
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = max_memory_mb * 1024 * 1024
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


class _Output:
    """Where a worker's stdout and stderr go: the console up to a budget, then the run log.

    A reward that prints megabytes per call would bury the run's progress lines; the first
    ``budget`` bytes (of both streams together) still reach the console, for a reward's own
    debugging prints, and the rest is appended to ``log_path`` (dropped when None), with one
    line on the console saying so.
    """

    def __init__(self, budget: int, log_path: str | None):
        self.left, self.log_path, self.noted = budget, log_path, False
        self.lock = threading.Lock()
        self.budget = budget
        self.captured: list[tuple[int, int, threading.Thread]] = []  # (fd, its console, its forwarder)

    def capture(self, fd: int) -> None:
        """Sends what this process writes to ``fd`` through the budget, from now on."""
        console = os.dup(fd)
        read, write = os.pipe()
        os.dup2(write, fd)
        os.close(write)
        forwarder = threading.Thread(target=self._forward, args=(read, console), name=f"output-{fd}", daemon=True)
        forwarder.start()
        self.captured.append((fd, console, forwarder))

    def drain(self, timeout_s: float = 1.5) -> None:  # within the 2 s the pool waits for a stopping worker
        """Forwards what is still in the pipes before the worker exits: each fd gets its console
        back, which closes its pipe, and its forwarder runs to the end of what was written."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        for fd, console, _ in self.captured:
            os.dup2(console, fd)
        deadline = time.monotonic() + timeout_s
        for _, _, forwarder in self.captured:
            forwarder.join(timeout=max(0.0, deadline - time.monotonic()))

    def _forward(self, read: int, console: int) -> None:
        log = None
        while True:
            try:
                chunk = os.read(read, 1 << 16)
            except OSError:
                return
            if not chunk:
                return
            with self.lock:
                shown = min(len(chunk), self.left)
                self.left -= shown
                note = not self.noted and shown < len(chunk)
                self.noted = self.noted or note
            _write_all(console, chunk[:shown])
            if note:
                where = f"goes to {self.log_path}" if self.log_path else "is dropped"
                _write_all(console, f"\nreward worker {os.getpid()}: its output past {self.budget} bytes {where}\n"
                           .encode())
            if shown < len(chunk) and self.log_path:
                try:
                    log = log or open(self.log_path, "ab")  # noqa: SIM115 - kept open for the worker's life
                    log.write(chunk[shown:])
                    log.flush()
                except OSError:
                    pass  # a full disk: the rest is lost, the reward goes on


def _write_all(fd: int, data: bytes) -> None:
    while data:
        try:
            data = data[os.write(fd, data):]
        except OSError:
            return


def _exit_with_parent(conn) -> None:
    """Exits the process once the parent's end of ``conn`` is closed (the parent died or closed the pool).

    POLLRDHUP reports only the peer's close, never a message, so this thread does not
    compete with the main thread's reads.
    """
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLRDHUP)
    while True:
        for _, events in poller.poll():
            if events & (select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL):
                os._exit(0)


def main(conn, max_memory_mb: int | None, preload: Sequence[str], output: tuple[int, str | None] | None = None,
         current=None) -> None:
    """Worker entry point: handshake, then serve messages until told to stop.

    ``output`` is (console budget in bytes, run log path) for what rewards print (None: as is);
    ``current`` a shared integer that tells the parent which reward function is running.
    """
    # Ctrl-C and a job's SIGTERM reach the whole process group; the parent decides what happens.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Threads start before the memory limit, which their stacks count against.
    if hasattr(select, "POLLRDHUP"):  # Linux
        threading.Thread(target=_exit_with_parent, args=(conn,), name="exit-with-parent", daemon=True).start()
    if output is not None:
        sink = _Output(*output)
        for fd in (1, 2):
            sink.capture(fd)
    try:
        for module in preload:
            importlib.import_module(module)
        if max_memory_mb:
            _limit_memory(max_memory_mb)
        signal.signal(signal.SIGPROF, _on_cpu_alarm)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent as one line
        conn.send(("fatal", f"reward worker failed to start: {first_line(exc)}"))
        return
    conn.send(("ready", os.getpid()))
    cache: dict[bytes, Any] = {}

    def load(blob: bytes):
        fns = cache.get(blob)
        if fns is None:
            fns = pickle.loads(blob)
            if len(cache) >= _MAX_CACHED_BLOBS:
                cache.clear()
            cache[blob] = fns
        return fns

    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return
            if message is None:
                return
            try:
                fns = load(message[2] if message[0] == "score" else message[1])
            except BaseException as exc:  # noqa: BLE001
                conn.send(("fatal", f"cannot load the reward functions in a worker process: {first_line(exc)}"))
                continue
            if message[0] == "load":
                conn.send(("loaded",))
            else:
                _, task_id, _, completion, row, timeout_s, skip = message
                conn.send(("scored", task_id, run_item(fns, completion, row, timeout_s, skip, current)))
    finally:  # what the rewards printed last reaches the console or the run log
        if output is not None:
            sink.drain()
