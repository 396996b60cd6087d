"""Devices of a TPU slice that this host does not have, for compiling ahead of time.

XLA's TPU compiler runs on any Linux host where libtpu is installed (``pip install
'podsjax[tpu]'``). Programs compiled for these devices cannot run, but their
``memory_analysis()`` is what the slice would allocate, and a program larger than a
chip's HBM fails to compile. ``--dry-run --topology v5e:2x4`` uses them to size a run
before the slice is booked.

Example:
    >>> devices = compile_only_devices("v5p:2x2x2")   # 8 TPU v5 chips
    >>> mesh = podsjax.devices.mesh.make_mesh("fsdp=8", devices=devices)
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import sys
import tempfile

_NAME = re.compile(r"^(v[0-9][a-z0-9]*):([1-9][0-9]*(?:x[1-9][0-9]*){1,2})$")
_CHIPS_PER_HOST = (2, 2, 1)  # a TPU VM's chip block; smaller slices are one host


def compile_only_devices(topology: str) -> list:
    """The devices of the TPU slice ``topology`` ("<version>:<chips per dimension>").

    Raises:
        ValueError: one line, when the name is malformed, libtpu is missing or the
            compiler does not know the slice.
    """
    match = _NAME.match(topology)
    if match is None:
        raise ValueError(f"a TPU topology looks like v5e:2x4, v5p:2x2x2 or v4:2x2x1; got {topology!r}")
    if importlib.util.find_spec("libtpu") is None:
        raise ValueError("compiling for a TPU slice needs libtpu on this host: pip install 'podsjax[tpu]'")
    # Compiling claims no chip, so another process holding libtpu's lock is no obstacle.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    dims = [int(d) for d in match.group(2).split("x")]
    dims += [1] * (3 - len(dims))
    per_host = tuple(min(d, h) for d, h in zip(dims, _CHIPS_PER_HOST))
    # A v4 chip's two cores are one device to JAX ("megacore"): per core, a mesh refuses them.
    chip = "megacore" if match.group(1).lower() == "v4" else "default"
    try:
        with _without_tpu_probes():
            description = topologies.get_topology_desc(platform="tpu", topology_name=topology,
                                                       chip_config_name=chip, chips_per_host_bounds=per_host,
                                                       num_slices=1)
    except Exception as exc:  # noqa: BLE001 - libtpu reports an unknown slice as a runtime error
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"TPU topology {topology!r}: {reason}") from None
    return list(description.devices)


@contextlib.contextmanager
def _without_tpu_probes():
    """Keeps libtpu's start-up off the console: on a host without a TPU it writes its failed
    probes for one (accelerator type, worker hostnames) straight to file descriptor 2, about 5
    lines that say nothing of the compile. Its errors still arrive as exceptions."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as sink:
            os.dup2(sink.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)
