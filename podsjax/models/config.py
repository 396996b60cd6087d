"""Model configuration: a frozen dataclass read from (and written back to) HF config.json.

Only the decoder families podsjax implements are accepted: Qwen2 (Qwen2.5) and Llama
(Llama 3.x). Everything else raises one error that names the supported architectures,
rather than silently loading a model whose forward pass would be wrong.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

# HF "architectures" entry -> our family name.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
}
_MODEL_TYPES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Parameters of the "llama3" RoPE frequency rescaling (Llama 3.1/3.2)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        if self.factor <= 0 or self.low_freq_factor <= 0:
            raise ValueError(f"llama3 rope_scaling needs positive factors, got {self}")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"llama3 rope_scaling needs high_freq_factor > low_freq_factor, got {self}")
        if self.original_max_position_embeddings <= 0:
            raise ValueError(f"llama3 rope_scaling needs original_max_position_embeddings > 0, got {self}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of a Qwen2 / Llama decoder.

    Attributes:
        arch: "qwen2" or "llama".
        vocab_size: V.
        hidden_size: D, the model width.
        intermediate_size: F, the SwiGLU width.
        num_layers: number of decoder blocks.
        num_heads: H, query heads.
        num_kv_heads: K, key/value heads (GQA when K < H; H must be a multiple of K).
        head_dim: E, per-head width (not necessarily D / H).
        rope_theta: RoPE base.
        rope_scaling: llama3 frequency rescaling, or None for plain RoPE.
        rms_norm_eps: epsilon of every RMSNorm.
        tie_word_embeddings: LM head reuses the embedding matrix.
        qkv_bias: q/k/v projections have a bias (Qwen2).
        max_position_embeddings: written back to config.json; not a hard limit here.
        bos_token_id, eos_token_id, pad_token_id: copied from / to config.json.
    """

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.arch not in _MODEL_TYPES:
            raise ValueError(f"arch must be one of {sorted(_MODEL_TYPES)}, got {self.arch!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError("rope_theta and rms_norm_eps must be positive")
        if isinstance(self.eos_token_id, list):  # keep the config hashable (it is a jit static)
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

    @property
    def num_params(self) -> int:
        """Total parameter count (embedding counted once when tied)."""
        d, e = self.hidden_size, self.head_dim
        q, kv = self.num_heads * e, self.num_kv_heads * e
        attn = d * q + 2 * d * kv + q * d + (q + 2 * kv if self.qkv_bias else 0)
        block = attn + 3 * d * self.intermediate_size + 2 * d
        head = 0 if self.tie_word_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.num_layers * block + d + head

    def to_hf_dict(self, dtype_name: str = "float32") -> dict[str, Any]:
        """config.json contents that transformers (4.x and 5.x) and vLLM load.

        RoPE settings are written in the long-standing ``rope_theta`` / ``rope_scaling``
        form, which every loader understands.
        """
        out: dict[str, Any] = {
            "architectures": [_MODEL_TYPES[self.arch]],
            "model_type": self.arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": dtype_name,
            "use_cache": True,
        }
        if self.rope_scaling is not None:
            out["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        if self.arch == "qwen2":
            out.update(use_sliding_window=False, sliding_window=None, attention_dropout=0.0)
        else:
            out.update(attention_bias=False, mlp_bias=False, attention_dropout=0.0)
        return out


def _unsupported(what: str) -> ValueError:
    return ValueError(f"{what}; podsjax.models supports {sorted(SUPPORTED_ARCHITECTURES)}")


def _read_rope(hf: dict[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    # transformers >= 5 writes "rope_parameters" (theta inside); older files and the Hub
    # checkpoints use top-level "rope_theta" plus "rope_scaling". Accept both.
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    theta = float(hf.get("rope_theta", params.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind in (None, "default"):
        return theta, None
    if kind != "llama3":
        raise ValueError(f"rope scaling type {kind!r} is not supported (only 'llama3' and none)")
    return theta, Llama3RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def from_hf_config(hf: dict[str, Any] | str | os.PathLike) -> ModelConfig:
    """Builds a :class:`ModelConfig` from a HF config dict, config.json, or checkpoint dir.

    Raises:
        ValueError: the architecture is not Qwen2ForCausalLM / LlamaForCausalLM, or it uses
            a feature this decoder does not implement (sliding window, biases on Llama,
            another activation or RoPE scaling type).
    """
    if not isinstance(hf, dict):
        path = os.fspath(hf)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no config.json at {path}")
        with open(path) as f:
            hf = json.load(f)
    archs = hf.get("architectures") or [_MODEL_TYPES.get(hf.get("model_type"), str(hf.get("model_type")))]
    arch = SUPPORTED_ARCHITECTURES.get(archs[0])
    if arch is None:
        raise _unsupported(f"architecture {archs[0]!r} is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise _unsupported(f"{archs[0]} with hidden_act={hf['hidden_act']!r} is not supported")
    if arch == "qwen2" and hf.get("use_sliding_window", False):
        raise _unsupported("Qwen2 with use_sliding_window=true is not supported")
    if arch == "llama" and (hf.get("attention_bias", False) or hf.get("mlp_bias", False)):
        raise _unsupported("Llama with attention_bias/mlp_bias is not supported")
    heads = int(hf["num_attention_heads"])
    theta, scaling = _read_rope(hf)
    return ModelConfig(
        arch=arch,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        # Qwen2 and Llama configs both default tie_word_embeddings to False when absent.
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2",
        max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
        pad_token_id=hf.get("pad_token_id"),
    )


_LLAMA32_ROPE = Llama3RopeScaling(
    factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
_QWEN25 = dict(arch="qwen2", rope_theta=1e6, rms_norm_eps=1e-6, qkv_bias=True, max_position_embeddings=32768,
               bos_token_id=151643, eos_token_id=151645, head_dim=128)
_LLAMA32 = dict(arch="llama", vocab_size=128256, intermediate_size=8192, rope_theta=500000.0,
                rope_scaling=_LLAMA32_ROPE, rms_norm_eps=1e-5, tie_word_embeddings=True,
                max_position_embeddings=131072, bos_token_id=128000, eos_token_id=(128001, 128008, 128009))

# Shapes of the public checkpoints (Instruct and base share them). For eval_shape,
# sharding plans and benchmarks; real weights always come from a local directory.
PRESETS: dict[str, ModelConfig] = {
    "Qwen2.5-0.5B": ModelConfig(**{**_QWEN25, "head_dim": 64}, vocab_size=151936, hidden_size=896,
                                intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2,
                                tie_word_embeddings=True),
    "Qwen2.5-1.5B": ModelConfig(**_QWEN25, vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                                num_layers=28, num_heads=12, num_kv_heads=2, tie_word_embeddings=True),
    "Qwen2.5-3B": ModelConfig(**_QWEN25, vocab_size=151936, hidden_size=2048, intermediate_size=11008,
                              num_layers=36, num_heads=16, num_kv_heads=2, tie_word_embeddings=True),
    "Qwen2.5-7B": ModelConfig(**_QWEN25, vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                              num_layers=28, num_heads=28, num_kv_heads=4, tie_word_embeddings=False),
    "Llama-3.2-1B": ModelConfig(**_LLAMA32, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                                head_dim=64),
    "Llama-3.2-3B": ModelConfig(**_LLAMA32, hidden_size=3072, num_layers=28, num_heads=24, num_kv_heads=8,
                                head_dim=128),
}


def preset(name: str) -> ModelConfig:
    """Returns the preset config ``name`` (an "-Instruct" suffix is accepted)."""
    key = name.split("/")[-1].removesuffix("-Instruct")
    if key not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[key]
