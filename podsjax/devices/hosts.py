"""This process's part of a multi-host run: the rows it feeds and reads, and values all hosts must agree on.

Every process of a run draws the same prompts (one seed, the same data order) and
tokenizes them all, which costs little. Each then places only the rows its own devices
hold (``sampling.Generator.place_rows``), reads back only those rows' completions, and
scores them; the scores are gathered so that every host computes the same selection and
the same metrics. With one process every helper here is the identity, so the single-host
path pays nothing.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def count() -> int:
    return jax.process_count()


def is_primary() -> bool:
    """Process 0: the one that writes logs, plots and exports."""
    return jax.process_index() == 0


def local_rows(x: jax.Array) -> tuple[int, np.ndarray]:
    """(first global row, this process's rows) of a row-sharded array; all rows with one process."""
    if count() == 1 or x.is_fully_addressable:
        return 0, np.asarray(x)
    pieces: dict[int, Any] = {}
    for shard in x.addressable_shards:
        pieces.setdefault(shard.index[0].start or 0, shard.data)  # replicas over the other axes: one is enough
    starts = sorted(pieces)
    arrays = [np.asarray(pieces[start]) for start in starts]
    ends = [start + len(a) for start, a in zip(starts, arrays)]
    if any(end != start for end, start in zip(ends, starts[1:])):
        raise ValueError(f"this process's rows are not contiguous (shards start at {starts}); order the mesh's "
                         "devices by process")
    return starts[0], np.concatenate(arrays)


def gather_rows(start: int, local: dict[str, np.ndarray], total: int) -> dict[str, np.ndarray]:
    """Each process's rows (``local``, beginning at global row ``start``) of every array, as the whole ``[total, ...]``.

    Rows held by several processes (a batch replicated across hosts) arrive once per holder;
    they are equal, and the last one is kept.
    """
    if count() == 1:
        return local
    from jax.experimental import multihost_utils

    starts = np.asarray(multihost_utils.process_allgather(np.int32(start)))
    stacked = multihost_utils.process_allgather(local)  # name -> [processes, rows, ...]
    whole = {}
    for name, values in stacked.items():
        values = np.asarray(values)
        out = np.empty((total, *values.shape[2:]), values.dtype)
        for first, piece in zip(starts, values):
            out[first : first + len(piece)] = piece
        whole[name] = out
    return whole


def agree(value: float) -> float:
    """Process 0's ``value`` on every process: host-side decisions (time budget, when to
    evaluate or checkpoint) read the training clock, and each host measures its own."""
    if count() == 1:
        return value
    from jax.experimental import multihost_utils

    return float(multihost_utils.broadcast_one_to_all(np.float32(value)))


def barrier(name: str) -> None:
    """Waits until every process gets here (a no-op with one process)."""
    if count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def sum_over_processes(values: dict[str, float]) -> dict[str, float]:
    """Each entry summed over processes (counts each host made of its own rows)."""
    if count() == 1 or not values:
        return values
    from jax.experimental import multihost_utils

    stacked = multihost_utils.process_allgather({k: np.float32(v) for k, v in values.items()})
    return {k: float(np.sum(v)) for k, v in stacked.items()}


def fetch(x: jax.Array) -> np.ndarray:
    """The whole of a (possibly sharded across hosts) array on every process; a collective."""
    if count() == 1 or x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
