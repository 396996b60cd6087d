"""The benchmark scripts still run (tiny shapes; the measured figures live in docs/benchmarks.md), and their floors are right."""

import importlib.util
import math
import os
import re
import subprocess
import sys
import time

import pytest

from benchmarks import costs
from benchmarks.machine import peaks_for
from benchmarks.qwen_model import SHAPES, hf_config, podsjax_config
from child_env import child_env

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_SHAPE = ["--layers", "1", "--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv-heads", "2",
              "--vocab", "1024"]
TINY_MODEL = [*TINY_SHAPE, "--repeats", "1"]


def run(module, *args, timeout=300):
    env = child_env()
    out = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def last_column(row: str) -> float:
    return float(row.rstrip(" |").rsplit("|", 1)[1])


def test_selection_benchmarks_reference_loop_finds_the_maximum_variance_subset():
    """The benchmark's reference (the authors' O(M^2) loop) against brute force, in-process."""
    import itertools

    import numpy as np

    from benchmarks import selection

    rng = np.random.default_rng(3)
    rewards = (rng.integers(0, 2, (20, 8)) + 0.25 * rng.integers(0, 3, (20, 8))).astype(np.float32)
    chosen = selection.reference_loop(rewards, 3)
    for row, picked in zip(rewards, chosen):
        best = max(np.var(row[list(c)]) for c in itertools.combinations(range(8), 3))
        assert len(set(picked)) == 3 and np.var(row[picked]) == pytest.approx(best, rel=1e-6)
    # One timed shape: the run checks podsjax against the reference, and the table holds its ratios.
    (row,) = selection.run([(4, 16)], min_time=0.0)
    b, n, m, *times = row
    assert (b, n, m) == (4, 16, 4) and all(t > 0 for t in times)
    line = selection.format_table([row]).splitlines()[-1]
    assert line.startswith("| 4 | 16 | 4 |") and f"| {times[0] / times[1]:.2f} |" in line
    assert selection.parse_shapes("64x16,8x4") == [(64, 16), (8, 4)]


def test_forward_benchmark_checks_logits_and_prints_a_ratio():
    printed = run("benchmarks.forward", "--batch", "1", "--seq", "16", "--dtype", "float32", *TINY_MODEL)
    assert "a/b speed-up" in printed and "max abs logit diff" in printed
    row = next(line for line in printed.splitlines() if line.startswith("| small"))
    assert last_column(row) < 1e-4, row  # fp32 (full-precision matmuls on an accelerator too): the same logits


def test_generate_benchmark_runs_both_contenders(data_dir):
    # Two samples of one prompt, as setting a samples 64: transformers' rows and log-probs line up with podsjax's.
    printed = run("benchmarks.generate", "--prompts", "1", "--samples", "2", "--prompt-len", "8", "--new-tokens", "4",
                  *TINY_MODEL, "--data", data_dir, "--reward-limit", "8", "--workers", "1")
    assert "a/b speed-up" in printed and "| gsm8k |" in printed and "| 1 x 2 x (8 + 4) |" in printed, printed
    row = next(line for line in printed.splitlines() if "| 1 x 2 x (8 + 4) |" in line)
    assert last_column(row) < 1e-4, row
    assert "% of floor" in printed and "| (a) podsjax |" in printed and "measured here" in printed


def test_train_step_benchmark_checks_lora_and_full_gradients():
    # The torch side of LoRA is peft (in the test extra): both updates are compared.
    modes = ["lora", "full"]
    printed = run("benchmarks.train_step", "--batch", "2", "--prompt-len", "8", "--completion-len", "8",
                  "--lora-rank", "8", "--update", ",".join(modes), "--dtype", "float32", *TINY_MODEL)
    rows = [line for line in printed.splitlines() if line.startswith(("| LoRA r8", "| full"))]
    assert len(rows) == len(modes), printed
    # Same weights (and LoRA A), same batch, same loss: the two first-step gradient norms must agree.
    for row in rows:
        assert last_column(row) < 1e-4, row
    assert "MFU a / b" in printed and "podsjax compile" in printed


def test_shared_prefix_benchmark_checks_both_forms_and_prints_ratios():
    for preset, lora in (("tiny", "0"), ("qwen0.5b", "4")):
        printed = run("benchmarks.shared_prefix", "--preset", preset, "--prompts", "2", "--m", "2", "--prompt-len", "8",
                      "--completion-len", "4", "--layers", "1", "--lora-rank", lora, "--repeats", "1")
        assert "| per row | 48 |" in printed and "| shared prefix | 32 |" in printed, printed
        assert "x update tokens/s" in printed and "1.50x fewer positions" in printed, printed


def test_decode_attention_benchmark_checks_every_split_against_the_xla_form(tmp_path):
    from benchmarks.kernel_variants import VARIANTS

    best = tmp_path / "fastest.txt"
    printed = run("benchmarks.decode_attention", "--rows", "8", "--prompt-len", "32", "--slots", "32", "--filled",
                  "16", "--head-dim", "16", "--sets", "2", "--iters", "2", "--dtype", "float32", "--best-to", str(best))
    rows = [line for line in printed.splitlines() if line.startswith("| ") and "---" not in line][1:]
    theirs = ["JAX's mqa kernels, the plan's k_splits", "JAX's mqa kernels, mqa's default k_splits"]
    plan, *others = VARIANTS  # the plan and JAX's kernels first: a time limit that cuts the sweep keeps them
    assert [r.split("|")[1].strip() for r in rows[:-1]] == [plan, *theirs, *others], printed
    assert rows[-1].startswith("| XLA form"), printed
    # Each split's output and written cache against the XLA form's, and JAX's kernels' too.
    assert all(last_column(r) < 1e-5 for r in rows[:-1]), printed
    chosen = best.read_text().strip()
    assert chosen in VARIANTS and f"for decoding: {chosen} (" in printed, printed
    assert "fastest: " in printed and "JAX's kernels at best: " in printed, printed


def test_the_sweep_hands_decoding_another_split_only_when_it_is_right_and_clearly_faster():
    from benchmarks.decode_attention import choose
    from benchmarks.kernel_variants import DEFAULT, VARIANTS

    other, wrong = [name for name in VARIANTS if name != DEFAULT][:2]
    assert choose({DEFAULT: (10.0, 1e-3), other: (9.0, 1e-3)}, 1e-2) == other
    assert choose({DEFAULT: (10.0, 1e-3), other: (9.8, 1e-3)}, 1e-2) == DEFAULT  # within the sweep's noise
    assert choose({DEFAULT: (10.0, 1e-3), other: (9.0, 1e-3), wrong: (5.0, 0.5)}, 1e-2) == other  # wrong: not taken
    assert choose({other: (9.0, 1e-3)}, 1e-2) == other  # the plan refused by the compiler
    assert choose({DEFAULT: (10.0, 0.5), other: (12.0, 0.5)}, 1e-2) == DEFAULT  # none right: the plan stays


def test_jax_s_own_decode_kernels_do_decoding_s_attention_call_for_left_padded_prompts():
    """benchmarks.jax_decode_kernels against the XLA form, in Pallas's interpreter: two prompts
    with left padding, Qwen's qkv bias, rows at different lengths."""
    import argparse

    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import decode_attention, jax_decode_kernels

    shape = argparse.Namespace(rows=8, prompts=2, kv_heads=2, groups=3, head_dim=16, prompt_len=32, slots=32,
                               filled=20, dtype="float32")
    x = decode_attention.make_inputs(shape, 0)
    padding = jnp.array([5, 0])
    x["prompt_mask_PS"] = jnp.arange(32)[None, :] >= padding[:, None]
    x["length_B"] = jnp.array([20, 1, 7, 32, 16, 3, 20, 9], jnp.int32)
    x["allowed_B1T"] = (jnp.arange(32)[None, :] < x["length_B"][:, None])[:, None]
    out, (keys, values) = jax.jit(decode_attention.xla_form)(x)
    for choice in (jax_decode_kernels.PLAN, jax_decode_kernels.DEFAULT):
        got, (got_keys, got_values) = jax_decode_kernels.attend(jax_decode_kernels.kernel_layout(x), choice=choice,
                                                                interpret=True)
        np.testing.assert_allclose(got, out, atol=2e-6, rtol=2e-6)
        np.testing.assert_array_equal(got_keys, keys)
        np.testing.assert_array_equal(jnp.swapaxes(got_values, 2, 3), values)
    with pytest.raises(ValueError, match="k_splits choice must be"):
        jax_decode_kernels.splits(x, "half")


def test_generate_benchmark_times_podsjax_alone_without_a_reference():
    printed = run("benchmarks.generate", "--rows", "2", "--prompt-len", "8", "--new-tokens", "4", *TINY_MODEL,
                  "--tasks", "", "--no-reference")
    assert "no reference" in printed and "| (a) podsjax |" in printed, printed
    assert "transformers generate" not in printed and "(b) transformers" not in printed, printed


def test_cli_step_benchmark_times_a_cold_and_a_warm_run_then_a_cold_one_with_other_xla_flags(data_dir):
    printed = run("benchmarks.cli_step", *TINY_SHAPE, "--max-steps", "2", "--eval-limit", "1", "--train-examples",
                  "8", "--tokenizer-vocab", "512", "--data", data_dir,
                  "--variant-xla-flags=--xla_backend_optimization_level=1", "--kernel-variant", "a launch a pass",
                  "--cli-flags", "--n", "4", "--m", "2", "--max-completion-length", "8", timeout=300)
    rows = [line.split("|")[1].strip() for line in printed.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows == ["run", "1: cold compile cache", "2: warm compile cache",
                    "3: cold, XLA_FLAGS +--xla_backend_optimization_level=1"], printed
    compiled = [int(line.split("|")[-3]) for line in printed.splitlines() if line.startswith("| ") and "cold" in line]
    assert len(compiled) == 2 and min(compiled) > 0, printed  # the variant had a compile cache of its own
    # Each run's start, milestone by milestone, in the order they happen.
    starts = re.findall(r"after launch: params loaded ([0-9.]+) s, step-0 evaluation ([0-9.]+) s, "
                        r"first step ([0-9.]+) s", printed)
    assert len(starts) == 3 and all(0 < float(a) <= float(b) <= float(c) for a, b, c in starts), printed
    # The console echoed as it lands, each line with its time since the launch, under the variant's wrapper.
    assert "benchmarks.kernel_variants 'a launch a pass' experiments.gsm8k" in printed, printed
    assert re.search(r"^  run 2 \[[0-9.]+ s\] loaded \S+ params in ", printed, re.M), printed


def test_cli_step_stops_the_cli_it_started_when_a_time_limit_stops_it(tmp_path, capsys):
    import signal

    from benchmarks.cli_step import run_cli

    pid_file = tmp_path / "pid"
    child = (f"import os, signal, sys, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
             "signal.signal(signal.SIGTERM, lambda *_: (print('on its way out', flush=True), sys.exit(1))); "
             "print('started', flush=True); time.sleep(120)")

    def time_limit(*_):
        raise SystemExit(143)  # what cli_step's SIGTERM handler raises

    previous = signal.signal(signal.SIGALRM, time_limit)
    signal.alarm(3)
    try:
        with pytest.raises(SystemExit):
            run_cli([sys.executable, "-c", child], str(tmp_path / "run1"), child_env(), "run 1", steps=4)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    printed = capsys.readouterr().out
    assert re.search(r"run 1 \[[0-9.]+ s\] started", printed) and "stopped before the CLI ended" in printed, printed
    assert re.search(r"run 1 \[[0-9.]+ s\] on its way out", printed), printed  # its last words are echoed too
    with pytest.raises(ProcessLookupError):  # ended and reaped
        os.kill(int(pid_file.read_text()), 0)


def test_cli_step_ends_the_cli_once_its_last_step_lands(tmp_path, capsys):
    """What a run does after its last step (the final evaluation and export) is timed by
    nothing, so the benchmark does not wait for it."""
    from benchmarks.cli_step import run_cli

    out, pid_file = tmp_path / "run1", tmp_path / "pid"
    child = (f"import json, os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
             f"os.makedirs({str(out)!r}, exist_ok=True); f = open({str(out / 'metrics.jsonl')!r}, 'w'); "
             "[(f.write(json.dumps({'step': s, 'time/update': 0.1}) + '\\n'), f.flush(), time.sleep(0.3)) "
             "for s in (1, 2)]; print('exporting', flush=True); time.sleep(120)")
    started = time.perf_counter()
    run = run_cli([sys.executable, "-c", child], str(out), child_env(), "run 1", steps=2)
    assert time.perf_counter() - started < 60
    assert [r["step"] for r in run["steps"]] == [1, 2] and run["first_step_s"] <= run["wall_s"]
    assert "step 2 landed: the CLI is ended here" in capsys.readouterr().out
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


def test_cli_step_s_timeline_splits_a_start_at_the_fit_check_where_one_ran():
    from benchmarks.cli_step import timeline

    gpu = [(3.0, "loaded 1544M params in 2.1 s"), (4.5, "checking that the run fits in device memory ..."),
           (12.2, "memory per device (1 x NVIDIA H200, remat full):"), (15.0, "eval at step 0: accuracy 0.0%"),
           (17.5, "first step done 17.4 s after start: step 1.6 s")]
    assert timeline(gpu) == ("params loaded 3.0 s, fit check from 4.5 s, to 12.2 s, step-0 evaluation 15.0 s, "
                             "first step 17.5 s")
    cpu = [gpu[0], gpu[3]]  # no fit check on a CPU; a first step that never came
    assert timeline(cpu) == "params loaded 3.0 s, step-0 evaluation 15.0 s, first step not seen"


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b"])
def test_shape_param_counts_agree_across_transformers_podsjax_and_the_floors(name):
    import torch
    import transformers

    spec = SHAPES[name]
    with torch.device("meta"):  # shapes only, no memory
        hf = transformers.Qwen2ForCausalLM(hf_config(spec, 2048))
    count = sum(p.numel() for p in hf.parameters())
    assert count == podsjax_config(spec, 2048).num_params == costs.matmul_params(spec)
    # The model cards: 0.49B, 1.54B, 3.09B.
    assert round(count / 1e9, 2) == {"qwen2.5-0.5b": 0.49, "qwen2.5-1.5b": 1.54, "qwen2.5-3b": 3.09}[name]


def test_decode_floor_matches_the_design_note():
    # DESIGN.md: 1.5B shape, bf16, 256 rows, 512 + 512 tokens on an H100: a 2.6 ms floor.
    peaks = peaks_for("NVIDIA H100 80GB HBM3")
    floor = costs.decode_step_bytes(SHAPES["qwen2.5-1.5b"], 2, 256, 512, 512) / peaks.bandwidth
    assert peaks.name == "H100 SXM" and floor == pytest.approx(2.6e-3, abs=0.05e-3)
    assert peaks_for("NVIDIA H100 PCIe").name == "H100 PCIe"
    assert peaks_for("TPU v5 lite").name == "TPU v5e" and peaks_for("TPU v5p").name == "TPU v5p"
    assert peaks_for("NVIDIA A100-SXM4-80GB").bandwidth == 2.0e12 and peaks_for("cpu") is None


def test_update_flops_follow_the_stated_formula():
    spec = SHAPES["small"]
    full = costs.update_flops(spec, 8, 64, 128, None)
    lora = costs.update_flops(spec, 8, 64, 128, 64)
    tokens = 8 * 192
    # Full fine-tuning is at least 6 N per token; LoRA is about 4 N + 6 N_lora per token (plus attention).
    assert full > 6 * costs.body_params(spec) * tokens
    assert 4 * costs.body_params(spec) * tokens < lora < full
    from podsjax.models.lora import LoraConfig, lora_shapes

    shapes = lora_shapes(podsjax_config(spec, 2048), LoraConfig(rank=64, alpha=64.0)).values()
    assert costs.lora_params(spec, 64) == sum(math.prod(a) + math.prod(b) for a, _, b, _ in shapes)


def test_trace_summary_counts_stream_kernels_once_and_leaves_derived_lines_out(tmp_path):
    import gzip
    import json

    from benchmarks import trace_summary

    meta = [
        {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 7, "tid": 1, "name": "thread_name", "args": {"name": "Stream #13(Compute)"}},
        {"ph": "M", "pid": 7, "tid": 2, "name": "thread_name", "args": {"name": "Stream #14(Compute)"}},
        {"ph": "M", "pid": 7, "tid": 3, "name": "thread_name", "args": {"name": "XLA Modules"}},
        {"ph": "M", "pid": 9, "name": "process_name", "args": {"name": "/host:CPU"}},
    ]
    kernels = [  # (tid, name, start, duration): 10-30 and 25-35 overlap on two streams; 50-60 alone
        (1, "loop_fusion_12", 10, 20), (2, "loop_fusion.13", 25, 10), (1, "gemm", 50, 10),
        (3, "jit_decode", 0, 100), (4, "ignored on host", 0, 100)]
    events = meta + [{"ph": "X", "pid": 9 if tid == 4 else 7, "tid": tid, "name": n, "ts": t, "dur": d}
                     for tid, n, t, d in kernels]
    path = tmp_path / "plugins" / "profile" / "run" / "perfetto_trace.json.gz"
    path.parent.mkdir(parents=True)
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    summary = trace_summary.summarize(trace_summary.device_kernels(
        trace_summary.load_events(trace_summary.find_trace(str(tmp_path)))))
    assert (summary.kernels, summary.span_us, summary.busy_us) == (3, 50.0, 35.0)
    assert summary.by_name == [("loop_fusion", 2, 30.0), ("gemm", 1, 10.0)]
    text = trace_summary.format_summary(summary, steps=2)
    assert "busy 0.018 ms (70% of the span)" in text and "| loop_fusion | 1.0 | 0.015 ms | 86% |" in text
    # A TPU has no streams: its "XLA Ops" line holds the kernels, "XLA Modules" the programs.
    tpu = [{"ph": "M", "pid": 3, "name": "process_name", "args": {"name": "/device:TPU:0"}},
           {"ph": "M", "pid": 3, "tid": 1, "name": "thread_name", "args": {"name": "XLA Modules"}},
           {"ph": "M", "pid": 3, "tid": 2, "name": "thread_name", "args": {"name": "XLA Ops"}},
           {"ph": "X", "pid": 3, "tid": 1, "name": "jit_decode", "ts": 0, "dur": 100},
           {"ph": "X", "pid": 3, "tid": 2, "name": "fusion.3", "ts": 10, "dur": 5}]
    assert trace_summary.device_kernels(tpu, "/device:TPU") == [("fusion.3", 10.0, 5.0)]


@pytest.mark.skipif(importlib.util.find_spec("jax_plugins.xla_cuda12") is None,
                    reason="jax's CUDA plugin is not installed (pip install 'podsjax[cuda]')")
def test_the_h100_plan_of_the_attention_call_counts_each_form_s_kernels_and_waves():
    from benchmarks.kernel_variants import VARIANTS

    printed = run("benchmarks.gpu_plan", "--attention")
    rows = {r.split("|")[2].strip(): r.split("|")[3:-1] for r in printed.splitlines() if r.startswith("| h100 ")}
    ours = [f"podsjax kernel ({name})" for name in VARIANTS]
    assert list(rows) == [*ours, "JAX's mqa, the plan's k_splits", "JAX's mqa, mqa's default k_splits",
                          "XLA ops"], printed
    kernels = {name: int(r[0]) for name, r in rows.items()}
    launches = {name: [[float(x) for x in launch.split(",")] for launch in r[2].split(";")] for name, r in rows.items()
                if name != "XLA ops"}
    # The plan: one launch holds both passes, in one wave; JAX's kernels are a launch each,
    # with XLA's bias, RoPE, cache write and merge around them.
    plan = ours[0]
    assert len(launches[plan]) == 1 and launches[plan][0][-1] <= 1.0, printed
    assert len(launches["podsjax kernel (a launch a pass)"]) == 2, printed
    assert all(len(launches[name]) == 2 for name in rows if name.startswith("JAX's")), printed
    assert all(kernels[plan] < n for name, n in kernels.items() if name.startswith(("JAX's", "XLA"))), printed
    # Each variant changes what it names: shorter walks launch more programs.
    assert launches["podsjax kernel (fill 1056 programs)"][0][0] > launches[plan][0][0], printed


def test_the_attention_benchmark_s_timed_program_keeps_each_form_s_output():
    """A program returning only the written caches lets XLA drop the attention of every form
    whose cache write does not need it (the XLA form, JAX's kernels, a launch a pass)."""
    import argparse

    import jax
    import numpy as np

    from benchmarks import decode_attention

    shape = argparse.Namespace(rows=4, prompts=1, kv_heads=2, groups=2, head_dim=16, prompt_len=16, slots=16,
                               filled=8, dtype="float32")
    x = decode_attention.make_inputs(shape, 0)
    rest = {name: v for name, v in x.items() if name not in decode_attention.CACHE}
    caches, outputs = decode_attention.timed_program(decode_attention.xla_form)(
        [rest], [tuple(jax.numpy.array(x[name], copy=True) for name in decode_attention.CACHE)])  # donated
    out, cache = jax.jit(decode_attention.xla_form)(x)
    np.testing.assert_array_equal(outputs[0], out)
    for got, want in zip(caches[0], cache):
        np.testing.assert_array_equal(got, want)
