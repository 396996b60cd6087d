"""The GRPO update (forward + backward + AdamW), LoRA and full, against the same step in PyTorch on the
same device; and where a PODS step's time goes on the tiny preset.

Update: a random Qwen2-shaped model (--shape: small ~98M by default, or
qwen2.5-0.5b / 1.5b / 3b, made from the config with no download) is built with
transformers and loaded into podsjax, so both sides train the same weights on the
same batch of B rows x (prompt L + completion T) tokens in --dtype (bfloat16 on
GPU/TPU, float32 on CPU by default). For each --update mode, LoRA first:
  (a) podsjax: ``podsjax.update.train_step.make_train_step`` on one device, jitted with the
      state donated, the model built with --remat (full: each layer recomputed in
      the backward pass; none; dots: matmul outputs kept). LoRA is r --lora-rank,
      alpha --lora-alpha on all 7 projections (``init_lora``), the base frozen.
  (b) PyTorch (CUDA when torch has it): the transformers model in eager mode with
      the same loss written in torch (token log-probs at temperature 0.9 of the
      completion positions only, clipped GRPO ratio, token-mean), backward,
      ``clip_grad_norm_`` and ``torch.optim.AdamW`` with the same hyperparameters.
      LoRA through peft with the same targets, rank and alpha and podsjax's A
      copied in. Gradient checkpointing (``gradient_checkpointing_enable``) is on
      whenever podsjax rematerialises (--remat other than none), so both trade
      the same compute for memory.
Throughput is tokens through the update (B x (L + T)) per second. MFU is the
update's model FLOPs (``benchmarks/costs.py``: 3 x forward for full; for LoRA
2 x the weight matmuls + 3 x attention + 6 x LoRA params x tokens; recompute not
counted) over time x the device's peak (``benchmarks/machine.py``: datasheet dense
bf16 on accelerators, a NumPy fp32 matmul measured on CPU). Peak memory is
JAX's ``peak_bytes_in_use`` since the process started (LoRA runs first, so the
full row's is the full update's) and ``torch.cuda.max_memory_allocated`` reset
per mode; CPU reports neither. podsjax's compile is timed on its own
(``.lower().compile()``). As an honesty check both first steps start from the
same weights (and the same LoRA A) and their gradient norms must agree. Then
each side runs once more to warm up and --repeats times in alternation; the
table shows the medians.

Phase shares (--phases): GRPO and PODS each run --phase-steps steps of the
built-in tiny preset through the real CLI (``python -m experiments.gsm8k --mesh 8``)
in a subprocess, and the table gives the share of step time in generation,
reward scoring, selection and the update, averaged over the steps after the
first (which compiles), like the paper's timing breakdown. (CPU only: it uses 8
fake devices; ``benchmarks/cli_step.py`` times the CLI on any device.)

Run (CPU): python -m benchmarks.train_step [--batch 8 --prompt-len 64 --completion-len 128] [--phases]
Run (GPU): python -m benchmarks.train_step --shape qwen2.5-1.5b --dtype bfloat16 --batch 16 --prompt-len 512 \
    --completion-len 512 --remat full
Smoke: python -m benchmarks.train_step --layers 2 --vocab 4096 --batch 2 --prompt-len 8 --completion-len 8
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from benchmarks import costs
from benchmarks.machine import (
    busy_note, busy_warning, cpu_snapshot, device_peaks, fmt_bytes, interleaved_medians, jax_peak_bytes,
    others_busy, print_machine, print_runs, reset_torch_peak, torch_device, torch_peak_bytes, torch_sync,
)
from benchmarks.qwen_model import add_model_args, build_hf_model, describe, resolve, to_podsjax
from podsjax.update import algorithms, train_step
from experiments import paper_settings
from podsjax.models import LoraConfig, init_lora

# transformers 5 renamed gradient checkpointing; peft still calls the old names.
warnings.filterwarnings("ignore", message=".*deprecated and will be removed in v6", category=FutureWarning)
PHASES = ("generation", "scoring", "selection", "update")
MODES = ("lora", "full")
HF_PROJECTIONS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                  "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def make_batch(args) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(args.seed)
    b, t = args.batch, args.completion_len
    ids = rng.integers(0, args.spec.vocab, (b, args.prompt_len + t))
    # Completions of random lengths, so the mask matters; the compute is the same for any mask.
    lengths = rng.integers(t // 2, t + 1, b)
    completion_mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    attention_mask = np.concatenate([np.ones((b, args.prompt_len)), completion_mask], axis=1).astype(np.int64)
    advantages = rng.standard_normal(b).astype(np.float32)
    return dict(ids=ids, attention_mask=attention_mask, completion_mask=completion_mask, advantages=advantages)


def podsjax_step(model, params, lora, batch, config):
    """(run_once, compile seconds): a donated update of ``lora`` on frozen ``params`` (of ``params`` when no LoRA)."""
    optimizer = algorithms.make_optimizer(config)
    if lora is not None:
        policy, _ = train_step.lora_apply_fn(model)
        trainable, frozen = lora, params
    else:
        policy, _ = train_step.full_apply_fn(model)
        trainable, frozen = params, None
    state = train_step.init_state(trainable, optimizer)
    train_batch = train_step.TrainBatch(
        input_ids=jnp.asarray(batch["ids"], jnp.int32),
        attention_mask=jnp.asarray(batch["attention_mask"], jnp.int32),
        completion_mask=jnp.asarray(batch["completion_mask"]),
        advantages=jnp.asarray(batch["advantages"]),
    )
    t0 = time.perf_counter()
    step = jax.jit(train_step.make_train_step(policy, optimizer, config), donate_argnums=0).lower(
        state, train_batch, frozen).compile()
    compile_s = time.perf_counter() - t0
    holder = {"state": state}

    def run_once() -> float:
        holder["state"], metrics = step(holder["state"], train_batch, frozen)
        return float(metrics.grad_norm)  # blocks until the step is done

    return run_once, compile_s


def lora_layers(weights):
    """(layer, projection, A, B) as NumPy from the layer-stacked LoRA tree (``layers/attn|mlp/proj/a|b``)."""
    for part in jax.device_get(weights)["layers"].values():
        for proj, ab in part.items():
            for i in range(ab["a"].shape[0]):
                yield i, proj, np.asarray(ab["a"][i]), np.asarray(ab["b"][i])


def add_peft_lora(hf_model, lora, rank: int, alpha: float):
    """peft LoRA on the same 7 projections, holding podsjax's A and B (A [in..., r] -> lora_A [r, in])."""
    import peft

    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none",
                             target_modules=[name.split(".")[-1] for name in HF_PROJECTIONS.values()])
    peft_model = peft.get_peft_model(hf_model, config)  # adapts hf_model's modules in place
    with torch.no_grad():
        for i, proj, a, b in lora_layers(lora.weights):
            module = hf_model.model.layers[i].get_submodule(HF_PROJECTIONS[proj])
            for torch_weight, value in ((module.lora_A["default"].weight, a.reshape(-1, rank).T),
                                        (module.lora_B["default"].weight, b.reshape(rank, -1).T)):
                torch_weight.copy_(torch.from_numpy(np.ascontiguousarray(value, np.float32)))
    return peft_model


def torch_step(args, hf_model, batch, config):
    trainable = [p for p in hf_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate, betas=(config.adam_b1, config.adam_b2),
                                  weight_decay=config.weight_decay)
    device = torch_device(torch)
    ids = torch.from_numpy(batch["ids"]).to(device)
    attention_mask = torch.from_numpy(batch["attention_mask"]).to(device)
    completion_mask = torch.from_numpy(batch["completion_mask"]).to(device)
    advantages = torch.from_numpy(batch["advantages"]).to(device)
    t = args.completion_len

    def run_once() -> float:
        optimizer.zero_grad(set_to_none=True)
        # The LM head on completion positions only, as podsjax's logits_slice does.
        hidden = hf_model.model(input_ids=ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        logits = hf_model.lm_head(hidden[:, -t - 1 : -1])
        logprobs = torch.log_softmax(logits.float() / config.temperature, dim=-1)
        logprobs = torch.gather(logprobs, -1, ids[:, -t:, None]).squeeze(-1)
        ratio = torch.exp(logprobs - logprobs.detach())  # one iteration per batch: ratio 1, as in podsjax
        high = config.epsilon_high if config.epsilon_high is not None else config.epsilon
        clipped = torch.clamp(ratio, 1 - config.epsilon, 1 + high)
        per_token = -torch.minimum(ratio * advantages[:, None], clipped * advantages[:, None])
        loss = (per_token * completion_mask).sum() / completion_mask.sum().clamp(min=1)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable, config.max_grad_norm)
        optimizer.step()
        return float(grad_norm)  # a host read: waits for the GPU

    return run_once


def run_mode(args, mode, model, params, hf_model, batch, config) -> dict:
    """One update mode, both sides; returns its row. LoRA adapts ``hf_model`` in place (run_update unloads it)."""
    lora = peft_model = None
    if mode == "lora":
        lora = init_lora(jax.random.key(args.seed + 1), model, LoraConfig(rank=args.lora_rank, alpha=args.lora_alpha))
        peft_model = add_peft_lora(hf_model, lora, args.lora_rank, args.lora_alpha)
    else:
        for p in hf_model.parameters():
            p.requires_grad_(True)
    trainable_pt = sum(p.numel() for p in hf_model.parameters() if p.requires_grad)
    reset_torch_peak(torch)
    jax_once, compile_s = podsjax_step(model, params, lora, batch, config)
    torch_once = torch_step(args, hf_model, batch, config)
    t0 = time.perf_counter()
    norm_jax = jax_once()
    first_call_s = time.perf_counter() - t0
    norm_pt = torch_once()
    (t_jax, times_jax), (t_pt, times_pt) = interleaved_medians([jax_once, torch_once], args.repeats)
    torch_sync(torch)
    flops = costs.update_flops(args.spec, args.batch, args.prompt_len, args.completion_len,
                               args.lora_rank if mode == "lora" else None)
    return dict(mode=mode, trainable=trainable_pt, norm_jax=norm_jax, norm_pt=norm_pt, compile_s=compile_s,
                first_call_s=first_call_s, t_jax=t_jax, t_pt=t_pt, times_jax=times_jax, times_pt=times_pt,
                flops=flops, peak_jax=jax_peak_bytes(), peak_pt=torch_peak_bytes(torch), peft_model=peft_model)


def enable_checkpointing(hf_model) -> None:
    """Per-layer gradient checkpointing, non-reentrant (it lets grads reach LoRA behind a frozen embedding)."""
    kwargs = {"use_reentrant": False}
    if hasattr(hf_model, "activation_checkpointing_enable"):  # transformers 5's name
        hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def run_update(args):
    hf_model = build_hf_model(args, args.prompt_len + args.completion_len)
    num_params = sum(p.numel() for p in hf_model.parameters())
    model, params = to_podsjax(hf_model, args.dtype, remat=args.remat)
    # Its rows hold distinct prompts, as the PyTorch side trains them: no prompt is shared.
    config = paper_settings.method_config("grpo", n=args.batch, m=args.batch, learning_rate=1e-6, temperature=0.9,
                                      shared_prefix=False)
    batch = make_batch(args)
    hf_model.train()  # dropout is 0 in Qwen2; train() turns on gradient checkpointing and the autograd path
    if args.remat != "none":
        enable_checkpointing(hf_model)
    rows = []
    for mode in (m for m in MODES if m in args.update):  # LoRA first: the full update donates the params
        row = run_mode(args, mode, model, params, hf_model, batch, config)
        if mode == "lora":
            hf_model = row["peft_model"].unload()  # the plain model again, adapters dropped
        del row["peft_model"]
        rows.append(row)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return num_params, rows


def format_update_table(args, rows) -> str:
    tokens = args.batch * (args.prompt_len + args.completion_len)
    peak = device_peaks().flops
    lines = [
        "| update | B x (L + T) | trainable | (a) podsjax jit step | (b) PyTorch eager step | a/b speed-up "
        "| MFU a / b | peak memory a / b | podsjax compile | grad-norm rel. diff |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tps_jax, tps_pt = tokens / r["t_jax"], tokens / r["t_pt"]
        rel = abs(r["norm_jax"] - r["norm_pt"]) / max(abs(r["norm_pt"]), 1e-30)
        mfu = "n/a" if peak is None else f"{100 * r['flops'] / (r['t_jax'] * peak):.1f} % / " \
                                         f"{100 * r['flops'] / (r['t_pt'] * peak):.1f} %"
        label = f"LoRA r{args.lora_rank}" if r["mode"] == "lora" else "full"
        lines.append(
            f"| {label}, AdamW | {args.batch} x ({args.prompt_len} + {args.completion_len}) | "
            f"{r['trainable'] / 1e6:.2f}M | {tps_jax:,.0f} tok/s ({r['t_jax']:.3f} s) | {tps_pt:,.0f} tok/s "
            f"({r['t_pt']:.3f} s) | {tps_jax / tps_pt:.2f}x | {mfu} | {fmt_bytes(r['peak_jax'])} / "
            f"{fmt_bytes(r['peak_pt'])} | {r['compile_s']:.1f} s | {rel:.1e} |")
    return "\n".join(lines)


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
    parser.add_argument("--update", type=lambda v: [m for m in v.split(",") if m], default=list(MODES),
                        help="update modes, comma-separated: lora, full (default both)")
    parser.add_argument("--remat", choices=("full", "none", "dots"), default="full",
                        help="podsjax per-layer rematerialisation; torch gets gradient checkpointing unless none")
    parser.add_argument("--lora-rank", type=int, default=64)
    parser.add_argument("--lora-alpha", type=float, default=64.0)
    parser.add_argument("--skip-update", action="store_true", help="only the phase table")
    parser.add_argument("--phases", action="store_true", help="also time GRPO and PODS phases on the tiny preset")
    parser.add_argument("--phase-steps", type=int, default=6, help="steps per method (the first is not counted)")
    parser.add_argument("--warmup-dir", help="reuse a cached tiny warm-up (default: build one in a temp dir)")
    parser.add_argument("--phase-flags", nargs=argparse.REMAINDER, default=[],
                        help="extra flags for the tiny runs (must come last)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.phase_steps < 2:
        raise SystemExit("error: --repeats must be >= 1 and --phase-steps >= 2")
    if not args.update or set(args.update) - set(MODES):
        raise SystemExit(f"error: --update takes {', '.join(MODES)} (comma-separated)")
    if "lora" in args.update and importlib.util.find_spec("peft") is None:
        raise SystemExit("error: the LoRA comparison needs peft: pip install -e '.[test]' (or run --update full)")

    torch.set_num_threads(args.threads)
    warning = busy_warning(print_machine(torch, transformers, args.retain_memory))
    resolve(args)
    start = time.perf_counter()
    if not args.skip_update:
        since = cpu_snapshot()
        num_params, rows = run_update(args)
        busy_during = others_busy(since)
        first = "; ".join(f"{r['mode']} {r['first_call_s']:.1f} s" for r in rows)
        print(f"model: {describe(args, num_params)}; podsjax remat {args.remat}, torch gradient checkpointing "
              f"{'off' if args.remat == 'none' else 'on'}; GRPO token-mean loss, temperature 0.9, AdamW + clip; "
              f"podsjax first step after compile {first}; median of {args.repeats} interleaved runs after 1 warm-up")
        print(format_update_table(args, rows))
        for r in rows:
            print_runs({f"podsjax {r['mode']}": r["times_jax"], f"PyTorch {r['mode']}": r["times_pt"]}, busy_during,
                       bool(warning))
    if args.phases:
        since = cpu_snapshot()
        results = run_phases(args)
        print(f"phases: tiny preset, --mesh 8, {args.phase_steps - 1} timed steps per method (after 1 compiling "
              f"step); during the runs {busy_note(others_busy(since))}")
        print(format_phase_table(results))
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
