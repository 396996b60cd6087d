"""Kernels and CUDA graphs read from XLA's thunk sequence (podsjax.devices.gpu_thunks)."""

import importlib.util

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from podsjax.devices import gpu_thunks, gpu_topology, topology
from podsjax.models import decode_kernel

needs_cuda_plugin = pytest.mark.skipif(importlib.util.find_spec("jax_plugins.xla_cuda12") is None,
                                       reason="jax's CUDA plugin is not installed (pip install 'podsjax[cuda]')")

# As XLA writes a sampler's: a data-dependent loop around a loop of decode steps; the
# step's first kernels in a graph, two after it alone.
NESTED = """001: kCopy  [source | next=002 (1)] kCopy
002: kWhile [prev=001 (1) | sink]
condition:
    003: kCustomKernel [source | sink] loop_and_fusion grid: [1, 1, 1]
  body:
    004: kCopy         [source | next=005 (1)] kCopy
    005: kWhile        [prev=004 (1) | sink]
condition:
        006: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1]
      body:
        000: kCommandBuffer  [source | next=010 (1)]
            007: kCustomKernel [source | next=008 (1)] loop_add_fusion grid: [1, 1, 1]
            008: kCustomKernel [prev=007 (1) | next=009 (1)] fusion_1 grid: [64, 1, 1] threads: [128, 1, 1]
            009: kCopy [prev=008 (1) | sink] kCopy
        010: kCublasLtMatmul [prev=000 (1) | next=011 (1)] kCublasLtMatmul
        011: kCustomKernel   [prev=010 (1) | sink] attention grid: [896, 1, 1] threads: [128, 1, 1]
"""


def test_the_innermost_loop_s_body_counts_its_graphs_and_the_kernels_launched_alone():
    got = gpu_thunks.innermost_loop(NESTED)
    assert got == gpu_thunks.Launches(graphs=1, alone=2, kernels_in_graphs=3) and got.launches == 3


def test_a_sequence_without_a_loop_or_a_missing_dump_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="no loop"):
        gpu_thunks.innermost_loop("001: kCopy  [source | sink] kCopy\n")
    with pytest.raises(ValueError, match="no thunk sequence of jit_sample") as info:
        gpu_thunks.read(tmp_path, "sample")
    assert "\n" not in str(info.value)


def loop_body_launches(tmp_path, target_config=None):
    """A loop of six cuBLAS GEMMs and softmaxes (and its counter) compiled for an H100, as its body launches."""
    devices = topology.compile_only_devices("h100")
    if target_config is not None:
        from jax.experimental import topologies
        devices = topologies.get_topology_desc(platform="cuda", topology="1x1x1", target_config=target_config).devices
    placed = NamedSharding(Mesh(devices[:1], ("x",)), PartitionSpec())

    def loop(x, w):
        def step(carry):
            i, x = carry
            for _ in range(6):
                x = jax.nn.softmax(x @ w, axis=-1)
            return i + 1, x
        return lax.while_loop(lambda c: (c[0] < 64) & (c[1][0, 0] < 5.0), step, (0, x))

    x, w = (jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=placed) for shape in ((64, 256), (256, 256)))
    options = {**gpu_thunks.dump_options(tmp_path), "xla_gpu_enable_triton_gemm": False}
    jax.jit(loop).lower(x, w).compile(options)
    return gpu_thunks.innermost_loop(gpu_thunks.read(tmp_path, "loop"))


@needs_cuda_plugin
def test_an_h100_loop_body_of_library_gemms_runs_as_one_cuda_graph(tmp_path):
    # The description names a driver, as a real GPU reports one: XLA captures cuBLAS calls
    # into a graph only on drivers that can (CUDA 12.3 on). Without one, each GEMM and
    # each kernel between two GEMMs launches alone, as the plan showed before.
    assert loop_body_launches(tmp_path / "a") == gpu_thunks.Launches(graphs=1, alone=0, kernels_in_graphs=13)
    driverless = "\n".join(line for line in gpu_topology.target_config("h100").splitlines()
                           if not line.strip().startswith(("driver_version", "compile_time_toolkit_version")))
    without = loop_body_launches(tmp_path / "b", driverless)
    assert without.graphs == 0 and without.alone == 13, without


@needs_cuda_plugin
def test_at_setting_as_shape_the_h100_holds_all_of_the_decode_attention_s_programs_at_once(tmp_path):
    # 64 rows of one prompt, 2 kv heads of 6 queries, 512 + 512 slots, bf16, the token taken
    # from the qkv heads with their bias: at least two programs an SM, and no more than the SMs hold at once
    # (by the registers ptxas gives the kernel and its shared memory), so no program waits
    # for another's to end. Filling each pass alone made 896 programs, 2.3 waves.
    placed = SingleDeviceSharding(topology.compile_only_devices("h100")[0])
    abstract = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=placed)  # noqa: E731
    rows, kv, groups, e = 64, 2, 6, 128
    cache = (abstract((1, kv, 512, e)), abstract((1, kv, 512, e)), abstract((1, 512), jnp.bool_),
             abstract((rows, kv, 512, e)), abstract((rows, kv, e, 512)), abstract((rows, 512), jnp.bool_),
             abstract((rows,), jnp.int32))
    heads = kv * groups + 2 * kv
    token = (abstract((rows, heads, e)), abstract((rows, e), jnp.float32), abstract((rows, e), jnp.float32),
             abstract((heads * e,)))  # Qwen's qkv bias, added in the kernel
    # At the suite's -O0 (child_env.SUITE_XLA_FLAGS) the kernel's PTX takes 242 registers.
    options = {**gpu_thunks.dump_options(tmp_path), "xla_backend_optimization_level": 3}
    decode_kernel.grouped_decode_attention.lower(None, *cache, token=token).compile(options)
    launch = gpu_thunks.occupancy(tmp_path, "grouped_decode_attention", "grouped_decode_attention", "h100")
    assert launch.programs >= 2 * launch.sms and launch.waves <= 1.0, (launch, launch.waves)
    assert 0 < launch.registers <= 255 and launch.shared_memory > 0
