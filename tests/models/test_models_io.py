"""HF checkpoint loading (sharded), export, round trips, bad checkpoints, host memory."""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors
import safetensors.numpy
import torch
from jax.sharding import PartitionSpec as P
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from podsjax.devices.mesh import make_mesh
import podsjax.models as pm

pytestmark = pytest.mark.cpu_mesh

VOCAB = 256


def build_hf(path, family, seed, **extra):
    """Tiny random HF model saved to ``path``; weights redrawn so logits are O(1)."""
    config_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if family == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)
    config = config_cls(**{**shape, **extra})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = (0.25 if "embed" in name else p.shape[1] ** -0.5) if p.ndim == 2 else 0.3
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Two tiny checkpoints: Qwen2 tied (bias, GQA) and Llama untied (llama3 RoPE, 1 kv head)."""
    qwen = tmp_path_factory.mktemp("qwen")
    build_hf(qwen, "qwen2", 0, tie_word_embeddings=True)
    llama = tmp_path_factory.mktemp("llama")
    build_hf(llama, "llama", 1, tie_word_embeddings=False, num_key_value_heads=1, rope_theta=500000.0,
             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    return {"qwen2": qwen, "llama": llama}


@pytest.fixture(scope="session")
def apply_fn():
    return jax.jit(lambda model, params, ids, lora: model.apply({"params": params}, ids, lora=lora).logits_BLV,
                   static_argnums=0)


def hf_load(path, dtype=torch.float32):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()


def hf_logits(model, ids_BL):
    with torch.no_grad():
        return model(torch.tensor(ids_BL)).logits.float().numpy()


IDS_BL = np.random.RandomState(0).randint(0, VOCAB, (2, 24)).astype(np.int32)


# --------------------------------------------------------------------------- export


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_round_trip_hf_podsjax_hf_is_identical(checkpoints, tmp_path, family):
    model, params = pm.from_pretrained(checkpoints[family])
    source = shutil.copytree(checkpoints[family], tmp_path / "source")
    (source / "vocab.json").write_text('{"a": 0}')  # a tokenizer's vocabulary, which tokenizer_from requires
    pm.save_pretrained(model, params, tmp_path / "out", tokenizer_from=source)
    original, reloaded = hf_load(checkpoints[family]), hf_load(tmp_path / "out")
    assert type(reloaded) is type(original)
    before, after = original.state_dict(), reloaded.state_dict()
    assert before.keys() == after.keys()
    for key in before:  # pure transposes and reshapes: bit-identical
        assert torch.equal(before[key], after[key]), key
    np.testing.assert_array_equal(hf_logits(reloaded, IDS_BL), hf_logits(original, IDS_BL))
    for name in ("generation_config.json", "vocab.json"):  # copied with tokenizer_from
        assert os.path.isfile(tmp_path / "out" / name), name


@pytest.mark.slow
def test_export_merges_lora_and_shards(checkpoints, tmp_path, apply_fn):
    model, params = pm.from_pretrained(checkpoints["llama"])
    lora = pm.init_lora(jax.random.key(0), model, pm.LoraConfig(rank=4, alpha=8.0))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(lora)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    lora = jax.tree.unflatten(treedef, [  # a trained-looking adapter: B != 0
        0.05 * jax.random.normal(key, x.shape) if path[-1].key == "b" else x
        for key, (path, x) in zip(keys, leaves, strict=True)])
    # A tiny shard limit forces several files plus model.safetensors.index.json.
    pm.save_pretrained(model, params, tmp_path / "merged", lora=lora, max_shard_bytes=100_000)
    files = os.listdir(tmp_path / "merged")
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 2
    exported = hf_logits(hf_load(tmp_path / "merged"), IDS_BL)
    ours = np.asarray(apply_fn(model, params, jnp.asarray(IDS_BL), lora))
    base = np.asarray(apply_fn(model, params, jnp.asarray(IDS_BL), None))
    assert np.abs(ours - base).max() > 1e-2  # the merged adapter is visible in the export
    assert np.abs(exported - ours).max() <= 1e-4
    # And the export reloads into podsjax through the sharded-index path.
    model2, params2 = pm.from_pretrained(tmp_path / "merged")
    assert np.abs(np.asarray(apply_fn(model2, params2, jnp.asarray(IDS_BL), None)) - ours).max() <= 1e-4


def test_bf16_checkpoint_loads_and_exports_bit_exact(checkpoints, tmp_path):
    hf_bf16 = hf_load(checkpoints["qwen2"]).to(torch.bfloat16)
    hf_bf16.save_pretrained(tmp_path / "bf16")
    model, params = pm.from_pretrained(tmp_path / "bf16", dtype=jnp.bfloat16)
    assert model.dtype == jnp.bfloat16 and params["embed"]["embedding"].dtype == jnp.bfloat16
    ref = hf_bf16.model.layers[0].self_attn.q_proj.weight.detach().float().numpy()
    np.testing.assert_array_equal(np.asarray(params["layers"]["attn"]["q"]["kernel"][0], np.float32),
                                  ref.T.reshape(64, 4, 16))
    pm.save_pretrained(model, params, tmp_path / "bf16_out")
    reloaded = hf_load(tmp_path / "bf16_out", dtype=torch.bfloat16)
    for key, value in hf_bf16.state_dict().items():
        assert torch.equal(value, reloaded.state_dict()[key]), key
    # bf16 weights into fp32 params: exact upcast.
    _, params32 = pm.from_pretrained(tmp_path / "bf16", dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(params32["layers"]["attn"]["q"]["kernel"][0]),
                                  ref.T.reshape(64, 4, 16))


def test_fp32_checkpoint_loads_into_bf16_params_rounded_as_numpy_rounds(checkpoints):
    # Kernels are transposed and cast on the device, the other tensors on the host: both
    # round to nearest even, as ml_dtypes does. The untied Llama has a layerless kernel (lm_head).
    hf = hf_load(checkpoints["llama"])
    _, params = pm.from_pretrained(checkpoints["llama"], dtype=jnp.bfloat16)
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    expected = {("layers", "mlp", "down", "kernel"): state["model.layers.1.mlp.down_proj.weight"].T,
                ("lm_head", "kernel"): state["lm_head.weight"].T,
                ("layers", "attn", "o", "kernel"): state["model.layers.1.self_attn.o_proj.weight"].T.reshape(4, 16, 64),
                ("embed", "embedding"): state["model.embed_tokens.weight"]}
    for path, want in expected.items():
        got = params
        for key in path:
            got = got[key]
        got = got[1] if path[0] == "layers" else got
        assert got.dtype == jnp.bfloat16, path
        np.testing.assert_array_equal(np.asarray(got), want.astype(jnp.bfloat16), err_msg=str(path))


def test_export_refuses_non_finite_weights_and_writes_nothing(checkpoints, tmp_path):
    model, params = pm.from_pretrained(checkpoints["qwen2"])
    poisoned = jax.tree.map(lambda x: x, params)
    poisoned["layers"]["mlp"]["up"]["kernel"] = poisoned["layers"]["mlp"]["up"]["kernel"].at[1, 0, 0].set(jnp.nan)
    with pytest.raises(pm.CheckpointError, match="non-finite weights .* layers/mlp/up/kernel") as err:
        pm.save_pretrained(model, poisoned, tmp_path / "out")
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()
    lora = pm.init_lora(jax.random.key(0), model, pm.LoraConfig(rank=2, alpha=2.0))
    lora = lora.replace(weights=jax.tree.map(lambda x: x * jnp.inf, lora.weights))
    with pytest.raises(pm.CheckpointError, match="lora/layers/attn/q/a"):
        pm.save_pretrained(model, params, tmp_path / "out", lora=lora)
    pm.save_pretrained(model, params, tmp_path / "out")  # the finite params export as before


def test_export_refuses_non_empty_dir_unless_overwrite(checkpoints, tmp_path):
    model, params = pm.from_pretrained(checkpoints["qwen2"])
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        pm.save_pretrained(model, params, out)
    assert os.listdir(out) == ["notes.txt"]
    pm.save_pretrained(model, params, out / "empty_ok")  # new dirs are fine
    (out / "model-00001-of-00002.safetensors").write_bytes(b"old")  # an earlier export's shard goes ...
    (out / "stale.safetensors").write_bytes(b"old")  # ... a file of another name is not an export's, and stays
    pm.save_pretrained(model, params, out, overwrite=True)
    written = os.listdir(out)
    assert "model-00001-of-00002.safetensors" not in written and "model.safetensors" in written
    assert "stale.safetensors" in written
    # The loader reads model.safetensors alone, as transformers does: the kept file is no weights of its.
    _, loaded = pm.from_pretrained(out)
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool((np.asarray(a) == np.asarray(b)).all()), params, loaded)))
    with pytest.raises(pm.CheckpointError, match="model.layers.0.self_attn.q_proj.weight"):
        broken = jax.tree.map(lambda x: x, params)
        del broken["layers"]["attn"]["q"]
        pm.save_pretrained(model, broken, tmp_path / "broken")


# --------------------------------------------------------------------------- bad checkpoints


def test_the_weights_are_the_files_transformers_reads(checkpoints, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoints["qwen2"], path)
    tensors = safetensors.numpy.load_file(path / "model.safetensors")
    _, expected = pm.from_pretrained(path)
    same = lambda a, b: all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(np.array_equal(x, y)), a, b)))
    # Another .safetensors beside model.safetensors (an adapter, a user's file) is not read.
    safetensors.numpy.save_file({"model.norm.weight": tensors["model.norm.weight"] + 1}, path / "extra.safetensors")
    assert same(pm.from_pretrained(path)[1], expected)
    # With both model.safetensors and an index, model.safetensors is the checkpoint, as in transformers.
    shard = "model-00001-of-00001.safetensors"
    safetensors.numpy.save_file({k: v + 1 for k, v in tensors.items()}, path / shard)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: shard for k in tensors}}))
    assert same(pm.from_pretrained(path)[1], expected)
    os.remove(path / "model.safetensors")  # now the index is the checkpoint
    np.testing.assert_allclose(np.asarray(pm.from_pretrained(path)[1]["final_norm"]["scale"]),
                               tensors["model.norm.weight"] + 1)


def copy_with(src, dst, edit):
    """Copies a single-file checkpoint, editing its tensors dict with ``edit``."""
    shutil.copytree(src, dst)
    tensors = safetensors.numpy.load_file(os.path.join(dst, "model.safetensors"))
    edit(tensors)
    safetensors.numpy.save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_one_error_lists_missing_unexpected_and_misshaped(checkpoints, tmp_path):
    def corrupt(t):
        del t["model.layers.1.mlp.up_proj.weight"]
        q = t["model.layers.0.self_attn.q_proj.weight"]
        t["model.layers.0.self_attn.q_proj.weight"] = np.ascontiguousarray(q[:, :32])
        t["model.layers.7.mlp.extra.weight"] = np.zeros((2, 2), np.float32)

    path = copy_with(checkpoints["qwen2"], tmp_path / "bad", corrupt)
    with pytest.raises(pm.CheckpointError) as err:
        pm.from_pretrained(path)
    message = str(err.value)
    assert "missing (1): model.layers.1.mlp.up_proj.weight" in message
    assert "unexpected (1): model.layers.7.mlp.extra.weight" in message
    assert "model.layers.0.self_attn.q_proj.weight: expected [64, 64], found [64, 32]" in message


def test_a_tied_checkpoint_s_own_lm_head_loads_only_when_it_is_the_embedding(checkpoints, tmp_path):
    # It had been dropped without a word, while transformers 5 loads it: the logits then differed by 0.84.
    config = json.loads((checkpoints["qwen2"] / "config.json").read_text())
    assert config["tie_word_embeddings"]

    def head(offset):
        def add(t):
            t["lm_head.weight"] = np.ascontiguousarray(t["model.embed_tokens.weight"] + offset)
        return add

    pm.from_pretrained(copy_with(checkpoints["qwen2"], tmp_path / "same", head(0.0)))
    with pytest.raises(pm.CheckpointError, match="ties the LM head to the embedding, but the weights hold an "
                                                 "lm_head.weight that differs from it"):
        pm.from_pretrained(copy_with(checkpoints["qwen2"], tmp_path / "other", head(0.5)))


def test_heads_compared_block_by_block_differ_in_any_block_and_rope_buffers_are_ignored(checkpoints, tmp_path):
    from podsjax.models import hf_io
    from podsjax.models.safetensors_io import SafetensorsFile

    # Compared 2 rows at a time, a difference in the last block only (real vocabularies span 37 blocks).
    head = np.arange(15, dtype=np.float32).reshape(5, 3)
    other = head.copy()
    other[4, 2] += 1
    safetensors.numpy.save_file({"a": head, "b": head.copy(), "c": other}, tmp_path / "t.safetensors")
    files = dict.fromkeys("abc", SafetensorsFile(str(tmp_path / "t.safetensors")))
    assert hf_io._same_tensor(files, "a", "b", rows=2) and not hf_io._same_tensor(files, "a", "c", rows=2)

    # Older Llama saves keep RoPE's inv_freq buffers: they load, ignored.
    def with_rope_buffer(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)

    pm.from_pretrained(copy_with(checkpoints["llama"], tmp_path / "rope", with_rope_buffer))


def test_incomplete_checkpoints_raise_clear_errors(checkpoints, tmp_path):
    # Config and weights of different models: every mismatch reported, nothing loaded.
    mixed = tmp_path / "mixed"
    shutil.copytree(checkpoints["qwen2"], mixed)
    shutil.copy(checkpoints["llama"] / "config.json", mixed / "config.json")
    with pytest.raises(pm.CheckpointError, match=r"missing \(1\): lm_head.weight"):
        pm.from_pretrained(mixed)
    # No weights at all.
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(checkpoints["qwen2"] / "config.json", empty / "config.json")
    with pytest.raises(pm.CheckpointError, match="neither model.safetensors nor model.safetensors.index.json"):
        pm.from_pretrained(empty)
    with pytest.raises(FileNotFoundError, match="config.json"):
        pm.from_pretrained(tmp_path / "nowhere")
    # Truncated file.
    cut = tmp_path / "cut"
    shutil.copytree(checkpoints["qwen2"], cut)
    blob = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(ValueError, match="truncated"):
        pm.from_pretrained(cut)
    # Sharded index naming a shard that is gone.
    index = tmp_path / "index"
    shutil.copytree(checkpoints["qwen2"], index)
    os.rename(index / "model.safetensors", index / "model-00001-of-00002.safetensors")
    with safetensors.safe_open(index / "model-00001-of-00002.safetensors", "np") as f:
        weight_map = {name: "model-00001-of-00002.safetensors" for name in f.keys()}
    weight_map["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (index / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(pm.CheckpointError, match="model-00002-of-00002.safetensors"):
        pm.from_pretrained(index)


def test_unknown_architecture_names_supported_ones(checkpoints, tmp_path):
    other = tmp_path / "gpt2"
    shutil.copytree(checkpoints["qwen2"], other)
    config = json.loads((other / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported.*Qwen2ForCausalLM"):
        pm.from_pretrained(other)


# --------------------------------------------------------------------------- sharding


def test_params_load_sharded_as_the_rules_say_and_match_unsharded(checkpoints, apply_fn):
    mesh = make_mesh("fsdp=4,tensor=2")
    model, params = pm.from_pretrained(checkpoints["qwen2"])
    sharded_model, sharded = pm.from_pretrained(checkpoints["qwen2"], mesh=mesh)
    layer, y = sharded["layers"], model.config.num_layers  # stacked: the layer axis is never split
    expected = {
        "embedding [V, D]": (sharded["embed"]["embedding"], P("tensor", "fsdp"), (128, 16)),
        "q [Y, D, H, E]": (layer["attn"]["q"]["kernel"], P(None, "fsdp", "tensor", None), (y, 16, 2, 16)),
        "k [Y, D, K, E]": (layer["attn"]["k"]["kernel"], P(None, "fsdp", "tensor", None), (y, 16, 1, 16)),
        "q bias [Y, H, E]": (layer["attn"]["q"]["bias"], P(None, "tensor", None), (y, 2, 16)),
        "o [Y, H, E, D]": (layer["attn"]["o"]["kernel"], P(None, "tensor", None, "fsdp"), (y, 2, 16, 16)),
        "up [Y, D, F]": (layer["mlp"]["up"]["kernel"], P(None, "fsdp", "tensor"), (y, 16, 64)),
        "down [Y, F, D]": (layer["mlp"]["down"]["kernel"], P(None, "tensor", "fsdp"), (y, 64, 16)),
        "norm [Y, D]": (layer["attn_norm"]["scale"], P(None, "fsdp"), (y, 16)),
    }
    for label, (array, spec, shard_shape) in expected.items():
        assert array.sharding.spec == spec, label
        assert array.addressable_shards[0].data.shape == shard_shape, label
        assert len(array.sharding.device_set) == 8, label
    assert jax.tree.map(lambda s: s.spec, pm.param_shardings(model, mesh)) == jax.tree.map(
        lambda a: a.sharding.spec, sharded)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(sharded), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ids_BL = jnp.asarray(np.tile(IDS_BL, (2, 1)))  # batch 4 over fsdp=4
    plain = np.asarray(apply_fn(model, params, ids_BL, None))
    logits = apply_fn(sharded_model, sharded, ids_BL, None)
    assert logits.sharding.spec == P("fsdp", None, "tensor")  # activation constraints applied
    assert np.abs(np.asarray(logits) - plain).max() <= 1e-5


@pytest.mark.slow
def test_sharded_prefill_and_decode_match_unsharded(checkpoints):
    mesh = make_mesh("data=2,fsdp=2,tensor=2")
    model, params = pm.from_pretrained(checkpoints["llama"])  # 1 kv head: replicated over tensor
    sharded_model, sharded = pm.from_pretrained(checkpoints["llama"], mesh=mesh)
    assert sharded["layers"]["attn"]["k"]["kernel"].sharding.spec == P(None, "fsdp", None, None)
    ids_BL = jnp.asarray(np.tile(IDS_BL, (2, 1)))
    mask_BL = jnp.ones_like(ids_BL).at[1, :5].set(0)

    def run(m, p, cache):
        logits, cache = pm.prefill(m, p, ids_BL[:, :20], mask_BL[:, :20], cache)
        out = [logits[:, -1]]
        for t in range(20, 23):
            step_logits, cache = pm.decode_step(m, p, ids_BL[:, t:t + 1], cache)
            out.append(step_logits)
        return jnp.stack(out, 1), cache

    plain, _ = jax.jit(run, static_argnums=0)(model, params, pm.init_cache(model.config, 4, 24, jnp.float32))
    cache = pm.init_cache(model.config, 4, 24, jnp.float32, mesh=mesh)
    assert cache.keys_YBSC.sharding.spec == P(None, ("data", "fsdp"), None, None)
    got, cache = jax.jit(run, static_argnums=0)(sharded_model, sharded, cache)
    assert np.abs(np.asarray(got) - np.asarray(plain)).max() <= 1e-5


# --------------------------------------------------------------------------- host memory


# Loads in a fresh process, so no other test's threads or caches allocate inside the
# tracemalloc window.
LOAD_SCRIPT = """
import json, sys, tracemalloc
import jax, numpy as np
from podsjax.devices.mesh import make_mesh
import podsjax.models as pm
mesh = make_mesh("8")
tracemalloc.start()
model, params = pm.from_pretrained(sys.argv[1], mesh=mesh)
jax.block_until_ready(params)
current, peak = tracemalloc.get_traced_memory()
tracemalloc.stop()
np.save(sys.argv[2], np.asarray(params["layers"]["mlp"]["down"]["kernel"][3]))
print(json.dumps({"peak": peak, "current": current, "lm_head_spec": str(params["lm_head"]["kernel"].sharding.spec)}))
"""


@pytest.mark.slow
def test_sharded_load_of_200mb_model_keeps_host_memory_near_one_tensor(tmp_path):
    # ~53M params (213 MB fp32), saved by transformers as a sharded index; no tensor is
    # more than ~8% of the model, so a loader that held the model on the host would show.
    config = Qwen2Config(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                         num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False)
    torch.manual_seed(0)
    checkpoint = tmp_path / "model"
    Qwen2ForCausalLM(config).save_pretrained(checkpoint, max_shard_size="64MB")
    assert os.path.isfile(checkpoint / "model.safetensors.index.json")
    model_bytes = sum(os.path.getsize(checkpoint / f) for f in os.listdir(checkpoint) if f.endswith(".safetensors"))
    largest = max(np.prod(spec.hf_shape) * 4 for spec in pm.tensor_specs(pm.Decoder(pm.from_hf_config(checkpoint))))
    assert model_bytes > 200e6 and largest < 0.1 * model_bytes

    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    done = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, str(checkpoint), str(tmp_path / "down.npy")],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # On CPU, jax may alias a suitably aligned numpy slice as the device buffer (zero
    # copy), so a loaded shard can stay traced as "host" memory; it is the param itself.
    # What the loader holds on top of that is the peak minus what is still held at the end.
    transient = result["peak"] - result["current"]
    print(f"\nmodel {model_bytes / 1e6:.0f} MB, largest tensor {largest / 1e6:.1f} MB, peak traced host memory "
          f"during load {result['peak'] / 1e6:.1f} MB, of which {result['current'] / 1e6:.1f} MB aliased by params")
    # One converted (transposed) tensor plus its per-device staging slices: < 2 tensors.
    assert transient < 2 * largest
    assert result["current"] < 0.5 * model_bytes  # the loader does not keep the model on the host
    assert result["lm_head_spec"] == str(P("fsdp", None))
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    name = "model.layers.3.mlp.down_proj.weight"
    np.testing.assert_array_equal(
        np.load(tmp_path / "down.npy"), safetensors.numpy.load_file(checkpoint / index["weight_map"][name])[name].T)


def test_random_init_is_born_sharded_and_matches_loaded_layout(checkpoints):
    mesh = make_mesh("fsdp=4,tensor=2")
    model, loaded = pm.from_pretrained(checkpoints["qwen2"], mesh=mesh)
    fresh = pm.init_params(model, jax.random.key(0), mesh=mesh)
    assert jax.tree.structure(fresh) == jax.tree.structure(loaded)
    assert jax.tree.map(lambda a: (a.shape, a.dtype, a.sharding.spec), fresh) == jax.tree.map(
        lambda a: (a.shape, a.dtype, a.sharding.spec), loaded)
    np.testing.assert_array_equal(np.asarray(fresh["layers"]["mlp_norm"]["scale"][1]), np.ones(64, np.float32))
    assert 0.015 < float(jnp.std(fresh["layers"]["mlp"]["up"]["kernel"][0])) < 0.025  # N(0, 0.02)


def test_the_streaming_writer_holds_one_tensor_where_the_package_holds_them_all(tmp_path):
    """Why export keeps its own writer: safetensors.numpy.save_file takes the whole model at once."""
    import tracemalloc

    from podsjax.models.safetensors_io import write_safetensors

    shape, count = (512, 1024), 8  # 2 MiB each, 16 MiB in all
    tensor_bytes = int(np.prod(shape)) * 4

    def make(i):
        return np.full(shape, i, np.float32)

    tracemalloc.start()
    write_safetensors(str(tmp_path / "ours.safetensors"),
                      [(f"t{i}", shape, np.float32, lambda i=i: make(i)) for i in range(count)])
    _, ours = tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    safetensors.numpy.save_file({f"t{i}": make(i) for i in range(count)}, str(tmp_path / "package.safetensors"))
    _, package = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"\npeak host memory writing {count} x {tensor_bytes / 2**20:.0f} MiB: streaming writer "
          f"{ours / 2**20:.1f} MiB, safetensors.numpy.save_file {package / 2**20:.1f} MiB")
    assert ours < 2 * tensor_bytes and package >= count * tensor_bytes
    # The same file either way: the package reads ours back tensor for tensor.
    with safetensors.safe_open(str(tmp_path / "ours.safetensors"), framework="np") as f:
        for i in range(count):
            np.testing.assert_array_equal(f.get_tensor(f"t{i}"), make(i))
