"""podsjax params -> a Hugging Face checkpoint (LoRA merged), written so that a failure keeps the old one.

The tensors are written into a staging folder inside the output directory, one at a time,
then moved over the old files (``os.replace``: each file whole, old or new), and the old
export's other shards last. A bad argument is refused before anything is written, and any
failure while writing removes the staging folder and leaves the directory as it was.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import shutil
import tempfile
from typing import Any

import jax
import numpy as np

from podsjax.data.prompts import VOCABULARY_FILES
from podsjax.models.decoder import Decoder
from podsjax.models.hf_io import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    TensorSpec,
    non_finite_leaves,
    tensor_specs,
    to_host,
)
from podsjax.models.lora import LoraParams, check_lora_fits, merged_kernel
from podsjax.models.params import check_params_fit
from podsjax.models.safetensors_io import write_safetensors

# Files copied by save_pretrained(tokenizer_from=...) so the export is servable as is.
TOKENIZER_FILES = (*VOCABULARY_FILES, "tokenizer_config.json", "special_tokens_map.json", "merges.txt",
                   "added_tokens.json", "chat_template.jinja", "generation_config.json")
# What an export may store weights as: what config.json's torch_dtype can name.
EXPORT_DTYPES = ("float32", "bfloat16", "float16")
STAGING_PREFIX = ".podsjax-export-"  # the staging folder inside the output directory


def save_pretrained(
    model: Decoder,
    params: dict[str, Any],
    path: str | os.PathLike,
    lora: LoraParams | None = None,
    *,
    overwrite: bool = False,
    dtype: Any = None,
    max_shard_bytes: int = 5 * 2**30,
    tokenizer_from: str | os.PathLike | None = None,
) -> None:
    """Writes config.json + safetensors that ``AutoModelForCausalLM.from_pretrained`` loads.

    Args:
        model: the decoder.
        params: its params (may be sharded; gathered one tensor at a time).
        path: output directory.
        lora: adapters to merge into the exported kernels (one kernel at a time).
        overwrite: allow writing into a non-empty directory (the old export is replaced only
            once the new one is written whole).
        dtype: export dtype, one of :data:`EXPORT_DTYPES`; defaults to each param's own dtype.
        max_shard_bytes: split into ``model-0000i-of-0000n.safetensors`` + index above this.
        tokenizer_from: a checkpoint dir whose tokenizer / generation files are copied.

    Raises:
        FileExistsError: ``path`` is a non-empty directory and ``overwrite`` is False.
        ValueError: ``dtype``, ``max_shard_bytes`` or ``lora`` is not one the export takes, or
            ``tokenizer_from`` is no directory holding a tokenizer.
        CheckpointError: ``params`` lack tensors the model config needs, have other shapes,
            or hold NaN / inf.
    """
    path = os.fspath(path)
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)) and not overwrite:
        raise FileExistsError(f"{path} exists and is not empty; pass overwrite=True to write into it")
    out_dtype = _export_dtype(dtype)
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be an integer >= 1; got {max_shard_bytes!r}")
    tokenizer_files = None if tokenizer_from is None else _tokenizer_files(os.fspath(tokenizer_from))
    specs = tensor_specs(model)
    _check_params(model, params, specs)
    if lora is not None:
        check_lora_fits(model, lora)
    bad = non_finite_leaves(params) + ([] if lora is None else ["lora/" + n for n in non_finite_leaves(lora.weights)])
    if bad:
        raise CheckpointError(f"refusing to export non-finite weights (NaN or inf) in {len(bad)} tensors: "
                              + ", ".join(bad[:5]) + (", ..." if len(bad) > 5 else ""))
    entries = [(s.hf_name, s.hf_shape, out_dtype or np.dtype(_lookup(params, s.path).dtype),
                _producer(params, lora, s, out_dtype)) for s in specs]
    if jax.process_index() != 0:  # other processes only join the gathers
        for entry in entries:
            entry[3]()
        return
    made = not os.path.exists(path)
    os.makedirs(path, exist_ok=True)
    for leftover in glob.glob(os.path.join(path, STAGING_PREFIX + "*")):  # of an export killed mid-write
        shutil.rmtree(leftover, ignore_errors=True)
    staging = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=path)
    try:
        names = _write(staging, entries, max_shard_bytes, model)
        for source in tokenizer_files or ():
            shutil.copyfile(source, os.path.join(staging, os.path.basename(source)))
        _replace(path, staging, names)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if made:
            shutil.rmtree(path, ignore_errors=True)
        raise
    os.rmdir(staging)


def _lookup(tree: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _export_dtype(dtype: Any) -> np.dtype | None:
    if dtype is None:
        return None
    try:
        out = np.dtype(dtype)
    except TypeError:
        out = None
    if out is None or out.name not in EXPORT_DTYPES:
        raise ValueError(f"save_pretrained dtype must be one of {', '.join(EXPORT_DTYPES)} (or None: each param's "
                         f"own); got {getattr(out, 'name', dtype)!r}")
    return out


def _check_params(model: Decoder, params: Any, specs: list[TensorSpec]) -> None:
    missing = [s.hf_name + " <- " + "/".join(s.path) for s in specs if _lookup(params, s.path) is None]
    if missing:
        raise CheckpointError(f"params lack {len(missing)} tensors: " + ", ".join(missing))
    try:
        check_params_fit(model, params)  # shapes, and no tensor the config lacks
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None


def _producer(params: Any, lora: LoraParams | None, spec: TensorSpec, out_dtype: np.dtype | None):
    """One HF tensor, made on demand: the layer's slice, its LoRA merged, on the host."""
    def run() -> np.ndarray:
        leaf = _lookup(params, spec.path)
        ab = _lookup(lora.weights, spec.path[:-1]) if lora is not None and spec.path[-1] == "kernel" else None
        if spec.layer is not None:  # one layer at a time, so the export never holds a merged stack
            leaf = leaf[spec.layer]
            ab = None if ab is None else jax.tree.map(lambda x: x[spec.layer], ab)
        if ab is not None:
            leaf = merged_kernel(leaf, ab, lora.scale)
        host = spec.to_hf(to_host(leaf))
        return host.astype(out_dtype or host.dtype, copy=False)
    return run


def _write(staging: str, entries: list, max_shard_bytes: int, model: Decoder) -> list[str]:
    """The shards, their index and config.json in ``staging``; returns the files written."""
    shards: list[list[Any]] = [[]]
    shard_bytes = 0
    for entry in entries:
        nbytes = math.prod(entry[1]) * entry[2].itemsize
        if shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(entry)
        shard_bytes += nbytes
    names = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    total = sum(write_safetensors(os.path.join(staging, name), shard)
                for name, shard in zip(names, shards, strict=True))
    if len(shards) > 1:
        weight_map = {entry[0]: name for name, shard in zip(names, shards, strict=True) for entry in shard}
        with open(os.path.join(staging, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        names.append(INDEX_FILE)
    dtypes = {np.dtype(e[2]).name for e in entries}
    dtype_name = "bfloat16" if "bfloat16" in dtypes else "float16" if "float16" in dtypes else "float32"
    with open(os.path.join(staging, "config.json"), "w") as f:
        json.dump(model.config.to_hf_dict(dtype_name), f, indent=2)
    return [*names, "config.json"]


def _tokenizer_files(source_dir: str) -> list[str]:
    """The tokenizer and generation files in ``source_dir``; a dir without a vocabulary is refused,
    since an export without its tokenizer cannot be served."""
    if not os.path.isdir(source_dir):
        raise ValueError(f"tokenizer_from {source_dir} is not a directory")
    found = [os.path.join(source_dir, name) for name in TOKENIZER_FILES
             if os.path.isfile(os.path.join(source_dir, name))]
    if not any(os.path.basename(path) in VOCABULARY_FILES for path in found):
        raise ValueError(f"tokenizer_from {source_dir} holds no tokenizer vocabulary ({', '.join(VOCABULARY_FILES)})")
    return found


_EXPORT_WEIGHTS = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")  # the names save_pretrained writes


def _replace(path: str, staging: str, weights: list[str]) -> None:
    """The staged files over ``path``'s, each whole; then the old export's other weight files."""
    for name in os.listdir(staging):
        os.replace(os.path.join(staging, name), os.path.join(path, name))
    # An earlier export's weights would shadow the new ones; other files (a PEFT adapter's
    # adapter_model.safetensors) are not an export's, and stay.
    stale = [name for name in os.listdir(path) if _EXPORT_WEIGHTS.fullmatch(name) or name == INDEX_FILE]
    for old in stale:
        if old not in weights:
            os.remove(os.path.join(path, old))
