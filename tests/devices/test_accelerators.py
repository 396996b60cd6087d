"""On a host with no GPU or TPU, the library starts JAX on the CPU alone: no plugin probes, no noise."""

import os
import pathlib
import subprocess
import sys

import pytest

from podsjax.devices import accelerators

ROOT = pathlib.Path(__file__).resolve().parents[2]
# What JAX's CUDA plugin and libtpu print when they probe a host without their device.
PROBE_NOISE = ("plugin configuration error", "cuInit", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "libtpu")


@pytest.mark.slow
@pytest.mark.skipif(accelerators.has_accelerator(), reason="a host with an accelerator: its plugin should start")
def test_a_library_user_on_a_cpu_host_sees_only_their_output(tmp_path):
    code = ("import jax, jax.numpy as jnp\n"
            "from podsjax import selection\n"
            "rewards = jnp.array([[0.0, 1.0, 1.0, 0.0, 1.0, 0.0]])\n"
            "print(selection.select('max_variance', rewards, 2).tolist(), jax.default_backend())\n")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("cpu") and result.stderr == "", result.stderr[-3000:]
    assert not any(noise in result.stdout + result.stderr for noise in PROBE_NOISE)


def test_jax_platforms_is_set_only_on_a_linux_host_without_an_accelerator(monkeypatch, tmp_path):
    monkeypatch.setattr(accelerators.sys, "platform", "linux")
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(accelerators, "has_accelerator", lambda: True)
    assert not accelerators.cpu_alone_without_accelerator() and "JAX_PLATFORMS" not in os.environ
    monkeypatch.setattr(accelerators, "has_accelerator", lambda: False)
    monkeypatch.delitem(sys.modules, "jax")  # as before the program imports JAX
    assert accelerators.cpu_alone_without_accelerator() and os.environ["JAX_PLATFORMS"] == "cpu"
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")  # the user's choice stands
    assert not accelerators.cpu_alone_without_accelerator() and os.environ["JAX_PLATFORMS"] == "cuda"
    monkeypatch.delenv("JAX_PLATFORMS")
    monkeypatch.setattr(accelerators.sys, "platform", "darwin")  # jax-metal has no device node to look for
    assert not accelerators.cpu_alone_without_accelerator()


def test_once_jax_runs_nothing_is_set(monkeypatch):
    # Too late for this process; setting the variable then would only reach child processes.
    monkeypatch.setattr(accelerators.sys, "platform", "linux")
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(accelerators, "has_accelerator", lambda: False)
    monkeypatch.setattr(accelerators, "_backends_started", lambda: True)
    assert not accelerators.cpu_alone_without_accelerator() and "JAX_PLATFORMS" not in os.environ


def test_the_device_nodes_tell_an_accelerator(tmp_path):
    assert not accelerators.has_accelerator(str(tmp_path), drivers=())
    for node in ("nvidiactl", "nvidia0", "dxg", "kfd", "accel0", "vfio", "neuron0"):
        (tmp_path / node).touch()
        assert accelerators.has_accelerator(str(tmp_path), drivers=())
        (tmp_path / node).unlink()
    (tmp_path / "accel").mkdir()  # /dev/accel/accel0 on newer TPU hosts
    assert accelerators.has_accelerator(str(tmp_path), drivers=())
    # A loaded NVIDIA driver whose device nodes are not made yet
    assert accelerators.has_accelerator(str(tmp_path / "none"), drivers=(str(tmp_path / "accel"),))


def test_a_platform_chosen_in_jax_config_stands(monkeypatch):
    import jax

    monkeypatch.setattr(accelerators.sys, "platform", "linux")
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(accelerators, "has_accelerator", lambda: False)
    monkeypatch.setattr(accelerators, "_backends_started", lambda: False)
    before = jax.config.jax_platforms
    try:
        jax.config.update("jax_platforms", "cuda,cpu")
        assert not accelerators.cpu_alone_without_accelerator()
        assert jax.config.jax_platforms == "cuda,cpu" and "JAX_PLATFORMS" not in os.environ
    finally:
        jax.config.update("jax_platforms", before)


def test_only_nvidia_nodes_or_driver_tell_an_nvidia_gpu(tmp_path):
    for node in ("kfd", "accel0", "vfio", "neuron0"):
        (tmp_path / node).touch()
    assert not accelerators.has_nvidia_gpu(str(tmp_path), drivers=())
    (tmp_path / "nvidia0").touch()
    assert accelerators.has_nvidia_gpu(str(tmp_path), drivers=())
    assert accelerators.has_nvidia_gpu(str(tmp_path / "none"), drivers=(str(tmp_path / "nvidia0"),))


def test_gpu_flags_are_added_unless_the_user_set_them():
    assert accelerators.with_gpu_flags("") == "--xla_gpu_enable_triton_gemm=false"
    assert accelerators.with_gpu_flags("--xla_dump_to=/x") == "--xla_dump_to=/x --xla_gpu_enable_triton_gemm=false"
    mine = "--xla_gpu_enable_triton_gemm=true"
    assert accelerators.with_gpu_flags(mine) == mine  # the user's choice stands, either way
    flags = accelerators.with_gpu_flags("")
    assert accelerators.with_gpu_flags(flags) == flags  # added once
    longer = "--xla_gpu_enable_triton_gemm_any=true"  # another flag, whose name starts with this one's
    assert accelerators.with_gpu_flags(longer) == f"{longer} --xla_gpu_enable_triton_gemm=false"
    # Without the GPU nothing can be autotuned: the flag goes last, and the last wins.
    assert accelerators.with_gpu_flags(mine, deviceless=True) == f"{mine} --xla_gpu_enable_triton_gemm=false"
