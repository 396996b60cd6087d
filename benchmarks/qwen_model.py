"""The random Qwen2-shaped models the benchmarks share: named shapes, flags, and both libraries' copies.

A shape is built from its config with random weights, so no download is needed.
The Qwen2.5 rows are the public config.json values of those checkpoints.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile

from benchmarks.machine import torch_device, usable_cores


@dataclasses.dataclass(frozen=True)
class Shape:
    """A Qwen2 architecture. Qwen2 always has q/k/v biases (transformers builds them unconditionally)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool = True
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = {
    "small": Shape(hidden=768, layers=12, heads=12, kv_heads=2, intermediate=2048, vocab=32000),  # ~98M, CPU-sized
    "qwen2.5-0.5b": Shape(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936),
    "qwen2.5-1.5b": Shape(hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, vocab=151936),
    "qwen2.5-3b": Shape(hidden=2048, layers=36, heads=16, kv_heads=2, intermediate=11008, vocab=151936),
}
# Flags that override one field of the chosen shape.
_OVERRIDES = ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab")


def add_shape_args(parser: argparse.ArgumentParser) -> None:
    """--shape, per-field overrides, --dtype and --seed."""
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small",
                        help="model shape with random weights (default small: ~98M params)")
    for name in _OVERRIDES:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"override the shape's {name}")
    parser.add_argument("--untied", dest="tied", action="store_const", const=False,
                        help="separate LM head (adds V x D params)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"),
                        help="params and compute (default: bfloat16 on GPU/TPU, float32 on CPU)")
    parser.add_argument("--seed", type=int, default=0)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """Shape flags plus the timing flags every side-by-side benchmark takes."""
    add_shape_args(parser)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per contender after one warm-up")
    parser.add_argument("--threads", type=int, default=usable_cores(), help="torch intra-op threads (CPU)")
    parser.add_argument("--glibc-defaults", dest="retain_memory", action="store_false",
                        help="leave malloc as glibc sets it up (default: retain freed memory, as the CLI does)")


def resolve(args) -> Shape:
    """Fills ``args.spec`` (the shape with overrides) and ``args.dtype`` (by backend when not given)."""
    overrides = {k: getattr(args, k) for k in (*_OVERRIDES, "tied") if getattr(args, k) is not None}
    args.spec = dataclasses.replace(SHAPES[args.shape], **overrides)
    import jax

    if args.dtype is None:
        # bf16 matmuls are emulated (slow) on CPU; accelerators are built for them.
        args.dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    if args.dtype == "float32" and jax.default_backend() != "cpu":
        # JAX would run fp32 matmuls as TF32/bf16 passes on GPU/TPU, torch as full fp32: race the same arithmetic.
        jax.config.update("jax_default_matmul_precision", "highest")
    return args.spec


def jax_dtype(name: str):
    import jax.numpy as jnp

    return jnp.dtype(name)


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def hf_config(spec: Shape, max_positions: int, **overrides):
    import transformers

    return transformers.Qwen2Config(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=max(2048, max_positions),
        tie_word_embeddings=spec.tied,
        rope_theta=spec.rope_theta,
        rms_norm_eps=spec.rms_eps,
        **overrides,
    )


def podsjax_config(spec: Shape, max_positions: int, **overrides):
    """The same architecture as a podsjax ``ModelConfig``."""
    from podsjax.models import ModelConfig

    return ModelConfig(
        arch="qwen2", vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_layers=spec.layers, num_heads=spec.heads, num_kv_heads=spec.kv_heads, head_dim=spec.head_dim,
        rope_theta=spec.rope_theta, rms_norm_eps=spec.rms_eps, tie_word_embeddings=spec.tied, qkv_bias=True,
        max_position_embeddings=max(2048, max_positions), **overrides,
    )


def build_hf_model(args, max_positions: int, **config_overrides):
    """A seeded random ``Qwen2ForCausalLM`` in eval mode, in ``args.dtype``, on torch's device (GPU when it has one).

    Attention is sdpa, transformers' default and its fast path on GPU.
    """
    import torch
    import transformers

    config = hf_config(args.spec, max_positions, **config_overrides)
    config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    default = torch.get_default_dtype()
    # Born in the dtype, as from_pretrained does: RoPE's inv_freq stays fp32 (a .to(bf16) would round it).
    torch.set_default_dtype(torch_dtype(args.dtype))
    try:
        with torch.device(torch_device(torch)):  # init on the GPU: a 3B model's init is slow on the host
            model = transformers.Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def to_podsjax(hf_model, dtype: str, **kwargs):
    """(model, params) loaded through ``from_pretrained``, so both sides hold the same weights."""
    import podsjax.models

    with tempfile.TemporaryDirectory() as tmp:
        hf_model.save_pretrained(tmp)
        return podsjax.models.from_pretrained(tmp, dtype=jax_dtype(dtype), **kwargs)


def describe(args, num_params: int) -> str:
    s = args.spec
    return (f"{args.shape} shape, {num_params:,} params, {s.layers} layers, hidden {s.hidden}, heads {s.heads}/"
            f"{s.kv_heads} kv, mlp {s.intermediate}, vocab {s.vocab}, {'tied' if s.tied else 'untied'} head, "
            f"{args.dtype}")
