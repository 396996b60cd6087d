"""Hugging Face checkpoints -> podsjax params, loaded sharded (the export: ``podsjax.models.hf_export``).

HF stores ``nn.Linear`` weights as ``[out, in]``, one tensor per layer; podsjax kernels are
``in_shape + out_shape`` with heads as their own axis, stacked over the layers. Every kernel is
transposed and reshaped on the way in (on the device, in the file's layout until then) and back
on the way out, and each layer's tensor is written into (or read from) its slot of the stacked
param. Tensors are read from memory-mapped files and placed one at a time, so host memory peaks
near the largest single tensor and device memory near the params plus one layer's tensor.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from podsjax.devices import mesh as mesh_lib
from podsjax.models.decoder import Decoder
from podsjax.models.model_config import CheckpointError, from_hf_config
from podsjax.models.params import abstract_params, check_float_dtypes, param_logical_axes
from podsjax.models.safetensors_io import SafetensorsFile

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Params are floating point; an integer tensor of the right byte size would load as garbage.
PARAM_DTYPES = ("F16", "BF16", "F32", "F64")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """How one HF tensor maps onto one podsjax param.

    Attributes:
        hf_name: e.g. ``model.layers.0.self_attn.q_proj.weight``.
        path: param path, e.g. ``("layers", "attn", "q", "kernel")``.
        kind: "kernel" (transpose + reshape), "bias" (reshape) or "copy".
        n_in: number of input dims of a kernel (2 for o_proj: heads x head_dim).
        param_shape / hf_shape: shapes on each side (one layer's, for stacked params).
        names: logical axis names of the param (of one layer).
        layer: index into the leading layer axis of a stacked param, else None.
    """

    hf_name: str
    path: tuple[str, ...]
    kind: str
    n_in: int
    param_shape: tuple[int, ...]
    hf_shape: tuple[int, ...]
    names: tuple[str | None, ...]
    layer: int | None = None

    def to_param(self, hf: np.ndarray, dtype: Any) -> np.ndarray:
        with np.errstate(over="ignore"):  # a value past dtype's range is refused by name after the load
            if self.kind == "kernel":
                # One C-ordered copy (with the dtype cast folded in); the reshape is then free.
                return np.ascontiguousarray(hf.T, dtype=dtype).reshape(self.param_shape)
            return np.array(hf, dtype=dtype).reshape(self.param_shape)

    def to_hf(self, param: np.ndarray) -> np.ndarray:
        if self.kind == "kernel":
            n_in = math.prod(self.param_shape[:self.n_in])
            return param.reshape(n_in, -1).T
        return param.reshape(self.hf_shape)


def _hf_name(path: tuple[str, ...], layer: int | None) -> tuple[str, str, int]:
    """(HF name, kind, n_in) of a param path (and layer, for stacked params)."""
    head, *rest = path
    if path == ("embed", "embedding"):
        return "model.embed_tokens.weight", "copy", 0
    if path == ("final_norm", "scale"):
        return "model.norm.weight", "copy", 0
    if path == ("lm_head", "kernel"):
        return "lm_head.weight", "kernel", 1
    if head == "layers" and layer is not None:
        prefix = f"model.layers.{layer}"
        if rest == ["attn_norm", "scale"]:
            return f"{prefix}.input_layernorm.weight", "copy", 0
        if rest == ["mlp_norm", "scale"]:
            return f"{prefix}.post_attention_layernorm.weight", "copy", 0
        group, proj, leaf = rest
        hf_group = "self_attn" if group == "attn" else "mlp"
        suffix = "weight" if leaf == "kernel" else "bias"
        kind = "kernel" if leaf == "kernel" else "bias"
        return f"{prefix}.{hf_group}.{proj}_proj.{suffix}", kind, 2 if proj == "o" else 1
    raise KeyError(f"no Hugging Face name for param {'/'.join(path)}")


def tensor_specs(model: Decoder) -> list[TensorSpec]:
    """The HF tensors a model expects, in checkpoint order (embeddings, layers, norm, head)."""
    shapes = abstract_params(model)
    names = param_logical_axes(model)
    flat_shapes = jax.tree_util.tree_flatten_with_path(shapes)[0]
    flat_names = jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, tuple))
    specs = []
    for (key_path, leaf), leaf_names in zip(flat_shapes, flat_names, strict=True):
        path = tuple(k.key for k in key_path)
        shape, leaf_names = tuple(leaf.shape), tuple(leaf_names)
        layers: list[int | None] = [None]
        if path[0] == "layers":  # stacked: one HF tensor per layer
            layers, shape, leaf_names = list(range(shape[0])), shape[1:], leaf_names[1:]
        for layer in layers:
            hf_name, kind, n_in = _hf_name(path, layer)
            if kind == "kernel":
                hf_shape = (math.prod(shape[n_in:]), math.prod(shape[:n_in]))
            elif kind == "bias":
                hf_shape = (math.prod(shape),)
            else:
                hf_shape = shape
            specs.append(TensorSpec(hf_name, path, kind, n_in, shape, hf_shape, leaf_names, layer))

    def order(spec: TensorSpec):
        rank = {"embed": 0, "final_norm": 2, "lm_head": 3}.get(spec.path[0], 1)
        return rank, spec.layer or 0, spec.hf_name

    return sorted(specs, key=order)


def _read_weight_map(index_path: str) -> dict[str, str]:
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
    except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{index_path}: not valid JSON ({err})") from None
    if not isinstance(index, dict) or "weight_map" not in index:
        raise CheckpointError(f"{index_path}: must be a JSON object with a 'weight_map' key")
    weight_map = index["weight_map"]
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_path}: weight_map must map tensor names to files, got {weight_map!r:.60}")
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise CheckpointError(f"{index_path}: weight_map[{name!r}] must be a file name, got {file!r:.60}")
    return weight_map


def _open_checkpoint(path: str) -> dict[str, SafetensorsFile]:
    """Maps every tensor name in the checkpoint dir to the (lazily mapped) file holding it.

    The files are the ones transformers reads: ``model.safetensors`` when it is there, else the
    index's shards. Any other ``*.safetensors`` (a PEFT adapter, a user's file) is not the model's.
    """
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        st = SafetensorsFile(single)
        return {name: st for name in st.header}
    index_path = os.path.join(path, INDEX_FILE)
    if not os.path.isfile(index_path):
        raise CheckpointError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} is there "
                              "(PyTorch .bin checkpoints are not supported)")
    weight_map = _read_weight_map(index_path)
    missing_files = sorted({f for f in weight_map.values() if not os.path.isfile(os.path.join(path, f))})
    if missing_files:
        raise CheckpointError(f"{path}: {INDEX_FILE} names shard files that do not exist: {missing_files}")
    files = {name: SafetensorsFile(os.path.join(path, name)) for name in sorted(set(weight_map.values()))}
    # Trust the files' own headers, not only the index, so an index/shard mismatch
    # surfaces as missing tensors rather than a crash mid-load.
    return {name: files[file] for name, file in weight_map.items() if name in files[file].header}


def _check(path: str, specs: list[TensorSpec], files: dict[str, SafetensorsFile], tied: bool) -> None:
    expected = {s.hf_name: s for s in specs}
    # Tied checkpoints sometimes still carry lm_head.weight; old ones carry RoPE buffers.
    ignorable = {"lm_head.weight"} if tied else set()
    missing = sorted(n for n in expected if n not in files)
    unexpected = sorted(n for n in files
                        if n not in expected and n not in ignorable and not n.endswith("rotary_emb.inv_freq"))
    misshaped = sorted(f"{n}: expected {list(s.hf_shape)}, found {list(files[n].shape(n))}"
                       for n, s in expected.items() if n in files and files[n].shape(n) != s.hf_shape)
    not_float = sorted(f"{n}: {files[n].dtype(n)} in {files[n].path}"
                       for n in expected if n in files and files[n].dtype(n) not in PARAM_DTYPES)
    problems = [f"{title} ({len(items)}): " + ", ".join(items)
                for title, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", misshaped),
                                     ("not floating point", not_float))
                if items]
    if problems:
        raise CheckpointError(f"checkpoint {path} does not match the model config: " + "; ".join(problems))
    if tied and "lm_head.weight" in files and not _same_tensor(files, "lm_head.weight", "model.embed_tokens.weight"):
        # transformers 4 ties them; 5 loads the file's head: logits would depend on the version.
        raise CheckpointError(f"checkpoint {path}: config.json ties the LM head to the embedding, but the weights "
                              "hold an lm_head.weight that differs from it; set tie_word_embeddings to false to use "
                              "it, or remove it to use the embedding")


def _same_tensor(files: dict[str, SafetensorsFile], a: str, b: str, rows: int = 4096) -> bool:
    """Whether tensors ``a`` and ``b`` are equal, compared a block of rows at a time (no full copy)."""
    if b not in files or files[a].shape(a) != files[b].shape(b) or files[a].dtype(a) != files[b].dtype(b):
        return False
    x, y = files[a].get(a), files[b].get(b)
    return all(np.array_equal(x[i:i + rows], y[i:i + rows]) for i in range(0, x.shape[0], rows))


def _place(host: np.ndarray, sharding) -> jax.Array:
    if sharding is None:
        return jax.device_put(host)
    # Each device (and, multi-host, each process) copies just its own shard.
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


@functools.lru_cache(maxsize=None)
def _zeros(shape: tuple[int, ...], dtype: Any, sharding) -> Any:
    """A jitted maker of a zero stacked param, born in its sharding."""
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def _file_layout(spec: TensorSpec, hf: np.ndarray, sharding) -> tuple[np.ndarray, Any, tuple[int, ...]]:
    """A kernel as the file holds it, ``out_shape + in_shape`` (a free reshape of the mapped
    bytes); its sharding, the param's with the axes in that order, so that the transpose moves
    nothing between devices; and the axes that take it to the param's ``in_shape + out_shape``."""
    n_in, n_out = spec.n_in, len(spec.param_shape) - spec.n_in
    view = hf.reshape(spec.param_shape[n_in:] + spec.param_shape[:n_in])
    if sharding is not None:
        parts = tuple(sharding.spec) + (None,) * (len(spec.param_shape) - len(sharding.spec))
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*parts[n_in:], *parts[:n_in]))
    return view, sharding, tuple(range(n_out, n_out + n_in)) + tuple(range(n_out))


@functools.lru_cache(maxsize=None)
def _transposer(perm: tuple[int, ...], dtype: Any, sharding) -> Any:
    """A jitted transpose-and-cast of one HF kernel into its param, in the param's sharding."""
    return jax.jit(lambda hf: jnp.transpose(hf, perm).astype(dtype), out_shardings=sharding)


@functools.partial(jax.jit, donate_argnums=0, static_argnames="perm")
def _set_layer(stacked: jax.Array, layer: jax.Array, index: jax.Array, perm: tuple[int, ...] | None) -> jax.Array:
    """Writes one layer's tensor into its slot, cast, and transposed by ``perm`` (an HF kernel's)."""
    layer = layer if perm is None else jnp.transpose(layer, perm)
    return jax.lax.dynamic_update_index_in_dim(stacked, layer.astype(stacked.dtype), index, 0)


def load_params(path: str | os.PathLike, model: Decoder, mesh: Mesh | None = None) -> dict[str, Any]:
    """Reads HF safetensors (one file or a sharded index) into params for ``model``.

    Args:
        path: checkpoint directory.
        model: the decoder (its config must match the checkpoint).
        mesh: when given, each tensor goes straight into its NamedSharding.

    Returns:
        Params tree of ``model.param_dtype`` arrays, per-layer tensors stacked.

    Raises:
        CheckpointError: a file is unreadable, or (in one line) all missing, unexpected,
            mis-shaped and non-floating-point tensors at once, before anything is loaded;
            or a tensor holds NaN or inf values (its file and name in the line).
    """
    path = os.fspath(path)
    files = _open_checkpoint(path)
    specs = tensor_specs(model)
    _check(path, specs, files, model.config.tie_word_embeddings)
    dtype = np.dtype(model.param_dtype)
    num_layers = model.config.num_layers
    params: dict[str, Any] = {}
    for spec in specs:
        hf = files[spec.hf_name].get(spec.hf_name)
        sharding = None if mesh is None else mesh_lib.logical_sharding(mesh, spec.names, spec.param_shape)
        node = params
        for part in spec.path[:-1]:
            node = node.setdefault(part, {})
        leaf = spec.path[-1]
        # A kernel goes to the device as the file holds it, to be transposed and cast there (numpy
        # transposes 16-bit tensors at under 1 GB/s); other tensors and f64 ones (jax takes those as
        # f32) are copied on the host: no param aliases the file. One tensor in flight at a time.
        if spec.kind == "kernel" and hf.dtype.itemsize <= 4:
            view, file_sharding, perm = _file_layout(spec, hf, sharding)
            placed = _place(view, file_sharding)
        else:
            placed, perm = _place(spec.to_param(hf, dtype), sharding), None
        if spec.layer is None:
            if perm is not None:
                placed = _transposer(perm, dtype, sharding)(placed)
            node[leaf] = jax.block_until_ready(placed)
        else:
            if leaf not in node:
                shape = (num_layers,) + spec.param_shape
                stacked_sharding = None if mesh is None else mesh_lib.logical_sharding(
                    mesh, ("layers",) + spec.names, shape)
                node[leaf] = _zeros(shape, dtype, stacked_sharding)()
            node[leaf] = jax.block_until_ready(_set_layer(node[leaf], placed, np.int32(spec.layer), perm=perm))
        del placed, hf
    _check_finite(path, specs, files, params, dtype)
    return params


def _check_finite(path: str, specs: list[TensorSpec], files: dict[str, SafetensorsFile], params: Any,
                  dtype: np.dtype) -> None:
    """Refuses NaN or inf weights (damaged bytes, a diverged save) at load, naming file and tensor.

    One on-device reduction over all params; only on a failure are the guilty params' tensors
    read again on the host, to name which of a stacked param's layers holds the values.
    """
    bad_paths = set(non_finite_leaves(params))
    if not bad_paths:
        return
    bad = [spec for spec in specs if "/".join(spec.path) in bad_paths
           and not np.isfinite(spec.to_param(files[spec.hf_name].get(spec.hf_name), dtype)).all()]
    if not bad:  # cannot happen: the device saw what the host placed
        raise CheckpointError(f"checkpoint {path}: non-finite (NaN or inf) weights in {sorted(bad_paths)}")
    first = bad[0]
    more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
    where = f"checkpoint {path}: tensor {first.hf_name} in {files[first.hf_name].path}"
    if np.isfinite(files[first.hf_name].get(first.hf_name)).all():  # finite as stored: the cast overflowed
        raise CheckpointError(f"{where} holds values past {dtype.name}'s range (largest {np.finfo(dtype).max:.6g})"
                              f"{more}; load it in bfloat16 or float32")
    raise CheckpointError(f"{where} holds NaN or inf values{more}; the file is damaged, or was saved from a run that "
                          "diverged")


def from_pretrained(
    path: str | os.PathLike,
    dtype: Any = jnp.float32,
    mesh: Mesh | None = None,
    *,
    compute_dtype: Any = None,
    remat: str = "full",
) -> tuple[Decoder, dict[str, Any]]:
    """Loads a local Qwen2 / Llama HF checkpoint directory.

    Args:
        path: directory with config.json and safetensors.
        dtype: param dtype.
        mesh: shard params (and constrain activations) on this mesh.
        compute_dtype: activation dtype; defaults to ``dtype``.
        remat: what each layer keeps for the backward pass (``decoder.REMAT_POLICIES``).

    Returns:
        ``(model, params)``; run it as
        ``model.apply({"params": params}, ids_BL, attention_mask=mask_BL).logits_BLV``.
    """
    check_float_dtypes(dtype=dtype, compute_dtype=compute_dtype)
    if os.path.isfile(path):
        raise CheckpointError(f"{os.fspath(path)}: from_pretrained takes the checkpoint's directory, not a file in it")
    config = from_hf_config(path)
    model = Decoder(config, dtype=compute_dtype or dtype, param_dtype=dtype, remat=remat, mesh=mesh)
    return model, load_params(path, model, mesh)


def to_host(x: jax.Array) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils  # collective: every process calls it

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


@jax.jit
def _all_finite(tree: Any) -> Any:
    return jax.tree.map(lambda x: jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else True, tree)


def non_finite_leaves(tree: Any) -> list[str]:
    """Param paths holding a NaN or inf (one on-device reduction per tensor)."""
    flags = jax.tree_util.tree_flatten_with_path(jax.device_get(_all_finite(tree)))[0]
    return ["/".join(str(getattr(k, "key", k)) for k in path) for path, ok in flags if not ok]
