"""The TPU decode attention over the stacked cache (podsjax.models.tpu_decode_kernel).

Against the XLA form in Pallas's interpreter here; compiled by XLA's TPU compiler (libtpu,
no TPU needed) for what a decode step moves.
"""

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from podsjax.devices import dry_run, tpu_topology
from podsjax.devices import mesh as mesh_lib
from podsjax.models import tpu_decode_kernel
from podsjax.sampler import sampling
import podsjax.models as pm

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed (pip install 'podsjax[tpu]')")


def stacked_case(layers, rows, slots, kv_heads, groups, head_dim, layer, dtype, seed=0):
    """Random queries and a stacked cache whose other layers are NaN (a read of one poisons the
    output), with holes in each row's allowed slots."""
    rng = np.random.default_rng(seed)
    shape = (layers, rows, slots, kv_heads * head_dim)
    poison = jnp.full(shape, jnp.nan, dtype)

    def cache():
        return poison.at[layer].set(jnp.asarray(rng.normal(size=shape[1:]), dtype))

    allowed = jnp.asarray(rng.random((rows, 1, slots)) < 0.6).at[:, :, 0].set(True)
    q = jnp.asarray(rng.normal(size=(rows, 1, kv_heads * groups, head_dim)), dtype)
    return q, cache(), cache(), jnp.int32(layer), allowed


def xla_form(q, keys, values, layer, allowed):
    return tpu_decode_kernel.attend_layer(q, keys, values, layer, allowed, platform="cpu")


def kernel_form(q, keys, values, layer, allowed, mesh=None):
    return tpu_decode_kernel.attend_layer(q, keys, values, layer, allowed, mesh, platform="tpu", interpret=True)


# (layers, rows, slots, kv heads, queries per kv head, head_dim, layer read): 8 rows a grid step,
# rows that only 2 divide, a row alone, the first and the last layer.
SHAPES = [(3, 16, 32, 2, 3, 128, 1), (2, 6, 48, 1, 6, 128, 0), (4, 1, 16, 2, 2, 128, 3)]


@pytest.mark.parametrize("shape", SHAPES)
def test_the_kernel_reads_its_layer_and_matches_the_xla_form_in_fp32(shape):
    case = stacked_case(*shape, jnp.float32)
    got = kernel_form(*case)
    assert not np.isnan(np.asarray(got)).any()
    np.testing.assert_allclose(got, xla_form(*case), atol=2e-6, rtol=2e-6)


def test_the_kernel_matches_the_xla_form_in_bf16():
    q, keys, values, layer, allowed = stacked_case(3, 16, 64, 2, 6, 128, 2, jnp.bfloat16)
    got = kernel_form(q, keys, values, layer, allowed).astype(jnp.float32)
    want = xla_form(q, keys, values, layer, allowed).astype(jnp.float32)
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)  # both round the output to bf16


def dot_precisions(closed):
    """The precisions of every dot_general in a jaxpr, the kernels' bodies included."""
    found = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.add(eqn.params["precision"])
            for value in eqn.params.values():
                inner = getattr(value, "jaxpr", value)
                if hasattr(inner, "eqns"):
                    walk(inner)

    walk(closed.jaxpr)
    return found


@pytest.mark.parametrize("dtype, precision", [(jnp.float32, jax.lax.Precision.HIGHEST),
                                              (jnp.bfloat16, jax.lax.Precision.DEFAULT)])
def test_the_kernel_multiplies_an_fp32_cache_in_full_fp32_and_a_bf16_one_in_the_mxus_own_pass(dtype, precision):
    # Whatever jax_default_matmul_precision says (the suite sets "highest"): Mosaic has no fp32
    # precision for bf16 operands, and DEFAULT would leave an fp32 cache to the MXU's bf16 pass.
    q, keys, values, layer, allowed = stacked_case(1, 2, 16, 1, 2, 128, 0, dtype)
    kernel = functools.partial(tpu_decode_kernel.stacked_decode_attention, interpret=True)
    closed = jax.make_jaxpr(kernel)(q[:, 0], keys, values, layer, allowed[:, 0])
    assert dot_precisions(closed) == {(precision, precision)}


@needs_libtpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_kernel_compiles_for_a_v5e_in_either_cache_dtype(dtype):
    devices = tpu_topology.compile_only_devices("v5e:1x1")
    mesh = mesh_lib.make_mesh("1", devices=devices)

    def spec(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, P()))

    args = (spec((8, 12, 128), dtype), spec((2, 8, 64, 256), dtype), spec((2, 8, 64, 256), dtype),
            spec((), jnp.int32), spec((8, 64), jnp.bool_))
    compiled = tpu_decode_kernel.stacked_decode_attention.lower(*args).compile()
    assert "tpu_custom_call" in compiled.as_text()


def test_rows_a_grid_step_holds_fit_the_vmem_budget():
    assert tpu_decode_kernel.rows_per_step(256, 1024, 256, 2) == 8  # 8 MB of blocks a step
    assert tpu_decode_kernel.rows_per_step(6, 1024, 256, 2) == 2
    assert tpu_decode_kernel.rows_per_step(256, 8192, 256, 2) == 1  # 8 MB a row
    assert tpu_decode_kernel.rows_per_step(256, 32768, 256, 2) is None  # 32 MB a row: the XLA form


def test_a_row_too_long_for_vmem_takes_the_xla_form():
    q, keys, values, layer, allowed = stacked_case(1, 2, 32768, 2, 1, 128, 0, jnp.float32)
    np.testing.assert_array_equal(kernel_form(q, keys, values, layer, allowed),
                                  xla_form(q, keys, values, layer, allowed))


@pytest.mark.cpu_mesh
@pytest.mark.parametrize("spec", ["data=8", "data=2,fsdp=4"])
def test_on_a_mesh_each_device_runs_the_kernel_on_its_rows(spec):
    mesh = mesh_lib.make_mesh(spec)
    q, keys, values, layer, allowed = stacked_case(2, 16, 32, 2, 3, 128, 1, jnp.float32)
    rows = mesh_lib.logical_to_spec(("batch",), mesh, (16,))
    keys, values = (jax.device_put(x, NamedSharding(mesh, P(None, *rows, None, None))) for x in (keys, values))
    q, allowed = (jax.device_put(x, NamedSharding(mesh, P(*rows))) for x in (q, allowed))
    got = jax.jit(lambda *a: kernel_form(*a, mesh=mesh))(q, keys, values, layer, allowed)
    want = xla_form(q, keys, values, layer, allowed)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-6)


@pytest.mark.cpu_mesh
@pytest.mark.parametrize("spec, split", [("data=4,tensor=2", True), ("data=2,tensor=4", False)])
def test_the_cache_splits_a_slot_over_tensor_only_where_that_divides_its_kv_heads(spec, split):
    # 2 kv heads of 8: a slot's 16 features divide over 4 devices, but a head must not.
    config = pm.ModelConfig(arch="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                            num_heads=4, num_kv_heads=2, head_dim=8, eos_token_id=2, pad_token_id=0)
    cache = jax.eval_shape(lambda: pm.init_cache(config, batch=8, max_len=16))
    keys = pm.cache_shardings(cache, mesh_lib.make_mesh(spec)).keys_YBSC.spec
    assert (keys[3] if len(keys) > 3 else None) in ((("tensor",), "tensor") if split else (None,))


@needs_libtpu
def test_a_v5e_decode_step_of_256_rows_reads_each_layer_of_the_cache_in_place():
    # Setting a's cache shapes (2 kv heads of 128, 512 + 512 slots) at 256 rows: a layer's keys
    # are 134 MB, too large for VMEM, and the XLA form copied each through HBM (2.65x its floor
    # for Qwen2.5-1.5B). Two small layers keep the compile short; the cache dominates the floor.
    config = pm.ModelConfig(arch="qwen2", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                            num_heads=12, num_kv_heads=2, head_dim=128, eos_token_id=2, pad_token_id=0)
    devices = tpu_topology.compile_only_devices("v5e:1x1")
    model = pm.Decoder(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                       mesh=mesh_lib.make_mesh("1", devices=devices))
    gen = sampling.Generator(model).compile(dry_run.abstract_base(model), None, prompts=4, prompt_len=512,
                                            num_samples=64, max_new_tokens=512, eos_token_ids=(2,))
    step = dry_run.decode_step_cost(gen["sample"])
    floor = gen["weights_read_bytes"] + gen["kv_cache_bytes"]
    assert gen["kv_cache_bytes"] > 10 * gen["weights_read_bytes"]
    assert step.bytes <= 1.3 * floor, (step.bytes, floor)
    assert "tpu_custom_call" in gen["sample"].as_text()
