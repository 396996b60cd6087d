"""Two local processes join one JAX run over gloo and reduce a per-host batch."""

import os
import socket
import subprocess
import sys

import pytest
from child_env import child_env

pytestmark = [pytest.mark.slow, pytest.mark.cpu_mesh]

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_build_one_global_batch():
    port = free_port()
    procs = []
    for pid in range(2):
        env = child_env(PODSJAX_COORDINATOR=f"127.0.0.1:{port}", PODSJAX_NUM_PROCESSES="2",
                        PODSJAX_PROCESS_ID=str(pid), JAX_PLATFORMS="cpu")  # the worker adds its devices
        procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "multihost_worker.py")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        outputs.append(out)
        assert proc.returncode == 0, out
    # 2 rows x 2 cols of 1.0 from process 0 plus of 2.0 from process 1: 4 + 8 = 12.
    for pid, out in enumerate(outputs):
        assert f"process {pid}: devices=4 total=12.0" in out, out


def test_partial_distributed_settings_are_rejected():
    from podsjax.devices import mesh as mesh_lib
    import pytest

    with pytest.raises(ValueError, match="needs all of coordinator address"):
        mesh_lib.initialize_distributed(coordinator_address="127.0.0.1:1234")
