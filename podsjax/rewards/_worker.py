"""The reward worker process: scores one item at a time under a CPU-time alarm.

The parent (``pool.RewardPool``) owns the wall-clock deadline and kills a worker
that misses it; this side only adds a cheap soft limit so that a reward stuck in
Python code (a sympy simplification, a regex loop) fails alone without costing a
process restart. A parent that dies without closing the pool (SIGKILL) cannot kill
anything, so a thread here exits the worker when the parent's end of the pipe closes,
even in the middle of a reward that never returns.

Messages from the parent: ``None`` (stop), ``("load", blob)`` (unpickle reward
functions ahead of time, so that their imports do not eat an item's budget), and
``("score", task_id, blob, completion, row, timeout_s)``. Replies: ``("ready",
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
import threading
from typing import Any, Callable, Sequence

# Statuses of one (item, function) call, reported to the parent.
OK, TIMEOUT, MEMORY, ERROR = "ok", "timeout", "memory", "error"
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
    fns: Sequence[Callable[..., Sequence[float]]], completion: str, row: dict[str, Any], timeout_s: float
) -> list[tuple[float, str, str]]:
    """Calls each reward function on one completion; returns (value, status, message) per function."""
    global _armed
    columns = {name: [value] for name, value in row.items()}
    results = []
    for fn in fns:
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
        except (_SoftTimeout, TimeoutError):  # TimeoutError: the reward's own budget (math-verify's)
            results.append((0.0, TIMEOUT, ""))
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


def main(conn, max_memory_mb: int | None, preload: Sequence[str]) -> None:
    """Worker entry point: handshake, then serve messages until told to stop."""
    # Ctrl-C and a job's SIGTERM reach the whole process group; the parent decides what happens.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if hasattr(select, "POLLRDHUP"):  # Linux; started before the memory limit, which its stack counts against
        threading.Thread(target=_exit_with_parent, args=(conn,), name="exit-with-parent", daemon=True).start()
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
            _, task_id, _, completion, row, timeout_s = message
            conn.send(("scored", task_id, run_item(fns, completion, row, timeout_s)))
