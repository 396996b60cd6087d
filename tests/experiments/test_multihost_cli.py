"""The experiment CLI as two local processes (a multi-host run over gloo) against one process."""

import json
import os
import subprocess
import sys

import pytest
from child_env import child_env
from test_mesh_multihost import free_port
from tiny_checkpoint import save_tiny_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.cpu_mesh]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(cache):
    env = {k: v for k, v in child_env().items() if not k.startswith("PODSJAX_")}
    # user_rewards (this directory) is the reward module a user would pass.
    path = os.pathsep.join(p for p in (HERE, env.get("PYTHONPATH")) if p)
    return {**env, "PODSJAX_CACHE_DIR": cache, "PYTHONPATH": path, "JAX_PLATFORMS": "cpu"}


def _records(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_dir):
    root = tmp_path_factory.mktemp("multihost_cli")
    checkpoint = save_tiny_checkpoint(root / "ckpt")
    gsm8k = os.path.join(data_dir, "gsm8k")
    flags = ["-m", "experiments.gsm8k", "--model", checkpoint, "--data", os.path.join(gsm8k, "train.jsonl"),
             "--eval-data", os.path.join(gsm8k, "test.jsonl"), "--eval-limit", "8", "--eval-every", "1000",
             "--mesh", "data=2,fsdp=2,tensor=2", "--method", "pods", "--n", "8", "--m", "4",
             "--prompts-per-step", "2", "--max-completion-length", "8", "--lora-rank", "2", "--max-steps", "2",
             "--reward", "user_rewards:length_mod_3", "--no-progress", "--reward-workers", "1"]
    env = _env(str(root / "cache"))
    one = str(root / "one")
    single = subprocess.run([sys.executable, *flags, "--out", one], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=400)
    assert single.returncode == 0, single.stderr[-3000:]
    two = str(root / "two")
    port = free_port()
    procs = [subprocess.Popen([sys.executable, *flags, "--out", two, "--coordinator", f"127.0.0.1:{port}",
                               "--num-processes", "2", "--process-id", str(pid)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for pid in range(2)]
    outputs = [proc.communicate(timeout=400) for proc in procs]
    for proc, (stdout, stderr) in zip(procs, outputs):
        assert proc.returncode == 0, stderr[-3000:]
    return one, two, single.stdout, [stdout for stdout, _ in outputs]


def test_two_processes_write_one_log_and_one_export(runs):
    _, two, _, stdouts = runs
    steps = [r["step"] for r in _records(two) if "train/loss" in r]
    assert steps == [1, 2]  # one writer: each step once
    evals = [json.loads(line) for line in open(os.path.join(two, "eval_history.jsonl"))]
    assert [e["step"] for e in evals] == [0]
    assert os.path.isfile(os.path.join(two, "final_adapter", "adapter_model.safetensors"))
    assert os.path.isfile(os.path.join(two, "final_model", "config.json"))
    assert "peak accuracy" in stdouts[0] and "peak accuracy" not in stdouts[1]
    assert "step 2/2" in stdouts[0] and "step 2/2" not in stdouts[1]


def test_two_processes_take_the_steps_of_one_process_at_the_same_global_batch(runs):
    one, two, _, _ = runs
    a, b = ([r for r in _records(run) if "train/loss" in r] for run in (one, two))
    assert len(a) == len(b) == 2
    for x, y in zip(a, b):
        # Same prompts, keys and global programs: the same rollouts and rewards, so the
        # same selection; the loss differs only by the order of cross-host sums.
        for key in ("reward/mean", "reward/selected_mean", "reward/user_rewards:length_mod_3",
                    "completion/length_mean", "reward/zero_std_groups"):
            assert x[key] == y[key], (key, x[key], y[key])
        assert x["reward/std"] > 0  # the groups have something to select and learn from
        assert x["train/loss"] == pytest.approx(y["train/loss"], rel=1e-5, abs=1e-7)
        assert x["train/grad_norm"] == pytest.approx(y["train/grad_norm"], rel=1e-4)
    ea, eb = (json.loads(open(os.path.join(run, "eval_history.jsonl")).readline()) for run in (one, two))
    assert (ea["eval/accuracy"], ea["eval/examples"]) == (eb["eval/accuracy"], eb["eval/examples"])
