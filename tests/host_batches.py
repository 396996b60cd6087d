"""Multi-host test workers' batches: each process's own rows as one global, batch-sharded tree."""

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from podsjax.devices import mesh as mesh_lib


def host_batch_to_global(local_batch: Any, mesh: Mesh) -> Any:
    """Turns each process's slice of the batch into one global, batch-sharded array tree.

    Every process passes its own rows ``[B / num_processes, ...]``; the result is ``[B, ...]``
    sharded over the mesh's batch axes. A ``TrainBatch``'s whole-batch statistics are dropped:
    each process computed them over its own rows only, so the step computes them again over
    the global batch.
    """
    if hasattr(local_batch, "loss_denominator"):
        local_batch = local_batch.replace(loss_denominator=None, advantage_mean=None)
    shards = mesh_lib.shard_count(mesh, "batch")

    def globalize(x):
        x = np.asarray(x)
        rows = x.shape[0] * jax.process_count()
        if rows % shards:
            raise ValueError(f"global batch of {rows} rows does not split over {shards} batch shards (data x fsdp)")
        return jax.make_array_from_process_local_data(mesh_lib.batch_sharding(mesh, x.ndim), x)

    return jax.tree.map(globalize, local_batch)
