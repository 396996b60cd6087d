"""Full-sequence forward pass: jitted podsjax against transformers' PyTorch model, on the same device.

A random Qwen2-shaped model (--shape: small ~98M by default, or qwen2.5-0.5b /
1.5b / 3b, made from the config with no download) is built with transformers,
saved to a temporary directory and loaded into podsjax with
``podsjax.models.from_pretrained``, so both sides run the same weights in --dtype
(bfloat16 on GPU/TPU, float32 on CPU by default). Both run the logits of the whole
[B, L] batch (no padding):
  (a) podsjax: ``jax.jit(model.apply)`` on JAX's default device
  (b) transformers: ``Qwen2ForCausalLM`` in eager PyTorch under ``torch.no_grad()``,
      sdpa attention, on CUDA when torch has it (timed up to ``torch.cuda.synchronize()``)
The max abs difference of the two logits is printed so the race is between
equal computations (about 1e-5 in fp32; bf16 differs in rounding order). After
that check (which doubles as the warm-up) the two are timed --repeats times each,
in alternation so that load from other processes falls on both alike; the table
shows the medians. On CPU torch gets one intra-op thread per usable core
(--threads), as XLA's CPU thread pool does, and the machine line reports how many
cores other processes kept busy; on a busy machine torch's OpenMP threads stall far
more than XLA's, so trust ratios from a quiet one.

Run (CPU): python -m benchmarks.forward [--batch 8 --seq 512 --repeats 3]
Run (GPU): python -m benchmarks.forward --shape qwen2.5-1.5b --dtype bfloat16 --batch 8 --seq 1024
Smoke: python -m benchmarks.forward --layers 2 --batch 2 --seq 64 --vocab 4096
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from benchmarks.machine import (
    busy_warning, cpu_snapshot, interleaved_medians, others_busy, print_machine, print_runs, torch_device,
    torch_synced,
)
from benchmarks.qwen_model import add_model_args, build_hf_model, describe, resolve, to_podsjax


def max_abs_diff(logits_jax, logits_pt) -> float:
    """Row by row, so a [B, L, 151936] batch never sits on the host twice at once."""
    return max(float(np.max(np.abs(np.asarray(logits_jax[i], np.float32) - logits_pt[i].float().cpu().numpy())))
               for i in range(logits_pt.shape[0]))


def run(args):
    spec = args.spec
    hf_model = build_hf_model(args, args.seq)
    num_params = sum(p.numel() for p in hf_model.parameters())  # tied weights counted once
    model, params = to_podsjax(hf_model, args.dtype)

    rng = np.random.default_rng(args.seed)
    ids_np = rng.integers(0, spec.vocab, (args.batch, args.seq), dtype=np.int64)
    mask_np = np.ones((args.batch, args.seq), np.int64)

    ids, mask = jnp.asarray(ids_np, jnp.int32), jnp.asarray(mask_np, jnp.int32)
    t0 = time.perf_counter()
    forward = jax.jit(lambda p, ids, mask: model.apply({"params": p}, ids, attention_mask=mask).logits_BLV).lower(
        params, ids, mask).compile()
    compile_s = time.perf_counter() - t0

    device = torch_device(torch)
    ids_pt, mask_pt = torch.from_numpy(ids_np).to(device), torch.from_numpy(mask_np).to(device)

    def torch_forward():
        with torch.no_grad():
            return hf_model(input_ids=ids_pt, attention_mask=mask_pt).logits

    # Honesty check: same weights, same inputs, same logits.
    max_diff = max_abs_diff(forward(params, ids, mask), torch_forward())

    (t_jax, times_jax), (t_pt, times_pt) = interleaved_medians(
        [lambda: forward(params, ids, mask).block_until_ready(), torch_synced(torch, torch_forward)],
        args.repeats, warm_up=False)
    return dict(
        num_params=num_params,
        attn_impl=hf_model.config._attn_implementation,
        max_diff=max_diff,
        compile_s=compile_s,
        t_jax=t_jax,
        t_pt=t_pt,
        times_jax=times_jax,
        times_pt=times_pt,
    )


def format_table(args, r) -> str:
    tokens = args.batch * args.seq
    tps_jax, tps_pt = tokens / r["t_jax"], tokens / r["t_pt"]
    lines = [
        "| model | B x L | (a) podsjax jit | (b) transformers eager | a/b speed-up | max abs logit diff |",
        "|---|---|---|---|---|---|",
        f"| {args.shape} {r['num_params'] / 1e6:.1f}M, {args.dtype} | {args.batch} x {args.seq} "
        f"| {tps_jax:,.0f} tok/s ({r['t_jax']:.3f} s) | {tps_pt:,.0f} tok/s ({r['t_pt']:.3f} s) "
        f"| {tps_jax / tps_pt:.2f}x | {r['max_diff']:.1e} |",
    ]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8, help="B, sequences per forward")
    parser.add_argument("--seq", type=int, default=512, help="L, tokens per sequence")
    add_model_args(parser)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("error: --repeats must be >= 1")

    torch.set_num_threads(args.threads)
    warning = busy_warning(print_machine(torch, transformers, args.retain_memory))
    resolve(args)
    start, since = time.perf_counter(), cpu_snapshot()
    r = run(args)
    busy_during = others_busy(since)
    print(
        f"model: {describe(args, r['num_params'])}; transformers attention: {r['attn_impl']}; "
        f"podsjax compile {r['compile_s']:.1f} s; median of {args.repeats} interleaved runs after 1 warm-up"
        f" (the logit check)"
    )
    print(format_table(args, r))
    print_runs({"podsjax": r["times_jax"], "transformers": r["times_pt"]}, busy_during, bool(warning),
               during=f"total {time.perf_counter() - start:.0f} s; during the run")


if __name__ == "__main__":
    main()
