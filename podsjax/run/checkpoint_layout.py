"""How a checkpoint lays out a state on disk, independent of the caller's pytree classes.

A checkpoint holds three items, each written by orbax into one step directory: the state as
a *flat* dict keyed by the leaf paths (``"opt_state/0/mu/params/w"``), a small JSON dict of
host-side progress, and the state leaves' checksums. Typed PRNG keys (``jax.random.key``) are
stored as their raw ``key_data`` and re-wrapped on restore. A damaged step directory is moved
aside to ``<step>.corrupt``, never deleted.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

STATE_ITEM = "state"
HOST_ITEM = "host"
CHECKSUMS_ITEM = "checksums"
CORRUPT_SUFFIX = ".corrupt"
# What a checkpoint folder holds: steps, damaged ones moved aside (``move_aside``), saves under way.
ENTRY = re.compile(rf"\d+({re.escape(CORRUPT_SUFFIX)}\d*)?|.+\.orbax-checkpoint-tmp.*")
_ROOT = "root"  # name of the only leaf when the state is a bare array


def _key_name(entry: Any) -> str:
    for attr in ("key", "name", "idx"):  # DictKey/FlattenedIndexKey, GetAttrKey, SequenceKey
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def leaf_paths(tree: Any) -> tuple[list[str], list[Any], Any]:
    """Flattens ``tree`` into ``(paths, leaves, treedef)`` with unique '/'-joined paths."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths = ["/".join(_key_name(k) for k in path) or _ROOT for path, _ in with_path]
    if len(set(paths)) != len(paths):
        dup = next(p for p in paths if paths.count(p) > 1)
        raise ValueError(f"two state leaves share the checkpoint name {dup!r}; rename one of the keys")
    return paths, [leaf for _, leaf in with_path], treedef


def is_key(x: Any) -> bool:
    """Whether ``x`` (an array or abstract array) holds typed PRNG keys."""
    return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def key_impl(abstract_key: jax.ShapeDtypeStruct) -> Any:
    """The PRNG implementation of an (abstract) typed key array."""
    # jax.random.key_impl only takes key arrays, so read it off a tracer of that type.
    found = []
    jax.eval_shape(lambda k: found.append(jax.random.key_impl(k)) or k, abstract_key)
    return found[0]


def abstract_leaf(path: str, leaf: Any) -> jax.ShapeDtypeStruct:
    """The orbax restore target for one leaf of the caller's abstract state."""
    if isinstance(leaf, (bool, int, float)):  # a Python number save() took: restored as JAX holds it
        leaf = jax.ShapeDtypeStruct((), jax.dtypes.canonicalize_dtype(np.result_type(leaf)))
    if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
        raise TypeError(f"abstract state leaf {path!r} must be a jax.ShapeDtypeStruct or array, got {type(leaf).__name__}")
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        # Unsharded targets land on this process's first device, like jnp.asarray does.
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    shape, dtype = tuple(leaf.shape), leaf.dtype
    if is_key(leaf):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, dtype))
        if isinstance(sharding, jax.sharding.NamedSharding):
            # A spec shorter than the rank leaves the trailing key-data axis replicated.
            sharding = jax.sharding.NamedSharding(sharding.mesh, sharding.spec)
        elif not isinstance(sharding, jax.sharding.SingleDeviceSharding):
            raise TypeError(f"PRNG key leaf {path!r}: only NamedSharding or single-device targets are supported")
        shape, dtype = tuple(data.shape), data.dtype
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def flat_state(state: Any) -> dict[str, Any]:
    """``state``'s leaves by path, typed PRNG keys as their key data: what the ``state`` item holds.

    Raises:
        ValueError: the state has no array leaves, or two leaves share a path name.
    """
    paths, leaves, _ = leaf_paths(state)
    if not paths:
        raise ValueError("state has no array leaves to checkpoint")
    for p, x in zip(paths, leaves):
        if not is_key(x):
            _check_storable(p, x)
    return {p: (jax.random.key_data(x) if is_key(x) else _as_jax_holds(x)) for p, x in zip(paths, leaves)}


def _as_jax_holds(x: Any) -> Any:
    """A Python number in the dtype JAX gives it (0.5 is float32 without x64), so that it is saved as
    it is restored; arrays as they are."""
    if isinstance(x, (bool, int, float)):
        return np.asarray(x, jax.dtypes.canonicalize_dtype(np.result_type(x)))
    return x


def _check_storable(path: str, x: Any) -> None:
    """One line for a leaf a save would fail on deep inside (text, an empty array: orbax left its
    temporary folder; complex or 4-bit values: the checksum) or restore changed (an int64 past
    int32's range comes back cut when JAX holds 32-bit integers)."""
    if not _numeric(x):
        raise ValueError(f"state leaf {path!r} is no array or number: {type(x).__name__}")
    dtype = np.result_type(x)
    if np.size(x) == 0:
        raise ValueError(f"state leaf {path!r} has no elements (shape {np.shape(x)}): orbax saves no empty array")
    if jnp.issubdtype(dtype, jnp.complexfloating) or _bits(dtype) < 8:
        raise ValueError(f"state leaf {path!r} is {dtype}, which a checkpoint does not store")
    if dtype.kind in "iu" and dtype.itemsize == 8 and not jax.config.jax_enable_x64 and not isinstance(x, jax.Array):
        narrow = np.iinfo(np.int32 if dtype.kind == "i" else np.uint32)
        low, high = int(np.min(x)), int(np.max(x))
        if low < narrow.min or high > narrow.max:
            raise ValueError(f"state leaf {path!r} holds {high if high > narrow.max else low}, past {narrow.dtype}: "
                             "JAX without x64 (jax_enable_x64) would restore it cut")


def _bits(dtype: np.dtype) -> int:
    """Bits a value takes (4 for int4, whose NumPy itemsize is a byte); 8 for other kinds."""
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.iinfo(dtype).bits
    return jnp.finfo(dtype).bits if jnp.issubdtype(dtype, jnp.floating) else 8


def _numeric(x: Any) -> bool:
    """An array (its dtype is orbax's to store) or a number; text and other objects are not."""
    return (hasattr(x, "dtype") and hasattr(x, "shape")) or isinstance(x, (bool, int, float, np.number))


def unflatten_state(flat: Mapping[str, Any], abstract_state: Any) -> Any:
    """The restored ``flat`` leaves in ``abstract_state``'s structure, typed keys re-wrapped with
    the target's PRNG implementation."""
    paths, leaves, treedef = leaf_paths(abstract_state)
    out = [jax.random.wrap_key_data(flat[p], impl=key_impl(x)) if is_key(x) else flat[p] for p, x in zip(paths, leaves)]
    return jax.tree_util.tree_unflatten(treedef, out)


def open_manager(directory: str, keep_last: int | None, async_save: bool) -> ocp.CheckpointManager:
    """An orbax manager of ``directory``'s step directories, each holding the three items."""
    # Step directories are made in the caller's thread: made in the background, a failed mkdir
    # (a read-only or full disk) left orbax's writer threads waiting for them, and the process
    # never exited.
    options = dict(enable_async_checkpointing=async_save, create=True, cleanup_tmp_directories=True,
                   async_options=ocp.AsyncOptions(create_directories_asynchronously=False))
    if keep_last is not None:
        options["preservation_policy"] = ocp.checkpoint_managers.LatestN(keep_last)
    return ocp.CheckpointManager(
        directory,
        options=ocp.CheckpointManagerOptions(**options),
        item_handlers={STATE_ITEM: ocp.StandardCheckpointHandler(), HOST_ITEM: ocp.JsonCheckpointHandler(),
                       CHECKSUMS_ITEM: ocp.JsonCheckpointHandler()},
    )


def save_args(flat: Mapping[str, Any], host: dict[str, Any], sums: dict[str, int]) -> ocp.args.Composite:
    return ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardSave(flat), HOST_ITEM: ocp.args.JsonSave(host),
                                 CHECKSUMS_ITEM: ocp.args.JsonSave(sums)})


def restore_args(targets: Mapping[str, jax.ShapeDtypeStruct]) -> ocp.args.Composite:
    return ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(targets), HOST_ITEM: ocp.args.JsonRestore(),
                                 CHECKSUMS_ITEM: ocp.args.JsonRestore()})


def saved_leaves(manager: ocp.CheckpointManager, step: int) -> Mapping[str, Any] | None:
    """The array metadata of step ``step``'s state by leaf path; None when its files are gone."""
    metadata = manager.item_metadata(step)[STATE_ITEM]
    return None if metadata is None else metadata.tree


def host_json(host_state: Mapping[str, Any] | None) -> dict[str, Any]:
    """``host_state`` as the JSON the checkpoint stores.

    Raises:
        ValueError: it is not a dict, or not JSON-serializable.
    """
    host_state = {} if host_state is None else host_state
    if not isinstance(host_state, Mapping):
        raise ValueError(f"host_state must be a dict, got {type(host_state).__name__}")
    try:
        return json.loads(json.dumps(dict(host_state)))
    except (TypeError, ValueError) as e:
        raise ValueError(f"host_state is not JSON-serializable: {e}") from None


def move_aside(directory: str, step: int) -> str:
    """Renames step ``step``'s directory to ``<step>.corrupt`` (``.corrupt1``, ... when taken);
    returns the new path. Only process 0 renames; every process gets the path."""
    source = os.path.join(directory, str(step))
    target = source + CORRUPT_SUFFIX
    if jax.process_index() == 0:
        suffix = 0
        while os.path.exists(target):  # a second damaged copy of the same step
            suffix += 1
            target = f"{source}{CORRUPT_SUFFIX}{suffix}"
        os.rename(source, target)
    return target
