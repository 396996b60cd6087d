"""A RewardPool's worker processes: starting them, reading their replies, noticing deaths and
missed deadlines, and replacing them (a forkserver that a reward killed included).

No worker outlives its pool: ``close()`` kills busy workers at once, and a pool still open at
interpreter exit is closed then.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.util
import time
import weakref
from multiprocessing.connection import wait
from typing import Any, Callable

from podsjax.rewards.pool_batch import Batch, Warnings
from podsjax.rewards.pool_workers import PoolConfig, RewardPoolError, WorkerHandle, default_workers, start_worker

# Restarts of a killed forkserver one batch survives before it stops.
MAX_SERVER_DEATHS = 3


# Open pools, closed at interpreter exit. multiprocessing's own exit hook sends its daemon
# processes SIGTERM and joins them, and workers ignore SIGTERM: registered after that hook
# (multiprocessing.util is imported above), this one runs first.
_OPEN_POOLS: "weakref.WeakSet[WorkerFleet]" = weakref.WeakSet()


@atexit.register
def _close_open_pools() -> None:
    for pool in list(_OPEN_POOLS):
        pool.close()


class WorkerFleet:
    """Worker processes that take one message at a time, kept at full strength.

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
        self._warnings = Warnings(warn)
        self._dead_servers: set[int | None] = set()  # forkserver pids seen dead

    def start(self, wait: bool = True) -> "WorkerFleet":
        """Starts the workers and waits until they are ready; a no-op when running.

        With ``wait=False`` it returns once they are launched, so they start up while the
        caller does other work; the next ``start()`` (the first ``score``) waits for them.
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

    def __enter__(self):
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

    # ------------------------------------------------------ workers and their replies

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

    def _replace_dead(self) -> None:
        for slot, w in enumerate(self._workers):
            if not w.process.is_alive():
                self._replace(slot)

    def _new_worker(self) -> WorkerHandle:
        try:
            return start_worker(self._ctx, self.config)
        except RewardPoolError:
            self.close()
            raise

    def _pump(self, state: Batch | None, blob: bytes | None = None) -> None:
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

    def _on_death(self, w: WorkerHandle, state: Batch | None) -> None:
        slot = self._workers.index(w)
        w.process.join(timeout=5)
        code = w.process.exitcode
        server_died = w.server_died()
        if server_died:
            self._on_server_death(w, state)
        elif w.state in ("starting", "loading"):
            self.close()
            raise RewardPoolError(f"a reward worker exited with code {code} while {w.state}")
        if w.state == "busy" and state is not None:
            state.fail(w.item, "crashes", function=w.current.value, exit_code=None if server_died else code)
        self._replace(slot)

    def _on_server_death(self, w: WorkerHandle, state: Batch | None) -> None:
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
        self._warnings.once(("server", f"warning: the reward pool's process server died (reward {name} may have "
                                       "killed it: a reward must not signal its parent); restarted it and its "
                                       "workers, and the items in flight count in reward/crashes"))
        deaths = sum(state.server_deaths.values())
        if deaths >= MAX_SERVER_DEATHS:
            worst = max(state.server_deaths, key=state.server_deaths.get)
            self.close()
            raise RewardPoolError(f"reward {state.name(worst)} killed the reward pool's process server {deaths} "
                                  "times in one batch; a reward must not signal its parent process")
