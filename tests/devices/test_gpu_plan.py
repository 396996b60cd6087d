"""--dry-run --topology h100: XLA's GPU compiler plans a run on a host without a GPU."""

import importlib.util
import json
import os
import re

import functools

import jax
import jax.numpy as jnp
import pytest

from podsjax import rl
from podsjax.devices import accelerators, dry_run, gpu_thunks, gpu_topology, hlo_cost, topology
import podsjax.models as pm
from experiments import paper_settings
from podsjax.devices import mesh as mesh_lib
from podsjax.models import rollout
from podsjax.sampler import sampling
from test_dry_run import FLAGS, config_only_checkpoint, run_cli

HAS_CUDA_PLUGIN = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
needs_cuda_plugin = pytest.mark.skipif(not HAS_CUDA_PLUGIN, reason="jax's CUDA plugin is not installed "
                                                                  "(pip install 'podsjax[cuda]')")
H100 = "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize("name", ["b200", "h100:", "h100:0", "h100:9", "H100", "gpu"])
def test_a_bad_gpu_topology_is_refused_in_one_line(name):
    with pytest.raises(ValueError, match="topology") as info:
        topology.compile_only_devices(name)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("missing", ["the plugin", "every plugin"])
def test_without_the_cuda_plugin_the_error_says_what_to_install(monkeypatch, missing):
    real = importlib.util.find_spec

    def find_spec(name, *a):
        if not name.startswith("jax_plugins"):
            return real(name, *a)
        if missing == "every plugin":  # no jax_plugins package: find_spec of a submodule raises
            raise ModuleNotFoundError("No module named 'jax_plugins'", name="jax_plugins")
        return None

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ValueError, match=r"needs jax's CUDA plugin on this host: pip install 'podsjax\[cuda\]'"):
        topology.compile_only_devices("h100")


def test_every_gpu_has_its_figures_and_a_target_description():
    for name, info in gpu_topology.GPUS.items():
        chip = topology.chip(info["kind"])
        assert chip.hbm_bytes == info["device_memory_size"] and chip.bandwidth > 1e11 and chip.peak_flops > 1e14
        text = gpu_topology.target_config(name)
        assert f'device_description_str: "{info["kind"]}"' in text and "cuda_compute_capability" in text


@pytest.fixture(scope="module")
def h100_model():
    if not HAS_CUDA_PLUGIN:
        pytest.skip("jax's CUDA plugin is not installed")
    config = pm.ModelConfig(arch="qwen2", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=64, eos_token_id=2, pad_token_id=0)
    mesh = mesh_lib.make_mesh("1", devices=topology.compile_only_devices("h100"))
    assert mesh_lib.platform(mesh) == "gpu"
    return pm.Decoder(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, mesh=mesh)


@needs_cuda_plugin
@pytest.mark.parametrize("completion", [64, 65])  # cuDNN's masked backward refuses odd lengths: padded
def test_the_h100_update_runs_cudnn_attention_forward_and_backward(h100_model, completion):
    algo = paper_settings.method_config("pods", n=8, m=4)
    lora = pm.LoraConfig(rank=4, alpha=8.0)
    optimizer, update = rl.update_program(h100_model, algo, lora)
    state, frozen = rl.abstract_state(h100_model, algo, optimizer, lora, dry_run.abstract_base(h100_model))
    text = update.lower(state, rl.abstract_batch(h100_model.mesh, 4, 64, completion), frozen).compile().as_text()
    calls = set(hlo_cost.custom_call_targets(text))
    assert any("fmha" in c and "Backward" not in c for c in calls), calls
    assert any("fmha" in c and "Backward" in c for c in calls), calls


@needs_cuda_plugin
def test_h100_decode_reads_a_bf16_cache_layer_by_layer(h100_model):
    # The attention choice follows the device compiled for, not this host's CPU backend:
    # on a CPU the cache is upcast to fp32 (XLA:CPU has no bf16 batched dot with an fp32
    # result), which on a GPU would double the bytes each decode step reads. On a GPU the
    # sampler runs the layers unrolled over a cache buffer per layer.
    gen = sampling.Generator(h100_model).compile(dry_run.abstract_base(h100_model), None, prompts=1, prompt_len=64,
                                                 num_samples=8, max_new_tokens=64, eos_token_ids=(2,))
    text = gen["sample"].as_text()
    # One layer of the cache: the prompt's KV once [prompts, kv heads, slots, head_dim], and
    # each row's completion [rows, kv heads, slots, head_dim] (values slots last).
    assert "bf16[1,2,64,64]" in text and "bf16[8,2,64,64]" in text
    assert not re.search(r"(bf16|f32)\[[0-9,]*8,2,128,64\]", text)  # the prompt in no row
    assert not re.search(r"(bf16|f32)\[2,8,2,64,64\]", text)  # no stacked cache
    # Greedy or sampled is a select: a conditional's predicate is read on the host, each step.
    assert "conditional(" not in text
    # No fp32 copy of a layer in memory (a fusion may still upcast what it reads, in registers).
    assert not any(re.search(r"f32\[[0-9,]*8,2,64,64\]", t) for t in kernel_output_types(text))


def kernel_output_types(hlo_text):
    """The types the program's kernels write: instructions outside fused computations."""
    computations, _ = hlo_cost.parse_module(hlo_text)
    fused = set(re.findall(r"calls=%?([\w.\-]+)", hlo_text))
    return [i.type for name, instrs in computations.items() if name not in fused for i in instrs]


@needs_cuda_plugin
@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape, gemms", [("Qwen2.5-1.5B", 28), ("Qwen2.5-3B", 42)])
def test_the_h100_weights_merge_is_a_few_batched_gemms_of_few_shapes(shape, gemms, param_dtype):
    # LoRA r64 on all 7 projections. Merged layer by layer, the 1.5B's 28 layers were 196
    # GEMMs for XLA's GPU compiler to tune; now each projection is one batched GEMM per group
    # of layers (4 groups of 7; the 3B's 36 layers, 6 of 6): at most 5 shapes (q, k and v, o, gate
    # and up, down), and a temporary of a group's weights, not all of them. bf16 params (the main
    # job's): without an order between the groups, XLA converted every group's kernels to fp32 in
    # one fusion, a temporary of 87 % of the weights (1.5B) and 96 % (3B).
    mesh = mesh_lib.make_mesh("1", devices=topology.compile_only_devices("h100"))
    model = pm.Decoder(pm.checkpoint_shape(shape), dtype=jnp.bfloat16, param_dtype=param_dtype, mesh=mesh)
    lora = jax.eval_shape(lambda k: pm.init_lora(k, model, pm.LoraConfig(rank=64, alpha=64.0)), jax.random.key(0))
    merge = jax.jit(functools.partial(rollout.rollout_weights, model)).lower(dry_run.abstract_base(model), lora)
    compiled = merge.compile()
    text = compiled.as_text()
    calls = re.findall(r"= \(?(\w+\[[\d,]+\])[^\n]*custom_call_target=\"__cublas", text)
    assert len(calls) == gemms and len(set(calls)) <= 5, calls
    memory = compiled.memory_analysis()
    assert memory.temp_size_in_bytes < 0.2 * memory.output_size_in_bytes


@needs_cuda_plugin
def test_an_h100_sampling_draw_reads_the_logits_twice_at_most():
    # The row's max with the greedy argmax, then the draw: two reads of a step's [64, V]
    # logits (39 MB each at Qwen's vocabulary), and no third.
    from podsjax.sampler import decoding

    placed = jax.sharding.SingleDeviceSharding(topology.compile_only_devices("h100")[0])
    cfg = decoding.SamplingConfig(num_samples=1, max_new_tokens=1, temperature=1.0, eos_token_ids=(1,))
    logits = jax.ShapeDtypeStruct((64, 151936), jnp.bfloat16, sharding=placed)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=placed)
    temperature = jax.ShapeDtypeStruct((), jnp.float32, sharding=placed)
    draw = jax.jit(lambda x, k, t: decoding.sample_tokens(x, k, t, cfg)).lower(logits, key, temperature)
    cost = hlo_cost.program_cost(draw.compile({"xla_gpu_enable_triton_gemm": False}).as_text())
    assert cost.bytes < 2.2 * 64 * 151936 * 2, cost.bytes / (64 * 151936 * 2)


@needs_cuda_plugin
@pytest.mark.slow
def test_an_h100_decode_step_of_qwen_1_5b_moves_at_most_1_3x_its_floor_as_one_cuda_graph(tmp_path):
    # Setting a's rollouts: 64 rows of 512 + 512 tokens, bf16, LoRA r64 merged for sampling.
    mesh = mesh_lib.make_mesh("1", devices=topology.compile_only_devices("h100"))
    model = pm.Decoder(pm.checkpoint_shape("Qwen2.5-1.5B"), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, mesh=mesh)
    algo = paper_settings.method_config("pods")
    lora = pm.LoraConfig(rank=64, alpha=64.0)
    generator = sampling.Generator(model, compiler_options=gpu_thunks.dump_options(tmp_path))
    plan = dry_run.plan(model, algo, lora, base_params=dry_run.abstract_base(model), prompts=1, prompt_len=512,
                        max_new_tokens=512, eos_token_ids=(151645,), generator=generator)
    assert plan.decode_step_bytes <= 1.3 * plan.decode_step_floor_bytes, (plan.decode_step_bytes,
                                                                           plan.decode_step_floor_bytes)
    # 9 kernels a layer: the attention kernel takes the step's token as the qkv GEMM wrote it
    # (383 a step when kernels before it rotated k, sliced v and scattered both into the cache;
    # 328.5 while a kernel still rotated q and laid it out for the attention), and its 4 parts
    # a row merge in one fusion (299.5 a step with 12 parts, merged in two).
    assert plan.rollout_weights > 0 and plan.decode_step_kernels < 280, plan.decode_step_kernels
    # The step's kernels (all but the loop's own bookkeeping) run as one CUDA graph: nothing
    # in it (a host callback, a library call the graph cannot hold) splits it into launches.
    step = gpu_thunks.innermost_loop(gpu_thunks.read(tmp_path, "sample"))
    assert step.graphs == 1 and step.alone == 0 and step.kernels_in_graphs > 0.95 * plan.decode_step_kernels, step


@needs_cuda_plugin
@pytest.mark.slow
def test_an_h100_decode_step_of_256_rows_reads_each_prompt_once_and_moves_at_most_1_3x_its_floor():
    # Four prompts of setting a's shapes, 64 samples each. The cache holds each prompt's KV
    # once and each row's completion: half the bytes of a cache with the prompt in every row.
    mesh = mesh_lib.make_mesh("1", devices=topology.compile_only_devices("h100"))
    config = pm.checkpoint_shape("Qwen2.5-1.5B")
    model = pm.Decoder(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, mesh=mesh)
    gen = sampling.Generator(model).compile(dry_run.abstract_base(model), None, prompts=4, prompt_len=512,
                                            num_samples=64, max_new_tokens=512, eos_token_ids=(151645,))
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2  # K and V, bf16
    keys_and_values = per_token * (4 * 512 + 256 * 512)
    assert keys_and_values <= gen["kv_cache_bytes"] < keys_and_values + 2**20  # + masks and counters
    step = dry_run.decode_step_cost(gen["sample"])
    row_cache_floor = gen["weights_read_bytes"] + per_token * 256 * (512 + 512)
    assert step.bytes <= row_cache_floor, (step.bytes, row_cache_floor)
    assert step.bytes <= 1.3 * (gen["weights_read_bytes"] + gen["kv_cache_bytes"])
    # Attention is one launch a layer (the shared prompts and the rows' own completions
    # together), its fp32 scores kept in registers: no kernel writes a layer's scores [rows,
    # kv heads, queries per kv head, slots].
    text = gen["sample"].as_text()
    assert hlo_cost.custom_call_targets(text).count("__gpu$xla.gpu.triton") == config.num_layers
    assert not any(re.search(r"f32\[256,2,6,512\]", t) for t in kernel_output_types(text))


@needs_cuda_plugin
@pytest.mark.slow
def test_h100_plan_from_config_json_alone_reports_costs_and_the_roofline(tmp_path):
    checkpoint = config_only_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "run"
    done = run_cli(["--model", checkpoint, "--dry-run", "--topology", "h100", "--mesh", "1", "--out", str(out),
                    "--dtype", "bfloat16", *FLAGS], tmp_path, env={"JAX_PLATFORMS": None})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "cuInit" not in done.stderr  # no probe for a GPU that is not here
    report = json.load(open(out / "dry_run.json"))
    assert report["device_kind"] == H100 and report["limit"] == gpu_topology.GPUS["h100"]["device_memory_size"]
    for program in ("prefill", "decode_step", "update"):
        cost = report["costs"][program]
        assert cost["bytes"] > 0 and cost["flops"] > 0 and cost["kernels"] > 0 and cost["roofline_s"] > 0, program
    assert report["decode_step_bytes"] >= report["decode_step_floor_bytes"] > 0
    assert report["step_roofline_s"] > report["costs"]["update"]["roofline_s"]
    assert "decode step moves" in done.stdout and f"one PODS step at the {H100}'s roofline" in done.stdout
    assert "within one NVIDIA H100 80GB HBM3's memory" in done.stdout


def _checkpoint(tmp_path, shape):
    directory = tmp_path / shape
    os.makedirs(directory)
    with open(directory / "config.json", "w") as f:
        json.dump(pm.checkpoint_shape(shape).to_hf_dict("bfloat16"), f)
    return str(directory)


@needs_cuda_plugin
@pytest.mark.slow
@pytest.mark.parametrize("setting,task,shape,gpus", [
    ("a", "gsm8k", "Qwen2.5-3B", "h100"), ("b", "gsm8k", "Llama-3.2-3B", "h100"), ("e", "gsm8k", "Qwen2.5-3B", "h100:8")])
def test_the_paper_settings_fit_their_h100s(tmp_path, setting, task, shape, gpus):
    # a-b: LoRA on one GPU (c and d are a's model with no more rows); e: a full fine-tune on 8.
    out = tmp_path / "run"
    done = run_cli(["--model", _checkpoint(tmp_path, shape), "--setting", setting, "--dry-run", "--topology", gpus,
                    "--out", str(out)], tmp_path, task=task)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.load(open(out / "dry_run.json"))
    assert report["total"] <= report["limit"] and report["devices"] == (8 if gpus == "h100:8" else 1)


@needs_cuda_plugin
@pytest.mark.slow
def test_an_h100_decode_step_launches_fewer_kernels_and_moves_fewer_bytes_with_the_default_cublas_gemms():
    # Why GPU_XLA_FLAGS turns Triton's GEMMs off: at 64 rows XLA splits the small GEMMs over K
    # into fp32 partials, each summed by a kernel of its own, and leaves the residual adds out.
    assert "--xla_gpu_enable_triton_gemm=false" in accelerators.GPU_XLA_FLAGS  # what the CLI compiles with
    mesh = mesh_lib.make_mesh("1", devices=topology.compile_only_devices("h100"))
    model = pm.Decoder(pm.checkpoint_shape("Qwen2.5-0.5B"), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, mesh=mesh)
    lora = jax.eval_shape(lambda k: pm.init_lora(k, model, pm.LoraConfig(rank=64, alpha=64.0)), jax.random.key(0))
    chip = topology.chip(H100)
    steps = {}
    triton = {"xla_gpu_enable_triton_gemm": True, "xla_gpu_autotune_level": 0}  # untuned: nothing to tune on here
    for name, options in [("cublas", {"xla_gpu_enable_triton_gemm": False}), ("triton", triton)]:
        gen = sampling.Generator(model, compiler_options=options).compile(
            dry_run.abstract_base(model), lora, prompts=1, prompt_len=512, num_samples=64, max_new_tokens=512,
            eos_token_ids=(151645,))
        steps[name] = dry_run.decode_step_cost(gen["sample"], chip)
    layers = model.config.num_layers
    assert steps["triton"].kernels >= steps["cublas"].kernels + layers, steps
    assert steps["triton"].bytes > 1.1 * steps["cublas"].bytes, steps
