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
exits by itself (see ``worker_process``). Workers ignore SIGINT and SIGTERM, which reach a
whole process group (Ctrl-C, SLURM): the parent decides. Starting, watching and replacing
the workers is ``pool_fleet``'s part; this module hands them a batch's items.
"""

from __future__ import annotations

import collections
import pickle
import time
from typing import Any, Sequence

from podsjax.rewards import worker_process
from podsjax.rewards.combine import RewardScores, RewardsLike, as_batch, as_weighted, summarize
from podsjax.rewards.pool_batch import Batch
from podsjax.rewards.pool_fleet import MAX_SERVER_DEATHS, WorkerFleet  # noqa: F401 - MAX_SERVER_DEATHS: API too
from podsjax.rewards.pool_workers import (  # noqa: F401 - DEFAULT_PRELOAD and PoolConfig are this module's API too
    DEFAULT_PRELOAD,
    PoolConfig,
    RewardPoolError,
)


def _pickle_rewards(weighted) -> bytes:
    for w in weighted:
        try:
            pickle.dumps(w.fn)
        except Exception as exc:  # noqa: BLE001 - turned into a one-line error
            raise TypeError(
                f"reward {w.name!r} cannot be sent to a worker process ({worker_process.first_line(exc)}); "
                "define it at module level (a lambda or local function does not pickle)"
            ) from None
    return pickle.dumps(tuple(w.fn for w in weighted))


class RewardPool(WorkerFleet):
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

    def __enter__(self) -> "RewardPool":
        return self.start()

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
        completions = as_batch(completions, columns)
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
                    self._warnings.once(("batch", f"warning: scoring a batch of {num_items} items took longer "
                                                  f"than batch_timeout_s {limit:g} s; its {len(pending)} items left "
                                                  "score 0 (counted in reward/timeouts)"))
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
                self._warnings.drain(state.notes)
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
