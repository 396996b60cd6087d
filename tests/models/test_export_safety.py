"""An export that fails leaves the directory as it was; a bad argument is refused before anything is written."""

import dataclasses
import hashlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import podsjax.models as pm
from podsjax.models import hf_export, peft_io
from podsjax.models import safetensors_io
from podsjax.sampler import sampling

CONFIG = pm.ModelConfig(arch="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                        num_kv_heads=1, head_dim=16, qkv_bias=True, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def model_params():
    model = pm.Decoder(CONFIG)
    return model, pm.init_params(model, jax.random.key(0))


def _contents(path) -> dict[str, str]:
    """Every file under ``path`` (hidden ones too) -> its md5."""
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            out[os.path.relpath(full, path)] = hashlib.md5(open(full, "rb").read()).hexdigest()
    return out


@pytest.fixture
def exported(model_params, tmp_path):
    """A finished export, sharded (so a single-file export must also remove its shards)."""
    model, params = model_params
    out = tmp_path / "model"
    pm.save_pretrained(model, params, out, max_shard_bytes=20_000)
    assert any(name.startswith("model-00001-of-") for name in os.listdir(out))
    return out


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn, jnp.complex64, "bf16", np.float64])
def test_a_dtype_the_export_cannot_store_is_refused_and_the_old_export_stays(model_params, exported, dtype):
    # overwrite=True had deleted the old weights first, then failed (float8) or wrote integer-cut
    # weights under a config that says float32 (int8).
    model, params = model_params
    before = _contents(exported)
    with pytest.raises(ValueError, match="save_pretrained dtype must be one of float32, bfloat16, float16"):
        pm.save_pretrained(model, params, exported, overwrite=True, dtype=dtype)
    assert _contents(exported) == before


def test_a_failure_while_writing_keeps_the_old_export_whole(model_params, exported, monkeypatch):
    model, params = model_params
    before = _contents(exported)
    real = safetensors_io.write_safetensors
    calls = []

    def fail_on_second_file(path, entries, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk went away")
        return real(path, entries, metadata)

    monkeypatch.setattr(hf_export, "write_safetensors", fail_on_second_file)
    with pytest.raises(OSError, match="disk went away"):
        pm.save_pretrained(model, params, exported, overwrite=True, max_shard_bytes=30_000)
    assert len(calls) == 2 and _contents(exported) == before  # no staging folder left either
    monkeypatch.undo()
    new = exported.parent / "new"
    monkeypatch.setattr(hf_export, "write_safetensors", fail_on_second_file)
    calls.clear()
    with pytest.raises(OSError):
        pm.save_pretrained(model, params, new, max_shard_bytes=30_000)
    assert not new.exists()  # a directory the export made is removed again


def test_a_new_export_replaces_the_old_one_and_drops_its_shards(model_params, exported):
    model, params = model_params
    doubled = jax.tree.map(lambda x: x * 2, params)
    (exported / "vocab.txt").write_text("a\nb\n")
    pm.save_pretrained(model, doubled, exported, overwrite=True, tokenizer_from=exported)  # its own folder
    assert sorted(os.listdir(exported)) == ["config.json", "model.safetensors", "vocab.txt"]
    assert (exported / "vocab.txt").read_text() == "a\nb\n"
    _, loaded = pm.from_pretrained(exported)
    np.testing.assert_array_equal(loaded["embed"]["embedding"], doubled["embed"]["embedding"])


def test_a_tokenizer_source_that_holds_no_tokenizer_is_refused_before_anything_is_written(model_params, tmp_path):
    # A mistyped path had given an export without its tokenizer, which no server can run.
    model, params = model_params
    (tmp_path / "empty").mkdir()
    (tmp_path / "generation_only").mkdir()  # a generation config is no tokenizer
    (tmp_path / "generation_only" / "generation_config.json").write_text("{}")
    for source, message in ((tmp_path / "no" / "such", "is not a directory"),
                            (tmp_path / "empty", "holds no tokenizer vocabulary"),
                            (tmp_path / "generation_only", "holds no tokenizer vocabulary")):
        with pytest.raises(ValueError, match=f"tokenizer_from {source} {message}"):
            pm.save_pretrained(model, params, tmp_path / "out", tokenizer_from=source)
        assert not (tmp_path / "out").exists()


def test_an_export_over_a_folder_keeps_files_that_are_no_export_s_weights(model_params, tmp_path):
    # Every *.safetensors had gone, a PEFT adapter's weights too (its config left pointing at nothing).
    model, params = model_params
    lora = pm.init_lora(jax.random.key(1), model, pm.LoraConfig(rank=2, alpha=4.0))
    pm.save_peft_adapter(model, lora, tmp_path)
    (tmp_path / "notes.safetensors").write_bytes(b"the user's")
    adapter = _contents(tmp_path)
    pm.save_pretrained(model, params, tmp_path, lora=lora, overwrite=True)
    after = _contents(tmp_path)
    assert {name: after.get(name) for name in adapter} == adapter
    assert "model.safetensors" in after


def test_a_leftover_staging_folder_is_cleared_by_the_next_export(model_params, exported):
    model, params = model_params
    leftover = exported / (hf_export.STAGING_PREFIX + "killed")
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half")
    pm.save_pretrained(model, params, exported, overwrite=True)
    assert not leftover.exists()


@pytest.mark.parametrize("bad,message", [(None, "max_shard_bytes must be an integer >= 1; got None"),
                                         (0, "max_shard_bytes must be an integer >= 1; got 0")])
def test_a_bad_shard_size_is_one_line(model_params, tmp_path, bad, message):
    model, params = model_params
    with pytest.raises(ValueError, match=message):
        pm.save_pretrained(model, params, tmp_path / "x", max_shard_bytes=bad)
    assert not (tmp_path / "x").exists()


def test_params_of_another_shape_are_named(model_params, tmp_path):
    model, params = model_params
    other = jax.tree.map(lambda x: x, params)
    other["layers"]["mlp"]["up"]["kernel"] = jnp.zeros((2, 32, 65))
    with pytest.raises(pm.CheckpointError, match=r"params do not fit this model: \['layers'\]\['mlp'\]\['up'\]"
                                                 r"\['kernel'\] is \(2, 32, 65\), the model's config gives \(2, 32, 64\)"):
        pm.save_pretrained(model, other, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_lora_of_another_model_is_refused_by_both_exports(model_params, tmp_path):
    model, params = model_params
    wider = pm.Decoder(dataclasses.replace(CONFIG, intermediate_size=96))
    lora = pm.init_lora(jax.random.key(1), wider, pm.LoraConfig(rank=2, alpha=2.0))
    with pytest.raises(ValueError, match=r"lora does not fit this model: layers/mlp/down/a is \(2, 96, 2\), the "
                                         r"model's config gives \(2, 64, 2\)"):
        pm.save_pretrained(model, params, tmp_path / "merged", lora=lora)
    with pytest.raises(ValueError, match="lora does not fit this model"):  # generation: before it compiles
        sampling.Generator(model).generate(params, np.ones((1, 4), np.int32), np.ones((1, 4), np.int32),
                                           jax.random.key(0), lora=lora, num_samples=1, max_new_tokens=2,
                                           eos_token_ids=2, temperature=1.0)
    with pytest.raises(ValueError, match="lora does not fit this model"):
        peft_io.save_peft_adapter(model, lora, tmp_path / "adapter")
    with pytest.raises(ValueError, match="lora must be the LoraParams that init_lora makes"):
        pm.save_pretrained(model, params, tmp_path / "merged", lora=lora.weights)
    # The forward and merge_lora had failed deep inside a reshape, or on a dict's missing .weights.
    ids = jnp.array([[3, 4, 5]])
    with pytest.raises(ValueError, match=r"lora does not fit this model: layers/mlp/down/a"):
        model.apply({"params": params}, ids, lora=lora)
    with pytest.raises(ValueError, match="lora must be the LoraParams that init_lora makes"):
        model.apply({"params": params}, ids, lora=lora.weights)
    with pytest.raises(ValueError, match=r"lora does not fit the kernel layers/mlp/down/kernel: A \(2, 96, 2\)"):
        pm.merge_lora(params, lora)
    with pytest.raises(ValueError, match="lora must be the LoraParams that init_lora makes; got dict"):
        pm.merge_lora(params, lora.weights)
    assert not (tmp_path / "merged").exists() and not (tmp_path / "adapter").exists()
    wider_params = pm.init_params(wider, jax.random.key(2))  # params of another config: one line too
    with pytest.raises(ValueError, match=r"params do not fit this model: \['layers'\]\['mlp'\]\['down'\]"):
        sampling.Generator(model).generate(wider_params, np.ones((1, 4), np.int32), np.ones((1, 4), np.int32),
                                           jax.random.key(0), num_samples=1, max_new_tokens=2, eos_token_ids=2,
                                           temperature=1.0)
    with pytest.raises(ValueError, match="LoRA targets must be a list of projection names"):
        pm.LoraConfig(targets="qkv")  # had been q, k and v


def test_an_adapter_export_that_fails_keeps_the_old_adapter(model_params, tmp_path, monkeypatch):
    model, _ = model_params
    lora = pm.init_lora(jax.random.key(1), model, pm.LoraConfig(rank=2, alpha=2.0))
    out = tmp_path / "adapter"
    peft_io.save_peft_adapter(model, lora, out)
    before = _contents(out)

    def broken(path, entries, metadata=None):
        open(path, "wb").write(b"half a file")
        raise OSError("disk went away")

    monkeypatch.setattr(peft_io, "write_safetensors", broken)
    with pytest.raises(OSError, match="disk went away"):
        peft_io.save_peft_adapter(model, lora.replace(weights=jax.tree.map(lambda x: x + 1, lora.weights)), out,
                                  overwrite=True)
    assert _contents(out) == before
