"""Device mesh from a spec string, and the one table of logical-axis rules.

The mesh always has the three axes ``("data", "fsdp", "tensor")``; a spec names only the
ones it uses and the rest get size 1, so every ``PartitionSpec`` in the package can name
all three axes without caring which are in use.

Every parameter and the main activations carry *logical* axis names (``vocab``, ``embed``,
``mlp``, ``q_heads``, ``kv_heads``, ``head_dim``, ``batch`` ...). :data:`LOGICAL_AXIS_RULES`
is the single place that says which mesh axes each logical name shards over.

Example:
    >>> mesh = make_mesh("fsdp=4,tensor=2")          # 8 devices
    >>> sharding = logical_sharding(mesh, ("embed", "mlp"), shape=(896, 4864))
    >>> sharding.spec
    PartitionSpec('fsdp', 'tensor')
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from podsjax.devices.mesh_spec import BATCH_AXES, MESH_AXES, parse_mesh_spec  # noqa: F401 - part of this module's API

# The one rules table. A logical name maps to a mesh axis, a tuple of mesh axes, or None
# (replicated). Weights are sharded FSDP-style over their model width ("embed") and
# Megatron-style over heads / MLP width / vocab ("tensor"); the batch of activations is
# split over both data-parallel axes. "act_embed" is the model width of *activations*:
# it stays replicated, since sharding it over fsdp would force a gather in every matmul.
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", BATCH_AXES),
    ("length", None),
    ("cache_slots", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("act_embed", None),
    ("mlp", "tensor"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("layers", None),
    ("lora_rank", None),
)

Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]


def make_mesh(spec: str | int | None = None, devices: Sequence[Any] | None = None) -> Mesh:
    """Builds the ``("data", "fsdp", "tensor")`` mesh described by ``spec``.

    All axes are ``AxisType.Auto``: the package shards with ``jax.jit`` in/out shardings
    plus ``with_sharding_constraint`` and lets the compiler propagate the rest. (jax 0.10+
    defaults ``jax.make_mesh`` to Explicit axes, which would change the typing rules of
    every op, so the choice is made here on purpose.)

    Args:
        spec: see :func:`parse_mesh_spec`; ``None`` puts every device on fsdp.
        devices: devices to use; defaults to ``jax.devices()`` (all processes), or their
            first ones when ``spec`` names fewer.

    Returns:
        A ``jax.sharding.Mesh`` with axis names :data:`MESH_AXES`.
    """
    if devices is None:
        devices = jax.devices()
        if spec is not None:
            # A spec for fewer devices than the host has (a single-GPU setting on an 8-GPU
            # host) takes the first ones; one for more is an error below.
            wanted = math.prod(parse_mesh_spec(spec, None).values())
            devices = devices[:wanted] if wanted <= len(devices) else devices
    devices = list(devices)
    if len({id(d) for d in devices}) != len(devices):  # one device in two places of the mesh
        raise ValueError(f"make_mesh got a device twice: {devices}")
    sizes = parse_mesh_spec(len(devices) if spec is None else spec, len(devices))
    shape = tuple(sizes[axis] for axis in MESH_AXES)
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def _rule_for(name: str | None, rules: Rules) -> tuple[str, ...]:
    if name is None:
        return ()
    for logical, mesh_axes in rules:
        if logical == name:
            if mesh_axes is None:
                return ()
            return (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
    raise KeyError(f"logical axis {name!r} has no rule; known: {[r[0] for r in rules]}")


def shard_count(mesh: Mesh | None, name: str, rules: Rules = LOGICAL_AXIS_RULES) -> int:
    """How many ways ``mesh`` splits a dimension with logical name ``name`` (1 without a mesh)."""
    if mesh is None:
        return 1
    return int(np.prod([mesh.shape[axis] for axis in _rule_for(name, rules)], dtype=np.int64))


def check_mesh(mesh: Any) -> None:
    """Refuses, in one line, a mesh that the logical rules cannot shard over: one without the
    axes :data:`MESH_AXES`, or with an axis that is not ``AxisType.Auto`` (``jax.make_mesh``'s
    Explicit default would change the typing rules of every op). :func:`make_mesh` builds one."""
    names = tuple(getattr(mesh, "axis_names", ()))
    if not isinstance(mesh, (Mesh, jax.sharding.AbstractMesh)) or not set(MESH_AXES) <= set(names):
        raise ValueError(f"podsjax needs a mesh with the axes {MESH_AXES}; got "
                         f"{names or type(mesh).__name__} (podsjax.devices.mesh.make_mesh builds one)")
    explicit = [n for n, t in zip(names, getattr(mesh, "axis_types", ())) if t != AxisType.Auto]
    if explicit:
        raise ValueError(f"podsjax needs a mesh of AxisType.Auto axes; {explicit} are not (jax.make_mesh's default "
                         "is Explicit: pass axis_types=(AxisType.Auto,) * 3, or use podsjax.devices.mesh.make_mesh)")


def logical_to_spec(
    names: Sequence[str | None],
    mesh: Mesh | None = None,
    shape: Sequence[int] | None = None,
    rules: Rules = LOGICAL_AXIS_RULES,
) -> PartitionSpec:
    """Turns logical axis names into a mesh ``PartitionSpec``.

    When ``mesh`` and ``shape`` are given, mesh axes that do not divide a dimension (for
    example 2 kv heads over tensor=4) or that are already used by an earlier dimension
    are dropped, so that dimension is replicated instead of failing: the same rules then
    serve every model size on every mesh.

    Args:
        names: one logical name (or None) per array dimension.
        mesh: the mesh the spec is for (needed for the divisibility check).
        shape: the array shape, same length as ``names``.
        rules: the rules table; defaults to :data:`LOGICAL_AXIS_RULES`.

    Returns:
        A ``PartitionSpec`` with one entry per dimension.
    """
    if shape is not None and len(shape) != len(names):
        raise ValueError(f"logical names {tuple(names)} do not match shape {tuple(shape)}")
    used: set[str] = set()
    entries: list[str | tuple[str, ...] | None] = []
    for dim, name in enumerate(names):
        kept: list[str] = []
        for axis in _rule_for(name, rules):
            if axis in used:
                continue
            if mesh is not None:
                size = mesh.shape[axis]
                if size == 1:
                    continue
                if shape is not None and shape[dim] % (size * math.prod(mesh.shape[a] for a in kept)) != 0:
                    continue
            kept.append(axis)
        used.update(kept)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return PartitionSpec(*entries)


def logical_sharding(
    mesh: Mesh, names: Sequence[str | None], shape: Sequence[int] | None = None, rules: Rules = LOGICAL_AXIS_RULES
) -> NamedSharding:
    """``NamedSharding`` on ``mesh`` for an array with the given logical axis names."""
    return NamedSharding(mesh, logical_to_spec(names, mesh, shape, rules))


def constrain(x: jax.Array, mesh: Mesh | None, names: Sequence[str | None]) -> jax.Array:
    """``with_sharding_constraint`` by logical names; identity only when ``mesh`` is None.

    The constraint is applied on every backend, CPU fake devices included, so sharded
    tests exercise the same partitioning as a TPU run.
    """
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, logical_sharding(mesh, names, x.shape))


def tree_shardings(mesh: Mesh, names_tree: Any, shapes_tree: Any, rules: Rules = LOGICAL_AXIS_RULES) -> Any:
    """Maps a tree of logical-name tuples plus a matching tree of shapes to NamedShardings.

    Args:
        mesh: target mesh.
        names_tree: pytree whose leaves are tuples of logical names (``PartitionSpec`` of
            logical names also works, as ``flax.linen.get_partition_spec`` returns).
        shapes_tree: pytree with the same structure whose leaves have ``.shape``.
        rules: the rules table.

    Returns:
        Pytree of ``NamedSharding`` with the structure of ``shapes_tree``.
    """
    is_names = lambda x: isinstance(x, (tuple, PartitionSpec))  # noqa: E731
    flat_names = jax.tree.leaves(names_tree, is_leaf=is_names)
    flat_shapes, treedef = jax.tree.flatten(shapes_tree)
    if len(flat_names) != len(flat_shapes):
        raise ValueError(f"names tree has {len(flat_names)} leaves but shapes tree has {len(flat_shapes)}")
    out = [
        logical_sharding(mesh, tuple(n), np.shape(s) if not hasattr(s, "shape") else s.shape, rules)
        for n, s in zip(flat_names, flat_shapes, strict=True)
    ]
    return jax.tree.unflatten(treedef, out)


def abstract(x: Any) -> jax.ShapeDtypeStruct:
    """``x``'s shape, dtype and sharding (when it has one), without its data."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


def with_shardings(tree: Any, shardings: Any) -> Any:
    """``ShapeDtypeStruct``s of ``tree``'s shapes and dtypes, placed on the matching ``shardings``."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def bytes_per_device(tree: Any) -> int:
    """Bytes one device holds of a tree of arrays or ``ShapeDtypeStruct``s (by their shardings)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        if not hasattr(leaf, "shape"):
            continue
        sharding = getattr(leaf, "sharding", None)
        shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
        # A PRNG key's dtype has no itemsize; a threefry key is two uint32.
        itemsize = 8 if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key) else np.dtype(leaf.dtype).itemsize
        total += math.prod(shape) * itemsize
    return total


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Sharding for a ``[B, ...]`` input: batch over ("data", "fsdp"), the rest replicated.

    A scalar (a whole-batch statistic) is replicated."""
    if ndim == 0:
        return NamedSharding(mesh, PartitionSpec())
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), mesh))


def rows_sharding(mesh: Mesh, rows: int, ndim: int) -> NamedSharding:
    """``batch_sharding`` for ``rows`` rows when they divide evenly over the batch shards, else replicated."""
    return batch_sharding(mesh, ndim if rows % shard_count(mesh, "batch") == 0 else 0)


# Environment variables read by `initialize_distributed` on GPU / CPU clusters
# (TPU pods need none: jax finds its peers itself).
DISTRIBUTED_ENV = ("PODSJAX_COORDINATOR", "PODSJAX_NUM_PROCESSES", "PODSJAX_PROCESS_ID")


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: Sequence[int] | None = None,
) -> bool:
    """Starts multi-host JAX, once, before any other JAX call of the run.

    On TPU pods (and SLURM / Open MPI clusters jax recognises) call it with no
    arguments. Elsewhere pass the coordinator ``host:port``, the number of
    processes and this process's id, or set ``PODSJAX_COORDINATOR``,
    ``PODSJAX_NUM_PROCESSES`` and ``PODSJAX_PROCESS_ID``. CPU processes talk
    over gloo collectives.

    Returns:
      True when this is a multi-process run after the call.
    """
    import os

    env = {name: os.environ.get(name) for name in DISTRIBUTED_ENV}
    coordinator_address = coordinator_address or env["PODSJAX_COORDINATOR"]
    try:
        if num_processes is None and env["PODSJAX_NUM_PROCESSES"] is not None:
            num_processes = int(env["PODSJAX_NUM_PROCESSES"])
        if process_id is None and env["PODSJAX_PROCESS_ID"] is not None:
            process_id = int(env["PODSJAX_PROCESS_ID"])
    except ValueError:
        raise ValueError(f"PODSJAX_NUM_PROCESSES and PODSJAX_PROCESS_ID must be integers; got {env}") from None
    explicit = (coordinator_address, num_processes, process_id)
    if any(v is not None for v in explicit) and not all(v is not None for v in explicit):
        raise ValueError(
            "multi-host start-up needs all of coordinator address, number of processes and process id "
            f"(or none of them for TPU / SLURM auto-detection); got {explicit}"
        )
    if jax.config.jax_platforms in (None, "", "cpu") or jax.default_backend() == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
    )
    return jax.process_count() > 1


def platform(mesh: Mesh | None) -> str:
    """The platform a program over ``mesh`` compiles for ("cpu", "gpu" or "tpu"): its devices'
    (compile-only ones from ``podsjax.devices.topology`` included), else JAX's default backend."""
    if mesh is not None:
        return mesh.devices.flat[0].platform
    return jax.default_backend()


def spec_axes(entry) -> tuple[str, ...]:
    """The mesh axes one ``PartitionSpec`` entry names (None, one axis, or a tuple of them)."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
