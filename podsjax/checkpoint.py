"""Checkpoints with orbax: periodic async saves, keep-last-K, exact resume.

A checkpoint holds three items, each written by orbax into one step directory:

- ``state``: any pytree of arrays (in practice the ``TrainState``: params or LoRA params,
  optimizer state, step, RNG). It is stored as a *flat* dict keyed by the leaf paths
  (``"opt_state/0/mu/params/w"``), so the on-disk layout does not depend on which pytree
  classes the caller uses, and a mismatch can be reported by leaf name. Typed PRNG keys
  (``jax.random.key``) are stored as their raw ``key_data`` and re-wrapped on restore.
- ``host``: a small JSON dict of host-side progress (data position, elapsed training
  seconds, ...).
- ``checksums``: one 32-bit checksum per state leaf, computed on the devices at save
  time (a position-weighted sum of the raw bits, so a flipped byte or a swapped block
  changes it). Restore recomputes them and refuses a checkpoint whose arrays changed.

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
import json
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

_STATE = "state"
_HOST = "host"
_SUMS = "checksums"
_ROOT = "root"  # name of the only leaf when the state is a bare array
CORRUPT_SUFFIX = ".corrupt"


class CheckpointCorrupt(ValueError):
    """A checkpoint's files are damaged: they do not load, or their arrays fail the checksums."""


class CheckpointMismatch(ValueError):
    """A checkpoint is whole but holds another state's leaves, shapes or dtypes."""


def _first_line(exc: BaseException) -> str:
    """The first line of an error, without the kilobyte of JSON spec that tensorstore appends."""
    line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return line.split(" [tensorstore_spec=")[0]


def _leaf_checksum(x: jax.Array) -> jax.Array:
    """A uint32 checksum of ``x``'s raw bits: sum over i of bits[i] * (i mod 65521 + 1), wrapping.

    Integer sums wrap the same way in any order, so the value does not depend on the
    sharding or the reduction order of the device that computes it.
    """
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    else:
        width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
        bits = jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)  # 8-byte types gain a trailing axis
    flat = bits.reshape(-1)
    weights = (jnp.arange(flat.shape[0], dtype=jnp.uint32) % jnp.uint32(65521)) + jnp.uint32(1)
    return jnp.sum(flat * weights, dtype=jnp.uint32)


_checksum = jax.jit(_leaf_checksum)


def _host_checksums(flat: dict[str, Any]) -> dict[str, int]:
    # One program per leaf shape and placement (leaves may live on different devices), each
    # finished before the next starts (fake CPU devices: docs/reliability.md, "Not promised").
    return {p: int(jax.device_get(_checksum(x))) for p, x in flat.items()}


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


def _key_name(entry: Any) -> str:
    for attr in ("key", "name", "idx"):  # DictKey/FlattenedIndexKey, GetAttrKey, SequenceKey
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def _leaf_paths(tree: Any) -> tuple[list[str], list[Any], Any]:
    """Flattens ``tree`` into ``(paths, leaves, treedef)`` with unique '/'-joined paths."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths = ["/".join(_key_name(k) for k in path) or _ROOT for path, _ in with_path]
    if len(set(paths)) != len(paths):
        dup = next(p for p in paths if paths.count(p) > 1)
        raise ValueError(f"two state leaves share the checkpoint name {dup!r}; rename one of the keys")
    return paths, [leaf for _, leaf in with_path], treedef


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def _key_impl(abstract_key: jax.ShapeDtypeStruct) -> Any:
    # jax.random.key_impl only takes key arrays, so read it off a tracer of that type.
    found = []
    jax.eval_shape(lambda k: found.append(jax.random.key_impl(k)) or k, abstract_key)
    return found[0]


def _abstract_leaf(path: str, leaf: Any) -> jax.ShapeDtypeStruct:
    """The orbax restore target for one leaf of the caller's abstract state."""
    if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
        raise TypeError(f"abstract state leaf {path!r} must be a jax.ShapeDtypeStruct or array, got {type(leaf).__name__}")
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        # Unsharded targets land on this process's first device, like jnp.asarray does.
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    shape, dtype = tuple(leaf.shape), leaf.dtype
    if _is_key(leaf):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, dtype))
        if isinstance(sharding, jax.sharding.NamedSharding):
            # A spec shorter than the rank leaves the trailing key-data axis replicated.
            sharding = jax.sharding.NamedSharding(sharding.mesh, sharding.spec)
        elif not isinstance(sharding, jax.sharding.SingleDeviceSharding):
            raise TypeError(f"PRNG key leaf {path!r}: only NamedSharding or single-device targets are supported")
        shape, dtype = tuple(data.shape), data.dtype
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


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
        self._clock = clock
        options = dict(enable_async_checkpointing=config.async_save, create=True,
                       cleanup_tmp_directories=True)
        if config.keep_last is not None:
            options["preservation_policy"] = ocp.checkpoint_managers.LatestN(config.keep_last)
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(**options),
            item_handlers={_STATE: ocp.StandardCheckpointHandler(), _HOST: ocp.JsonCheckpointHandler(),
                           _SUMS: ocp.JsonCheckpointHandler()},
        )
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
        host_state = {} if host_state is None else host_state
        if not isinstance(host_state, Mapping):
            raise ValueError(f"host_state must be a dict, got {type(host_state).__name__}")
        try:
            host_json = json.loads(json.dumps(dict(host_state)))
        except (TypeError, ValueError) as e:
            raise ValueError(f"host_state is not JSON-serializable: {e}") from None
        if not (force or self.should_save(step, now)):
            return False
        if step in self._manager.all_steps():
            return False  # already saved (e.g. a forced final save right after a periodic one)
        paths, leaves, _ = _leaf_paths(state)
        if not paths:
            raise ValueError("state has no array leaves to checkpoint")
        flat = {p: (jax.random.key_data(x) if _is_key(x) else x) for p, x in zip(paths, leaves)}
        sums = _host_checksums(flat)
        self._manager.save(
            step,
            args=ocp.args.Composite(**{_STATE: ocp.args.StandardSave(flat), _HOST: ocp.args.JsonSave(host_json),
                                       _SUMS: ocp.args.JsonSave(sums)}),
            force=True,  # the decision is ours; orbax's own interval policy must not veto it
        )
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
        self._manager.wait_until_finished()
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"no checkpoint to restore in {self.directory}")
        if step is None:
            step = steps[-1]
        elif int(step) not in steps:
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory} (available: {steps})")
        step = int(step)
        paths, leaves, treedef = _leaf_paths(abstract_state)
        targets = {p: _abstract_leaf(p, x) for p, x in zip(paths, leaves)}
        where = f"checkpoint {self.directory}/{step}"
        try:
            self._check_matches(step, targets)
            restored = self._manager.restore(step, args=ocp.args.Composite(**{
                _STATE: ocp.args.StandardRestore(targets), _HOST: ocp.args.JsonRestore(), _SUMS: ocp.args.JsonRestore()}))
        except CheckpointMismatch:
            raise
        except Exception as exc:  # orbax/tensorstore raise many types for damaged files
            raise CheckpointCorrupt(f"{where} does not load ({type(exc).__name__}: {_first_line(exc)})") from exc
        flat = restored[_STATE]
        expected, actual = restored[_SUMS] or {}, _host_checksums(flat)
        bad = sorted(p for p in actual if expected.get(p) != actual[p])
        if bad:
            raise CheckpointCorrupt(f"{where}: {len(bad)} array(s) fail their checksum, first {bad[0]!r}")
        out = [
            jax.random.wrap_key_data(flat[p], impl=_key_impl(x)) if _is_key(x) else flat[p]
            for p, x in zip(paths, leaves)
        ]
        self._last_saved_step = step
        return jax.tree_util.tree_unflatten(treedef, out), dict(restored[_HOST] or {})

    def restore_latest(self, abstract_state: Any, warn: Callable[[str], None] = print
                       ) -> tuple[Any, dict[str, Any], int] | None:
        """Restores the newest checkpoint that loads and passes its checksums.

        A newer checkpoint that is damaged is renamed ``<step>.corrupt`` next to the
        others (kept, not deleted) and ``warn`` is told; the one before it is tried.

        Returns:
            ``(state, host_state, step)``, or None when the directory holds no checkpoint.

        Raises:
            CheckpointCorrupt: checkpoints exist but none of them loads.
            CheckpointMismatch: a whole checkpoint holds another state (another config).
        """
        self._manager.wait_until_finished()
        steps = self.all_steps()
        moved = []
        for step in reversed(steps):
            try:
                state, host = self.restore(abstract_state, step)
            except CheckpointCorrupt as exc:
                moved.append(self._move_aside(step))
                warn(f"warning: {exc}; moved it to {moved[-1]} and trying the checkpoint before it")
                continue
            if moved:
                self._manager.reload()
            return state, host, step
        if moved:
            self._manager.reload()
            raise CheckpointCorrupt(f"no checkpoint in {self.directory} loads; the damaged ones were moved to "
                                    f"*{CORRUPT_SUFFIX}; start again with --overwrite")
        return None

    def _move_aside(self, step: int) -> str:
        source = os.path.join(self.directory, str(step))
        target = source + CORRUPT_SUFFIX
        if jax.process_index() == 0:
            suffix = 0
            while os.path.exists(target):  # a second damaged copy of the same step
                suffix += 1
                target = f"{source}{CORRUPT_SUFFIX}{suffix}"
            os.rename(source, target)
        return target

    def _check_matches(self, step: int, targets: dict[str, jax.ShapeDtypeStruct]) -> None:
        metadata = self._manager.item_metadata(step)[_STATE]  # None when its files are gone
        saved = None if metadata is None else metadata.tree
        where = f"checkpoint {self.directory}/{step}"
        if not saved:
            raise CheckpointCorrupt(f"{where} has no readable array metadata")
        missing = [p for p in targets if p not in saved]
        if missing:
            raise CheckpointMismatch(f"{where} has no leaf {missing[0]!r} that the target state expects ({len(missing)} missing)")
        extra = [p for p in saved if p not in targets]
        if extra:
            raise CheckpointMismatch(f"{where} has leaf {extra[0]!r} that the target state lacks ({len(extra)} extra)")
        for p, t in targets.items():
            s = saved[p]
            if tuple(s.shape) != tuple(t.shape):
                raise CheckpointMismatch(f"{where}: leaf {p!r} has shape {tuple(s.shape)}, target expects {tuple(t.shape)}")
            if np.dtype(s.dtype) != np.dtype(t.dtype):
                raise CheckpointMismatch(f"{where}: leaf {p!r} has dtype {np.dtype(s.dtype)}, target expects {np.dtype(t.dtype)}")

    def delete(self, step: int) -> None:
        """Deletes the checkpoint of ``step`` (after any pending save has committed)."""
        self._manager.wait_until_finished()
        self._manager.delete(int(step))

    # -- lifecycle ---------------------------------------------------------------------

    def wait_until_finished(self) -> None:
        """Blocks until a background save (if any) is committed; re-raises its error."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases orbax resources. Idempotent."""
        if not self._closed:
            self._closed = True
            self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
