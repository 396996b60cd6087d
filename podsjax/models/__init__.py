"""Qwen2 / Llama decoders in Flax Linen, loaded from and exported to HF checkpoints.

Axis letters used in names here, beyond the package glossary: E head_dim, F MLP width,
S KV-cache slots, C a slot's K * E cached features, Y layers.

Example:
    >>> model, params = podsjax.models.from_pretrained("/ckpt/Qwen2.5-0.5B-Instruct", mesh=mesh)
    >>> logits_BLV = model.apply({"params": params}, ids_BL, attention_mask=mask_BL).logits_BLV
    >>> lora = podsjax.models.init_lora(jax.random.key(0), model, LoraConfig(rank=64, alpha=64))
    >>> podsjax.models.save_pretrained(model, params, "/out/merged", lora=lora)
    >>> podsjax.models.save_peft_adapter(model, lora, "/out/adapter")   # for PeftModel.from_pretrained
"""

from podsjax.models.cache import KVCache, cache_shardings, decode_step, init_cache, prefill
from podsjax.models.model_config import (CHECKPOINT_SHAPES, SUPPORTED_ARCHITECTURES, Llama3RopeScaling, ModelConfig, from_hf_config, checkpoint_shape)
from podsjax.models.decoder import REMAT_POLICIES, Decoder, DecoderOutput
from podsjax.models.hf_export import save_pretrained
from podsjax.models.hf_io import CheckpointError, from_pretrained, load_params, tensor_specs
from podsjax.models.lora import DEFAULT_TARGETS, LoraConfig, LoraParams, init_lora, lora_logical_axes, merge_lora
from podsjax.models.params import abstract_params, init_params, param_logical_axes, param_shardings
from podsjax.models.peft_io import save_peft_adapter
from podsjax.models.rope import apply_rope, rope_inv_freq, rope_tables

__all__ = [
    "CheckpointError", "DEFAULT_TARGETS", "Decoder", "DecoderOutput", "KVCache", "Llama3RopeScaling", "LoraConfig", "LoraParams",
    "ModelConfig", "CHECKPOINT_SHAPES", "REMAT_POLICIES", "SUPPORTED_ARCHITECTURES", "abstract_params", "apply_rope", "cache_shardings",
    "decode_step", "from_hf_config", "from_pretrained", "init_cache", "init_lora", "init_params", "load_params",
    "lora_logical_axes", "merge_lora", "param_logical_axes", "param_shardings", "prefill", "checkpoint_shape",
    "rope_inv_freq", "rope_tables", "save_peft_adapter", "save_pretrained", "tensor_specs",
]
