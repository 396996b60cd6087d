"""A decode step on a GPU against its memory floor, from XLA's GPU compiler on any host.

For each GPU, checkpoint shape and row count it compiles the sampler's decode program
deviceless (``podsjax.devices.gpu_topology``) in both layer layouts and counts one step from the
optimized HLO (``podsjax.devices.hlo_cost``): bytes moved against the floor (the weights the step
reads and its KV cache, once) and against the floor of a cache that repeats each prompt's
KV in every row, kernels launched, and the step's roofline time. "unrolled" is what
podsjax runs on a GPU (each prompt's KV held once for its samples); "scanned" is the
training layout (the prompt's KV in every row). "cublas" GEMMs are the main job's
(``podsjax.devices.accelerators.GPU_XLA_FLAGS``); "triton" are XLA's Triton GEMM fusions at
their untuned configs, where a GPU's autotuner starts (it has no GPU here to tune on).

    python -m benchmarks.gpu_plan                 # H100, Qwen2.5-1.5B and 3B, 64 and 256 rows
    python -m benchmarks.gpu_plan --gpus h100 a100 l40s --shapes Qwen2.5-3B --rows 64
    python -m benchmarks.gpu_plan --shapes Qwen2.5-1.5B --rows 64 --gemms cublas triton

Needs jax's CUDA plugin (``pip install 'podsjax[cuda]'``), not a GPU.
"""

from __future__ import annotations

import argparse
import itertools
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile for GPUs from this host; probe for none here
from podsjax.devices.accelerators import with_gpu_flags  # noqa: E402 - imports no JAX

os.environ["XLA_FLAGS"] = with_gpu_flags(os.environ.get("XLA_FLAGS", ""), deviceless=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from podsjax.devices import dry_run, topology  # noqa: E402
from podsjax.devices import mesh as mesh_lib  # noqa: E402
from podsjax.devices.gpu_topology import GPUS  # noqa: E402
from podsjax.sampler import sampling  # noqa: E402
import podsjax.models as pm  # noqa: E402

PROMPT, COMPLETION, LORA_RANK = 512, 512, 64  # setting a's shapes
GEMMS = {"cublas": {"xla_gpu_enable_triton_gemm": False},
         "triton": {"xla_gpu_enable_triton_gemm": True, "xla_gpu_autotune_level": 0}}


def decode_step(gpu: str, shape: str, rows: int, layers: str, gemms: str = "cublas") -> dict:
    """One decode step of ``rows`` rows (64 samples per prompt) as the compiler plans it."""
    mesh = mesh_lib.make_mesh("1", devices=topology.compile_only_devices(gpu))
    model = pm.Decoder(pm.checkpoint_shape(shape), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, mesh=mesh,
                       rollout_layers=layers)
    lora = jax.eval_shape(lambda k: pm.init_lora(k, model, pm.LoraConfig(rank=LORA_RANK, alpha=64.0)),
                          jax.random.key(0))
    lora = lora.replace(weights=jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), lora.weights,
        mesh_lib.tree_shardings(mesh, pm.lora_logical_axes(lora), lora.weights)))
    gen = sampling.Generator(model, compiler_options=GEMMS[gemms]).compile(dry_run.abstract_base(model), lora, prompts=rows // 64,
                                            prompt_len=PROMPT, num_samples=64, max_new_tokens=COMPLETION,
                                            eos_token_ids=(151645,))
    chip = topology.chip(GPUS[gpu]["kind"])
    step = dry_run.decode_step_cost(gen["sample"], chip)
    floor = gen["weights_read_bytes"] + gen["kv_cache_bytes"]
    cfg = model.config
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # K and V in bf16
    row_floor = gen["weights_read_bytes"] + per_token * rows * (PROMPT + COMPLETION)
    return {"bytes": step.bytes, "floor": floor, "row_floor": row_floor, "cache": gen["kv_cache_bytes"],
            "kernels": step.kernels, "roofline_s": step.roofline_s, "compile_s": gen["compile_s"]["sample"]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", nargs="+", default=["h100"], choices=sorted(GPUS))
    parser.add_argument("--shapes", nargs="+", default=["Qwen2.5-1.5B", "Qwen2.5-3B"])
    parser.add_argument("--rows", nargs="+", type=int, default=[64, 256])
    parser.add_argument("--gemms", nargs="+", default=["cublas"], choices=sorted(GEMMS))
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}; LoRA r{LORA_RANK}, bf16, {PROMPT} + {COMPLETION} tokens, 64 samples per prompt")
    print("floor: the weights and the KV cache read once; row-cache floor: the same with the prompt's KV in every row")
    print("| GPU | shape | rows | layers | GEMMs | KV cache | bytes / step | / floor | / row-cache floor | kernels "
          "| step (roofline) | sampling compile |")
    print("|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for gpu in args.gpus:
        for shape in args.shapes:
            for rows in args.rows:
                for layers, gemms in itertools.product(("unrolled", "scanned"), args.gemms):
                    r = decode_step(gpu, shape, rows, layers, gemms)
                    print(f"| {gpu} | {shape} | {rows} | {layers} | {gemms} | {r['cache'] / 1e9:.2f} GB | "
                          f"{r['bytes'] / 1e9:.2f} GB | {r['bytes'] / r['floor']:.2f}x | "
                          f"{r['bytes'] / r['row_floor']:.2f}x | {r['kernels']:.0f} | "
                          f"{r['roofline_s'] * 1e3:.2f} ms | {r['compile_s']:.1f} s |", flush=True)


if __name__ == "__main__":
    main()
