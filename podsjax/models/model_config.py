"""Model configuration: a frozen dataclass read from (and written back to) HF config.json.

Only the decoder families podsjax implements are accepted: Qwen2 (Qwen2.5) and Llama
(Llama 3.x). Everything else raises one error that names the supported architectures,
rather than silently loading a model whose forward pass would be wrong.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

# HF "architectures" entry -> our family name.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
}
_MODEL_TYPES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}


def _finite(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


class CheckpointError(ValueError):
    """A checkpoint is unreadable (config.json, index, safetensors) or does not match the model."""


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Parameters of the "llama3" RoPE frequency rescaling (Llama 3.1/3.2)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            if not _finite(getattr(self, name)):
                raise ValueError(f"llama3 rope_scaling.{name} must be a finite number, got {getattr(self, name)!r}")
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
        for name in ("rope_theta", "rms_norm_eps"):  # a NaN here makes every logit NaN
            if not _finite(getattr(self, name)) or not getattr(self, name) > 0:
                raise ValueError(f"ModelConfig.{name} must be a finite number > 0, got {getattr(self, name)!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, Llama3RopeScaling):
            raise ValueError(f"ModelConfig.rope_scaling must be a Llama3RopeScaling or None (from_hf_config reads "
                             f"a config.json's), got {type(self.rope_scaling).__name__}")
        for name in ("tie_word_embeddings", "qkv_bias"):  # bool("false") is True
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if isinstance(self.eos_token_id, list):  # keep the config hashable (it is a jit static)
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        eos = self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)
        ids = [("bos_token_id", self.bos_token_id), ("pad_token_id", self.pad_token_id),
               *(("eos_token_id", value) for value in eos)]
        for name, value in ids:
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"ModelConfig.{name} must be token ids (ints) or None, got {value!r}")

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


def _unsupported(source: str, what: str) -> CheckpointError:
    return CheckpointError(f"{source}: {what}; podsjax.models supports {sorted(SUPPORTED_ARCHITECTURES)}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_POSITIVE_INT = "a positive int"
_POSITIVE_NUMBER = "a positive number"
_BOOL = "true or false"
_CHECKS = {
    _POSITIVE_INT: lambda v: _is_int(v) and v > 0,
    _POSITIVE_NUMBER: lambda v: (_is_int(v) or isinstance(v, float)) and 0 < v < math.inf,
    _BOOL: lambda v: isinstance(v, bool),
}
_REQUIRED = object()


def _get(hf: dict[str, Any], key: str, kind: str, source: str, default: Any = _REQUIRED, prefix: str = "") -> Any:
    """``hf[key]`` checked to be ``kind``; null counts as absent, as transformers treats it."""
    value = hf.get(key)
    if value is None:
        if default is _REQUIRED:
            raise CheckpointError(f"{source}: missing required key '{prefix}{key}'")
        return default
    if not _CHECKS[kind](value):
        raise CheckpointError(f"{source}: {prefix}{key} must be {kind}, got {value!r:.60}")
    return value


def _object(hf: dict[str, Any], key: str, source: str) -> dict[str, Any]:
    value = hf.get(key) or {}
    if not isinstance(value, dict):
        raise CheckpointError(f"{source}: {key} must be an object or null, got {value!r:.60}")
    return value


def _token_ids(hf: dict[str, Any], key: str, source: str, many: bool = False) -> Any:
    value = hf.get(key)
    ids = value if many and isinstance(value, list) else [value]
    if value is not None and not all(_is_int(i) for i in ids):
        kind = "an int or a list of ints" if many else "an int"
        raise CheckpointError(f"{source}: {key} must be {kind} or null, got {value!r:.60}")
    return value


def _one_value(sources: list[tuple[str, dict[str, Any]]], key: str, kind: str, source: str, default: Any) -> Any:
    """``key`` from wherever a config gives it; places that give different values are refused,
    since transformers' versions differ on which one wins."""
    found = {f"{where}{key}": _get(d, key, kind, source, None, where) for where, d in sources}
    given = {name: value for name, value in found.items() if value is not None}
    if len(set(given.values())) > 1:
        raise CheckpointError(f"{source}: " + " and ".join(f"{k} {v!r:.30}" for k, v in given.items())
                              + " disagree; keep one")
    return next(iter(given.values()), default)


def _read_rope(hf: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """RoPE theta and the llama3 scaling arguments (None for plain RoPE)."""
    # transformers >= 5 writes "rope_parameters" (theta inside); older files and the Hub
    # checkpoints use top-level "rope_theta" plus "rope_scaling". Accept both.
    params = _object(hf, "rope_parameters", source)
    legacy = _object(hf, "rope_scaling", source)
    where = "rope_scaling" if legacy else "rope_parameters"
    scaling = legacy or params
    def settings(d):  # the scaling's own settings; transformers reads a legacy "type" as "rope_type"
        return {("rope_type" if k == "type" else k): v for k, v in d.items() if k != "rope_theta"}

    scaled = settings(params)
    if legacy and scaled not in ({}, {"rope_type": "default"}) and scaled != settings(legacy):
        raise CheckpointError(f"{source}: rope_scaling and rope_parameters disagree; keep one")
    theta = _one_value([("", hf), ("rope_parameters.", params), ("rope_scaling.", legacy)], "rope_theta",
                       _POSITIVE_NUMBER, source, 10000.0)
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind in (None, "default"):
        return float(theta), None
    if kind != "llama3":
        raise CheckpointError(f"{source}: rope scaling type {kind!r:.60} is not supported (only 'llama3' and none)")
    args = {key: float(_get(scaling, key, _POSITIVE_NUMBER, source, prefix=where + "."))
            for key in ("factor", "low_freq_factor", "high_freq_factor")}
    # transformers lets a top-level original_max_position_embeddings stand in for the scaling's.
    args["original_max_position_embeddings"] = _one_value(
        [("", hf), (where + ".", scaling)], "original_max_position_embeddings", _POSITIVE_INT, source, None)
    if args["original_max_position_embeddings"] is None:
        raise CheckpointError(f"{source}: missing required key '{where}.original_max_position_embeddings'")
    return float(theta), args


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{path}: not valid JSON ({err})") from None


def from_hf_config(hf: dict[str, Any] | str | os.PathLike) -> ModelConfig:
    """Builds a :class:`ModelConfig` from a HF config dict, config.json, or checkpoint dir.

    Raises:
        FileNotFoundError: no config.json at the path.
        CheckpointError: config.json is not a JSON object, lacks a key or has one of the
            wrong type; or the architecture is not Qwen2ForCausalLM / LlamaForCausalLM, or
            it uses a feature this decoder does not implement (sliding window, biases on
            Llama, another activation or RoPE scaling type). The message names the file.
    """
    source = "HF config"
    if not isinstance(hf, dict):
        source = os.fspath(hf)
        if os.path.isdir(source):
            source = os.path.join(source, "config.json")
        if not os.path.isfile(source):
            raise FileNotFoundError(f"no config.json at {source}")
        hf = _read_json(source)
        if not isinstance(hf, dict):
            raise CheckpointError(f"{source}: must hold a JSON object, got a {type(hf).__name__}")
    model_type = str(hf.get("model_type"))
    archs = hf.get("architectures") or [_MODEL_TYPES.get(model_type, model_type)]
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise CheckpointError(f"{source}: architectures must be a list of strings, got {archs!r:.60}")
    arch = SUPPORTED_ARCHITECTURES.get(archs[0])
    if arch is None:
        raise _unsupported(source, f"architecture {archs[0]!r:.60} is not supported")
    # transformers builds the model model_type names (a "mistral" one has a sliding window).
    if hf.get("model_type") is not None and model_type != arch:
        raise _unsupported(source, f"model_type {hf['model_type']!r:.60} is not {archs[0]}'s {arch!r}")
    if hf.get("hidden_act", "silu") != "silu":
        raise _unsupported(source, f"{archs[0]} with hidden_act={hf['hidden_act']!r:.60} is not supported")
    if arch == "qwen2" and hf.get("use_sliding_window", False):
        raise _unsupported(source, "Qwen2 with use_sliding_window=true is not supported")
    if arch == "llama" and (hf.get("attention_bias", False) or hf.get("mlp_bias", False)):
        raise _unsupported(source, "Llama with attention_bias/mlp_bias is not supported")
    hidden = _get(hf, "hidden_size", _POSITIVE_INT, source)
    heads = _get(hf, "num_attention_heads", _POSITIVE_INT, source)
    theta, scaling = _read_rope(hf, source)
    fields = dict(
        arch=arch,
        vocab_size=_get(hf, "vocab_size", _POSITIVE_INT, source),
        hidden_size=hidden,
        intermediate_size=_get(hf, "intermediate_size", _POSITIVE_INT, source),
        num_layers=_get(hf, "num_hidden_layers", _POSITIVE_INT, source),
        num_heads=heads,
        num_kv_heads=_get(hf, "num_key_value_heads", _POSITIVE_INT, source, heads),
        head_dim=_get(hf, "head_dim", _POSITIVE_INT, source, hidden // heads),
        rope_theta=theta,
        rms_norm_eps=float(_get(hf, "rms_norm_eps", _POSITIVE_NUMBER, source, 1e-6)),
        # Qwen2 and Llama configs both default tie_word_embeddings to False when absent.
        tie_word_embeddings=_get(hf, "tie_word_embeddings", _BOOL, source, False),
        qkv_bias=arch == "qwen2",
        max_position_embeddings=_get(hf, "max_position_embeddings", _POSITIVE_INT, source, 32768),
        bos_token_id=_token_ids(hf, "bos_token_id", source),
        eos_token_id=_token_ids(hf, "eos_token_id", source, many=True),
        pad_token_id=_token_ids(hf, "pad_token_id", source),
    )
    try:  # the dataclasses check what spans keys: heads vs kv heads, even head_dim, rope factors
        return ModelConfig(**fields, rope_scaling=None if scaling is None else Llama3RopeScaling(**scaling))
    except ValueError as err:
        raise CheckpointError(f"{source}: {err}") from None


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
CHECKPOINT_SHAPES: dict[str, ModelConfig] = {
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


def checkpoint_shape(name: str) -> ModelConfig:
    """The config of the public checkpoint ``name`` (a Hub name or its last part; "-Instruct" is accepted)."""
    key = name.split("/")[-1].removesuffix("-Instruct")
    if key not in CHECKPOINT_SHAPES:
        raise ValueError(f"unknown checkpoint shape {name!r}; known: {sorted(CHECKPOINT_SHAPES)}")
    return CHECKPOINT_SHAPES[key]
