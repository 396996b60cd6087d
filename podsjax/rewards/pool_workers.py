"""A RewardPool's settings, its error, and its handle on one worker process."""

from __future__ import annotations

import dataclasses
import os
import time

from podsjax.rewards import worker_process

# Tries to reach a forkserver that a reward killed (multiprocessing relaunches it).
_SERVER_TRIES = 5

# Imported once in the forkserver, so replacing a dead worker costs a fork, not imports.
DEFAULT_PRELOAD = ("podsjax.rewards", "math_verify", "sympy")


class RewardPoolError(RuntimeError):
    """The pool cannot do its job (a worker cannot start or cannot load a reward)."""


def default_workers() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    """Settings of a RewardPool.

    Attributes:
        max_workers: worker processes.
        timeout_s: CPU-time budget of one reward function on one item. The wall
            deadline of an item is ``timeout_s * num_functions + kill_grace_s``.
        kill_grace_s: extra wall time before a stuck worker is killed.
        max_memory_mb: address-space limit of each worker (RLIMIT_AS); None for none.
        start_method: 'forkserver' or 'spawn'.
        preload: modules each worker (and the forkserver) imports at start.
        startup_timeout_s: how long a worker may take to start or load the rewards.
        give_up_after: timeouts in a row of one function after which a batch stops calling
            it (it scores 0 for the batch's other items).
        batch_timeout_s: wall-clock limit of one ``score`` call, whatever its size; the items
            left then score 0 (``reward/timeouts``). None: no limit.
        output_budget_bytes: what a worker's rewards may print to the console (stdout and
            stderr together); the rest goes to ``output_log``. None: no limit.
        output_log: the file that receives a worker's output past its budget (None: dropped).
    """

    max_workers: int
    timeout_s: float = 10.0
    kill_grace_s: float = 1.0
    max_memory_mb: int | None = 4096
    start_method: str = "forkserver"
    preload: tuple[str, ...] = DEFAULT_PRELOAD
    startup_timeout_s: float = 120.0
    give_up_after: int = 4
    batch_timeout_s: float | None = 600.0
    output_budget_bytes: int | None = 16384
    output_log: str | None = None

    def __post_init__(self):
        for name in ("max_workers", "give_up_after"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        _seconds(self.timeout_s, "timeout_s")
        _seconds(self.kill_grace_s, "kill_grace_s", zero=True)
        _seconds(self.startup_timeout_s, "startup_timeout_s")
        if self.batch_timeout_s is not None:
            _seconds(self.batch_timeout_s, "batch_timeout_s")
        for name, low in (("max_memory_mb", 64), ("output_budget_bytes", 0)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ValueError(f"{name} must be None or an int >= {low}, got {value!r}")
        if self.start_method not in ("forkserver", "spawn"):
            raise ValueError(
                f"start_method must be 'forkserver' or 'spawn' (fork is unsafe under JAX), got {self.start_method!r}"
            )
        if isinstance(self.preload, str) or not all(isinstance(m, str) for m in self.preload):
            raise ValueError(f"preload must be a list of module names, got {self.preload!r}")  # "sympy": s, y, ...
        object.__setattr__(self, "preload", tuple(self.preload))


# A timer past this overflows the worker's setitimer, after which every item would score 0.
MAX_SECONDS = 1e6


def _seconds(value, name: str, zero: bool = False) -> None:
    """A finite number of seconds, > 0 (>= 0 with ``zero``) and at most MAX_SECONDS."""
    number = not isinstance(value, bool) and isinstance(value, (int, float))
    if not number or not (0 <= value if zero else 0 < value) or not value <= MAX_SECONDS:
        raise ValueError(f"{name} must be a number of seconds, {'>= 0' if zero else '> 0'} and at most "
                         f"{MAX_SECONDS:.0e}; got {value!r}")


class WorkerHandle:
    """Parent-side handle: the process, its pipe, and what it is doing."""

    def __init__(self, ctx, config: PoolConfig):
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        self.current = ctx.Value("i", -1, lock=False)  # the reward function it is in (set by the worker)
        output = None if config.output_budget_bytes is None else (config.output_budget_bytes, config.output_log)
        self.process = ctx.Process(
            target=worker_process.main, args=(child_conn, config.max_memory_mb, config.preload, output, self.current),
            daemon=True,
        )
        try:
            self.process.start()
        finally:
            child_conn.close()
        self.server = forkserver_pid()  # the process server it was forked from (None: spawn)
        self.start_method = config.start_method
        self.conn = parent_conn
        self.state = "starting"  # starting -> idle <-> (loading | busy)
        self.deadline = time.monotonic() + config.startup_timeout_s
        self.item = -1
        self.task_id = -1
        self.loaded: set[bytes] = set()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()

    def server_died(self) -> bool:
        """Whether this worker's exit report is its forkserver's death (it reads as exit code 255)
        while the worker itself lives on."""
        if self.start_method != "forkserver" or self.process.exitcode != 255:
            return False
        try:
            with open(f"/proc/{self.process.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False


def start_worker(ctx, config: PoolConfig) -> WorkerHandle:
    """A new worker; a forkserver that a reward killed is restarted on the way (multiprocessing
    relaunches a dead one, once it has seen it exit: meanwhile connecting fails).

    Raises:
        RewardPoolError: no process server comes back.
    """
    for attempt in range(_SERVER_TRIES):
        try:
            return WorkerHandle(ctx, config)
        except (OSError, EOFError) as exc:
            error = exc
            time.sleep(0.05 * 2**attempt)
    raise RewardPoolError(f"cannot start a reward worker: its process server is gone and does not come back "
                          f"({worker_process.first_line(error)})")


def forkserver_pid() -> int | None:
    from multiprocessing import forkserver

    return getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
