"""The benchmark scripts still run (tiny shapes; the real numbers live in the README)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_MODEL = ["--layers", "1", "--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv-heads", "2",
              "--vocab", "1024", "--repeats", "1"]


def run(module, *args):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_selection_benchmark_prints_its_ratio_table():
    printed = run("benchmarks.selection", "--shapes", "8x16", "--min-time", "0.01")
    assert "| a/b | c/a | a/d |" in printed and "| 8 | 16 | 4 |" in printed


def test_forward_benchmark_checks_logits_and_prints_a_ratio():
    printed = run("benchmarks.forward", "--batch", "1", "--seq", "16", *TINY_MODEL)
    assert "a/b speed-up" in printed and "max abs logit diff" in printed


def test_generate_benchmark_runs_both_contenders(shared_data_dir):
    printed = run("benchmarks.generate", "--prompts", "2", "--prompt-len", "8", "--new-tokens", "4", *TINY_MODEL,
                  "--data", shared_data_dir, "--reward-limit", "8", "--workers", "1")
    assert "a/b speed-up" in printed and "| gsm8k |" in printed


def test_train_step_benchmark_checks_gradients_and_prints_a_ratio():
    printed = run("benchmarks.train_step", "--batch", "2", "--prompt-len", "8", "--completion-len", "8", *TINY_MODEL)
    row = next(line for line in printed.splitlines() if line.startswith("| Qwen2-shaped"))
    # Same weights, same batch, same loss: the two first-step gradient norms must agree.
    assert float(row.rstrip(" |").rsplit("|", 1)[1]) < 1e-4, row
    assert "a/b speed-up" in printed
