"""Checkpointer: exact round trips (typed keys, optax state, shardings), triggers, atomicity."""

import os
import signal
import subprocess
import sys
import textwrap

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from podsjax.run.checkpoint import CheckpointConfig, Checkpointer
from child_env import child_env

pytestmark = pytest.mark.cpu_mesh

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@flax.struct.dataclass
class State:
    params: dict
    opt_state: optax.OptState
    step: jax.Array
    rng: jax.Array


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Explicit,))


def make_state(mesh, seed=0):
    """A small trained-looking state: sharded params, non-trivial adamw moments, typed key."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = {
        "w": jax.device_put(jax.random.normal(k1, (16, 8)), NamedSharding(mesh, P("fsdp", None))),
        "b": jax.device_put(jax.random.normal(k2, (8,)), NamedSharding(mesh, P())),
    }
    tx = optax.adamw(1e-2, b1=0.9, b2=0.99, weight_decay=0.1)
    opt_state = tx.init(params)
    for _ in range(2):
        grads = jax.tree.map(lambda p: jnp.sin(p) + 0.5, params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return State(params=params, opt_state=opt_state, step=jnp.int32(7 + seed),
                 rng=jax.random.fold_in(jax.random.key(123), seed))


def abstract_of(state, sharding_fn=None):
    def leaf(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_fn(x) if sharding_fn else x.sharding)

    return jax.tree.map(leaf, state)


def host_copy(state):
    """Numpy copies of every leaf (key data for typed keys), independent of device buffers."""
    def one(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.array(x, copy=True)

    return jax.tree.map(one, state)


def assert_same(expected_np, restored):
    exp_leaves, exp_def = jax.tree_util.tree_flatten_with_path(expected_np)
    got = host_copy(restored)
    got_leaves, got_def = jax.tree_util.tree_flatten_with_path(got)
    assert exp_def == got_def
    assert len(exp_leaves) == len(got_leaves) > 0
    for (path, e), (_, g) in zip(exp_leaves, got_leaves):
        assert e.dtype == g.dtype, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(g, e, err_msg=jax.tree_util.keystr(path))


def test_round_trip_typed_key_adamw_sharded(tmp_path, mesh):
    state = make_state(mesh)
    expected = host_copy(state)
    host = {"data_position": 17, "elapsed_train_seconds": 12.5, "epoch": 0}
    with Checkpointer(CheckpointConfig(str(tmp_path), async_save=False)) as ck:
        assert ck.latest_step() is None
        assert ck.save(7, state, host, force=True)
        assert ck.latest_step() == 7
    # A fresh Checkpointer, as after a restart, finds and restores it.
    with Checkpointer(CheckpointConfig(str(tmp_path))) as ck:
        restored, host_back = ck.restore(abstract_of(state))
    assert host_back == host
    assert_same(expected, restored)
    assert jax.dtypes.issubdtype(restored.rng.dtype, jax.dtypes.prng_key)
    assert jax.random.key_impl(restored.rng) == jax.random.key_impl(state.rng)
    # The restored key draws the same numbers as the original one.
    np.testing.assert_array_equal(jax.random.uniform(restored.rng, (4,)), jax.random.uniform(state.rng, (4,)))
    assert restored.params["w"].sharding == state.params["w"].sharding
    assert restored.opt_state[0].mu["w"].sharding.spec == P("fsdp", None)
    assert restored.step.dtype == jnp.int32 and int(restored.step) == 7


def test_restore_into_different_sharding(tmp_path, mesh):
    state = make_state(mesh, seed=1)
    expected = host_copy(state)
    with Checkpointer(CheckpointConfig(str(tmp_path), async_save=False)) as ck:
        ck.save(3, state, force=True)
    mesh2 = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Explicit,) * 2)

    def target(x):
        # 2-D leaves split their second axis over fsdp and first over data; the rest replicate.
        return NamedSharding(mesh2, P("data", "fsdp") if x.ndim == 2 else P())

    with Checkpointer(CheckpointConfig(str(tmp_path))) as ck:
        restored, host = ck.restore(abstract_of(state, target))
    assert host == {}
    assert_same(expected, restored)
    w = restored.params["w"]
    assert w.sharding == NamedSharding(mesh2, P("data", "fsdp"))
    assert w.addressable_shards[0].data.shape == (8, 2)
    assert restored.rng.sharding == NamedSharding(mesh2, P())


def test_async_save_then_donate_is_safe(tmp_path, mesh):
    state = make_state(mesh, seed=2)
    expected = host_copy(state)
    overwrite = jax.jit(lambda s: jax.tree.map(lambda x: x if x.dtype == jax.random.key(0).dtype else x * 0 - 3, s),
                        donate_argnums=0)
    with Checkpointer(CheckpointConfig(str(tmp_path), async_save=True)) as ck:
        assert ck.save(9, state, {"data_position": 4}, force=True)
        # Right after save returns the caller may donate and overwrite the buffers.
        new = overwrite(state)
        jax.block_until_ready(new)
        ck.wait_until_finished()
        restored, host = ck.restore(abstract_of(new))
    assert float(np.asarray(new.params["b"])[0]) == -3.0
    assert host == {"data_position": 4}
    assert_same(expected, restored)


def test_keep_last_deletes_old(tmp_path):
    state = {"x": jnp.arange(4.0)}
    with Checkpointer(CheckpointConfig(str(tmp_path), keep_last=2, async_save=True)) as ck:
        for step in range(1, 6):
            assert ck.save(step, {"x": state["x"] + step}, {"step": step}, force=True)
        ck.wait_until_finished()
        assert ck.all_steps() == [4, 5]
        restored, host = ck.restore({"x": jax.ShapeDtypeStruct((4,), jnp.float32)}, step=4)
    assert sorted(os.listdir(tmp_path)) == ["4", "5"]
    np.testing.assert_array_equal(np.asarray(restored["x"]), np.arange(4.0) + 4)
    assert host == {"step": 4}


def test_every_n_steps(tmp_path):
    state = {"x": jnp.zeros(2)}
    with Checkpointer(CheckpointConfig(str(tmp_path), save_every_steps=3, async_save=False)) as ck:
        assert not ck.should_save(0)
        saved = [s for s in range(1, 10) if ck.save(s, state)]
        assert saved == [3, 6, 9]
        assert ck.all_steps() == [3, 6, 9] and not ck.should_save(9)
        assert ck.save(10, state, force=True) and ck.all_steps()[-1] == 10
        assert not ck.save(10, state, force=True)  # already on disk: no error, no second save


def test_every_t_seconds_with_fake_clock(tmp_path):
    now = [100.0]
    state = {"x": jnp.zeros(2)}
    cfg = CheckpointConfig(str(tmp_path), save_every_seconds=10.0, async_save=False)
    with Checkpointer(cfg, clock=lambda: now[0]) as ck:
        assert not ck.should_save(1)  # first look starts the interval at t=100
        now[0] = 109.9
        assert not ck.save(2, state)
        now[0] = 110.0
        assert ck.should_save(3)
        assert ck.save(3, state)
        now[0] = 115.0
        assert not ck.should_save(4)  # the interval restarted at the save (t=110)
        now[0] = 120.5
        assert ck.save(5, state)
        # An explicit `now` (e.g. the training clock) overrides the clock.
        assert not ck.should_save(6, now=125.0) and ck.should_save(6, now=131.0)
        assert ck.all_steps() == [3, 5]


def test_partial_tmp_dir_is_ignored_and_cleaned(tmp_path):
    with Checkpointer(CheckpointConfig(str(tmp_path), async_save=False)) as ck:
        ck.save(1, {"x": jnp.ones(3)}, {"pos": 1}, force=True)
    partial = tmp_path / "2.orbax-checkpoint-tmp-1700000000"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "_METADATA").write_text("{truncated")
    with Checkpointer(CheckpointConfig(str(tmp_path))) as ck:
        assert ck.latest_step() == 1 and ck.all_steps() == [1]
        restored, host = ck.restore({"x": jax.ShapeDtypeStruct((3,), jnp.float32)})
        np.testing.assert_array_equal(np.asarray(restored["x"]), np.ones(3))
        assert host == {"pos": 1}
    assert not partial.exists()


_CRASH_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import jax, jax.numpy as jnp
    from podsjax.run.checkpoint import CheckpointConfig, Checkpointer

    ck = Checkpointer(CheckpointConfig(sys.argv[1], async_save=True))
    ck.save(1, {"w": jnp.arange(64.0), "rng": jax.random.key(1)}, {"pos": 1}, force=True)
    ck.wait_until_finished()
    real_rename = os.rename

    def crash_on_commit(src, dst, *args, **kwargs):
        # Die the moment orbax tries to commit step 2: all its files are written, none committed.
        if os.path.basename(os.fspath(dst)) == "2":
            os.kill(os.getpid(), signal.SIGKILL)
        return real_rename(src, dst, *args, **kwargs)

    os.rename = crash_on_commit
    ck.save(2, {"w": jnp.arange(64.0) + 1, "rng": jax.random.key(2)}, {"pos": 2}, force=True)
    ck.wait_until_finished()
    print("step 2 committed without crashing")
""")


def test_crash_mid_save_leaves_no_valid_checkpoint(tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    script = tmp_path / "crash.py"
    script.write_text(_CRASH_SCRIPT)
    env = child_env()
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, str(script), str(ckpt_dir)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr[-2000:]
    leftovers = [n for n in os.listdir(ckpt_dir) if n.startswith("2.")]
    assert leftovers and "orbax-checkpoint-tmp" in leftovers[0]  # the killed save really got far
    with Checkpointer(CheckpointConfig(str(ckpt_dir))) as ck:
        assert ck.all_steps() == [1]
        abstract = {"w": jax.ShapeDtypeStruct((64,), jnp.float32), "rng": jax.random.key(0)}
        restored, host = ck.restore(abstract)
        with pytest.raises(FileNotFoundError, match=r"no checkpoint for step 2 .*available: \[1\]"):
            ck.restore(abstract, step=2)
    assert host == {"pos": 1}
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(64.0))
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(restored["rng"])),
                                  np.asarray(jax.random.key_data(jax.random.key(1))))


def one_line(excinfo):
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


def test_restore_empty_dir_error(tmp_path):
    with Checkpointer(CheckpointConfig(str(tmp_path / "nothing"))) as ck:
        with pytest.raises(FileNotFoundError) as e:
            ck.restore({"x": jax.ShapeDtypeStruct((2,), jnp.float32)})
    assert "no checkpoint to restore in" in one_line(e) and "nothing" in one_line(e)


def test_mismatched_target_errors_name_the_leaf(tmp_path, mesh):
    state = make_state(mesh, seed=3)
    with Checkpointer(CheckpointConfig(str(tmp_path), async_save=False)) as ck:
        ck.save(1, state, force=True)
        wrong_shape = abstract_of(state).replace(
            params={"w": jax.ShapeDtypeStruct((16, 4), jnp.float32), "b": jax.ShapeDtypeStruct((8,), jnp.float32)})
        with pytest.raises(ValueError) as e:
            ck.restore(wrong_shape)
        assert "'params/w'" in one_line(e) and "(16, 8)" in one_line(e) and "(16, 4)" in one_line(e)

        wrong_dtype = abstract_of(state).replace(step=jax.ShapeDtypeStruct((), jnp.float32))
        with pytest.raises(ValueError, match=r"'step' has dtype int32, target expects float32"):
            ck.restore(wrong_dtype)

        lora_only = abstract_of(state).replace(params={"lora_a": jax.ShapeDtypeStruct((8, 2), jnp.float32)})
        with pytest.raises(ValueError) as e:
            ck.restore(lora_only)
        assert "'params/lora_a'" in one_line(e) and "target state expects" in one_line(e)

        missing_rng = {"params": abstract_of(state).params, "opt_state": abstract_of(state).opt_state,
                       "step": jax.ShapeDtypeStruct((), jnp.int32)}
        with pytest.raises(ValueError, match=r"has leaf 'rng' that the target state lacks"):
            ck.restore(missing_rng)


def test_bad_host_state_and_configs(tmp_path):
    with Checkpointer(CheckpointConfig(str(tmp_path), async_save=False)) as ck:
        with pytest.raises(ValueError, match="host_state is not JSON-serializable"):
            ck.save(1, {"x": jnp.zeros(1)}, {"bad": object()}, force=True)
        assert ck.all_steps() == []
    for kwargs in [dict(save_every_steps=0), dict(save_every_steps=2.5), dict(save_every_seconds=-1.0),
                   dict(save_every_seconds=float("inf")), dict(keep_last=0), dict(keep_last=True)]:
        with pytest.raises(ValueError) as e:
            CheckpointConfig(str(tmp_path), **kwargs)
        assert next(iter(kwargs)) in one_line(e)
    with pytest.raises(ValueError, match="directory"):
        CheckpointConfig("")


def _two_checkpoints(tmp_path):
    with Checkpointer(CheckpointConfig(str(tmp_path), async_save=False)) as ck:
        for step in (1, 2):
            ck.save(step, {"x": jnp.arange(1000.0) * step}, {"pos": step}, force=True)
    return {"x": jax.ShapeDtypeStruct((1000,), jnp.float32)}


def _largest_data_file(step_dir):
    files = [os.path.join(d, f) for d, _, names in os.walk(step_dir / "state") if os.path.basename(d) == "d"
             for f in names]
    return max(files, key=os.path.getsize)


@pytest.mark.parametrize("damage", ["flip_bytes", "wrong_checksum", "delete_data", "truncate_data",
                                    "remove_manifest"])
def test_a_damaged_newest_checkpoint_is_moved_aside_and_the_previous_restored(tmp_path, damage):
    abstract = _two_checkpoints(tmp_path)
    step_dir = tmp_path / "2"
    data = _largest_data_file(step_dir)
    if damage == "flip_bytes":
        with open(data, "r+b") as f:
            f.seek(os.path.getsize(data) // 2)
            chunk = bytearray(f.read(2))
            f.seek(-2, os.SEEK_CUR)
            f.write(bytes(b ^ 0xFF for b in chunk))
    elif damage == "wrong_checksum":
        (step_dir / "checksums" / "metadata").write_text('{"x": 12345}')
    elif damage == "delete_data":
        os.remove(data)
    elif damage == "truncate_data":
        with open(data, "r+b") as f:
            f.truncate(os.path.getsize(data) // 3)
    else:
        os.remove(step_dir / "state" / "manifest.ocdbt")
    warnings = []
    with Checkpointer(CheckpointConfig(str(tmp_path))) as ck:
        state, host, step = ck.restore_latest(abstract, warn=warnings.append)
        assert (step, host) == (1, {"pos": 1}) and ck.all_steps() == [1]
        np.testing.assert_array_equal(np.asarray(state["x"]), np.arange(1000.0))
        assert ck.save(2, {"x": jnp.ones(1000)}, force=True)  # step 2 can be written again
    assert len(warnings) == 1 and "checkpoint" in warnings[0] and "\n" not in warnings[0], warnings
    assert (tmp_path / "2.corrupt").is_dir()  # kept for inspection


def test_checksums_catch_changed_bits_that_still_load(tmp_path):
    from podsjax.run.checkpoint_integrity import leaf_checksum

    x = jnp.arange(1000.0)
    flipped = x.at[500].set(jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x[500], jnp.uint32) ^ 1,
                                                         jnp.float32))
    swapped = x.at[10].set(x[11]).at[11].set(x[10])
    sums = {int(leaf_checksum(v)) for v in (x, flipped, swapped)}
    assert len(sums) == 3
    for dtype in (jnp.bfloat16, jnp.int32, jnp.bool_, jnp.uint32):
        assert leaf_checksum(jnp.ones(7, dtype)).dtype == jnp.uint32


def test_no_loadable_checkpoint_is_one_error_and_a_mismatch_is_not_damage(tmp_path):
    from podsjax.run.checkpoint import CheckpointCorrupt, CheckpointMismatch

    abstract = _two_checkpoints(tmp_path)
    with Checkpointer(CheckpointConfig(str(tmp_path))) as ck:
        with pytest.raises(CheckpointMismatch, match="shape"):
            ck.restore_latest({"x": jax.ShapeDtypeStruct((7,), jnp.float32)})
    assert sorted(os.listdir(tmp_path)) == ["1", "2"]  # another config's state is not moved aside
    for step in ("1", "2"):
        (tmp_path / step / "checksums" / "metadata").write_text('{"x": 1}')
    with Checkpointer(CheckpointConfig(str(tmp_path))) as ck:
        with pytest.raises(CheckpointCorrupt, match="no checkpoint in .* loads"):
            ck.restore_latest(abstract, warn=lambda line: None)
    assert sorted(os.listdir(tmp_path)) == ["1.corrupt", "2.corrupt"]
    with Checkpointer(CheckpointConfig(str(tmp_path))) as ck:
        assert ck.restore_latest(abstract) is None and ck.all_steps() == []


def test_the_layout_stores_a_flat_state_by_leaf_path_and_moves_damage_aside(tmp_path):
    from podsjax.run import checkpoint_layout as layout

    state = {"a": {"w": jnp.arange(3.0)}, "rng": jax.random.key(7)}
    flat = layout.flat_state(state)
    assert set(flat) == {"a/w", "rng"} and not layout.is_key(flat["rng"])
    back = layout.unflatten_state(flat, jax.eval_shape(lambda: state))
    assert layout.is_key(back["rng"]) and bool(jnp.all(jax.random.key_data(back["rng"]) ==
                                                       jax.random.key_data(state["rng"])))
    with pytest.raises(ValueError, match="no array leaves"):
        layout.flat_state({})
    with pytest.raises(ValueError, match="not JSON-serializable"):
        layout.host_json({"position": object()})
    (tmp_path / "3").mkdir()
    (tmp_path / "3.corrupt").mkdir()  # an earlier damaged copy of the same step is kept too
    assert layout.move_aside(str(tmp_path), 3) == str(tmp_path / "3.corrupt1")
    assert sorted(os.listdir(tmp_path)) == ["3.corrupt", "3.corrupt1"]


def test_integrity_checks_name_the_first_leaf_that_differs():
    from podsjax.run import checkpoint
    from podsjax.run.checkpoint_integrity import (CheckpointCorrupt, CheckpointMismatch, check_matches, host_checksums, verify_checksums)

    target = {"w": jax.ShapeDtypeStruct((2,), jnp.float32)}
    check_matches({"w": jax.ShapeDtypeStruct((2,), jnp.float32)}, target, "ckpt")
    with pytest.raises(CheckpointMismatch, match=r"^ckpt: leaf 'w' has shape \(3,\), target expects \(2,\)$"):
        check_matches({"w": jax.ShapeDtypeStruct((3,), jnp.float32)}, target, "ckpt")
    with pytest.raises(CheckpointMismatch, match="has leaf 'v' that the target state lacks"):
        check_matches({"w": target["w"], "v": target["w"]}, target, "ckpt")
    with pytest.raises(CheckpointCorrupt, match="no readable array metadata"):
        check_matches(None, target, "ckpt")
    flat = {"w": jnp.ones(2)}
    verify_checksums(flat, host_checksums(flat), "ckpt")
    with pytest.raises(CheckpointCorrupt, match=r"1 array\(s\) fail their checksum, first 'w'"):
        verify_checksums(flat, {"w": 0}, "ckpt")
    assert checkpoint.CheckpointCorrupt is CheckpointCorrupt and checkpoint.CheckpointMismatch is CheckpointMismatch


def test_a_restore_that_fails_for_the_target_moves_no_checkpoint_aside(tmp_path):
    # A target orbax cannot place (here: 6 values over 8 devices) had renamed every good step *.corrupt.
    from jax.sharding import NamedSharding, PartitionSpec

    from podsjax.devices.mesh import make_mesh
    from podsjax.run.checkpoint import CheckpointCorrupt

    with Checkpointer(CheckpointConfig(str(tmp_path), async_save=False)) as ck:
        for step in (1, 2):
            ck.save(step, {"x": jnp.arange(6.0) * step}, {"pos": step}, force=True)
    mesh = make_mesh("8")
    odd = {"x": jax.ShapeDtypeStruct((6,), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("fsdp")))}
    with Checkpointer(CheckpointConfig(str(tmp_path))) as ck:
        with pytest.raises(CheckpointCorrupt, match="steps 1, 2 left in place"):
            ck.restore_latest(odd, warn=lambda line: None)
    assert sorted(os.listdir(tmp_path)) == ["1", "2"]


def test_a_checkpoint_directory_that_is_a_file_is_one_line(tmp_path):
    # orbax's background thread had printed a 30-line traceback, and save() failed deep in etils.
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="checkpoint directory .* is a file"):
        Checkpointer(CheckpointConfig(str(tmp_path / "f")))


_FAILED_SAVE = """
import os, resource, signal, sys
import jax.numpy as jnp
from podsjax.run.checkpoint import Checkpointer, CheckpointConfig
ck = Checkpointer(CheckpointConfig(sys.argv[1], keep_last=1, async_save=True))
ck.save(1, {"w": jnp.ones(1000)}, {"pos": 1}, force=True)
ck.wait_until_finished()
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (2000, resource.RLIM_INFINITY))
ck.save(2, {"w": jnp.arange(100000.0)}, {"pos": 2}, force=True)
try:
    ck.wait_until_finished()
    print("no error")
except Exception:
    print("steps", ck.all_steps(), ck.latest_step())
"""


def run_script(tmp_path, source: str) -> subprocess.CompletedProcess:
    """``source`` run in a child process on the CPU, with a checkpoint directory as its argument."""
    script = tmp_path / "script.py"
    script.write_text(source)
    return subprocess.run([sys.executable, str(script), str(tmp_path / "ck")], env=child_env(JAX_PLATFORMS="cpu"),
                          capture_output=True, text=True, timeout=120)


def test_a_failed_background_save_leaves_the_committed_steps_known(tmp_path):
    # After the error orbax had listed no step at all, and a resume in the same process found nothing.
    proc = run_script(tmp_path, _FAILED_SAVE)
    assert "steps [1] 1" in proc.stdout, proc.stdout + proc.stderr[-2000:]


_FAILED_MKDIR = """
import errno, os, sys
import jax.numpy as jnp
from podsjax.run.checkpoint import Checkpointer, CheckpointConfig
ck = Checkpointer(CheckpointConfig(sys.argv[1], keep_last=2, async_save=True))
ck.save(1, {"w": jnp.ones(10)}, {"pos": 1}, force=True)
ck.wait_until_finished()
make_dir = os.mkdir
def full_disk(path, *args, **kwargs):  # no room for step 2's folder (ENOSPC, or a read-only disk)
    if "2.orbax-checkpoint-tmp" in os.fspath(path):
        raise OSError(errno.ENOSPC, "No space left on device", os.fspath(path))
    return make_dir(path, *args, **kwargs)
os.mkdir = full_disk
try:
    ck.save(2, {"w": jnp.ones(10)}, {"pos": 2}, force=True)
    ck.wait_until_finished()
    print("no error")
except OSError as exc:
    print("error", exc.strerror, "steps", ck.all_steps(), flush=True)
ck.close()
"""


def test_a_step_folder_that_cannot_be_made_fails_the_save_and_the_process_still_exits(tmp_path):
    # Made in the background, the failed folder had left orbax's writer threads waiting for it
    # forever: the run printed its error, then never exited.
    proc = run_script(tmp_path, _FAILED_MKDIR)
    assert "error No space left on device steps [1]" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_text_leaf_is_named_before_anything_is_saved(tmp_path):
    with Checkpointer(CheckpointConfig(str(tmp_path), async_save=False)) as ck:
        with pytest.raises(ValueError, match="state leaf 'name' is no array or number: str"):  # had failed deep inside
            ck.save(1, {"w": jnp.ones(3), "name": "policy"}, force=True)
        assert ck.all_steps() == []


@pytest.mark.parametrize("leaf,message", [
    # orbax had raised 17 frames deep and left its temporary folder (an async save then hung at exit).
    (jnp.zeros((0, 4)), r"state leaf 'odd' has no elements \(shape \(0, 4\)\)"),
    # the checksum had failed inside lax.bitcast_convert_type
    (jnp.ones(3, jnp.complex64), "state leaf 'odd' is complex64, which a checkpoint does not store"),
    (jnp.arange(4, dtype=jnp.int4), "state leaf 'odd' is int4, which a checkpoint does not store"),
    # restored as int32 5 and 7, the checksum agreeing (it too was taken after the cut)
    (np.array([2**40 + 5, 7], np.int64), f"state leaf 'odd' holds {2**40 + 5}, past int32"),
])
def test_a_leaf_a_checkpoint_would_fail_on_or_cut_is_named_before_anything_is_saved(tmp_path, leaf, message):
    with Checkpointer(CheckpointConfig(str(tmp_path), async_save=False)) as ck:
        with pytest.raises(ValueError, match=message):
            ck.save(1, {"w": jnp.ones(3), "odd": leaf}, force=True)
        assert ck.all_steps() == [] and os.listdir(tmp_path) == []
        ck.save(2, {"w": jnp.ones(3), "fits": np.array([2**31 - 1, -(2**31)], np.int64)}, force=True)
        assert ck.all_steps() == [2]


def test_python_numbers_in_a_state_restore_into_the_same_tree(tmp_path):
    # save() had taken them (0.5 as float64) and restore() refused the same tree in one line.
    state = {"w": jnp.ones(3), "lr": 0.5, "count": 7, "flag": True}
    with Checkpointer(CheckpointConfig(str(tmp_path), async_save=False)) as ck:
        ck.save(1, state, force=True)
        restored, _ = ck.restore(state)
    assert {k: (np.asarray(v).dtype.name, np.asarray(v).tolist()) for k, v in restored.items() if k != "w"} == {
        "lr": ("float32", 0.5), "count": ("int32", 7), "flag": ("bool", True)}
