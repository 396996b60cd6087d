"""The random Qwen2-shaped model the forward, generate and train-step benchmarks share."""

from __future__ import annotations

import argparse
import tempfile

from benchmarks.machine import usable_cores


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """Model shape (default about 98M params) and the timing flags every benchmark takes."""
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--untied", dest="tied", action="store_false", help="separate LM head (adds V x D params)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per contender after one warm-up")
    parser.add_argument("--threads", type=int, default=usable_cores(), help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--glibc-defaults", dest="retain_memory", action="store_false",
                        help="leave malloc as glibc sets it up (default: retain freed memory, as the CLI does)")


def build_hf_model(args, max_positions: int, **config_overrides):
    """A seeded random ``Qwen2ForCausalLM`` in eval mode."""
    import torch
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(2048, max_positions),
        tie_word_embeddings=args.tied,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        **config_overrides,
    )
    torch.manual_seed(args.seed)
    return transformers.Qwen2ForCausalLM(config).eval()


def to_podsjax(hf_model, **kwargs):
    """(model, params) loaded through ``from_pretrained``, so both sides hold the same weights."""
    import jax.numpy as jnp

    import podsjax.models

    with tempfile.TemporaryDirectory() as tmp:
        hf_model.save_pretrained(tmp)
        return podsjax.models.from_pretrained(tmp, dtype=jnp.float32, **kwargs)


def describe(args, num_params: int) -> str:
    return (f"{num_params:,} params, {args.layers} layers, hidden {args.hidden}, heads {args.heads}/"
            f"{args.kv_heads} kv, mlp {args.intermediate}, vocab {args.vocab}, "
            f"{'tied' if args.tied else 'untied'} head")
