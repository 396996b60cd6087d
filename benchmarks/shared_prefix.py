"""The update per row against the update with each prompt computed once (``algorithm.shared_prefix``),
side by side in one process, on one device.

Both forms take the same batch (``train.build_batch``: P prompts, m rows each, left-padded
prompts of Lp tokens with 60-100 % of them real, completions of T tokens with 25-100 %
real) and the same jitted step (``train.make_train_step``, state donated). Each form is
compiled, run once more to warm up, then both run --repeats times in alternation; the
table shows the medians. Update tokens/s counts the rows' tokens, P x m x (Lp + T), for
both forms, so its ratio is the speed-up; "positions" is what each form runs through the
layers (P x m x (Lp + T) per row, P x Lp + P x m x T shared). As a check, the two first
steps' losses and gradient norms must agree.

Presets (--preset): ``tiny`` is the tiny preset's update (its model, full fine-tuning in
fp32, 32 prompts x m 4, Lp 128, T 48); ``qwen0.5b`` is a Qwen2.5-0.5B shape
(``benchmarks.qwen_model``) with --layers of its 24 layers (default 4, CPU-sized), LoRA r 64,
1 prompt x m 8, Lp 256, T 64. Any size flag overrides the preset's.

--mesh spreads the batch and the params over a mesh (``podsjax.mesh``; on a CPU, fake
devices: set XLA_FLAGS=--xla_force_host_platform_device_count=8), as the tiny preset's CLI
run does with --mesh 8.

Run: python -m benchmarks.shared_prefix --preset tiny
     XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.shared_prefix --preset tiny --mesh 8
     python -m benchmarks.shared_prefix --preset qwen0.5b --repeats 3
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import podsjax.models as pm
from benchmarks.qwen_model import SHAPES
from podsjax import algorithms, train
from podsjax import mesh as mesh_lib
from podsjax.tiny.build import TINY_MODEL

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
    policy, _ = train.lora_apply_fn(model) if lora is not None else train.full_apply_fn(model)
    trainable, frozen = (lora, params) if lora is not None else (params, None)
    # The state is donated: each form updates its own copy.
    state = train.init_state(jax.tree.map(jnp.copy, trainable), optimizer)
    start = time.perf_counter()
    step = jax.jit(train.make_train_step(policy, optimizer, config), donate_argnums=0).lower(
        state, batch, frozen).compile()
    compile_s = time.perf_counter() - start
    holder = {"state": state}

    def run_once():
        holder["state"], metrics = step(holder["state"], batch, frozen)
        return float(metrics.loss), float(metrics.grad_norm)  # blocks until the step is done

    return run_once, compile_s


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    for name in ("prompts", "m", "prompt_len", "completion_len", "layers", "lora_rank"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, help="override the preset's")
    parser.add_argument("--remat", choices=pm.REMAT_POLICIES, default="full")
    parser.add_argument("--mesh", help="a mesh spec, as the CLI's --mesh (default: one device)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
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
    batch, _ = train.build_batch(*rollouts(args, config.vocab_size), algorithms.AlgorithmConfig(**common))
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
