"""A checkpoint whose tokenizer is missing or too large for its embedding, or whose weights
are not finite, is refused at load in one line that names it."""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
from tiny_checkpoint import save_tiny_checkpoint
from tiny_tokenizer import save_tiny_tokenizer
from transformers import Qwen2Config, Qwen2ForCausalLM

import podsjax.models as pm
from experiments import cli, runner
from podsjax.data import prompts

pytestmark = pytest.mark.cpu_mesh

O_PROJ = "model.layers.0.self_attn.o_proj.weight"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def never_trains(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the run went on")

    monkeypatch.setattr(runner, "_train_and_export", never)


def run_cli(model, data_dir, out):
    gsm8k = os.path.join(data_dir, "gsm8k")
    return cli.main("gsm8k", ["--model", str(model), "--data", os.path.join(gsm8k, "train.jsonl"), "--eval-data",
                              os.path.join(gsm8k, "test.jsonl"), "--out", str(out), "--max-steps", "1",
                              "--no-compile-cache", "--reward-workers", "1"])


def one_error_line(capsys):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


def test_a_checkpoint_without_tokenizer_files_is_refused(source, tmp_path, data_dir, capsys, never_trains):
    model = shutil.copytree(source, tmp_path / "model")
    for name in prompts.VOCABULARY_FILES + ("tokenizer_config.json", "merges.txt", "special_tokens_map.json"):
        if os.path.exists(model / name):
            os.remove(model / name)
    assert run_cli(model, data_dir, tmp_path / "out") == 2
    err = one_error_line(capsys)
    assert f"{model}: the checkpoint has no tokenizer (looked for tokenizer.json, tokenizer.model" in err
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_larger_than_the_embedding_is_refused(tmp_path, data_dir, capsys, never_trains):
    model = save_tiny_tokenizer(tmp_path / "model")
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(model)
    ids = prompts.token_id_count(prompts.load_tokenizer(model))
    assert ids > 256
    capsys.readouterr()
    assert run_cli(model, data_dir, tmp_path / "out") == 2
    err = one_error_line(capsys)
    assert f"the tokenizer has {ids} token ids but the model's vocabulary (vocab_size) has 256" in err
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_smaller_than_the_embedding_is_fine(source):
    tokenizer = prompts.load_tokenizer(source)
    prompts.check_vocab(tokenizer, prompts.token_id_count(tokenizer), "exact")
    prompts.check_vocab(tokenizer, 151936, "padded as Qwen's are")
    with pytest.raises(prompts.PromptError, match="has 3;"):
        prompts.check_vocab(tokenizer, 3, "cut")


@pytest.mark.parametrize("fill", [np.nan, np.inf])
def test_non_finite_weights_are_refused_at_load_naming_file_and_tensor(source, tmp_path, fill):
    model = shutil.copytree(source, tmp_path / "model")
    weights = os.path.join(model, "model.safetensors")
    tensors = safetensors.numpy.load_file(weights)
    tensors[O_PROJ][1, 2] = fill
    safetensors.numpy.save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(pm.CheckpointError) as err:
        pm.from_pretrained(model)
    message = str(err.value)
    assert "\n" not in message and O_PROJ in message and weights in message and "NaN or inf" in message


def test_finite_weights_past_the_load_dtype_s_range_are_named_so_not_called_damaged(source, tmp_path):
    model = shutil.copytree(source, tmp_path / "model")
    weights = os.path.join(model, "model.safetensors")
    tensors = safetensors.numpy.load_file(weights)
    tensors[O_PROJ][1, 2] = 1e5  # float16 ends at 65504
    safetensors.numpy.save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(pm.CheckpointError, match="past float16's range.*load it in bfloat16 or float32") as err:
        pm.from_pretrained(model, dtype=jnp.float16)
    assert "damaged" not in str(err.value) and O_PROJ in str(err.value)
    pm.from_pretrained(model, dtype=jnp.bfloat16)
    # A file where the directory belongs is named as such, not read as a config.
    with pytest.raises(pm.CheckpointError, match="takes the checkpoint's directory, not a file in it"):
        pm.from_pretrained(weights)


def test_ff_bytes_in_tensor_data_are_refused_through_the_cli(source, tmp_path, data_dir, capsys):
    model = shutil.copytree(source, tmp_path / "model")
    weights = os.path.join(model, "model.safetensors")
    with open(weights, "rb") as f:
        blob = bytearray(f.read())
    size = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + size])
    start, end = header[O_PROJ]["data_offsets"]
    blob[8 + size + start:8 + size + start + 16] = b"\xff" * 16  # 0xFFFFFFFF is a NaN in float32
    with open(weights, "wb") as f:
        f.write(blob)
    assert run_cli(model, data_dir, tmp_path / "out") == 2
    err = one_error_line(capsys)
    assert O_PROJ in err and weights in err
    assert not (tmp_path / "out").exists()  # a failed start leaves nothing: the rerun is not refused
