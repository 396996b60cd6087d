"""LoRA adapters exported in PEFT's format, for torch users: ``PeftModel.from_pretrained(base, path)``.

PEFT stores, per adapted ``nn.Linear`` of layer i, ``lora_A.weight`` ``[r, in_features]`` and
``lora_B.weight`` ``[out_features, r]`` under ``base_model.model.<module path>``, and scales
``B @ A`` by ``lora_alpha / r``: podsjax's ``A @ B * alpha / r`` transposed, with the
projection's input and output axes flattened in the order the checkpoint converter uses.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import jax
import numpy as np

from podsjax.models.hf_io import CheckpointError, non_finite_leaves, to_host, tensor_specs
from podsjax.models.lora import LoraParams, check_lora_fits
from podsjax.models.safetensors_io import write_safetensors

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def _module_name(hf_weight_name: str) -> str:
    """``model.layers.0.self_attn.q_proj.weight`` -> ``base_model.model.model.layers.0.self_attn.q_proj``."""
    return "base_model.model." + hf_weight_name.removesuffix(".weight")


def save_peft_adapter(model, lora: LoraParams, path: str | os.PathLike, *,
                      base_model_name_or_path: str | None = None, overwrite: bool = False) -> list[str]:
    """Writes ``adapter_config.json`` + ``adapter_model.safetensors`` that PEFT loads onto the base model.

    Args:
        model: the :class:`~podsjax.models.Decoder` the adapters belong to.
        lora: the trained adapters (may be sharded; gathered one layer at a time).
        path: output directory.
        base_model_name_or_path: recorded in the config, as PEFT does (a Hub name or a path).
        overwrite: allow writing into a non-empty directory.

    Returns:
        The PEFT ``target_modules`` written (``["down_proj", "gate_proj", ...]``).

    Raises:
        FileExistsError: ``path`` is a non-empty directory and ``overwrite`` is False.
        CheckpointError: an adapter holds NaN or inf.
    """
    path = os.fspath(path)
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)) and not overwrite:
        raise FileExistsError(f"{path} exists and is not empty; pass overwrite=True to write into it")
    check_lora_fits(model, lora)
    bad = non_finite_leaves(lora.weights)
    if bad:
        raise CheckpointError(f"refusing to export non-finite LoRA weights (NaN or inf) in {len(bad)} tensors: "
                              + ", ".join(bad[:5]))
    layers = lora.weights["layers"]
    entries, targets, rank = [], set(), None
    for spec in tensor_specs(model):
        group_proj = spec.path[1:3] if spec.path[0] == "layers" and spec.path[-1] == "kernel" else None
        ab = layers.get(group_proj[0], {}).get(group_proj[1]) if group_proj else None
        if ab is None:
            continue
        rank = ab["a"].shape[-1]
        n_in = math.prod(spec.param_shape[:spec.n_in])
        n_out = math.prod(spec.param_shape[spec.n_in:])
        module = _module_name(spec.hf_name)
        targets.add(spec.hf_name.split(".")[-2])

        def a_of(ab=ab, layer=spec.layer, shape=(n_in, rank)):  # bound now: the loop moves on
            return np.ascontiguousarray(to_host(ab["a"][layer]).reshape(shape).T)

        def b_of(ab=ab, layer=spec.layer, shape=(rank, n_out)):
            return np.ascontiguousarray(to_host(ab["b"][layer]).reshape(shape).T)

        entries += [(f"{module}.lora_A.weight", (rank, n_in), np.dtype(ab["a"].dtype), a_of),
                    (f"{module}.lora_B.weight", (n_out, rank), np.dtype(ab["b"].dtype), b_of)]
    if not entries:
        raise CheckpointError("the LoRA tree adapts no projection of this model")
    config: dict[str, Any] = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(rank), "lora_alpha": float(lora.scale * rank),
        "target_modules": sorted(targets), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "inference_mode": True, "modules_to_save": None,
        "base_model_name_or_path": base_model_name_or_path,
    }
    if jax.process_index() != 0:  # other processes only join the gathers
        for entry in entries:
            entry[3]()
        return config["target_modules"]
    os.makedirs(path, exist_ok=True)
    # Both files written aside, then moved over the old ones: a failure while writing keeps the old adapter.
    staged = {name: os.path.join(path, f".{name}.partial") for name in (WEIGHTS_FILE, CONFIG_FILE)}
    try:
        write_safetensors(staged[WEIGHTS_FILE], entries, metadata={"format": "pt"})
        with open(staged[CONFIG_FILE], "w") as f:
            json.dump(config, f, indent=2)
        for name, partial in staged.items():
            os.replace(partial, os.path.join(path, name))
    finally:
        for partial in staged.values():
            if os.path.exists(partial):
                os.remove(partial)
    return config["target_modules"]
