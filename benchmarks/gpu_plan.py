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
    python -m benchmarks.gpu_plan --attention     # one layer's decode attention call, each form

``--attention`` compiles the call that ``benchmarks.decode_attention`` times, at setting a's
shape, in each form (podsjax's kernel, JAX's own Pallas ``mqa`` kernels, XLA ops), and prints
its kernels, its bytes, and each attention kernel's programs against what the GPU holds at
once (registers from ptxas, shared memory from the launch).

Needs jax's CUDA plugin (``pip install 'podsjax[cuda]'``), not a GPU.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import re
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile for GPUs from this host; probe for none here
from podsjax.devices.accelerators import with_gpu_flags  # noqa: E402 - imports no JAX

os.environ["XLA_FLAGS"] = with_gpu_flags(os.environ.get("XLA_FLAGS", ""), deviceless=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import decode_attention, jax_decode_kernels, kernel_variants  # noqa: E402
from podsjax.devices import dry_run, gpu_thunks, hlo_cost, topology  # noqa: E402
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


def attention_forms() -> dict:
    """Each form of one layer's decode attention call at setting a's shape: (function, its inputs, its cache)."""
    shape = argparse.Namespace(rows=64, prompts=1, kv_heads=2, groups=6, head_dim=128, prompt_len=PROMPT,
                               slots=COMPLETION, filled=COMPLETION // 2, dtype="bfloat16")
    x = decode_attention.make_inputs(shape, 0)
    theirs = jax_decode_kernels.kernel_layout(x)
    forms = {f"podsjax kernel ({name})": (functools.partial(_under_variant, name), x, decode_attention.CACHE)
             for name in kernel_variants.VARIANTS}
    for choice in (jax_decode_kernels.PLAN, jax_decode_kernels.DEFAULT):
        forms[f"JAX's mqa, {choice} k_splits"] = (
            lambda y, choice=choice: jax_decode_kernels.attend(y, choice=choice), theirs, jax_decode_kernels.CACHE)
    forms["XLA ops"] = (decode_attention.xla_form, x, decode_attention.CACHE)
    return forms


def _under_variant(name: str, x: dict):
    """``decode_attention.kernel_form`` as kernel variant ``name`` splits it (applied while it traces)."""
    saved = kernel_variants.apply(name)
    try:
        return decode_attention.kernel_form(x)
    finally:
        kernel_variants.restore(saved)


def attention_call(gpu: str, fn, x: dict, cache: tuple[str, str]) -> dict:
    """``benchmarks.decode_attention``'s timed program of ``fn`` on one input set, compiled for
    ``gpu``: kernels, bytes, and its attention kernels' launches."""
    placed = jax.sharding.SingleDeviceSharding(topology.compile_only_devices(gpu)[0])
    abstract = {name: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=placed) for name, v in x.items()}
    rest = {name: v for name, v in abstract.items() if name not in cache}
    program = decode_attention.timed_program(fn, cache)
    with tempfile.TemporaryDirectory() as dump:
        options = {**gpu_thunks.dump_options(dump), "xla_backend_optimization_level": 3}
        compiled = program.lower([rest], [tuple(abstract[n] for n in cache)]).compile(options)
        sequence = gpu_thunks.read(dump, program.__name__)
        names = re.findall(r"^\s*\d+: kCustomKernel\s.*?\] (\S*(?:grouped_decode|mha_forward)\S*) grid:",
                           sequence, re.M)
        launches = [gpu_thunks.occupancy(dump, program.__name__, name, gpu) for name in names]
    cost = hlo_cost.program_cost(compiled.as_text())
    return {"kernels": cost.kernels, "bytes": cost.bytes, "launches": launches}


def print_attention(gpus: list[str]) -> None:
    print(f"jax {jax.__version__}; one layer's decode attention call: 64 rows of one prompt, 2 kv heads x 6, "
          f"head 128, {PROMPT} prompt + {COMPLETION // 2}/{COMPLETION} completion slots, bf16; the qkv heads in, "
          "the cache written")
    print("MB: by the optimized HLO, which counts a kernel's operands whole (the kernels read only the written slots)")
    print("| GPU | form | kernels | MB | attention kernel: programs, registers, shared KB, an SM holds, waves |")
    print("|---|---|---:|---:|---|")
    forms = attention_forms()
    for gpu in gpus:
        for name, (fn, x, cache) in forms.items():
            jax.clear_caches()  # the kernel traces again under each variant's constants
            r = attention_call(gpu, fn, x, cache)
            kernels = "; ".join(f"{o.programs}, {o.registers}, {o.shared_memory / 1024:.0f}, {o.per_sm}, "
                                f"{o.waves:.2f}" for o in r["launches"]) or "-"
            print(f"| {gpu} | {name} | {r['kernels']:.0f} | {r['bytes'] / 1e6:.1f} | {kernels} |", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", nargs="+", default=["h100"], choices=sorted(GPUS))
    parser.add_argument("--shapes", nargs="+", default=["Qwen2.5-1.5B", "Qwen2.5-3B"])
    parser.add_argument("--rows", nargs="+", type=int, default=[64, 256])
    parser.add_argument("--gemms", nargs="+", default=["cublas"], choices=sorted(GEMMS))
    parser.add_argument("--attention", action="store_true", help="one layer's decode attention call instead")
    args = parser.parse_args(argv)
    if args.attention:
        return print_attention(args.gpus)
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
