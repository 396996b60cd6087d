"""--dry-run --topology: XLA's TPU compiler sizes a run for a slice this host does not have."""

import importlib.util
import json

import pytest

from experiments import cli
from podsjax.devices import topology, tpu_topology
from test_dry_run import FLAGS, config_only_checkpoint, run_cli

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed (pip install 'podsjax[tpu]')")


@pytest.mark.parametrize("name", ["v5e", "v5e:", "v5e:2x", "tpu:2x2", "v5e:0x2", "v5p:2x2x2x2", "2x2"])
def test_a_malformed_topology_is_refused_in_one_line(name):
    with pytest.raises(ValueError, match="a TPU topology looks like v5e:2x4") as info:
        tpu_topology.compile_only_devices(name)
    assert "\n" not in str(info.value)


def test_without_libtpu_the_error_says_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a))
    with pytest.raises(ValueError, match=r"needs libtpu on this host: pip install 'podsjax\[tpu\]'"):
        tpu_topology.compile_only_devices("v5e:2x4")


def test_topology_without_dry_run_is_refused(tmp_path, capsys):
    code = cli.main("gsm8k", ["--topology", "v5e:2x4", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "only goes with --dry-run" in err, err


@needs_libtpu
def test_an_unknown_slice_is_refused_in_one_line():
    with pytest.raises(ValueError, match="TPU topology 'v5e:3x3'") as info:
        tpu_topology.compile_only_devices("v5e:3x3")
    assert "\n" not in str(info.value)


@needs_libtpu
@pytest.mark.slow
def test_dry_run_compiles_for_a_tpu_slice_this_host_does_not_have(tmp_path):
    checkpoint = config_only_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "run"
    done = run_cli(["--model", checkpoint, "--dry-run", "--topology", "v5e:2x4", "--mesh", "fsdp=2",
                    "--out", str(out), *FLAGS], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.load(open(out / "dry_run.json"))
    assert report["device_kind"] == "TPU v5 lite" and report["devices"] == 2, report
    assert report["update_temp"] > 0 and report["kv_cache"] > 0
    assert report["limit"] == topology.CHIPS["TPU v5 lite"].hbm_bytes  # the peak is checked against a chip's HBM
    assert "fitted each program into one TPU v5 lite chip, and the peak is within its HBM" in done.stdout
    # libtpu's failed probes for a TPU on this host stay off the console.
    assert "could not determine TPU" not in done.stderr and "InitGoogle" not in done.stderr, done.stderr[-3000:]


@needs_libtpu
@pytest.mark.slow
def test_a_run_larger_than_the_chips_hbm_fails_in_one_line(tmp_path):
    checkpoint = config_only_checkpoint(tmp_path / "ckpt")
    # 4096 samples of 64 + 8192 tokens: a KV cache of ~70 GB against a v5e chip's 16 GB.
    flags = [*FLAGS, "--n", "4096", "--m", "4", "--max-completion-length", "8192"]
    done = run_cli(["--model", checkpoint, "--dry-run", "--topology", "v5e:2x2", "--mesh", "1",
                    "--out", str(tmp_path / "run"), *flags], tmp_path)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(errors) == 1 and "does not fit on the TPU v5 lite" in errors[0], done.stderr[-3000:]
    assert "Traceback" not in done.stderr


@needs_libtpu
def test_sampling_keeps_the_kv_cache_in_one_layout_without_a_copy():
    # The TPU compiler prefers a decode-loop layout of the cache that packs kv heads with
    # head_dim; a default-layout cache handed from a prefill program to a decode program was
    # copied in and out. Prefill and decode are one program, so no cache crosses an edge.
    import re
    import jax.numpy as jnp

    from podsjax.devices import dry_run, mesh as mesh_lib
    from podsjax.sampler import sampling
    import podsjax.models as pm

    devices = tpu_topology.compile_only_devices("v5e:2x2")
    config = pm.ModelConfig(arch="qwen2", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=64, eos_token_id=2, pad_token_id=0)
    model = pm.Decoder(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                       mesh=mesh_lib.make_mesh("1", devices=devices[:1]))
    gen = sampling.Generator(model).compile(dry_run.abstract_base(model), None, prompts=1, prompt_len=512,
                                            num_samples=64, max_new_tokens=512, eos_token_ids=(2,))
    text = gen["sample"].as_text()
    # The stacked cache, [layers, rows, slots, kv heads x head_dim (padded or not)], K and V.
    assert re.search(r"bf16\[2,64,1024,\d+\]", text)
    copies = re.findall(r"= bf16\[2,64,1024,\d+\]\S* copy(?:-start)?\(", text)
    assert not copies, copies


@needs_libtpu
def test_a_v4_slice_is_one_device_a_chip_and_makes_a_mesh():
    # Its devices had been the chips' cores, and make_mesh failed with an AssertionError inside JAX.
    from podsjax.devices import mesh as mesh_lib

    devices = topology.compile_only_devices("v4:2x2x1")
    assert len(devices) == 4 and {d.core_on_chip for d in devices} == {0}
    assert dict(mesh_lib.make_mesh(None, devices=devices).shape) == {"data": 1, "fsdp": 4, "tensor": 1}
