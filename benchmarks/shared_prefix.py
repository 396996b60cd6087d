"""The update per row against the update with each prompt computed once (``algorithm.shared_prefix``),
side by side in one process, on one device.

Both forms take the same batch (``train_step.build_batch``: P prompts, m rows each, left-padded
prompts of Lp tokens with 60-100 % of them real, completions of T tokens with 25-100 %
real) and the same jitted step (``train_step.make_train_step``, state donated). Each form is
compiled, run once more to warm up, then both run --repeats times in alternation; the
table shows the medians. Update tokens/s counts the rows' tokens, P x m x (Lp + T), for
both forms, so its ratio is the speed-up; "positions" is what each form runs through the
layers (P x m x (Lp + T) per row, P x Lp + P x m x T shared). As a check, the two first
steps' losses and gradient norms must agree.

Presets (--preset): ``tiny`` is the tiny preset's update (its model, full fine-tuning in
fp32, 32 prompts x m 4, Lp 128, T 48); ``qwen0.5b`` is a Qwen2.5-0.5B shape
(``benchmarks.qwen_model``) with --layers of its 24 layers (default 4, CPU-sized), LoRA r 64,
1 prompt x m 8, Lp 256, T 64. Any size flag overrides the preset's.

--mesh spreads the batch and the params over a mesh (``podsjax.devices.mesh``; on a CPU, fake
devices: set XLA_FLAGS=--xla_force_host_platform_device_count=8), as the tiny preset's CLI
run does with --mesh 8.

The whole step (--whole-step): the tiny preset's quick start (``python -m experiments.gsm8k
--mesh 8``, its warm-up from the shared cache or --warmup-dir) runs --cli-steps steps with
``--algorithm.shared_prefix false`` and ``true``, in alternation for --rounds rounds, each a
fresh process; the table gives the median over the steps after each run's first (which
compiles) of the CLI's own ``time/*`` phases, and the ratios per row / shared. Both forms
update to the same numbers up to fp32 rounding, so their runs generate and train alike
(CPU: the runs use 8 fake devices, as ``benchmarks.train_step --phases`` does).

Run: python -m benchmarks.shared_prefix --preset tiny
     python -m benchmarks.shared_prefix --whole-step --cli-steps 6 --rounds 2
     XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.shared_prefix --preset tiny --mesh 8
     python -m benchmarks.shared_prefix --preset qwen0.5b --repeats 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import podsjax.models as pm
from benchmarks.machine import busy_note, cpu_snapshot, others_busy
from benchmarks.qwen_model import SHAPES
from podsjax.devices import mesh as mesh_lib
from podsjax.tiny.build import TINY_MODEL
from podsjax.update import algorithms, train_step

PRESETS = {
    "tiny": dict(prompts=32, m=4, prompt_len=128, completion_len=48, layers=None, lora_rank=0),
    "qwen0.5b": dict(prompts=1, m=8, prompt_len=256, completion_len=64, layers=4, lora_rank=64),
}


def model_config(preset: str, layers: int | None) -> pm.ModelConfig:
    if preset == "tiny":
        return TINY_MODEL if layers is None else dataclasses.replace(TINY_MODEL, num_layers=layers)
    shape = SHAPES["qwen2.5-0.5b"]
    return pm.ModelConfig(arch="qwen2", vocab_size=shape.vocab, hidden_size=shape.hidden,
                          intermediate_size=shape.intermediate, num_layers=layers or shape.layers,
                          num_heads=shape.heads, num_kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                          rope_theta=shape.rope_theta, qkv_bias=True, tie_word_embeddings=shape.tied)


def rollouts(args, vocab: int):
    """Left-padded prompts and completions of random real lengths, with rewards that vary in each group."""
    rng = np.random.default_rng(args.seed)
    p, m, lp, t = args.prompts, args.m, args.prompt_len, args.completion_len
    prompt_ids = rng.integers(3, vocab, (p, lp)).astype(np.int32)
    real = rng.integers(int(0.6 * lp), lp + 1, p)
    prompt_mask = (np.arange(lp)[None] >= lp - real[:, None]).astype(np.int32)
    tokens = rng.integers(3, vocab, (p, m, t)).astype(np.int32)
    mask = np.arange(t) < rng.integers(max(1, t // 4), t + 1, (p, m))[..., None]
    rewards = rng.integers(0, 2, (p, m)).astype(np.float32) + rng.normal(0, 0.1, (p, m)).astype(np.float32)
    return prompt_ids, prompt_mask, tokens, mask, rewards


def compiled_step(model, params, lora, config, batch):
    """(run_once, compile seconds) of a donated update of ``config``."""
    optimizer = algorithms.make_optimizer(config)
    policy, _ = train_step.lora_apply_fn(model) if lora is not None else train_step.full_apply_fn(model)
    trainable, frozen = (lora, params) if lora is not None else (params, None)
    # The state is donated: each form updates its own copy.
    state = train_step.init_state(jax.tree.map(jnp.copy, trainable), optimizer)
    start = time.perf_counter()
    step = jax.jit(train_step.make_train_step(policy, optimizer, config), donate_argnums=0).lower(
        state, batch, frozen).compile()
    compile_s = time.perf_counter() - start
    holder = {"state": state}

    def run_once():
        holder["state"], metrics = step(holder["state"], batch, frozen)
        return float(metrics.loss), float(metrics.grad_norm)  # blocks until the step is done

    return run_once, compile_s


PHASES = ("generation", "scoring", "selection", "update")
CLI_FORMS = {"per row": "false", "shared prefix": "true"}


def cli_run(form: str, steps: int, out: str, warmup_dir: str | None, flags: list[str]) -> list[dict[str, float]]:
    """The ``time/*`` phases of each step after the first of one quick-start run with ``form``."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the CLI sets its own device count
    command = [sys.executable, "-m", "experiments.gsm8k", "--mesh", "8", "--max-steps", str(steps),
               "--eval-every", "1e9", "--eval-limit", "8", "--no-progress", "--out", out,
               "--algorithm.shared_prefix", CLI_FORMS[form], *(["--warmup-dir", warmup_dir] if warmup_dir else []),
               *flags]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: the {form} run failed:\n{done.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
        steps_run = [r for r in map(json.loads, f) if "time/update" in r]
    return [{p: r[f"time/{p}"] for p in PHASES} for r in steps_run[1:]]  # the first step compiles


def whole_step(args) -> None:
    """Prints the quick start's phases per row and shared-prefix, from alternating CLI runs."""
    since = cpu_snapshot()
    steps = {form: [] for form in CLI_FORMS}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            for form in CLI_FORMS:
                out = os.path.join(tmp, f"{form.replace(' ', '-')}-{round_index}")
                steps[form] += cli_run(form, args.cli_steps, out, args.warmup_dir, args.cli_flags)
    busy = others_busy(since)
    medians = {form: {p: statistics.median(s[p] for s in rows) for p in PHASES} | {
        "step": statistics.median(sum(s.values()) for s in rows)} for form, rows in steps.items()}
    print(f"whole step: the tiny preset's quick start (--mesh 8), {args.rounds} rounds of "
          f"{args.cli_steps} steps a form in alternation, each run's first step (compiles) left out; median seconds "
          f"of {len(steps['per row'])} steps a form; during the runs {busy_note(busy)}")
    columns = (*PHASES, "step")
    print("| form | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for form, median in medians.items():
        print(f"| {form} | " + " | ".join(f"{median[c]:.3f}" for c in columns) + " |")
    ratios = {c: medians["per row"][c] / max(medians["shared prefix"][c], 1e-9) for c in columns}
    print("| per row / shared | " + " | ".join(f"{ratios[c]:.2f}x" for c in columns) + " |")
    print(f"shared prefix / per row: update phase {ratios['update']:.2f}x faster, whole step {ratios['step']:.2f}x")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    for name in ("prompts", "m", "prompt_len", "completion_len", "layers", "lora_rank"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, help="override the preset's")
    parser.add_argument("--remat", choices=pm.REMAT_POLICIES, default="full")
    parser.add_argument("--mesh", help="a mesh spec, as the CLI's --mesh (default: one device)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--whole-step", action="store_true",
                        help="time the quick start's whole step (the CLI's time/* phases) instead of the update alone")
    parser.add_argument("--cli-steps", type=int, default=6, help="--whole-step: steps a run (the first not counted)")
    parser.add_argument("--rounds", type=int, default=2, help="--whole-step: runs of each form, in alternation")
    parser.add_argument("--warmup-dir", help="--whole-step: the tiny warm-up to use (default: the shared cache)")
    parser.add_argument("--cli-flags", nargs=argparse.REMAINDER, default=[],
                        help="--whole-step: extra flags for the CLI runs (must come last)")
    args = parser.parse_args(argv)
    if args.whole_step:
        if args.cli_steps < 2 or args.rounds < 1:
            raise SystemExit("error: --cli-steps must be >= 2 (the first step compiles) and --rounds >= 1")
        return whole_step(args)
    for name, value in PRESETS[args.preset].items():
        if getattr(args, name) is None:
            setattr(args, name, value)

    config = model_config(args.preset, args.layers)
    mesh = mesh_lib.make_mesh(args.mesh) if args.mesh else None
    model = pm.Decoder(config, remat=args.remat, mesh=mesh)
    params = pm.init_params(model, jax.random.key(args.seed))
    lora = None
    if args.lora_rank:
        lora = pm.init_lora(jax.random.key(1), model, pm.LoraConfig(rank=args.lora_rank, alpha=float(args.lora_rank)))
    common = dict(algorithm="grpo", n=args.m, m=args.m, learning_rate=1e-5, temperature=1.0)
    batch, _ = train_step.build_batch(*rollouts(args, config.vocab_size), algorithms.AlgorithmConfig(**common))
    if mesh is not None:
        params = jax.device_put(params, pm.param_shardings(model, mesh))
        if lora is not None:
            lora = jax.device_put(lora, mesh_lib.batch_sharding(mesh, 0))
        batch = jax.tree.map(lambda x: jax.device_put(
            x, mesh_lib.rows_sharding(mesh, x.shape[0], x.ndim) if x.ndim else mesh_lib.batch_sharding(mesh, 0)), batch)
    p, m, lp, t = args.prompts, args.m, args.prompt_len, args.completion_len
    tokens = p * m * (lp + t)
    forms = {"per row": False, "shared prefix": True}
    positions = {"per row": tokens, "shared prefix": p * lp + p * m * t}

    runs, first, compiles = {}, {}, {}
    for name, shared in forms.items():
        algo = algorithms.AlgorithmConfig(**common, shared_prefix=shared)
        runs[name], compiles[name] = compiled_step(model, params, lora, algo, batch)
        first[name] = runs[name]()
        runs[name]()  # warm-up
    (loss_a, norm_a), (loss_b, norm_b) = first.values()
    if not (np.isclose(loss_a, loss_b, rtol=1e-4, atol=1e-6) and np.isclose(norm_a, norm_b, rtol=1e-3)):
        raise SystemExit(f"the forms disagree: loss {loss_a} vs {loss_b}, grad norm {norm_a} vs {norm_b}")
    times = {name: [] for name in forms}
    for _ in range(args.repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)

    mode = f"LoRA r{args.lora_rank}" if lora is not None else "full fine-tuning"
    print(f"{args.preset}: {config.num_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size}, {mode}, "
          f"remat {args.remat}, {jax.devices()[0].platform}, mesh {args.mesh or 'none'}; {p} prompts x m {m}, Lp {lp}, T {t}; "
          f"median of {args.repeats}")
    print("| form | positions through the layers | compile s | step s | update tokens/s |")
    print("|---|---:|---:|---:|---:|")
    medians = {name: statistics.median(times[name]) for name in forms}
    for name in forms:
        print(f"| {name} | {positions[name]} | {compiles[name]:.1f} | {medians[name]:.3f} | "
              f"{tokens / medians[name]:.0f} |")
    ratio = medians["per row"] / medians["shared prefix"]
    print(f"shared prefix / per row: {ratio:.2f}x update tokens/s, step time x{1 / ratio:.2f}, "
          f"{positions['per row'] / positions['shared prefix']:.2f}x fewer positions")


if __name__ == "__main__":
    main()
