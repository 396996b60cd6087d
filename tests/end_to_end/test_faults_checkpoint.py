"""Hostile checkpoints (safetensors headers, config.json, the shard index) fail in one line.

Every error is a CheckpointError naming the file and the tensor or key, raised before any
weight is placed on a device.
"""

import json
import math
import os
import shutil
import struct

import jax
import numpy as np
import pytest
import safetensors.numpy
from tiny_checkpoint import save_tiny_checkpoint

import podsjax.models as pm
from experiments import runner
from experiments.cli import UsageError
from experiments.config import ExperimentConfig, ModelSection
from podsjax.models import hf_io
from podsjax.models.safetensors_io import SafetensorsFile
from podsjax.rl import RunConfig

Q = "model.layers.0.self_attn.q_proj.weight"
NORM = "model.norm.weight"
WEIGHTS = "model.safetensors"
SHARD = "model-00001-of-00001.safetensors"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(autouse=True)
def nothing_placed(monkeypatch):
    """Any weight reaching a device before the error fails the test."""
    def place(*args):
        raise AssertionError("a weight was placed before the checkpoint was rejected")

    monkeypatch.setattr(hf_io, "_place", place)


def copy(source, dst):
    shutil.copytree(source, dst)
    return dst


def read_file(path):
    """(header dict, data bytes) of a safetensors file."""
    blob = open(path, "rb").read()
    (size,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + size]), blob[8 + size:]


def packed(header, data=b""):
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob + data


def raises_one_line(call, *needles):
    with pytest.raises(pm.CheckpointError) as err:
        call()
    message = str(err.value)
    assert type(err.value) is pm.CheckpointError and "\n" not in message, message
    for needle in needles:
        assert needle in message, message
    return message


def load(path):
    return lambda: pm.from_pretrained(path)


# --------------------------------------------------------------------------- safetensors dtypes


def test_integer_header_with_float_byte_size_is_refused(source, tmp_path):
    # I32 and F32 have the same itemsize: the header alone decides, and it must not load as ints.
    path = copy(source, tmp_path / "ckpt")
    header, data = read_file(path / WEIGHTS)
    header[Q]["dtype"] = "I32"
    (path / WEIGHTS).write_bytes(packed(header, data))
    raises_one_line(load(path), Q, "I32", str(path / WEIGHTS), "not floating point")


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.int16, np.int8, np.uint8, np.bool_])
def test_non_floating_parameters_are_refused(source, tmp_path, dtype):
    path = copy(source, tmp_path / "ckpt")
    tensors = safetensors.numpy.load_file(path / WEIGHTS)
    tensors[NORM] = tensors[NORM].astype(dtype)
    safetensors.numpy.save_file(tensors, path / WEIGHTS, metadata={"format": "pt"})
    raises_one_line(load(path), NORM, str(path / WEIGHTS), "not floating point")


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_floating_parameters_are_cast(source, tmp_path, monkeypatch, dtype):
    monkeypatch.undo()  # this checkpoint does load
    path = copy(source, tmp_path / "ckpt")
    tensors = safetensors.numpy.load_file(path / WEIGHTS)
    tensors[NORM] = (tensors[NORM] + 0.5).astype(dtype)
    safetensors.numpy.save_file(tensors, path / WEIGHTS, metadata={"format": "pt"})
    _, params = pm.from_pretrained(path)
    assert params["final_norm"]["scale"].dtype == np.float32
    np.testing.assert_array_equal(np.asarray(params["final_norm"]["scale"]), tensors[NORM].astype(np.float32))


# --------------------------------------------------------------------------- safetensors headers


def entry(name, **changes):
    def edit(header, data):
        header[name].update(changes)
        return packed(header, data)
    return edit


def replace(name, value):
    def edit(header, data):
        header[name] = value
        return packed(header, data)
    return edit


def end_of(header, name):
    return header[name]["data_offsets"][1]


HEADER_CASES = {
    # id: (file bytes from (header, data), what the message must say besides the file)
    "begin_after_end": (lambda h, d: entry(Q, data_offsets=h[Q]["data_offsets"][::-1])(h, d), [Q, "begin after"]),
    "negative_offset": (lambda h, d: entry(Q, data_offsets=[-4, end_of(h, Q)])(h, d), [Q, "data_offsets"]),
    "one_offset": (lambda h, d: entry(Q, data_offsets=[0])(h, d), [Q, "two non-negative ints"]),
    "three_offsets": (lambda h, d: entry(Q, data_offsets=[0, 4, 8])(h, d), [Q, "two non-negative ints"]),
    "string_offsets": (lambda h, d: entry(Q, data_offsets=["0", "4"])(h, d), [Q, "two non-negative ints"]),
    "float_offsets": (lambda h, d: entry(Q, data_offsets=[0.0, 4.0])(h, d), [Q, "two non-negative ints"]),
    "offsets_missing": (lambda h, d: replace(Q, {"dtype": "F32", "shape": [2]})(h, d), [Q, "data_offsets"]),
    "offsets_past_end": (lambda h, d: entry(NORM, data_offsets=[len(d), len(d) + 4 * h[NORM]["shape"][0]])(h, d),
                         [NORM, "truncated"]),
    "truncated_file": (lambda h, d: packed(h, d[:-4]), ["tensor '", "run past the end", "truncated"]),
    "size_not_shape": (lambda h, d: entry(Q, shape=[h[Q]["shape"][0] + 1, h[Q]["shape"][1]])(h, d), [Q, "needs"]),
    "shape_string": (lambda h, d: entry(Q, shape="32x32")(h, d), [Q, "shape"]),
    "shape_negative": (lambda h, d: entry(Q, shape=[-32, -32])(h, d), [Q, "shape"]),
    "shape_float": (lambda h, d: entry(NORM, shape=[32.0])(h, d), [NORM, "shape"]),
    "shape_bool": (lambda h, d: entry(NORM, shape=[True])(h, d), [NORM, "shape"]),
    "unknown_dtype": (lambda h, d: entry(Q, dtype="F8_E4M3")(h, d), [Q, "F8_E4M3"]),
    "dtype_not_string": (lambda h, d: entry(Q, dtype=["F32"])(h, d), [Q, "dtype"]),
    "entry_not_object": (lambda h, d: replace(Q, "F32")(h, d), [Q, "object"]),
    "entry_list": (lambda h, d: replace(Q, [0, 4])(h, d), [Q, "object"]),
    "header_list": (lambda h, d: packed(b"[1, 2]", d), ["JSON object"]),
    "header_not_json": (lambda h, d: packed(b"{not json", d), ["corrupt safetensors header"]),
    "header_not_utf8": (lambda h, d: packed(b'{"\xff\xfe": 1}', d), ["corrupt safetensors header"]),
    "header_deeply_nested": (lambda h, d: packed(b"[" * 100_000, d), ["corrupt safetensors header"]),
    "metadata_list": (lambda h, d: packed({**h, "__metadata__": ["pt"]}, d), ["__metadata__"]),
    "header_longer_than_file": (lambda h, d: struct.pack("<Q", 8 + len(d) + 10**6) + b"{}" + d, ["length"]),
    "header_length_huge": (lambda h, d: struct.pack("<Q", 2**63) + d, ["length"]),
    "shorter_than_8_bytes": (lambda h, d: b"\x10\x00\x00", ["shorter than 8 bytes"]),
    "empty_file": (lambda h, d: b"", ["shorter than 8 bytes"]),
}


@pytest.mark.parametrize("case", list(HEADER_CASES))
def test_corrupt_safetensors_header_names_file_and_tensor(source, tmp_path, case):
    make, needles = HEADER_CASES[case]
    path = copy(source, tmp_path / "ckpt")
    header, data = read_file(path / WEIGHTS)
    (path / WEIGHTS).write_bytes(make(header, data))
    raises_one_line(load(path), str(path / WEIGHTS), *needles)
    raises_one_line(lambda: SafetensorsFile(str(path / WEIGHTS)), str(path / WEIGHTS), *needles)


def test_valid_file_reads_as_before(source):
    st = SafetensorsFile(os.path.join(source, WEIGHTS))
    reference = safetensors.numpy.load_file(os.path.join(source, WEIGHTS))
    assert sorted(st.keys()) == sorted(reference)
    for name, value in reference.items():
        assert st.dtype(name) == "F32" and st.shape(name) == value.shape
        np.testing.assert_array_equal(st.get(name), value)


def test_zero_size_tensor_at_end_of_data_is_valid(tmp_path):
    path = tmp_path / "zero.safetensors"
    path.write_bytes(packed({"a": {"dtype": "F32", "shape": [0, 3], "data_offsets": [0, 0]}}))
    assert SafetensorsFile(str(path)).get("a").shape == (0, 3)


def test_one_error_for_every_mismatch_is_one_line(source, tmp_path):
    path = copy(source, tmp_path / "ckpt")
    tensors = safetensors.numpy.load_file(path / WEIGHTS)
    del tensors[NORM]
    tensors["model.extra.weight"] = np.zeros(2, np.float32)
    tensors[Q] = np.ascontiguousarray(tensors[Q][:, :2])
    safetensors.numpy.save_file(tensors, path / WEIGHTS, metadata={"format": "pt"})
    raises_one_line(load(path), f"missing (1): {NORM}", "unexpected (1): model.extra.weight", f"{Q}: expected")


def test_empty_weights_file_and_missing_weights_give_one_line(source, tmp_path):
    empty = copy(source, tmp_path / "empty")
    (empty / WEIGHTS).write_bytes(b"")
    raises_one_line(load(empty), str(empty / WEIGHTS), "not a safetensors file")
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(os.path.join(source, "config.json"), bare / "config.json")
    raises_one_line(load(bare), str(bare), "neither model.safetensors nor model.safetensors.index.json")


# --------------------------------------------------------------------------- config.json


def edit_config(**changes):
    def make(config):
        config.update(changes)
        return json.dumps(config).encode()
    return make


def drop(key):
    def make(config):
        del config[key]
        return json.dumps(config).encode()
    return make


LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

CONFIG_CASES = {
    "not_json": (lambda c: b'{"hidden_size": ', ["not valid JSON"]),
    "binary_garbage": (lambda c: b"\xff\xfe\x00\x81garbage\x9c", ["not valid JSON"]),
    "deeply_nested": (lambda c: b"[" * 100_000, ["not valid JSON"]),
    "json_list": (lambda c: json.dumps([c]).encode(), ["JSON object", "list"]),
    "json_string": (lambda c: b'"Qwen2ForCausalLM"', ["JSON object", "str"]),
    "missing_hidden_size": (drop("hidden_size"), ["missing required key 'hidden_size'"]),
    "missing_vocab_size": (drop("vocab_size"), ["missing required key 'vocab_size'"]),
    "missing_layers": (drop("num_hidden_layers"), ["'num_hidden_layers'"]),
    "hidden_size_string": (edit_config(hidden_size="abc"), ["hidden_size must be a positive int", "'abc'"]),
    "hidden_size_numeric_string": (edit_config(hidden_size="32"), ["hidden_size must be a positive int"]),
    "layers_fraction": (edit_config(num_hidden_layers=2.5), ["num_hidden_layers must be a positive int", "2.5"]),
    "layers_bool": (edit_config(num_hidden_layers=True), ["num_hidden_layers"]),
    "negative_intermediate": (edit_config(intermediate_size=-64), ["intermediate_size", "-64"]),
    "zero_vocab": (edit_config(vocab_size=0), ["vocab_size"]),
    "negative_heads": (edit_config(num_attention_heads=-2), ["num_attention_heads"]),
    "kv_heads_list": (edit_config(num_key_value_heads=[1]), ["num_key_value_heads"]),
    "kv_heads_not_dividing": (edit_config(num_key_value_heads=3), ["multiple of num_kv_heads"]),
    "head_dim_string": (edit_config(head_dim="16"), ["head_dim"]),
    "eps_string": (edit_config(rms_norm_eps="1e-6"), ["rms_norm_eps must be a positive number"]),
    "theta_nan": (edit_config(rope_theta=math.nan), ["rope_theta must be a positive number"]),
    "theta_negative": (edit_config(rope_theta=-1.0), ["rope_theta"]),
    "tie_string": (edit_config(tie_word_embeddings="false"), ["tie_word_embeddings must be true or false"]),
    "eos_string": (edit_config(eos_token_id="</s>"), ["eos_token_id"]),
    "eos_list_of_strings": (edit_config(eos_token_id=[1, "x"]), ["eos_token_id"]),
    "bos_list": (edit_config(bos_token_id=[1]), ["bos_token_id"]),
    "rope_scaling_string": (edit_config(rope_scaling="linear"), ["rope_scaling must be an object"]),
    "rope_parameters_list": (edit_config(rope_parameters=[1]), ["rope_parameters must be an object"]),
    "llama3_without_factor": (edit_config(rope_scaling={"rope_type": "llama3"}), ["'rope_scaling.factor'"]),
    "llama3_factor_string": (edit_config(rope_scaling={"rope_type": "llama3", "factor": "8", "low_freq_factor": 1,
                                                       "high_freq_factor": 4, "original_max_position_embeddings": 64}),
                             ["rope_scaling.factor must be a positive number"]),
    "llama3_factors_inverted": (edit_config(rope_scaling={"rope_type": "llama3", "factor": 8, "low_freq_factor": 4,
                                                          "high_freq_factor": 1,
                                                          "original_max_position_embeddings": 64}),
                                ["high_freq_factor > low_freq_factor"]),
    "rope_type_unknown": (edit_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}), ["'yarn'"]),
    "architectures_string": (edit_config(architectures="Qwen2ForCausalLM"), ["architectures must be a list"]),
    "architectures_dict": (edit_config(architectures={"a": 1}), ["architectures must be a list"]),
    "architectures_of_ints": (edit_config(architectures=[1]), ["architectures must be a list"]),
    "unsupported_architecture": (edit_config(architectures=["GPT2LMHeadModel"]),
                                 ["'GPT2LMHeadModel' is not supported", "Qwen2ForCausalLM"]),
    "model_type_list_fallback": (edit_config(architectures=None, model_type=["qwen2"]), ["is not supported"]),
    "hidden_act_gelu": (edit_config(hidden_act="gelu"), ["hidden_act"]),
    # transformers builds what model_type names: a Mistral with a sliding window, or nothing.
    "model_type_mistral": (edit_config(model_type="mistral", sliding_window=8), ["model_type 'mistral'", "'qwen2'"]),
    "model_type_unknown": (edit_config(model_type="foo"), ["model_type 'foo'"]),
    # Where transformers' versions differ on which value wins, differing values are refused.
    "theta_disagrees": (edit_config(rope_theta=500000.0),
                        ["rope_theta 500000.0", "rope_parameters.rope_theta 10000.0", "disagree"]),
    "scaling_theta_disagrees": (edit_config(rope_scaling={"rope_type": "default", "rope_theta": 1e6}),
                                ["rope_scaling.rope_theta 1000000.0", "disagree"]),
    "scaling_and_parameters_disagree": (edit_config(rope_parameters=LLAMA3, rope_scaling={**LLAMA3, "factor": 4.0}),
                                        ["rope_scaling and rope_parameters"]),
    "llama3_original_max_disagrees": (edit_config(rope_parameters=LLAMA3, original_max_position_embeddings=16),
                                      ["original_max_position_embeddings 16", "64", "disagree"]),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_bad_config_json_names_file_and_key(source, tmp_path, case):
    make, needles = CONFIG_CASES[case]
    path = copy(source, tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_bytes(make(config))
    config_path = str(path / "config.json")
    raises_one_line(load(path), config_path, *needles)
    raises_one_line(lambda: pm.from_hf_config(config_path), config_path, *needles)
    # The dry run reads config.json alone; it too reports one line naming the file.
    with pytest.raises(UsageError) as err:
        runner._dry_run_model(ExperimentConfig(run=RunConfig(out_dir="run", max_steps=1),
                                               model=ModelSection(path=str(path))), None)
    assert "\n" not in str(err.value) and config_path in str(err.value), err.value


def test_rope_settings_given_once_anywhere_are_read(source):
    config = json.loads(open(os.path.join(source, "config.json")).read())
    del config["rope_parameters"]
    # A legacy rope_scaling's own theta, and a top-level original_max_position_embeddings.
    config["rope_scaling"] = {key: value for key, value in LLAMA3.items() if key != "original_max_position_embeddings"}
    config.update(original_max_position_embeddings=64, rope_scaling={**config["rope_scaling"], "rope_theta": 5e5})
    loaded = pm.from_hf_config(config)
    assert loaded.rope_theta == 5e5 and loaded.rope_scaling.original_max_position_embeddings == 64
    config["rope_theta"] = 5e5  # the same value in two places is one value
    assert pm.from_hf_config(config).rope_theta == 5e5
    # A legacy "type" is transformers' "rope_type": the same scaling written both ways agrees.
    legacy = {("type" if k == "rope_type" else k): v for k, v in config["rope_scaling"].items()}
    config.update(rope_scaling=legacy, rope_parameters=dict(config["rope_scaling"]))
    assert pm.from_hf_config(config).rope_scaling.factor == 8.0


def test_config_dicts_are_checked_too():
    hf = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": "2", "num_attention_heads": 4}
    raises_one_line(lambda: pm.from_hf_config(hf), "HF config", "num_hidden_layers")
    hf["num_hidden_layers"] = 2
    assert pm.from_hf_config(hf).num_layers == 2


def test_missing_config_json_still_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        pm.from_pretrained(tmp_path)


def test_checkpoint_error_is_one_class():
    assert pm.CheckpointError is hf_io.CheckpointError is pm.model_config.CheckpointError
    assert issubclass(pm.CheckpointError, ValueError)


# --------------------------------------------------------------------------- shard index


def indexed(source, dst):
    """The tiny checkpoint as one shard listed by an index."""
    path = copy(source, dst)
    os.rename(path / WEIGHTS, path / SHARD)
    return path


INDEX_CASES = {
    "not_json": (b'{"weight_map": ', ["not valid JSON"]),
    "binary_garbage": (b"\xff\xfe\x00\x81\x9c", ["not valid JSON"]),
    "json_list": (b"[]", ["'weight_map'"]),
    "no_weight_map": (json.dumps({"metadata": {}}).encode(), ["'weight_map'"]),
    "weight_map_list": (json.dumps({"weight_map": [SHARD]}).encode(), ["weight_map must map"]),
    "weight_map_string": (json.dumps({"weight_map": SHARD}).encode(), ["weight_map must map"]),
    "file_not_string": (json.dumps({"weight_map": {NORM: 1}}).encode(), [f"weight_map['{NORM}']"]),
    "file_null": (json.dumps({"weight_map": {Q: SHARD, NORM: None}}).encode(), [f"weight_map['{NORM}']"]),
}


@pytest.mark.parametrize("case", list(INDEX_CASES))
def test_bad_index_names_file_and_key(source, tmp_path, case):
    content, needles = INDEX_CASES[case]
    path = indexed(source, tmp_path / "ckpt")
    (path / hf_io.INDEX_FILE).write_bytes(content)
    raises_one_line(load(path), str(path / hf_io.INDEX_FILE), *needles)


def test_good_index_still_loads(source, tmp_path, monkeypatch):
    monkeypatch.undo()
    path = indexed(source, tmp_path / "ckpt")
    with safetensors.safe_open(path / SHARD, "np") as f:
        weight_map = {name: SHARD for name in f.keys()}
    (path / hf_io.INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _, params = pm.from_pretrained(path)
    _, unsharded = pm.from_pretrained(source)
    assert jax.tree.structure(params) == jax.tree.structure(unsharded)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(unsharded), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
