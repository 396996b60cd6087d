"""What the CLI and the runner share: the user-error type and facts about a run directory and mesh.

Imports no JAX, so the CLI can check flags before JAX starts.
"""

from __future__ import annotations

import math

DRY_RUN_FILE = "dry_run.json"  # --dry-run's figures
CONFIG_FILE = "config.json"  # a run's resolved config (a dry run writes it too)


class UsageError(Exception):
    """A bad flag, path or combination; reported as one line with exit status 2."""


def mesh_device_count(spec: str | None) -> int:
    """Devices a ``--mesh`` spec needs (parsed without importing JAX)."""
    from podsjax.devices.mesh_spec import parse_mesh_spec

    if spec is None:
        return 1
    try:
        return math.prod(parse_mesh_spec(spec, None).values())
    except ValueError as exc:
        raise UsageError(f"--mesh {spec!r}: {exc}") from None


def has_accelerator(dev: str = "/dev") -> bool:
    """Whether this host has a GPU or TPU device node (so JAX's plugins may find one)."""
    from podsjax.devices.accelerators import has_accelerator as found  # no JAX

    return found(dev)

