"""Checkpoints with orbax: periodic async saves, keep-last-K, exact resume.

A checkpoint holds three items, each written by orbax into one step directory:

- ``state``: any pytree of arrays (in practice the ``TrainState``: params or LoRA params,
  optimizer state, step, RNG). It is stored as a *flat* dict keyed by the leaf paths
  (``"opt_state/0/mu/params/w"``), so the on-disk layout does not depend on which pytree
  classes the caller uses, and a mismatch can be reported by leaf name. Typed PRNG keys
  (``jax.random.key``) are stored as their raw ``key_data`` and re-wrapped on restore
  (``checkpoint_layout``).
- ``host``: a small JSON dict of host-side progress (data position, elapsed training
  seconds, ...).
- ``checksums``: one 32-bit checksum per state leaf, computed on the devices at save
  time (a position-weighted sum of the raw bits, so a flipped byte or a swapped block
  changes it). Restore recomputes them and refuses a checkpoint whose arrays changed
  (``checkpoint_integrity``).

:meth:`Checkpointer.restore_latest` restores the newest checkpoint that loads and
passes its checksums; a newer one that does not is renamed ``<step>.corrupt`` (kept
for inspection, never deleted) with a warning.

Atomicity comes from orbax: a step is written into ``<step>.orbax-checkpoint-tmp*`` and
renamed to ``<step>`` only after every item is complete, and only renamed directories are
listed. A crash mid-save leaves a tmp directory that is ignored, and removed the next
time a :class:`Checkpointer` opens the directory. Checkpoints beyond ``keep_last`` are
deleted only after the new one is committed, so the newest checkpoint is always whole.

Donation: with ``async_save`` orbax copies every array to host memory *before*
:meth:`Checkpointer.save` returns and writes the files in a background thread, so the
caller may donate the saved state's buffers to the next jitted step right after ``save``
returns.

Example:
    >>> ckpt = Checkpointer(CheckpointConfig("/tmp/run/ckpt", save_every_seconds=1800))
    >>> state, host = ckpt.restore(abstract_state)            # on resume
    >>> ckpt.save(step, state, {"data_position": 17})         # every step; saves when due
    >>> ckpt.close()
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from podsjax.run.checkpoint_integrity import (CheckpointCorrupt, CheckpointMismatch, check_matches, first_line, host_checksums, verify_checksums)
from podsjax.run.checkpoint_layout import (CHECKSUMS_ITEM, CORRUPT_SUFFIX, HOST_ITEM, STATE_ITEM, abstract_leaf, flat_state, host_json, leaf_paths, move_aside, open_manager, restore_args, save_args, saved_leaves, unflatten_state)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """When and where to checkpoint.

    Attributes:
        directory: root directory; step ``s`` lives in ``directory/s``.
        save_every_steps: save when ``step % save_every_steps == 0`` (None: never by step).
        save_every_seconds: save when this many seconds of the checkpointer's clock have
            passed since the last save (None: never by time).
        keep_last: how many of the newest checkpoints to keep; older ones are deleted.
            None keeps all.
        async_save: write files in a background thread (the call still blocks for the
            device-to-host copy).
    """

    directory: str
    save_every_steps: int | None = None
    save_every_seconds: float | None = None
    keep_last: int | None = 3
    async_save: bool = True

    def __post_init__(self):
        if not isinstance(self.directory, (str, os.PathLike)) or not str(self.directory):
            raise ValueError(f"CheckpointConfig.directory must be a non-empty path, got {self.directory!r}")
        if self.save_every_steps is not None and (
            isinstance(self.save_every_steps, bool) or not isinstance(self.save_every_steps, int)
            or self.save_every_steps < 1
        ):
            raise ValueError(f"save_every_steps must be a positive int or None, got {self.save_every_steps!r}")
        if self.save_every_seconds is not None and not (
            isinstance(self.save_every_seconds, (int, float))
            and math.isfinite(self.save_every_seconds) and self.save_every_seconds > 0
        ):
            raise ValueError(f"save_every_seconds must be a finite number > 0 or None, got {self.save_every_seconds!r}")
        if self.keep_last is not None and (
            isinstance(self.keep_last, bool) or not isinstance(self.keep_last, int) or self.keep_last < 1
        ):
            raise ValueError(f"keep_last must be an int >= 1 or None, got {self.keep_last!r}")


class Checkpointer:
    """Periodic, atomic, optionally async checkpoints of a pytree plus a host dict.

    Every process of a multi-host run must make the same calls in the same order.

    Args:
        config: the :class:`CheckpointConfig`.
        clock: the clock the ``save_every_seconds`` trigger reads when ``now`` is not
            passed; pass the training clock to exclude evaluation time, as the paper does.
    """

    def __init__(self, config: CheckpointConfig, *, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.directory = os.path.abspath(os.fspath(config.directory))
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):  # orbax's threads would report it
            raise ValueError(f"checkpoint directory {self.directory} is a file")
        self._clock = clock
        self._manager = open_manager(self.directory, config.keep_last, config.async_save)
        self._last_saved_step = self._manager.latest_step()
        # Set lazily by the first should_save/save, so a clock that the caller restores
        # after construction (elapsed training seconds) does not trigger a spurious save.
        self._last_save_time: float | None = None
        self._closed = False

    # -- queries -----------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Steps with a committed (or in-flight async) checkpoint, ascending."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest checkpointed step, or None when there is none."""
        return self._manager.latest_step()

    def should_save(self, step: int, now: float | None = None) -> bool:
        """Whether ``step`` is due: every N steps, or T clock seconds since the last save.

        A step at or below the last saved (or restored) step is never due. In multi-host
        runs the time trigger's decision is taken on process 0 and broadcast, since the
        hosts' clocks differ and a save must be entered by all of them.
        """
        step = int(step)
        if self._last_saved_step is not None and step <= self._last_saved_step:
            return False
        cfg = self.config
        if cfg.save_every_steps is not None and step > 0 and step % cfg.save_every_steps == 0:
            return True
        if cfg.save_every_seconds is None:
            return False
        now = self._clock() if now is None else float(now)
        if self._last_save_time is None:
            self._last_save_time = now
        due = now - self._last_save_time >= cfg.save_every_seconds
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            due = bool(multihost_utils.broadcast_one_to_all(np.asarray(due)))
        return due

    # -- save / restore ----------------------------------------------------------------

    def save(self, step: int, state: Any, host_state: Mapping[str, Any] | None = None, *,
             force: bool = False, now: float | None = None) -> bool:
        """Saves ``state`` and ``host_state`` as ``step`` if due (or ``force``).

        Returns once the arrays are copied to host memory, so the caller may then donate
        or overwrite the state's buffers. With ``async_save`` the files are written in the
        background; a later save, :meth:`wait_until_finished` or :meth:`close` waits.

        Args:
            step: training step number (a Python int or a scalar array).
            state: pytree of arrays; typed PRNG key leaves are stored as key data.
            host_state: JSON-serializable dict of host-side progress.
            force: save even if :meth:`should_save` says no (e.g. the final step).
            now: clock reading for the time trigger (default: the checkpointer's clock).

        Returns:
            True if a save was started; False if it was not due or ``step`` is on disk.

        Raises:
            ValueError: ``host_state`` is not a JSON-serializable dict, or the state has
                no array leaves or two leaves with the same path name.
        """
        step = int(step)
        host = host_json(host_state)
        if not (force or self.should_save(step, now)):
            return False
        if step in self._manager.all_steps():
            return False  # already saved (e.g. a forced final save right after a periodic one)
        flat = flat_state(state)
        # force: the decision is ours; orbax's own interval policy must not veto it.
        self._wait()  # an earlier save's error surfaces here, with the steps on disk read again
        self._manager.save(step, args=save_args(flat, host, host_checksums(flat)), force=True)
        self._last_saved_step = step
        self._last_save_time = self._clock() if now is None else float(now)
        return True

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """Restores a checkpoint straight into the target shardings.

        Args:
            abstract_state: pytree like the saved state whose leaves are
                ``jax.ShapeDtypeStruct`` (with ``.sharding``) or arrays; leaves without a
                sharding go to this process's first device. The sharding may differ from
                the one the checkpoint was saved with.
            step: which step to restore; None restores the newest.

        Returns:
            ``(state, host_state)``: ``state`` has the structure of ``abstract_state``, typed
            key leaves re-wrapped with the target's PRNG implementation.

        Raises:
            FileNotFoundError: no checkpoint (or none for ``step``) in the directory.
            CheckpointMismatch: the checkpoint's leaves differ from the target's in name,
                shape or dtype; the message names the first offending leaf.
            CheckpointCorrupt: its files do not load, or an array fails its checksum.
        """
        self._wait()
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"no checkpoint to restore in {self.directory}")
        if step is None:
            step = steps[-1]
        elif int(step) not in steps:
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory} (available: {steps})")
        step = int(step)
        paths, leaves, _ = leaf_paths(abstract_state)
        targets = {p: abstract_leaf(p, x) for p, x in zip(paths, leaves)}
        where = f"checkpoint {self.directory}/{step}"
        try:
            check_matches(saved_leaves(self._manager, step), targets, where)
            restored = self._manager.restore(step, args=restore_args(targets))
        except CheckpointMismatch:
            raise
        except Exception as exc:  # orbax/tensorstore raise many types for damaged files
            raise CheckpointCorrupt(f"{where} does not load ({type(exc).__name__}: {first_line(exc)})",
                                    proven=False) from exc
        verify_checksums(restored[STATE_ITEM], restored[CHECKSUMS_ITEM], where)
        self._last_saved_step = step
        return unflatten_state(restored[STATE_ITEM], abstract_state), dict(restored[HOST_ITEM] or {})

    def restore_latest(self, abstract_state: Any, warn: Callable[[str], None] = print
                       ) -> tuple[Any, dict[str, Any], int] | None:
        """Restores the newest checkpoint that loads and passes its checksums.

        A newer checkpoint that is damaged is renamed ``<step>.corrupt`` next to the
        others (kept, not deleted) and ``warn`` is told; the one before it is tried. A
        checkpoint that failed to load without proof of damage (a checksum, unreadable
        metadata) is moved aside only once an older one loads into the same target: when
        none loads, the fault may be this process's (its memory, the target's shardings),
        and those checkpoints stay as they are.

        Returns:
            ``(state, host_state, step)``, or None when the directory holds no checkpoint.

        Raises:
            CheckpointCorrupt: checkpoints exist but none of them loads.
            CheckpointMismatch: a whole checkpoint holds another state (another config).
        """
        self._wait()
        return _restore_newest(self, abstract_state, warn)

    def delete(self, step: int) -> None:
        """Deletes the checkpoint of ``step`` (after any pending save has committed)."""
        self._wait()
        self._manager.delete(int(step))

    # -- lifecycle ---------------------------------------------------------------------

    def wait_until_finished(self) -> None:
        """Blocks until a background save (if any) is committed; re-raises its error."""
        self._wait()

    def _wait(self) -> None:
        try:
            self._manager.wait_until_finished()
        except BaseException:
            # A failed background save (a full disk) left orbax's list of steps empty, though
            # the committed ones are whole on disk: read them again, then raise.
            self._manager.reload()
            raise

    def close(self) -> None:
        """Waits for pending saves and releases orbax resources. Idempotent."""
        if not self._closed:
            self._closed = True
            self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _restore_newest(ck: Checkpointer, abstract_state: Any, warn: Callable[[str], None]
                    ) -> tuple[Any, dict[str, Any], int] | None:
    """:meth:`Checkpointer.restore_latest`'s walk from the newest step back."""
    steps = ck.all_steps()
    moved, unproven = [], []
    for step in reversed(steps):
        try:
            state, host = ck.restore(abstract_state, step)
        except CheckpointCorrupt as exc:
            if exc.proven:
                moved.append(move_aside(ck.directory, step))
                warn(f"warning: {exc}; moved it to {moved[-1]} and trying the checkpoint before it")
            else:
                unproven.append((step, exc))
            continue
        for newer, exc in unproven:  # an older one loads into the same target: the newer files are at fault
            moved.append(move_aside(ck.directory, newer))
            warn(f"warning: {exc}; moved it to {moved[-1]}, as step {step} loads")
        if moved:
            ck._manager.reload()
        return state, host, step
    if moved:
        ck._manager.reload()
    for _, exc in unproven:
        warn(f"warning: {exc}")
    if moved or unproven:
        names = ", ".join(str(s) for s, _ in sorted(unproven))
        kept = (f"; {'steps' if len(unproven) > 1 else 'step'} {names} left in place (no proof of damage: check "
                "this machine's memory, disk and the run's devices, then resume again)" if unproven else "")
        aside = f"; the damaged ones were moved to *{CORRUPT_SUFFIX}" if moved else ""
        raise CheckpointCorrupt(f"no checkpoint in {ck.directory} loads{aside}{kept}; or start again with "
                                "--overwrite")
    return None
