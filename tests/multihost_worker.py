"""One process of the 2-process localhost test in test_mesh_multihost.py (not a test file)."""

import os
import sys

os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from host_batches import host_batch_to_global  # noqa: E402
from podsjax.devices import mesh as mesh_lib  # noqa: E402


def main():
    assert mesh_lib.initialize_distributed()  # reads PODSJAX_* from the environment
    process = jax.process_index()
    mesh = mesh_lib.make_mesh("data=2,fsdp=2")  # 2 processes x 2 local devices
    local_rows = np.full((2, 2), process + 1, np.float32)  # this host's 2 rows
    batch = host_batch_to_global({"x": local_rows}, mesh)
    assert batch["x"].shape == (4, 2)
    total = jax.jit(lambda b: jnp.sum(b["x"]))(batch)  # a cross-process reduction
    print(f"process {process}: devices={jax.device_count()} total={float(total)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
