"""2 processes x 4 CPU devices (gloo) take the same train step as 1 process x 8 devices."""

import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import train_multihost_worker as worker
from podsjax.devices import mesh as mesh_lib
from child_env import child_env

pytestmark = [pytest.mark.slow, pytest.mark.cpu_mesh]

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 240


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_workers(tmp_path):
    """Launches the 2 workers; their output goes to log files, so no pipe fills while we compute."""
    port = free_port()
    procs = []
    for pid in range(2):
        env = child_env(PODSJAX_COORDINATOR=f"127.0.0.1:{port}", PODSJAX_NUM_PROCESSES="2",
                        PODSJAX_PROCESS_ID=str(pid), JAX_PLATFORMS="cpu")  # the worker adds its devices
        with open(tmp_path / f"worker{pid}.log", "w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, os.path.join(HERE, "train_multihost_worker.py"), str(tmp_path / "two_hosts.npz")],
                env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def wait_for(procs, tmp_path):
    deadline = time.monotonic() + TIMEOUT_S
    for pid, proc in enumerate(procs):
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            pass  # reported below with the worker's log; the caller kills it
        log = (tmp_path / f"worker{pid}.log").read_text()
        status = "timed out" if proc.returncode is None else f"exit code {proc.returncode}"
        assert proc.returncode == 0, f"worker {pid} failed ({status}, limit {TIMEOUT_S}s):\n{log}"


def one_host_step():
    """The reference: this process's 8 fake devices, the same mesh, the whole batch on one host."""
    assert jax.device_count() == 8
    mesh = mesh_lib.make_mesh(worker.MESH)
    step, state = worker.setup(mesh)
    # host_batch_to_global drops the per-process batch statistics; so does the reference.
    batch = worker.local_batch(slice(None)).replace(loss_denominator=None, advantage_mean=None)
    sharded = jax.tree.map(lambda x: jax.device_put(x, mesh_lib.batch_sharding(mesh, x.ndim)), batch)
    new_state, metrics = step(state, sharded, None)
    # The step really moved the params (else equal-after-step proves little) and saw tokens.
    moved = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(state.params)))
    assert moved > 1e-4 and float(metrics.num_tokens) > 0
    return {**worker.flat(new_state.params, "params"), **worker.flat(metrics, "metrics"),
            **worker.flat(batch, "batch")}


def test_two_host_step_equals_one_host_eight_devices(tmp_path):
    procs = start_workers(tmp_path)
    try:
        want = one_host_step()  # computed while the workers compile
        wait_for(procs, tmp_path)
    finally:
        for proc in procs:  # a failed or hung run must not leave a worker behind
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    got = dict(np.load(tmp_path / "two_hosts.npz"))

    assert sorted(got) == sorted(want)
    # Each host's rows landed where the one-host batch has them (bitwise).
    for key in (k for k in want if k.startswith("batch")):
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    diffs = {k: float(np.max(np.abs(got[k] - want[k]))) for k in want if not k.startswith("batch")}
    print(f"max |two hosts - one host|: params {max(v for k, v in diffs.items() if k.startswith('params')):.3g}, "
          f"metrics {max(v for k, v in diffs.items() if k.startswith('metrics')):.3g}")
    # fp32; the two runs reduce in different orders (gloo vs in-process), so not bitwise.
    assert all(v <= 1e-6 for v in diffs.values()), {k: v for k, v in diffs.items() if v > 1e-6}
