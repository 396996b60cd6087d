"""A process pool that scores completions with a per-item timeout and survives bad items.

Model output is adversarial input to a reward: sympy can hang on ``5^{5^{5^{5}}}``,
a regex can backtrack forever, a C extension can crash. ``RewardPool`` sends one
item (one completion and its row of columns) at a time to each worker process:

* a reward stuck in Python code hits a CPU-time alarm inside the worker and
  scores 0 (``reward/timeouts``); the worker lives on;
* a worker that misses the wall-clock deadline (stuck in C code, sleeping) is
  killed and replaced; its item scores 0 (``reward/timeouts``);
* a worker that dies (segfault, ``os._exit``, the OOM killer) is replaced; its
  item scores 0 (``reward/crashes``);
* an allocation past ``max_memory_mb`` raises MemoryError in the worker; the item
  scores 0 (``reward/memory_errors``);
* a reward that raises scores 0 for that function (``reward/errors``, logged).

Workers start with the 'forkserver' (default) or 'spawn' method, never 'fork':
the parent runs JAX, which is multithreaded, and forking it is unsafe. Start the
pool once and reuse it across steps; start-up costs seconds.

No worker outlives its pool: ``close()`` kills busy workers at once, a pool still open
at interpreter exit is closed then, and a worker whose parent dies (SIGKILL, a crash)
exits by itself (see ``_worker``). Workers ignore SIGINT and SIGTERM, which reach a
whole process group (Ctrl-C, SLURM): the parent decides.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import logging
import multiprocessing
import multiprocessing.util
import os
import pickle
import time
import weakref
from multiprocessing.connection import wait
from typing import Any, Sequence

import numpy as np

from podsjax.rewards import _worker
from podsjax.rewards.combine import RewardScores, RewardsLike, as_weighted, check_columns, summarize

logger = logging.getLogger(__name__)

# Imported once in the forkserver, so replacing a dead worker costs a fork, not imports.
DEFAULT_PRELOAD = ("podsjax.rewards", "math_verify", "sympy")


# Open pools, closed at interpreter exit. multiprocessing's own exit hook sends its daemon
# processes SIGTERM and joins them, and workers ignore SIGTERM: registered after that hook
# (multiprocessing.util is imported above), this one runs first.
_OPEN_POOLS: "weakref.WeakSet[RewardPool]" = weakref.WeakSet()


@atexit.register
def _close_open_pools() -> None:
    for pool in list(_OPEN_POOLS):
        pool.close()


class RewardPoolError(RuntimeError):
    """The pool cannot do its job (a worker cannot start or cannot load a reward)."""


def _default_workers() -> int:
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
    """

    max_workers: int
    timeout_s: float = 10.0
    kill_grace_s: float = 1.0
    max_memory_mb: int | None = 4096
    start_method: str = "forkserver"
    preload: tuple[str, ...] = DEFAULT_PRELOAD
    startup_timeout_s: float = 120.0

    def __post_init__(self):
        if not isinstance(self.max_workers, int) or self.max_workers < 1:
            raise ValueError(f"max_workers must be a positive int, got {self.max_workers!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if not self.kill_grace_s >= 0:
            raise ValueError(f"kill_grace_s must be >= 0, got {self.kill_grace_s!r}")
        if self.max_memory_mb is not None and self.max_memory_mb < 64:
            raise ValueError(f"max_memory_mb must be None or >= 64, got {self.max_memory_mb!r}")
        if self.start_method not in ("forkserver", "spawn"):
            raise ValueError(
                f"start_method must be 'forkserver' or 'spawn' (fork is unsafe under JAX), got {self.start_method!r}"
            )
        if not self.startup_timeout_s > 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {self.startup_timeout_s!r}")
        object.__setattr__(self, "preload", tuple(self.preload))


class _Worker:
    """Parent-side handle: the process, its pipe, and what it is doing."""

    def __init__(self, ctx, config: PoolConfig):
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=_worker.main, args=(child_conn, config.max_memory_mb, config.preload), daemon=True
        )
        self.process.start()
        child_conn.close()
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


def _pickle_rewards(weighted) -> bytes:
    for w in weighted:
        try:
            pickle.dumps(w.fn)
        except Exception as exc:  # noqa: BLE001 - turned into a one-line error
            raise TypeError(
                f"reward {w.name!r} cannot be sent to a worker process ({_worker.first_line(exc)}); "
                "define it at module level (a lambda or local function does not pickle)"
            ) from None
    return pickle.dumps(tuple(w.fn for w in weighted))


class RewardPool:
    """Scores completions in worker processes with per-item timeouts.

    Use as a context manager, started once and reused across steps::

        with RewardPool(max_workers=8, timeout_s=5) as pool:
            for step in ...:
                scores = pool.score(completions, default_rewards("gsm8k"), answer=gold_B)

    Args:
        max_workers: worker processes (default: usable CPUs, at most 8).
        **settings: the other fields of PoolConfig.
    """

    def __init__(self, max_workers: int | None = None, **settings: Any):
        self.config = PoolConfig(max_workers=_default_workers() if max_workers is None else max_workers, **settings)
        self._ctx = multiprocessing.get_context(self.config.start_method)
        self._workers: list[_Worker] = []
        self._task_ids = 0
        self.restarts = 0

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> "RewardPool":
        """Starts the workers and waits until they are ready; a no-op when running."""
        if self._workers:
            return self
        if self.config.start_method == "forkserver":
            # Only takes effect if this process has not started its forkserver yet.
            self._ctx.set_forkserver_preload(list(self.config.preload))
        _OPEN_POOLS.add(self)
        self._workers = [_Worker(self._ctx, self.config) for _ in range(self.config.max_workers)]
        try:
            while any(w.state == "starting" for w in self._workers):
                self._pump(None)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stops the workers and waits for them to exit; idempotent.

        Idle workers are asked to stop; busy ones (a reward in flight may hang) are killed at once.
        """
        workers, self._workers = self._workers, []
        _OPEN_POOLS.discard(self)
        for w in workers:
            if w.state != "idle":
                w.kill()
                continue
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 2.0
        for w in workers:
            w.process.join(timeout=max(0.0, deadline - time.monotonic()))
            w.kill()

    def __enter__(self) -> "RewardPool":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self):
        # Daemonic workers die with the interpreter anyway; this covers a pool
        # dropped without close() in a long-lived process.
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    @property
    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in self._workers]

    # ------------------------------------------------------------------ scoring

    def score(self, completions: Sequence[str], rewards: RewardsLike, **columns: Sequence[Any]) -> RewardScores:
        """Scores every completion with every reward function.

        Args:
            completions: [B] decoded completions.
            rewards: reward specs (see ``combine.as_weighted``); functions must be
                importable by name in a fresh process.
            **columns: dataset columns, each a list of B values (the gold in ``answer``).

        Returns:
            RewardScores in input order; items that failed score 0 for the failing
            functions and are counted in ``metrics``.
        """
        start = time.perf_counter()
        weighted = as_weighted(rewards)
        completions = list(completions)
        check_columns(len(completions), columns)
        blob = _pickle_rewards(weighted)
        self.start()
        restarts_before = self.restarts
        num_items, num_fns = len(completions), len(weighted)
        state = _Batch(num_fns, num_items, [w.name for w in weighted])
        pending = collections.deque(range(num_items))
        wall_s = self.config.timeout_s * num_fns + self.config.kill_grace_s
        try:
            self._replace_dead()
            while state.done < num_items:
                for w in self._workers:
                    if w.state != "idle":
                        continue
                    if blob not in w.loaded:
                        self._send(w, ("load", blob), "loading", self.config.startup_timeout_s)
                    elif pending:
                        i = pending.popleft()
                        row = {name: column[i] for name, column in columns.items()}
                        self._task_ids += 1
                        w.item, w.task_id = i, self._task_ids
                        message = ("score", w.task_id, blob, completions[i], row, self.config.timeout_s)
                        if not self._send(w, message, "busy", wall_s):
                            pending.appendleft(i)  # the worker was already dead; retry elsewhere
                self._pump(state, blob)
        except Exception:
            # Busy workers hold stale work; restart them so the next call starts clean.
            for slot, w in enumerate(self._workers):
                if w.state not in ("idle", "starting"):
                    self._replace(slot)
            raise
        except BaseException:
            # KeyboardInterrupt or a stop (SIGTERM): the process is on its way out, so no
            # replacements; a later call starts the pool again.
            self.close()
            raise
        state.counts["restarts"] = self.restarts - restarts_before
        return summarize(weighted, state.values_FB, state.failed_B, state.counts, time.perf_counter() - start)

    # ---------------------------------------------------------------- internals

    def _send(self, w: _Worker, message, new_state: str, budget_s: float) -> bool:
        try:
            w.conn.send(message)
        except (OSError, ValueError):
            self._replace(self._workers.index(w))
            return False
        w.state, w.deadline = new_state, time.monotonic() + budget_s
        return True

    def _replace(self, slot: int) -> None:
        self._workers[slot].kill()
        self._workers[slot] = _Worker(self._ctx, self.config)
        self.restarts += 1

    def _replace_dead(self) -> None:
        for slot, w in enumerate(self._workers):
            if not w.process.is_alive():
                self._replace(slot)

    def _pump(self, state: "_Batch | None", blob: bytes | None = None) -> None:
        """Waits for one round of replies, deaths or deadlines and handles them."""
        active = [w for w in self._workers if w.state != "idle"]
        if not active:
            return
        by_handle = {}
        for w in active:
            by_handle[w.conn] = w
            by_handle[w.process.sentinel] = w
        timeout = max(0.0, min(w.deadline for w in active) - time.monotonic())
        ready = set(wait(list(by_handle), timeout=timeout))
        for w in active:
            if w.conn not in ready and w.process.sentinel not in ready:
                continue
            message = None
            if w.conn in ready or w.conn.poll():
                try:
                    message = w.conn.recv()
                except (EOFError, OSError):
                    message = None
            if message is None:
                self._on_death(w, state)
            elif message[0] == "ready":
                w.state = "idle"
            elif message[0] == "loaded":
                w.loaded.add(blob)
                w.state = "idle"
            elif message[0] == "fatal":
                raise RewardPoolError(message[1])
            elif message[0] == "scored" and state is not None and message[1] == w.task_id:
                state.record(w.item, message[2])
                w.state = "idle"
        now = time.monotonic()
        for slot, w in enumerate(self._workers):
            if w.state == "idle" or now < w.deadline:
                continue
            if w.state == "busy":
                state.fail(w.item, "timeouts")
                self._replace(slot)
            else:
                self.close()
                action = "start" if w.state == "starting" else "load the reward functions"
                raise RewardPoolError(f"a reward worker did not {action} within {self.config.startup_timeout_s} s")

    def _on_death(self, w: _Worker, state: "_Batch | None") -> None:
        slot = self._workers.index(w)
        if w.state in ("starting", "loading"):
            w.process.join(timeout=5)
            code = w.process.exitcode
            self.close()
            raise RewardPoolError(f"a reward worker exited with code {code} while {w.state}")
        if w.state == "busy" and state is not None:
            state.fail(w.item, "crashes")
        self._replace(slot)


class _Batch:
    """Results of one score() call as they arrive."""

    _COUNTER = {_worker.TIMEOUT: "timeouts", _worker.MEMORY: "memory_errors", _worker.ERROR: "errors"}

    def __init__(self, num_fns: int, num_items: int, names: list[str]):
        self.values_FB = np.zeros((num_fns, num_items), np.float64)
        self.failed_B = np.zeros(num_items, bool)
        self.counts: collections.Counter = collections.Counter()
        self.names = names
        self.done = 0
        self._logged_error = False

    def record(self, item: int, results: list[tuple[float, str, str]]) -> None:
        kinds = set()
        for f, (value, status, message) in enumerate(results):
            self.values_FB[f, item] = value
            if status != _worker.OK:
                kinds.add(self._COUNTER[status])
                if status == _worker.ERROR and not self._logged_error:
                    self._logged_error = True
                    logger.warning("reward %r raised on item %d (scored 0): %s", self.names[f], item, message)
        for kind in kinds:
            self.counts[kind] += 1
        self.failed_B[item] = bool(kinds)
        self.done += 1

    def fail(self, item: int, kind: str) -> None:
        self.values_FB[:, item] = 0.0
        self.failed_B[item] = True
        self.counts[kind] += 1
        self.done += 1
