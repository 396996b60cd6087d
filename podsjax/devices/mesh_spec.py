"""Mesh specs (``"8"``, ``"data=2,fsdp=4"``) parsed without JAX, so a launcher can size the host
devices before JAX starts. ``podsjax.devices.mesh`` builds the mesh itself."""

from __future__ import annotations

import math

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "tensor")
BATCH_AXES: tuple[str, ...] = ("data", "fsdp")  # the axes a batch of activations splits over


def parse_mesh_spec(spec: str | int, num_devices: int | None) -> dict[str, int]:
    """Parses a mesh spec into axis sizes.

    Args:
        spec: ``"8"`` (all devices on fsdp), or comma-separated ``axis=size`` pairs over
            ``data``, ``fsdp`` and ``tensor`` such as ``"data=2,fsdp=4"``.
        num_devices: how many devices the mesh must cover (None: any number).

    Returns:
        Sizes of all three axes in :data:`MESH_AXES` order (missing axes get 1).

    Raises:
        ValueError: malformed spec, unknown or repeated axis, or a product of sizes that
            differs from ``num_devices``.
    """
    text = str(spec).strip().replace(" ", "")
    sizes = {axis: 1 for axis in MESH_AXES}
    if text.isdecimal():  # ASCII and other decimal digits; not "²", which int() refuses
        sizes["fsdp"] = int(text)
    else:
        seen: set[str] = set()
        for part in text.split(","):
            name, eq, value = part.partition("=")
            if not eq or not value.isdecimal():
                raise ValueError(
                    f"mesh spec {spec!r}: expected 'N' or 'axis=size,...' over {MESH_AXES}, got {part!r}"
                )
            if name not in sizes:
                raise ValueError(f"mesh spec {spec!r}: unknown axis {name!r}; known axes are {MESH_AXES}")
            if name in seen:
                raise ValueError(f"mesh spec {spec!r}: axis {name!r} given twice")
            seen.add(name)
            sizes[name] = int(value)
    if any(size < 1 for size in sizes.values()):
        raise ValueError(f"mesh spec {spec!r}: axis sizes must be >= 1, got {sizes}")
    total = math.prod(sizes.values())
    if num_devices is not None and total != num_devices:
        raise ValueError(
            f"mesh spec {spec!r} needs {total} devices ({sizes}) but {num_devices} are available"
        )
    return sizes
