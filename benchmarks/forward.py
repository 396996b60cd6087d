"""Full-sequence forward pass: jitted podsjax against transformers' PyTorch model.

One random Qwen2-shaped model (default about 98M params: hidden 768, 12 layers,
12 query / 2 kv heads, MLP 2048, vocab 32000, tied embeddings) is built with
transformers, saved to a temporary directory and loaded into podsjax with
``podsjax.models.from_pretrained``, so both sides run the same weights. Both
run fp32 logits over the whole [B, L] batch (no padding) in one process:
  (a) podsjax: ``jax.jit(model.apply)`` on the loaded params
  (b) transformers: ``Qwen2ForCausalLM`` in eager PyTorch under ``torch.no_grad()``
      with its default attention implementation (printed)
The max abs difference of the two logits is printed so the race is between
equal computations. After that check (which doubles as the warm-up) the two
are timed --repeats times each, in alternation so that load from other processes
falls on both alike; the table shows the medians. torch gets one intra-op
thread per usable core (--threads), as XLA's CPU thread pool does. The machine
line reports how many cores other processes kept busy before the run, the runs
line how many during it; on a busy machine torch's OpenMP threads stall far more
than XLA's, so trust ratios from a quiet one.

Run: python -m benchmarks.forward [--batch 8 --seq 512 --layers 12 --repeats 3]
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

from benchmarks.machine import busy_warning, cpu_snapshot, interleaved_medians, others_busy, print_machine, print_runs
from benchmarks.qwen_model import add_model_args, build_hf_model, describe, to_podsjax


def run(args):
    hf_model = build_hf_model(args, args.seq)
    num_params = sum(p.numel() for p in hf_model.parameters())  # tied weights counted once
    model, params = to_podsjax(hf_model)

    rng = np.random.default_rng(args.seed)
    ids_np = rng.integers(0, args.vocab, (args.batch, args.seq), dtype=np.int64)
    mask_np = np.ones((args.batch, args.seq), np.int64)

    ids, mask = jnp.asarray(ids_np, jnp.int32), jnp.asarray(mask_np, jnp.int32)
    forward = jax.jit(lambda p, ids, mask: model.apply({"params": p}, ids, attention_mask=mask))
    t0 = time.perf_counter()
    forward.lower(params, ids, mask).compile()
    compile_s = time.perf_counter() - t0

    ids_pt, mask_pt = torch.from_numpy(ids_np), torch.from_numpy(mask_np)

    def torch_forward():
        with torch.no_grad():
            return hf_model(input_ids=ids_pt, attention_mask=mask_pt).logits

    # Honesty check: same weights, same inputs, same logits.
    logits_jax = np.asarray(forward(params, ids, mask))
    logits_pt = torch_forward().numpy()
    max_diff = float(np.max(np.abs(logits_jax - logits_pt)))
    del logits_jax, logits_pt

    (t_jax, times_jax), (t_pt, times_pt) = interleaved_medians(
        [lambda: forward(params, ids, mask).block_until_ready(), torch_forward], args.repeats, warm_up=False)
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
        f"| Qwen2-shaped {r['num_params'] / 1e6:.1f}M, fp32 | {args.batch} x {args.seq} "
        f"| {tps_jax:,.0f} tok/s ({r['t_jax']:.2f} s) | {tps_pt:,.0f} tok/s ({r['t_pt']:.2f} s) "
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
