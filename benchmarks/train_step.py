"""The GRPO update (forward + backward + AdamW) against an equal PyTorch step, and where a PODS step's time goes.

Update throughput: one random Qwen2-shaped model (default about 98M params, see
benchmarks/qwen_model.py) is built with transformers and loaded into podsjax, so
both sides train the same weights on the same batch of B rows x (prompt L +
completion T) tokens, fp32, in one process:
  (a) podsjax: ``podsjax.train.make_train_step`` (full fine-tune), jitted with the
      state donated, on one device: the step the loop runs
  (b) PyTorch: the transformers model in eager mode, the same loss written in torch
      (token log-probs at temperature 0.9, clipped GRPO ratio, token-mean), backward,
      ``clip_grad_norm_`` and ``torch.optim.AdamW`` with the same hyperparameters
Throughput is tokens through the update (B x (L + T)) per second. As an honesty
check, both first steps start from the same weights and their gradient norms must
agree. Then each side runs once more to warm up and --repeats times in
alternation; the table shows the medians.

Phase shares (--phases): GRPO and PODS each run --phase-steps steps of the
built-in tiny preset through the real CLI (``python -m experiments.gsm8k --mesh 8``)
in a subprocess, and the table gives the share of step time in generation,
reward scoring, selection and the update, averaged over the steps after the
first (which compiles), like the paper's timing breakdown.

Run: python -m benchmarks.train_step [--batch 8 --prompt-len 64 --completion-len 128] [--phases]
Smoke: python -m benchmarks.train_step --layers 2 --vocab 4096 --batch 2 --prompt-len 8 --completion-len 8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from benchmarks.machine import (
    busy_note, busy_warning, cpu_snapshot, interleaved_medians, others_busy, print_machine, print_runs,
)
from benchmarks.qwen_model import add_model_args, build_hf_model, describe, to_podsjax
from podsjax import train

PHASES = ("generation", "scoring", "selection", "update")


def make_batch(args) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(args.seed)
    b, t = args.batch, args.completion_len
    ids = rng.integers(0, args.vocab, (b, args.prompt_len + t))
    # Completions of random lengths, so the mask matters; the compute is the same for any mask.
    lengths = rng.integers(t // 2, t + 1, b)
    completion_mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    attention_mask = np.concatenate([np.ones((b, args.prompt_len)), completion_mask], axis=1).astype(np.int64)
    advantages = rng.standard_normal(b).astype(np.float32)
    return dict(ids=ids, attention_mask=attention_mask, completion_mask=completion_mask, advantages=advantages)


def podsjax_step(model, params, batch, config):
    optimizer = train.make_optimizer(config)
    policy, _ = train.full_apply_fn(model)
    step = jax.jit(train.make_train_step(policy, optimizer, config), donate_argnums=0)
    state = train.init_state(params, optimizer, jax.random.key(0))
    train_batch = train.TrainBatch(
        input_ids=jnp.asarray(batch["ids"], jnp.int32),
        attention_mask=jnp.asarray(batch["attention_mask"], jnp.int32),
        completion_mask=jnp.asarray(batch["completion_mask"]),
        advantages=jnp.asarray(batch["advantages"]),
    )
    holder = {"state": state}

    def run_once() -> float:
        holder["state"], metrics = step(holder["state"], train_batch, None)
        return float(metrics.grad_norm)  # blocks until the step is done

    return run_once


def torch_step(args, hf_model, batch, config):
    hf_model.train()  # dropout is 0 in Qwen2; train() only matters for the autograd path
    optimizer = torch.optim.AdamW(hf_model.parameters(), lr=config.learning_rate,
                                  betas=(config.adam_b1, config.adam_b2), weight_decay=config.weight_decay)
    ids = torch.from_numpy(batch["ids"])
    attention_mask = torch.from_numpy(batch["attention_mask"])
    completion_mask = torch.from_numpy(batch["completion_mask"])
    advantages = torch.from_numpy(batch["advantages"])
    t = args.completion_len

    def run_once() -> float:
        optimizer.zero_grad(set_to_none=True)
        logits = hf_model(input_ids=ids, attention_mask=attention_mask).logits[:, -t - 1 : -1]
        logprobs = torch.log_softmax(logits.float() / config.temperature, dim=-1)
        logprobs = torch.gather(logprobs, -1, ids[:, -t:, None]).squeeze(-1)
        ratio = torch.exp(logprobs - logprobs.detach())  # one iteration per batch: ratio 1, as in podsjax
        high = config.epsilon_high if config.epsilon_high is not None else config.epsilon
        clipped = torch.clamp(ratio, 1 - config.epsilon, 1 + high)
        per_token = -torch.minimum(ratio * advantages[:, None], clipped * advantages[:, None])
        loss = (per_token * completion_mask).sum() / completion_mask.sum().clamp(min=1)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(hf_model.parameters(), config.max_grad_norm)
        optimizer.step()
        return float(grad_norm)

    return run_once


def run_update(args):
    hf_model = build_hf_model(args, args.prompt_len + args.completion_len)
    num_params = sum(p.numel() for p in hf_model.parameters())
    model, params = to_podsjax(hf_model)
    config = train.preset("grpo", n=args.batch, m=args.batch, learning_rate=1e-6, temperature=0.9)
    batch = make_batch(args)
    jax_once, torch_once = podsjax_step(model, params, batch, config), torch_step(args, hf_model, batch, config)
    t0 = time.perf_counter()
    norm_jax = jax_once()  # compiles
    first_call_s = time.perf_counter() - t0
    norm_pt = torch_once()
    (t_jax, times_jax), (t_pt, times_pt) = interleaved_medians([jax_once, torch_once], args.repeats)
    return dict(num_params=num_params, norm_jax=norm_jax, norm_pt=norm_pt, first_call_s=first_call_s,
                t_jax=t_jax, t_pt=t_pt, times_jax=times_jax, times_pt=times_pt)


def format_update_table(args, r) -> str:
    tokens = args.batch * (args.prompt_len + args.completion_len)
    tps_jax, tps_pt = tokens / r["t_jax"], tokens / r["t_pt"]
    rel = abs(r["norm_jax"] - r["norm_pt"]) / max(abs(r["norm_pt"]), 1e-30)
    return "\n".join([
        "| model | B x (L + T) | (a) podsjax jit step | (b) PyTorch eager step | a/b speed-up | grad-norm rel. diff |",
        "|---|---|---|---|---|---|",
        f"| Qwen2-shaped {r['num_params'] / 1e6:.1f}M, fp32, AdamW | {args.batch} x ({args.prompt_len} + "
        f"{args.completion_len}) | {tps_jax:,.0f} tok/s ({r['t_jax']:.2f} s) | {tps_pt:,.0f} tok/s "
        f"({r['t_pt']:.2f} s) | {tps_jax / tps_pt:.2f}x | {rel:.1e} |",
    ])


# ------------------------------------------------------------------ phase shares


def run_phases(args) -> dict[str, dict[str, float]]:
    """Mean seconds per phase for each method, from the tiny preset's metrics.jsonl."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the CLI sets its own device count
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        warmup_dir = args.warmup_dir or os.path.join(tmp, "warmup")
        for method in ("grpo", "pods"):
            out = os.path.join(tmp, method)
            command = [sys.executable, "-m", "experiments.gsm8k", "--mesh", "8", "--method", method,
                       "--max-steps", str(args.phase_steps), "--eval-every", "1e9", "--eval-limit", "8",
                       "--warmup-dir", warmup_dir, "--no-progress", "--out", out, *args.phase_flags]
            done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"error: the {method} run failed:\n{done.stderr[-3000:]}")
            with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
                steps = [r for r in map(json.loads, f) if "time/update" in r]
            timed = steps[1:]  # the first step compiles
            if not timed:
                raise SystemExit("error: --phase-steps must be >= 2 (the first step compiles)")
            results[method] = {p: float(np.mean([s[f"time/{p}"] for s in timed])) for p in PHASES}
            with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
                algo = json.load(f)["algorithm"]
            results[method]["label"] = f"{method} (n={algo['n']}, m={algo['m']})"
    return results


def format_phase_table(results) -> str:
    lines = ["| method | step time | " + " | ".join(PHASES) + " |", "|---|---|" + "---|" * len(PHASES)]
    for r in results.values():
        total = sum(r[p] for p in PHASES)
        shares = " | ".join(f"{r[p] / total:.0%} ({r[p]:.2f} s)" for p in PHASES)
        lines.append(f"| {r['label']} | {total:.2f} s | {shares} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8, help="B, rows per update")
    parser.add_argument("--prompt-len", type=int, default=64, help="L, prompt tokens per row")
    parser.add_argument("--completion-len", type=int, default=128, help="T, completion tokens per row")
    add_model_args(parser)
    parser.add_argument("--skip-update", action="store_true", help="only the phase table")
    parser.add_argument("--phases", action="store_true", help="also time GRPO and PODS phases on the tiny preset")
    parser.add_argument("--phase-steps", type=int, default=6, help="steps per method (the first is not counted)")
    parser.add_argument("--warmup-dir", help="reuse a cached tiny warm-up (default: build one in a temp dir)")
    parser.add_argument("--phase-flags", nargs=argparse.REMAINDER, default=[],
                        help="extra flags for the tiny runs (must come last)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.phase_steps < 2:
        raise SystemExit("error: --repeats must be >= 1 and --phase-steps >= 2")

    torch.set_num_threads(args.threads)
    warning = busy_warning(print_machine(torch, transformers, args.retain_memory))
    start = time.perf_counter()
    if not args.skip_update:
        since = cpu_snapshot()
        r = run_update(args)
        busy_during = others_busy(since)
        print(f"model: {describe(args, r['num_params'])}; GRPO token-mean loss, temperature 0.9, AdamW + clip; "
              f"podsjax first call (compile + run) {r['first_call_s']:.1f} s; median of {args.repeats} "
              f"interleaved runs after 1 warm-up")
        print(format_update_table(args, r))
        print_runs({"podsjax": r["times_jax"], "PyTorch": r["times_pt"]}, busy_during, bool(warning))
    if args.phases:
        since = cpu_snapshot()
        results = run_phases(args)
        print(f"phases: tiny preset, --mesh 8, {args.phase_steps - 1} timed steps per method (after 1 compiling "
              f"step); during the runs {busy_note(others_busy(since))}")
        print(format_phase_table(results))
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
