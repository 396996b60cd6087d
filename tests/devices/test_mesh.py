"""Mesh specs, the logical-axis rules, and sharding constraints on 8 fake CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from podsjax.devices import mesh as mesh_lib

pytestmark = pytest.mark.cpu_mesh


@pytest.mark.parametrize(
    "spec, sizes",
    [
        ("8", {"data": 1, "fsdp": 8, "tensor": 1}),
        (8, {"data": 1, "fsdp": 8, "tensor": 1}),
        ("data=2,fsdp=4", {"data": 2, "fsdp": 4, "tensor": 1}),
        ("fsdp=4,tensor=2", {"data": 1, "fsdp": 4, "tensor": 2}),
        (" tensor=2, data=2, fsdp=2 ", {"data": 2, "fsdp": 2, "tensor": 2}),
    ],
)
def test_make_mesh_specs(spec, sizes):
    mesh = mesh_lib.make_mesh(spec)
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert dict(mesh.shape) == sizes
    # Auto on purpose: jit shardings + with_sharding_constraint, not Explicit typing.
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    assert mesh.devices.size == 8


def test_a_mesh_the_rules_cannot_shard_over_is_one_line():
    import podsjax.models as pm

    config = pm.ModelConfig(arch="qwen2", vocab_size=32, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2,
                            num_kv_heads=1, head_dim=4)
    other_names = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    explicit = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Explicit,) * 3)
    for mesh, why in ((other_names, r"the axes \('data', 'fsdp', 'tensor'\); got \('x',\)"),
                      (explicit, r"AxisType.Auto axes; \['data', 'fsdp', 'tensor'\] are not")):
        with pytest.raises(ValueError, match=why):
            pm.Decoder(config, mesh=mesh)
        with pytest.raises(ValueError, match=why):
            mesh_lib.check_mesh(mesh)
    pm.Decoder(config, mesh=mesh_lib.make_mesh("fsdp=4,tensor=2"))  # podsjax's own is taken


def test_make_mesh_default_uses_all_devices_on_fsdp():
    assert dict(mesh_lib.make_mesh().shape) == {"data": 1, "fsdp": 8, "tensor": 1}
    two = mesh_lib.make_mesh("tensor=2", devices=jax.devices()[:2])
    assert dict(two.shape) == {"data": 1, "fsdp": 1, "tensor": 2}
    # A spec for fewer devices than the host has (a 1-GPU setting on an 8-GPU host) takes the first ones.
    one = mesh_lib.make_mesh("1")
    assert one.devices.size == 1 and one.devices.flat[0] == jax.devices()[0]
    assert list(mesh_lib.make_mesh("data=2,fsdp=2").devices.flat) == jax.devices()[:4]
    with pytest.raises(ValueError, match="needs 2 devices"):
        mesh_lib.make_mesh("2", devices=jax.devices()[:1])  # explicit devices must match


@pytest.mark.parametrize(
    "spec, message",
    [
        ("16", "needs 16 devices"),
        ("data=2,fsdp=8", "needs 16 devices"),
        ("data=2,pipeline=4", "unknown axis 'pipeline'"),
        ("fsdp=4,fsdp=2", "given twice"),
        ("fsdp:8", "expected"),
        ("fsdp=0,data=8", ">= 1"),
        ("", "expected"),
    ],
)
def test_bad_mesh_specs_raise_one_clear_error(spec, message):
    with pytest.raises(ValueError, match=message) as err:
        mesh_lib.make_mesh(spec)
    assert "\n" not in str(err.value)


def test_rules_table_maps_each_logical_axis_once():
    names = [name for name, _ in mesh_lib.LOGICAL_AXIS_RULES]
    assert len(names) == len(set(names))
    for required in ("batch", "vocab", "embed", "mlp", "q_heads", "kv_heads", "head_dim"):
        assert required in names


def test_logical_to_spec_follows_rules_and_drops_non_dividing_axes():
    mesh = mesh_lib.make_mesh("data=2,fsdp=2,tensor=2")
    assert mesh_lib.logical_to_spec(("embed", "mlp"), mesh, (64, 128)) == P("fsdp", "tensor")
    assert mesh_lib.logical_to_spec(("vocab", "embed"), mesh, (256, 64)) == P("tensor", "fsdp")
    assert mesh_lib.logical_to_spec(("embed", "q_heads", "head_dim"), mesh, (64, 4, 16)) == P("fsdp", "tensor", None)
    assert mesh_lib.logical_to_spec(("batch", "length"), mesh, (8, 5)) == P(("data", "fsdp"), None)
    # 1 kv head cannot split over tensor=2: replicate that dim instead of failing.
    assert mesh_lib.logical_to_spec(("embed", "kv_heads", "head_dim"), mesh, (64, 1, 16)) == P("fsdp", None, None)
    # Batch 2 divides data=2 but not data*fsdp=4: keep only the axis that fits.
    assert mesh_lib.logical_to_spec(("batch",), mesh, (2,)) == P("data")
    # Size-1 mesh axes are left out so specs stay minimal.
    fsdp_only = mesh_lib.make_mesh("8")
    assert mesh_lib.logical_to_spec(("batch", "vocab"), fsdp_only, (8, 256)) == P("fsdp", None)
    with pytest.raises(KeyError, match="no rule"):
        mesh_lib.logical_to_spec(("heads_typo",), mesh, (4,))


def test_tree_shardings_and_batch_sharding():
    mesh = mesh_lib.make_mesh("fsdp=4,tensor=2")
    shapes = {"w": jax.ShapeDtypeStruct((64, 128), jnp.float32), "b": jax.ShapeDtypeStruct((128,), jnp.float32)}
    names = {"w": ("embed", "mlp"), "b": ("mlp",)}
    shardings = mesh_lib.tree_shardings(mesh, names, shapes)
    assert shardings["w"].spec == P("fsdp", "tensor") and shardings["b"].spec == P("tensor")
    assert mesh_lib.batch_sharding(mesh, 2).spec == P("fsdp", None)


def test_constrain_really_shards_on_cpu_and_is_identity_without_mesh():
    mesh = mesh_lib.make_mesh("data=2,fsdp=2,tensor=2")
    x = jnp.arange(8 * 6 * 4, dtype=jnp.float32).reshape(8, 6, 4)

    @jax.jit
    def f(x):
        return mesh_lib.constrain(x * 2, mesh, ("batch", "length", "mlp"))

    y = f(x)
    assert y.sharding.spec == P(("data", "fsdp"), None, "tensor")
    assert y.addressable_shards[0].data.shape == (2, 6, 2)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x) * 2)
    assert mesh_lib.constrain(x, None, ("batch", "length", "mlp")) is x


def test_a_device_named_twice_or_an_odd_digit_is_one_line():
    device = jax.devices()[0]
    with pytest.raises(ValueError, match="make_mesh got a device twice"):  # it had built the mesh
        mesh_lib.make_mesh("2", devices=[device, device])
    with pytest.raises(ValueError, match="mesh spec 'fsdp=²': expected 'N' or 'axis=size"):  # int() had refused "²"
        mesh_lib.make_mesh("fsdp=²")


def test_an_empty_compile_cache_directory_is_refused(tmp_path):
    from podsjax.devices import compilation

    # "" had silently meant the default folder.
    with pytest.raises(ValueError, match="compile cache: the directory is empty"):
        compilation.enable_compile_cache("")
    with pytest.raises(ValueError, match="min_compile_time_s must be seconds >= 0; got nan"):
        compilation.enable_compile_cache(tmp_path, min_compile_time_s=float("nan"))


def test_topology_and_optimizer_arguments_of_another_kind_are_one_line():
    from podsjax.devices import topology
    from podsjax.update import algorithms

    with pytest.raises(ValueError, match="a topology is a name such as 'v5e:2x4' or 'h100:8'; got None"):
        topology.compile_only_devices(None)
    with pytest.raises(TypeError, match="make_optimizer takes an AlgorithmConfig; got dict"):
        algorithms.make_optimizer({})
