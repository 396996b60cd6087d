"""NVIDIA GPUs that this host does not have, for compiling ahead of time.

XLA's GPU compiler runs on a CPU-only host once jax's CUDA plugin is installed (``pip
install 'podsjax[cuda]'``): given a GPU's target description it compiles for that GPU
without one, with cuDNN attention and cuBLAS calls in the program. The executables cannot
run, but their memory and optimized HLO (``podsjax.devices.hlo_cost``) are the GPU's.
``--dry-run --topology h100`` uses them to plan a run.

Example:
    >>> devices = compile_only_devices("h100:8")   # one host with 8 H100s
    >>> mesh = podsjax.devices.mesh.make_mesh("fsdp=8", devices=devices)
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re

# What XLA needs to know of each GPU (its GpuDeviceInfoProto fields), from NVIDIA's
# specifications, and the most thread blocks an SM holds. The device kind is what a real GPU
# of the kind reports.
GPUS = {
    "h100": dict(kind="NVIDIA H100 80GB HBM3", major=9, minor=0, core_count=132, fpus_per_core=128,
                 clock_rate_ghz=1.98, memory_bandwidth=3_352_320_000_000, device_memory_size=84_929_347_584,
                 l2_cache_size=52_428_800, shared_memory_per_core=233_472, shared_memory_per_block_optin=232_448,
                 threads_per_core_limit=2048, blocks_per_core_limit=32),
    "h200": dict(kind="NVIDIA H200", major=9, minor=0, core_count=132, fpus_per_core=128, clock_rate_ghz=1.98,
                 memory_bandwidth=4_800_000_000_000, device_memory_size=150_754_820_096, l2_cache_size=52_428_800,
                 shared_memory_per_core=233_472, shared_memory_per_block_optin=232_448, threads_per_core_limit=2048,
                 blocks_per_core_limit=32),
    "a100": dict(kind="NVIDIA A100-SXM4-80GB", major=8, minor=0, core_count=108, fpus_per_core=64,
                 clock_rate_ghz=1.41, memory_bandwidth=2_039_000_000_000, device_memory_size=85_097_594_880,
                 l2_cache_size=41_943_040, shared_memory_per_core=167_936, shared_memory_per_block_optin=166_912,
                 threads_per_core_limit=2048, blocks_per_core_limit=32),
    "l40s": dict(kind="NVIDIA L40S", major=8, minor=9, core_count=142, fpus_per_core=128, clock_rate_ghz=2.52,
                 memory_bandwidth=864_000_000_000, device_memory_size=47_697_362_944, l2_cache_size=100_663_296,
                 shared_memory_per_core=102_400, shared_memory_per_block_optin=101_376, threads_per_core_limit=1536,
                 blocks_per_core_limit=24),
}
REGISTERS_PER_SM = 65536  # 32-bit registers an SM holds, on every GPU above
_NAME = re.compile(r"^([a-z0-9]+)(?::([1-9][0-9]*))?$")
_MAX_PER_HOST = 8
INSTALL = "pip install 'podsjax[cuda]'"


def is_gpu_name(name: str) -> bool:
    match = _NAME.match(name)
    return match is not None and match.group(1) in GPUS


def target_config(gpu: str) -> str:
    """The GpuTargetConfig text proto XLA compiles ``gpu`` from, with this host's cuDNN and CUDA."""
    info = GPUS[gpu]
    cudnn = _version("nvidia-cudnn-cu12", (9, 0, 0))
    cuda = _version("nvidia-cuda-runtime-cu12", (12, 0))
    fields = {key: info[key] for key in ("core_count", "fpus_per_core", "clock_rate_ghz", "memory_bandwidth",
                                         "device_memory_size", "l2_cache_size", "shared_memory_per_core",
                                         "shared_memory_per_block_optin", "threads_per_core_limit")}
    fields.update(threads_per_block_limit=1024, threads_per_warp=32, shared_memory_per_block=49152,
                  block_dim_limit_x=2147483647, block_dim_limit_y=65535, block_dim_limit_z=65535,
                  registers_per_core_limit=REGISTERS_PER_SM, registers_per_block_limit=65536)
    # Without a driver's version XLA assumes none that can capture library calls (cuBLAS,
    # custom calls) into CUDA graphs, and runs each kernel of a loop body as its own launch.
    # The oldest driver that runs this CUDA runtime can; a real GPU host's is newer still.
    version = ".".join(map(str, cuda + (0,)))
    fields.update(driver_version=f'"{version}"', runtime_version=f'"{version}"',
                  compile_time_toolkit_version=f'"{version}"')
    body = "\n".join(f"  {key}: {value}" for key, value in fields.items())
    return (f"gpu_device_info {{\n{body}\n  cuda_compute_capability {{ major: {info['major']} minor: {info['minor']} }}"
            f"\n}}\nplatform_name: \"CUDA\"\ndnn_version_info {{ major: {cudnn[0]} minor: {cudnn[1]} "
            f"patch: {cudnn[2]} }}\nruntime_version {{ major: {cuda[0]} minor: {cuda[1]} }}\n"
            f"device_description_str: \"{info['kind']}\"\n")


def _version(package: str, default: tuple[int, ...]) -> tuple[int, ...]:
    try:
        parts = [int(p) for p in importlib.metadata.version(package).split(".")[:len(default)]]
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return default
    return tuple(parts + list(default[len(parts):]))


def compile_only_devices(name: str) -> list:
    """The devices of ``name``: a GPU (h100, h200, a100, l40s) and optionally ``:count`` of
    them on one host (h100:8).

    Raises:
        ValueError: one line, when the name is unknown, the CUDA plugin is missing or the
            compiler refuses the description.
    """
    match = _NAME.match(name)
    if match is None or match.group(1) not in GPUS:
        raise ValueError(f"a GPU topology is one of {', '.join(GPUS)}, optionally with :count (h100:8); got {name!r}")
    count = int(match.group(2) or 1)
    if count > _MAX_PER_HOST:
        raise ValueError(f"GPU topology {name!r}: at most {_MAX_PER_HOST} GPUs on one host")
    try:
        plugin = importlib.util.find_spec("jax_plugins.xla_cuda12")
    except ModuleNotFoundError:  # no plugin at all: no jax_plugins package to look in
        plugin = None
    if plugin is None:
        raise ValueError(f"compiling for a GPU needs jax's CUDA plugin on this host: {INSTALL}")
    from jax.experimental import topologies

    try:
        description = topologies.get_topology_desc(platform="cuda", topology=f"1x1x{count}",
                                                   target_config=target_config(match.group(1)))
    except Exception as exc:  # noqa: BLE001 - the plugin reports a refused description as a runtime error
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"GPU topology {name!r}: {reason}") from None
    return list(description.devices)
