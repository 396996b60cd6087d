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
* a reward that raises scores 0 for that function (``reward/errors``, logged);
* a function that times out on ``give_up_after`` items in a row is not called again in that
  batch (it scores 0, ``reward/timeouts``); a batch that gives up on every function stops
  with ``RewardPoolError``, and a batch past ``batch_timeout_s`` scores what is left 0;
* a reward that kills the forkserver: the server and the workers are restarted (the items
  in flight count as ``reward/crashes``); a batch where that happens 3 times stops with
  ``RewardPoolError`` naming the reward;
* what rewards print reaches the console up to a budget, then ``output_log``.

The first NaN, error, crash, give-up and restart of a pool is one ``warning:`` line each.

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
import multiprocessing
import multiprocessing.util
import pickle
import time
import weakref
from multiprocessing.connection import wait
from typing import Any, Callable, Sequence

from podsjax.rewards import _worker
from podsjax.rewards.combine import RewardScores, RewardsLike, as_weighted, check_columns, summarize
from podsjax.rewards.pool_batch import Batch, Note
from podsjax.rewards.pool_workers import (  # noqa: F401 - DEFAULT_PRELOAD and PoolConfig are this module's API too
    DEFAULT_PRELOAD,
    PoolConfig,
    WorkerHandle,
    default_workers,
    forkserver_pid,
)

# Restarts of a killed forkserver one batch survives before it stops; tries to reach a new one.
MAX_SERVER_DEATHS = 3
_SERVER_TRIES = 5


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
        warn: takes each warning line (default: print).
        **settings: the other fields of PoolConfig.
    """

    def __init__(self, max_workers: int | None = None, *, warn: Callable[[str], None] | None = None,
                 **settings: Any):
        self.config = PoolConfig(max_workers=default_workers() if max_workers is None else max_workers, **settings)
        self._ctx = multiprocessing.get_context(self.config.start_method)
        self._workers: list[WorkerHandle] = []
        self._ready = False  # the workers started were waited for
        self._task_ids = 0
        self.restarts = 0
        self.server_restarts = 0
        self._warn = warn or (lambda line: print(line, flush=True))
        self._warned: set[str] = set()
        self._dead_servers: set[int | None] = set()  # forkserver pids seen dead

    # ----------------------------------------------------------------- lifecycle

    def start(self, wait: bool = True) -> "RewardPool":
        """Starts the workers and waits until they are ready; a no-op when running.

        With ``wait=False`` it returns once they are launched, so they start up while the
        caller does other work; the next ``start()`` (the first :meth:`score`) waits for them.
        """
        if not self._workers:
            if self.config.start_method == "forkserver":
                # Only takes effect if this process has not started its forkserver yet.
                self._ctx.set_forkserver_preload(list(self.config.preload))
            _OPEN_POOLS.add(self)
            self._workers = [self._new_worker() for _ in range(self.config.max_workers)]
            self._ready = False
        if wait and not self._ready:
            try:
                while any(w.state == "starting" for w in self._workers):
                    self._pump(None)
            except BaseException:
                self.close()
                raise
            self._ready = True
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
        state = Batch([w.name for w in weighted], num_items, self.config.give_up_after)
        pending = collections.deque(range(num_items))
        wall_s = self.config.timeout_s * num_fns + self.config.kill_grace_s
        limit = self.config.batch_timeout_s
        batch_deadline = float("inf") if limit is None else time.monotonic() + limit
        try:
            self._replace_dead()
            while state.done < num_items:
                if pending and time.monotonic() >= batch_deadline:
                    self._warn_once(("batch", f"warning: scoring a batch of {num_items} items took longer than "
                                              f"batch_timeout_s {limit:g} s; its {len(pending)} items left score 0 "
                                              "(counted in reward/timeouts)"))
                    while pending:
                        state.fail(pending.popleft(), "timeouts")
                for w in self._workers:
                    if w.state != "idle":
                        continue
                    if blob not in w.loaded:
                        self._send(w, ("load", blob), "loading", self.config.startup_timeout_s)
                    elif pending:
                        i = pending.popleft()
                        row = {name: column[i] for name, column in columns.items()}
                        self._task_ids += 1
                        w.item, w.task_id, w.current.value = i, self._task_ids, -1
                        skip = tuple(state.given_up)
                        message = ("score", w.task_id, blob, completions[i], row, self.config.timeout_s, skip)
                        budget = min(wall_s, max(0.0, batch_deadline - time.monotonic()))
                        if not self._send(w, message, "busy", budget):
                            pending.appendleft(i)  # the worker was already dead; retry elsewhere
                self._pump(state, blob)
                self._warn_notes(state.notes)
                if state.all_given_up and state.done < num_items:
                    names = ", ".join(repr(name) for name in state.names)
                    raise RewardPoolError(
                        f"every reward function ({names}) timed out on {self.config.give_up_after} items in a row, "
                        f"so no item can be scored: a reward hangs, or needs more than its {self.config.timeout_s:g} "
                        "s per item (--run.reward_timeout_s)")
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

    def _warn_once(self, note: Note) -> None:
        key, line = note
        if key not in self._warned:
            self._warned.add(key)
            self._warn(line)

    def _warn_notes(self, notes: list[Note]) -> None:
        for note in notes:
            self._warn_once(note)
        notes.clear()

    # ---------------------------------------------------------------- internals

    def _send(self, w: WorkerHandle, message, new_state: str, budget_s: float) -> bool:
        try:
            w.conn.send(message)
        except (OSError, ValueError):
            self._replace(self._workers.index(w))
            return False
        w.state, w.deadline = new_state, time.monotonic() + budget_s
        return True

    def _replace(self, slot: int) -> None:
        self._workers[slot].kill()
        self._workers[slot] = self._new_worker()
        self.restarts += 1

    def _new_worker(self) -> WorkerHandle:
        """A new worker; a forkserver that a reward killed is restarted on the way (multiprocessing
        relaunches a dead one, once it has seen it exit: meanwhile connecting fails)."""
        for attempt in range(_SERVER_TRIES):
            try:
                return WorkerHandle(self._ctx, self.config)
            except (OSError, EOFError) as exc:
                error = exc
                time.sleep(0.05 * 2**attempt)
        self.close()
        raise RewardPoolError(f"cannot start a reward worker: its process server is gone and does not come back "
                              f"({_worker.first_line(error)})")

    def _server_died(self, w: WorkerHandle) -> bool:
        """Whether ``w``'s exit report is its forkserver's death (it reads as exit code 255) while
        ``w`` itself lives on."""
        if self.config.start_method != "forkserver" or w.process.exitcode != 255:
            return False
        try:
            with open(f"/proc/{w.process.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False

    def _on_server_death(self, w: WorkerHandle, state: "Batch | None") -> None:
        """Counts a forkserver death once (every worker reports it), and stops a batch where
        rewards keep killing it."""
        if w.server in self._dead_servers:
            return
        self._dead_servers.add(w.server)
        self.server_restarts += 1
        for slot, other in enumerate(self._workers):  # its idle workers are cut off too
            if other is not w and other.server == w.server and other.state == "idle":
                self._replace(slot)
        # The function some worker ran last: the killer has usually replied by now, and its
        # neighbour is the one whose report of the death arrives.
        started = [x.current.value for x in (w, *self._workers) if x.current.value >= 0]
        culprit = started[0] if started else None
        if state is None:
            return
        state.server_deaths[culprit] += 1
        name = state.name(culprit)
        self._warn_once(("server", f"warning: the reward pool's process server died (reward {name} may have killed "
                                   "it: a reward must not signal its parent); restarted it and its workers, and the "
                                   "items in flight count in reward/crashes"))
        deaths = sum(state.server_deaths.values())
        if deaths >= MAX_SERVER_DEATHS:
            worst = max(state.server_deaths, key=state.server_deaths.get)
            self.close()
            raise RewardPoolError(f"reward {state.name(worst)} killed the reward pool's process server {deaths} "
                                  "times in one batch; a reward must not signal its parent process")

    def _replace_dead(self) -> None:
        for slot, w in enumerate(self._workers):
            if not w.process.is_alive():
                self._replace(slot)

    def _pump(self, state: "Batch | None", blob: bytes | None = None) -> None:
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
                state.fail(w.item, "timeouts", function=w.current.value)
                self._replace(slot)
            else:
                self.close()
                action = "start" if w.state == "starting" else "load the reward functions"
                raise RewardPoolError(f"a reward worker did not {action} within {self.config.startup_timeout_s} s")

    def _on_death(self, w: WorkerHandle, state: "Batch | None") -> None:
        slot = self._workers.index(w)
        w.process.join(timeout=5)
        code = w.process.exitcode
        server_died = self._server_died(w)
        if server_died:
            self._on_server_death(w, state)
        elif w.state in ("starting", "loading"):
            self.close()
            raise RewardPoolError(f"a reward worker exited with code {code} while {w.state}")
        if w.state == "busy" and state is not None:
            state.fail(w.item, "crashes", function=w.current.value, exit_code=None if server_died else code)
        self._replace(slot)

