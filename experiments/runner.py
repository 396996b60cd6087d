"""Turns a resolved experiment config into a podsjax run: model, data, trainer, export, summary."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

import jax
import jax.numpy as jnp

from experiments.cli import TINY_HINT, UsageError, mesh_device_count
from podsjax import data, loop, prompts, train
from podsjax import mesh as mesh_lib
from podsjax import models as pm


def _mesh(spec):
    if spec is None:
        return None
    wanted = mesh_device_count(spec)
    if jax.default_backend() != "cpu" and jax.device_count() < wanted:
        raise UsageError(f"--mesh {spec} needs {wanted} devices but this {jax.default_backend()} host has "
                         f"{jax.device_count()}")
    try:
        return mesh_lib.make_mesh(spec)
    except ValueError as exc:
        raise UsageError(f"--mesh {spec}: {exc}") from None


def _load_tasks(config):
    task = config["task"]
    try:
        train_set = data.load_task(task, "train", path=config["data"]).examples
        test_set = data.load_task(task, "test", path=config["eval_data"]).examples
    except data.DataError as exc:
        raise UsageError(str(exc)) from None
    return train_set, test_set


def _tiny(config, out_dir):
    from podsjax import tiny

    print(TINY_HINT, flush=True)
    directory = config.get("warmup_dir") or os.path.join(out_dir, tiny.WARMUP_DIRNAME)
    seed = config["run"]["seed"]
    try:
        steps = {"steps": config["warmup_steps"]} if config.get("warmup_steps") else {}
        stats = tiny.warm_up(directory, seed=seed, data_seed=seed, log=lambda line: print(line, flush=True), **steps)
    except tiny.WarmupError as exc:
        raise UsageError(str(exc)) from None
    how = "reused" if stats.cached else f"trained in {stats.total_seconds:.0f} s"
    print(f"tiny preset: warm-up test accuracy {stats.test_accuracy:.0%} ({how}; cached in {directory})",
          flush=True)
    train_set, test_set = tiny.tiny_tasks(seed)
    return stats.path, train_set, test_set


def run(config: dict, out_dir: str, *, overwrite: bool, resume: bool) -> int:
    mesh = _mesh(config["model"]["mesh"])
    if overwrite and os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    if not resume:
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
    try:
        return _train_and_export(config, out_dir, mesh)
    except (prompts.PromptError, pm.CheckpointError) as exc:  # a bad checkpoint or template: one line
        raise UsageError(str(exc)) from None


def _train_and_export(config: dict, out_dir: str, mesh) -> int:
    if config["model_path"] is None:
        checkpoint, train_set, test_set = _tiny(config, out_dir)
    else:
        checkpoint = config["model_path"]
        train_set, test_set = _load_tasks(config)
    dtype = jnp.bfloat16 if config["model"]["dtype"] == "bfloat16" else jnp.float32
    model, params = pm.from_pretrained(checkpoint, dtype=dtype, mesh=mesh)
    tokenizer = prompts.load_tokenizer(checkpoint)
    try:
        algo = train.AlgorithmConfig(**config["algorithm"])
        run_config = loop.RunConfig(out_dir=out_dir, task=config["task"], **config["run"])
        lora_rank = config["model"]["lora_rank"]
        lora = pm.LoraConfig(rank=lora_rank, alpha=config["model"]["lora_alpha"]) if lora_rank else None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    start = time.time()
    trainer = loop.Trainer(model, params, tokenizer, train_set, test_set, algo, run_config, lora=lora)
    state_lora = None
    history = trainer.run()
    if lora is not None:
        state_lora = trainer.state.params
        final_params = params
    else:
        final_params = trainer.state.params
    export_dir = os.path.join(out_dir, "final_model")
    pm.save_pretrained(model, final_params, export_dir, lora=state_lora, overwrite=True, tokenizer_from=checkpoint)
    print_summary(config, history, int(trainer.state.step), trainer.host["elapsed_train_s"], time.time() - start,
                  export_dir)
    return 0


def print_summary(config, history, steps, train_seconds, wall_seconds, export_dir, file=None):
    accuracies = [h["eval/accuracy"] for h in history]
    peak = max(accuracies) if accuracies else float("nan")
    peak_at = history[accuracies.index(peak)]["time/elapsed_train_s"] if accuracies else float("nan")
    rows = [
        ("method", config["algorithm"]["algorithm"]),
        ("n / m", f"{config['algorithm']['n']} / {config['algorithm']['m']}"),
        ("steps", str(steps)),
        ("training clock", f"{train_seconds:.0f} s (wall {wall_seconds:.0f} s)"),
        ("accuracy first / last", f"{accuracies[0]:.1%} / {accuracies[-1]:.1%}" if accuracies else "-"),
        ("peak accuracy", f"{peak:.1%} at {peak_at:.0f} s" if accuracies else "-"),
        ("exported model", export_dir),
    ]
    width = max(len(k) for k, _ in rows)
    # sys.stdout is looked up per call: a default bound at import would outlive a redirect.
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows), file=file or sys.stdout, flush=True)
