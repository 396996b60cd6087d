"""Rollout generation (podsjax against transformers, on the same device) and reward-scoring throughput.

Generation: a random Qwen2-shaped model (--shape: small ~98M by default, or
qwen2.5-0.5b / 1.5b / 3b, made from the config with no download) is built with
transformers and loaded into podsjax with ``podsjax.models.from_pretrained``, in
--dtype (bfloat16 on GPU/TPU, float32 on CPU by default). Both sides sample
S samples of each of P prompts of L random tokens, T new tokens each, at temperature 1
(no top-k, no top-p), end to end (prefill included):
  (a) podsjax: ``podsjax.sampler.sampling.Generator.generate`` (one program: prefill, then a while_loop decode)
  (b) transformers: ``model.generate(do_sample=True, ...)`` in eager PyTorch under
      ``torch.no_grad()``, sdpa attention and its default dynamic cache, on CUDA when
      torch has it (timed up to ``torch.cuda.synchronize()``)
EOS is disabled so every row has exactly T tokens: podsjax gets an EOS id one
past the vocabulary, which can never be sampled, and every ``rollouts.lengths``
is checked to be T; transformers gets ``eos_token_id=None`` and its output
length is checked. As an honesty check the podsjax log-probs of its sampled
tokens are compared with the transformers model's own log-probs of the same
sequences (max abs diff printed).

Decode against the memory floor: each side's prefill is timed on its own (podsjax:
jit ``prefill`` into a fresh cache; transformers: the base model with
``use_cache=True``), and a decode step is (generate - prefill) / T. Its floor is
the bytes a step must read, weights + the KV cache at its mean fill (each prompt once, P L,
and its samples' completions, P S T/2)
(``benchmarks/costs.py``), over the device's peak memory bandwidth
(``benchmarks/machine.py``; on CPU a NumPy memcpy measured here).

Rewards: the gold solutions of GSM8K test and MATH-500 are written as
completions ``<think>{solution}</think><answer>{answer}</answer>`` and scored
with the paper's rewards (``default_rewards``: accuracy + format + tag count),
in process (``score_rewards``) and through ``RewardPool`` worker processes.
Every completion is correct, so the mean accuracy must be 1.

Each contender runs once to warm up, then --repeats times in alternation with
the others of its table (so that load from other processes falls on all alike);
tables show medians. On CPU torch gets one intra-op thread per usable core
(--threads), as XLA's CPU thread pool does; the machine line reports how many
cores other processes kept busy, and on a busy machine torch's OpenMP threads
stall far more than XLA's, so trust ratios from a quiet one.

Run (CPU): python -m benchmarks.generate [--rows 32 --prompt-len 64 --new-tokens 128]
Run (GPU): python -m benchmarks.generate --shape qwen2.5-1.5b --dtype bfloat16 --rows 256 --prompt-len 512 \
    --new-tokens 512 --tasks ''
Where a GPU decode step goes (kernels against the time between them):
    python -m benchmarks.generate --shape qwen2.5-1.5b --rows 64 --prompt-len 512 --new-tokens 256 --tasks '' \
        --profile /tmp/podsjax-trace    (then: python -m benchmarks.trace_summary /tmp/podsjax-trace --steps 256)
Smoke: python -m benchmarks.generate --layers 2 --rows 4 --new-tokens 16 --vocab 4096 --reward-limit 50
"""

from __future__ import annotations

# Heavy imports (torch, transformers, jax) live inside functions: RewardPool's
# worker processes re-import this main module, and they need none of them.
import argparse
import os
import time

from benchmarks.machine import (
    busy_warning, cpu_snapshot, device_peaks, interleaved_medians, others_busy, print_machine, print_runs,
    torch_device, torch_synced,
)
from benchmarks.qwen_model import add_model_args, build_hf_model, describe, jax_dtype, resolve, to_podsjax

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DATA = os.path.join(REPO_ROOT, "tests", "data")  # real GSM8K / MATH-500 rows
TASK_DIRS = {"gsm8k": "gsm8k", "math": "math500"}
LOGIT_CHUNK_BYTES = 2**30  # the log-prob check runs this much of fp32 logits at a time


# ------------------------------------------------------------------ generation


def run_generate(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from podsjax.models import init_cache, prefill
    from podsjax.sampler import decoding
    from podsjax.sampler.sampling import Generator

    if args.steps_per_check is not None:  # read when the sampling program traces
        decoding.MAX_STEPS_PER_CHECK = args.steps_per_check

    spec = args.spec
    # EOS off: no token id ends a transformers row early.
    hf_model = build_hf_model(args, args.prompt_len + args.new_tokens, bos_token_id=None, eos_token_id=None,
                              pad_token_id=0)
    num_params = sum(p.numel() for p in hf_model.parameters())  # tied weights counted once
    model, params = to_podsjax(hf_model, args.dtype)

    p, samples, length, t_new = args.rows, args.samples, args.prompt_len, args.new_tokens
    rng = np.random.default_rng(args.seed)
    ids_np = rng.integers(0, spec.vocab, (p, length), dtype=np.int64)
    mask_np = np.ones((p, length), np.int64)
    never_eos = spec.vocab  # one past the last token id: never sampled

    ids, mask = jnp.asarray(ids_np, jnp.int32), jnp.asarray(mask_np, jnp.int32)
    calls = [0]
    generator = Generator(model)  # compiles once; every timed call reuses its programs

    def podsjax_generate(return_logprobs=False):  # timed as the training loop runs it: no log-probs
        calls[0] += 1
        rollouts = generator.generate(
            params, ids, mask, jax.random.key(calls[0]),
            num_samples=samples, max_new_tokens=t_new, temperature=1.0, top_p=1.0, top_k=0,
            eos_token_ids=(never_eos,), return_logprobs=return_logprobs,
        )
        return jax.block_until_ready(rollouts)

    # What generate's prefill stage does: each prompt once, into a fresh cache of L + T slots.
    prefill_fn = jax.jit(lambda params, ids, mask: prefill(
        model, params, ids, mask, init_cache(model.config, p, length + t_new, dtype=model.dtype), last_only=True))

    device = torch_device(torch)
    ids_pt, mask_pt = torch.from_numpy(ids_np).to(device), torch.from_numpy(mask_np).to(device)

    def torch_generate():
        with torch.no_grad():
            return hf_model.generate(
                input_ids=ids_pt, attention_mask=mask_pt, do_sample=True, temperature=1.0, top_k=0,
                top_p=1.0, max_new_tokens=t_new, min_new_tokens=t_new, eos_token_id=None, pad_token_id=0,
                num_return_sequences=samples,
            )

    def torch_prefill():
        with torch.no_grad():  # the base model: generate's prefill runs the LM head on the last position only
            return hf_model.model(input_ids=ids_pt, attention_mask=mask_pt, use_cache=True).last_hidden_state

    t0 = time.perf_counter()
    rollouts = podsjax_generate()
    first_call_s = time.perf_counter() - t0
    lengths = np.asarray(rollouts.lengths)
    if not (lengths == t_new).all():
        raise SystemExit(f"error: podsjax rows ended early (lengths {sorted(set(lengths.tolist()))}); EOS must be off")
    del rollouts
    lp_diff = None
    if args.reference:
        checked = podsjax_generate(return_logprobs=True)  # untimed: the sampled tokens' log-probs against torch's
        # Rollout row b * S + j is sample j of prompt b.
        lp_diff = logprob_diff(hf_model, ids_pt.repeat_interleave(samples, 0), np.asarray(checked.tokens, np.int64),
                               np.asarray(checked.logprobs))
        del checked
        out = torch_generate()
        if tuple(out.shape) != (p * samples, length + t_new):
            raise SystemExit(f"error: transformers returned {tuple(out.shape)}, expected {(p * samples, length + t_new)}")
        del out

    contenders = [podsjax_generate, lambda: jax.block_until_ready(prefill_fn(params, ids, mask))]
    if args.reference:
        contenders += [torch_synced(torch, torch_generate), torch_synced(torch, torch_prefill)]
    timed = interleaved_medians(contenders, args.repeats)
    (t_jax, times_jax), (prefill_jax, _) = timed[:2]
    (t_pt, times_pt), (prefill_pt, _) = timed[2:] or [(None, None)] * 2
    def traced() -> str:  # one more podsjax call under the profiler, once the timed ones are printed
        from benchmarks import trace_summary

        with jax.profiler.trace(args.profile, create_perfetto_trace=True):
            podsjax_generate()
        events = trace_summary.load_events(trace_summary.find_trace(args.profile))
        device = "/host:CPU" if jax.default_backend() == "cpu" else f"/device:{jax.default_backend().upper()}"
        return trace_summary.format_summary(trace_summary.summarize(trace_summary.device_kernels(events, device)),
                                            steps=t_new)

    return dict(
        num_params=num_params,
        attn_impl=hf_model.config._attn_implementation,
        first_call_s=first_call_s,
        steps_per_check=decoding.steps_per_check(t_new),
        lp_diff=lp_diff,
        t_jax=t_jax,
        t_pt=t_pt,
        prefill_jax=prefill_jax,
        prefill_pt=prefill_pt,
        times_jax=times_jax,
        times_pt=times_pt,
        trace=traced if args.profile else None,
    )


def logprob_diff(hf_model, ids_pt, tokens_np, logprobs_np) -> float:
    """Max abs diff of podsjax's log-probs of its samples against the transformers model's, a few rows at a time.

    Only the positions that predict a sampled token go through the LM head, so the
    check holds [rows, T, V] logits, never [rows, L + T, V].
    """
    import numpy as np
    import torch

    rows, t_new = tokens_np.shape
    chunk = max(1, LOGIT_CHUNK_BYTES // (t_new * hf_model.config.vocab_size * 4))
    worst = 0.0
    with torch.no_grad():
        for r0 in range(0, rows, chunk):
            new = torch.from_numpy(tokens_np[r0:r0 + chunk]).to(ids_pt.device)
            full = torch.cat([ids_pt[r0:r0 + chunk], new], dim=1)
            hidden = hf_model.model(input_ids=full, attention_mask=torch.ones_like(full)).last_hidden_state
            logits = hf_model.lm_head(hidden[:, -t_new - 1:-1]).float()
            ref = torch.log_softmax(logits, -1).gather(-1, new[..., None])[..., 0].cpu().numpy()
            worst = max(worst, float(np.max(np.abs(logprobs_np[r0:r0 + chunk] - ref))))
    return worst


def decode_floor_s(args) -> float | None:
    """Seconds a decode step needs at least: bytes it must read / peak memory bandwidth."""
    from benchmarks.costs import decode_step_bytes

    bandwidth = device_peaks().bandwidth
    if bandwidth is None:
        return None
    itemsize = jax_dtype(args.dtype).itemsize
    return decode_step_bytes(args.spec, itemsize, args.rows, args.prompt_len, args.new_tokens,
                             samples=args.samples) / bandwidth


def format_generate_table(args, r) -> str:
    tokens = args.rows * args.samples * args.new_tokens
    tps_jax = tokens / r["t_jax"]
    shape = f"{args.rows} x {args.samples} x ({args.prompt_len} + {args.new_tokens})"
    if r["t_pt"] is None:
        return (f"podsjax generate, {args.shape} {r['num_params'] / 1e6:.1f}M, {args.dtype}, {shape}: "
                f"{tps_jax:,.0f} tok/s ({r['t_jax']:.2f} s); no reference")
    tps_pt = tokens / r["t_pt"]
    return "\n".join([
        "| model | P x S x (prompt + new) | (a) podsjax generate | (b) transformers generate | a/b speed-up "
        "| max abs logprob diff |",
        "|---|---|---|---|---|---|",
        f"| {args.shape} {r['num_params'] / 1e6:.1f}M, {args.dtype} | {shape} | {tps_jax:,.0f} tok/s "
        f"({r['t_jax']:.2f} s) | {tps_pt:,.0f} tok/s ({r['t_pt']:.2f} s) | {tps_jax / tps_pt:.2f}x | {r['lp_diff']:.1e} |",
    ])


def format_decode_table(args, r) -> str:
    floor = decode_floor_s(args)
    lines = [
        "| contender | prefill | decode step = (generate - prefill) / T | memory floor per step | % of floor |",
        "|---|---|---|---|---|",
    ]
    for name, total, pre in (("(a) podsjax", r["t_jax"], r["prefill_jax"]),
                             ("(b) transformers", r["t_pt"], r["prefill_pt"])):
        if total is None:
            continue
        step = (total - pre) / args.new_tokens
        if step <= 0:  # a tiny model's prefill is noise-sized
            lines.append(f"| {name} | {pre * 1e3:.1f} ms | n/a (prefill timed >= generate) | | |")
            continue
        share = "n/a" if floor is None else f"{100 * floor / step:.0f} %"
        floor_ms = "unknown" if floor is None else f"{floor * 1e3:.3f} ms"
        lines.append(f"| {name} | {pre * 1e3:.1f} ms | {step * 1e3:.3f} ms | {floor_ms} | {share} |")
    return "\n".join(lines)


# --------------------------------------------------------------------- rewards


def reward_inputs(task_name: str, data_dir: str, limit: int | None):
    """Gold solutions as think/answer completions, plus their reward columns."""
    from podsjax.data.datasets import load_task, reward_columns

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
            acc_in = float(checks["in_process"].per_function["accuracy"].mean())
            acc_pool = float(checks["pool"].per_function["accuracy"].mean())
            total_max = sum(w.weight for w in rewards)
            rows.append((name, len(completions), t_in, t_pool, acc_in, acc_pool, float(checks["pool"].total_B.mean()),
                         total_max, int(failures)))
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
    parser.add_argument("--rows", "--prompts", dest="rows", type=int, default=32,
                        help="P, prompts decoded together")
    parser.add_argument("--samples", type=int, default=1,
                        help="S, samples per prompt (P x S rows; setting a is --prompts 1 --samples 64, each prompt "
                             "held once in the cache for its samples)")
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
    parser.add_argument("--steps-per-check", type=int, default=None,
                        help="podsjax decode steps between two checks whether every row stopped (default: the "
                             "library's; 1 checks every token)")
    parser.add_argument("--no-reference", dest="reference", action="store_false",
                        help="time podsjax alone (no transformers generate, no log-prob check)")
    parser.add_argument("--profile", metavar="DIR",
                        help="trace one more podsjax generate into DIR (jax.profiler) and summarize its kernels")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit("error: --repeats must be >= 1")
    if args.rows < 1 or args.samples < 1:
        raise SystemExit("error: --prompts and --samples must be >= 1")
    if args.steps_per_check is not None and args.steps_per_check < 1:
        raise SystemExit("error: --steps-per-check must be >= 1")
    unknown = sorted(set(args.tasks) - set(TASK_DIRS))
    if unknown:
        raise SystemExit(f"error: unknown --tasks {unknown}; expected gsm8k and/or math")

    import torch
    import transformers

    torch.set_num_threads(args.threads)
    warning = busy_warning(print_machine(torch, transformers, args.retain_memory))
    resolve(args)
    start, since = time.perf_counter(), cpu_snapshot()
    if not args.skip_generate:
        r = run_generate(args)
        busy_during = others_busy(since)
        print(
            f"model: {describe(args, r['num_params'])}; temperature 1, EOS off (all lengths checked == "
            f"{args.new_tokens}); transformers attention: {r['attn_impl']}, default dynamic cache; KV cache in "
            f"{args.dtype}; podsjax decode steps between stop checks: "
            f"{r['steps_per_check']}; podsjax first call (compile + run) {r['first_call_s']:.1f} s; "
            f"median of {args.repeats} interleaved runs after 1 warm-up"
        )
        print(format_generate_table(args, r))
        print(format_decode_table(args, r))
        runs = {"podsjax": r["times_jax"], **({"transformers": r["times_pt"]} if r["times_pt"] else {})}
        print_runs(runs, busy_during, bool(warning),
                   during="during generation")
        if r["trace"]:  # after the tables: a time limit that stops the trace leaves them printed
            print(f"podsjax generate traced (prefill + {args.new_tokens} decode steps, figures per step), "
                  f"trace in {args.profile}:", flush=True)
            print(r["trace"]())
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
