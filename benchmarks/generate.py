"""Rollout generation (podsjax against transformers) and reward-scoring throughput.

Generation: one random Qwen2-shaped model (default about 98M params: hidden 768,
12 layers, 12 query / 2 kv heads, MLP 2048, vocab 32000, tied embeddings) is
built with transformers, saved to a temporary directory and loaded into podsjax
with ``podsjax.models.from_pretrained``. Both sides sample P prompts of L random
tokens x T new tokens at temperature 1 (no top-k, no top-p), fp32, end to end
(prefill included), in one run:
  (a) podsjax: ``podsjax.sampling.generate`` (jit prefill + lax.while_loop decode)
  (b) transformers: ``model.generate(do_sample=True, ...)`` in eager PyTorch under
      ``torch.no_grad()``, default attention implementation and cache (printed)
EOS is disabled so every row has exactly T tokens: podsjax gets an EOS id one
past the vocabulary, which can never be sampled, and every ``rollouts.lengths``
is checked to be T; transformers gets ``eos_token_id=None`` and its output
length is checked. As an honesty check the podsjax log-probs of its sampled
tokens are compared with the transformers model's own log-probs of the same
sequences (max abs diff printed).

Rewards: the gold solutions of GSM8K test and MATH-500 are written as
completions ``<think>{solution}</think><answer>{answer}</answer>`` and scored
with the paper's rewards (``default_rewards``: accuracy + format + tag count),
in process (``score_rewards``) and through ``RewardPool`` worker processes.
Every completion is correct, so the mean accuracy must be 1.

Each contender runs once to warm up, then --repeats times in alternation with
the other contender of its table (so that load from other processes falls on
both alike); tables show medians. torch gets one intra-op thread per usable
core (--threads), as XLA's CPU thread pool does. The machine line reports how
many cores other processes kept busy before the run, the runs line how many
during generation; on a busy machine torch's OpenMP threads stall far more than
XLA's, so trust ratios from a quiet one.

Run: python -m benchmarks.generate [--prompts 32 --prompt-len 64 --new-tokens 128]
Smoke: python -m benchmarks.generate --layers 2 --prompts 4 --new-tokens 16 --vocab 4096 --reward-limit 50
"""

from __future__ import annotations

# Heavy imports (torch, transformers, jax) live inside functions: RewardPool's
# worker processes re-import this main module, and they need none of them.
import argparse
import os
import time

from benchmarks.machine import busy_warning, cpu_snapshot, interleaved_medians, others_busy, print_machine, print_runs
from benchmarks.qwen_model import add_model_args, build_hf_model, describe, to_podsjax

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DATA = os.path.join(REPO_ROOT, "..", "shared", "data")
TASK_DIRS = {"gsm8k": "gsm8k", "math": "math500"}


# ------------------------------------------------------------------ generation


def run_generate(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from podsjax.sampling import generate

    # EOS off: no token id ends a transformers row early.
    hf_model = build_hf_model(args, args.prompt_len + args.new_tokens, bos_token_id=None, eos_token_id=None,
                              pad_token_id=0)
    num_params = sum(p.numel() for p in hf_model.parameters())  # tied weights counted once
    model, params = to_podsjax(hf_model)

    p, length, t_new = args.prompts, args.prompt_len, args.new_tokens
    rng = np.random.default_rng(args.seed)
    ids_np = rng.integers(0, args.vocab, (p, length), dtype=np.int64)
    mask_np = np.ones((p, length), np.int64)
    never_eos = args.vocab  # one past the last token id: never sampled

    ids, mask = jnp.asarray(ids_np, jnp.int32), jnp.asarray(mask_np, jnp.int32)
    calls = [0]

    def podsjax_generate():
        calls[0] += 1
        rollouts = generate(
            model, params, ids, mask, jax.random.key(calls[0]),
            num_samples=1, max_new_tokens=t_new, temperature=1.0, top_p=1.0, top_k=0,
            eos_token_ids=(never_eos,),
        )
        return jax.block_until_ready(rollouts)

    ids_pt, mask_pt = torch.from_numpy(ids_np), torch.from_numpy(mask_np)

    def torch_generate():
        with torch.no_grad():
            return hf_model.generate(
                input_ids=ids_pt, attention_mask=mask_pt, do_sample=True, temperature=1.0, top_k=0,
                top_p=1.0, max_new_tokens=t_new, min_new_tokens=t_new, eos_token_id=None, pad_token_id=0,
            )

    t0 = time.perf_counter()
    rollouts = podsjax_generate()
    first_call_s = time.perf_counter() - t0
    lengths = np.asarray(rollouts.lengths)
    if not (lengths == t_new).all():
        raise SystemExit(f"error: podsjax rows ended early (lengths {sorted(set(lengths.tolist()))}); EOS must be off")

    # Honesty check: podsjax's log-probs of its own samples under the transformers model.
    with torch.no_grad():
        full = torch.cat([ids_pt, torch.from_numpy(np.asarray(rollouts.tokens, np.int64))], dim=1)
        logits = hf_model(input_ids=full, attention_mask=torch.ones_like(full)).logits[:, length - 1: -1]
        ref_lp = torch.log_softmax(logits.float(), -1).gather(-1, full[:, length:, None])[..., 0].numpy()
    lp_diff = float(np.max(np.abs(np.asarray(rollouts.logprobs) - ref_lp)))

    out = torch_generate()
    if tuple(out.shape) != (p, length + t_new):
        raise SystemExit(f"error: transformers returned {tuple(out.shape)}, expected {(p, length + t_new)}")

    (t_jax, times_jax), (t_pt, times_pt) = interleaved_medians([podsjax_generate, torch_generate], args.repeats)
    return dict(
        num_params=num_params,
        attn_impl=hf_model.config._attn_implementation,
        first_call_s=first_call_s,
        lp_diff=lp_diff,
        t_jax=t_jax,
        t_pt=t_pt,
        times_jax=times_jax,
        times_pt=times_pt,
    )


def format_generate_table(args, r) -> str:
    tokens = args.prompts * args.new_tokens
    tps_jax, tps_pt = tokens / r["t_jax"], tokens / r["t_pt"]
    return "\n".join([
        "| model | P x (prompt + new) | (a) podsjax generate | (b) transformers generate | a/b speed-up "
        "| max abs logprob diff |",
        "|---|---|---|---|---|---|",
        f"| Qwen2-shaped {r['num_params'] / 1e6:.1f}M, fp32 | {args.prompts} x ({args.prompt_len} + {args.new_tokens}) "
        f"| {tps_jax:,.0f} tok/s ({r['t_jax']:.2f} s) | {tps_pt:,.0f} tok/s ({r['t_pt']:.2f} s) "
        f"| {tps_jax / tps_pt:.2f}x | {r['lp_diff']:.1e} |",
    ])


# --------------------------------------------------------------------- rewards


def reward_inputs(task_name: str, data_dir: str, limit: int | None):
    """Gold solutions as think/answer completions, plus their reward columns."""
    from podsjax.data import load_task, reward_columns

    path = os.path.join(data_dir, TASK_DIRS[task_name], "test.jsonl")
    task = load_task(task_name, "test", path=path, limit=limit)
    completions = []
    for example in task:
        # GSM8K keeps its full worked solution (with "#### 18") in `solution`; MATH has `solution` too.
        reasoning = example.columns.get("solution", "")
        completions.append(f"<think>{reasoning}</think><answer>{example.answer}</answer>")
    return completions, reward_columns(list(task))


def run_rewards(args) -> list[tuple]:
    from podsjax.rewards import RewardPool, default_rewards, score_rewards

    rows = []
    inputs = {name: reward_inputs(name, args.data, args.reward_limit) for name in args.tasks}
    t0 = time.perf_counter()
    with RewardPool(max_workers=args.workers, timeout_s=args.reward_timeout) as pool:
        startup_s = time.perf_counter() - t0
        for name in args.tasks:
            completions, columns = inputs[name]
            rewards = default_rewards(name)
            checks = {}

            def in_process():
                checks["in_process"] = score_rewards(completions, rewards, **columns)

            def pooled():
                checks["pool"] = pool.score(completions, rewards, **columns)

            (t_in, _), (t_pool, _) = interleaved_medians([in_process, pooled], args.repeats)
            metrics = checks["pool"].metrics
            failures = sum(metrics[f"reward/{k}"] for k in ("timeouts", "crashes", "memory_errors", "errors"))
            acc_in = checks["in_process"].metrics["reward/accuracy"]
            acc_pool = metrics["reward/accuracy"]
            total_max = sum(w.weight for w in rewards)
            rows.append((name, len(completions), t_in, t_pool, acc_in, acc_pool, metrics["reward/total"], total_max,
                         int(failures)))
    return rows, startup_s


def format_reward_table(args, rows) -> str:
    lines = [
        f"| task | completions | (c) in process | (d) RewardPool, {args.workers} workers | d/c "
        "| mean accuracy (in process / pool) | mean total reward | pool failures |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, n, t_in, t_pool, acc_in, acc_pool, total, total_max, failures in rows:
        lines.append(
            f"| {name} | {n} | {n / t_in:,.0f} /s ({t_in:.2f} s) | {n / t_pool:,.0f} /s ({t_pool:.2f} s) "
            f"| {t_in / t_pool:.2f}x | {acc_in:.3f} / {acc_pool:.3f} | {total:.3f} of {total_max:g} | {failures} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------ main


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32, help="P, prompts (one sample each)")
    parser.add_argument("--prompt-len", type=int, default=64, help="L, tokens per prompt")
    parser.add_argument("--new-tokens", type=int, default=128, help="T, tokens sampled per prompt")
    add_model_args(parser)
    parser.add_argument("--data", default=DEFAULT_DATA, help="folder holding gsm8k/test.jsonl and math500/test.jsonl")
    parser.add_argument("--tasks", type=lambda s: [t for t in s.split(",") if t], default=["gsm8k", "math"],
                        help="reward tasks, comma-separated (gsm8k, math); empty skips rewards")
    parser.add_argument("--reward-limit", type=int, default=None, help="score only the first N examples per task")
    parser.add_argument("--workers", type=int, default=2, help="RewardPool worker processes")
    parser.add_argument("--reward-timeout", type=float, default=10.0, help="RewardPool per-item timeout_s")
    parser.add_argument("--skip-generate", action="store_true", help="only the reward benchmark")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("error: --repeats must be >= 1")
    unknown = sorted(set(args.tasks) - set(TASK_DIRS))
    if unknown:
        raise SystemExit(f"error: unknown --tasks {unknown}; expected gsm8k and/or math")

    import torch
    import transformers

    torch.set_num_threads(args.threads)
    warning = busy_warning(print_machine(torch, transformers, args.retain_memory))
    start, since = time.perf_counter(), cpu_snapshot()
    if not args.skip_generate:
        r = run_generate(args)
        busy_during = others_busy(since)
        print(
            f"model: {describe(args, r['num_params'])}; temperature 1, EOS off (all lengths checked == "
            f"{args.new_tokens}); transformers attention: {r['attn_impl']}, default dynamic cache; "
            f"podsjax first call (compile + run) {r['first_call_s']:.1f} s; "
            f"median of {args.repeats} interleaved runs after 1 warm-up"
        )
        print(format_generate_table(args, r))
        print_runs({"podsjax": r["times_jax"], "transformers": r["times_pt"]}, busy_during, bool(warning),
                   during="during generation")
    if args.tasks:
        rows, startup_s = run_rewards(args)
        print(
            f"rewards: gold solutions as <think>...</think><answer>...</answer>, default_rewards(task) "
            f"(accuracy + format + tag_count); pool start-up {startup_s:.1f} s (not timed); "
            f"median of {args.repeats} interleaved runs after 1 warm-up"
        )
        print(format_reward_table(args, rows))
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
