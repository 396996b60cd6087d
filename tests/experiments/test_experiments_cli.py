"""The experiment CLIs: a real-checkpoint run on 8 devices, bad flags, no clobbering, resume."""

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest
from test_log_backends import wait_for_wandb
from test_metrics import read_events
from tiny_checkpoint import save_tiny_checkpoint

from experiments import cli, runner
from child_env import child_env

pytestmark = pytest.mark.cpu_mesh

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("cli_ckpt"))


@pytest.fixture(scope="module", autouse=True)
def compile_cache(tmp_path_factory):
    """The CLI's persistent compile cache, kept out of the user's home for these runs.

    The runs of this module share it, in-process too: programs of the same shapes (another
    seed, another method's generation) load instead of compiling again. After each test JAX's
    cache flags are put back (tests/conftest.py), so other tests compile without it."""
    before = os.environ.get("PODSJAX_CACHE_DIR")
    os.environ["PODSJAX_CACHE_DIR"] = path = str(tmp_path_factory.mktemp("compile_cache"))
    yield path
    if before is None:
        os.environ.pop("PODSJAX_CACHE_DIR", None)
    else:
        os.environ["PODSJAX_CACHE_DIR"] = before


def test_the_compile_cache_turned_on_after_a_compile_is_used(tmp_path):
    # In-process CLI runs turn the cache on after earlier compiles of the same process.
    import jax
    import jax.numpy as jnp

    from podsjax.devices import compilation

    compilation.disable_compile_cache()
    jax.jit(lambda x: x + 1)(jnp.ones(3)).block_until_ready()
    cache = compilation.enable_compile_cache(tmp_path / "cache", min_compile_time_s=0)
    try:
        jax.jit(lambda x: x * 3 - 1)(jnp.ones(5)).block_until_ready()
    finally:
        compilation.disable_compile_cache()
    assert os.listdir(cache)


def run_cli(args, timeout=300):
    env = child_env()
    return subprocess.run([sys.executable, "-m", "experiments.gsm8k", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_real_checkpoint_run_on_mesh_8_then_resume(checkpoint, data_dir, tmp_path):
    gsm8k = os.path.join(data_dir, "gsm8k")
    out = str(tmp_path / "run")
    common = ["--model", checkpoint, "--data", os.path.join(gsm8k, "train.jsonl"),
              "--eval-data", os.path.join(gsm8k, "test.jsonl"), "--eval-limit", "8", "--mesh", "8",
              "--method", "pods", "--n", "8", "--m", "4", "--max-completion-length", "8", "--lora-rank", "2",
              "--eval-every", "1000", "--no-progress", "--reward-workers", "1", "--out", out]
    first = run_cli([*common, "--max-steps", "2"])
    assert first.returncode == 0, first.stderr[-3000:]
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["algorithm"]["n"] == 8 and config["model"]["mesh"] == "8" and config["model"]["remat"] == "full"
    assert "peak accuracy" in first.stdout
    # stdout is a pipe here, as under nohup or SLURM: no bar, but plain lines say what happens.
    for words in (f"loading model from {checkpoint}", "compiled update (",
                  "first step done", "step 2/2 | train clock"):
        assert words in first.stdout, (words, first.stdout[-3000:])
    assert os.path.isfile(os.path.join(out, "final_model", "config.json"))
    adapter = json.load(open(os.path.join(out, "final_adapter", "adapter_config.json")))  # LoRA: PEFT's format too
    assert (adapter["r"], adapter["base_model_name_or_path"]) == (2, checkpoint)
    assert os.path.isfile(os.path.join(out, "best_model", "config.json")) and "best model (" in first.stdout
    # Written after the last export: what makes the run complete for --resume.
    assert json.load(open(os.path.join(out, "exported.json"))) == {
        "exports": ["final_model", "final_adapter", "best_model"],
        "budgets": {"time_budget_s": None, "max_steps": 2}}  # what it ended under
    assert os.path.isfile(os.path.join(out, "metrics.jsonl"))
    events = read_events(glob.glob(os.path.join(out, "events.out.tfevents.*"))[0])
    histograms = [(e.step, v.tag, v.histo.num) for e in events for v in e.summary.value if v.HasField("histo")]
    # Each step: the rewards of its 8 rollouts and the advantages of the 4 trained.
    assert histograms == [(s, tag, num) for s in (1, 2) for tag, num in (("reward/total", 8), ("train/advantages", 4))]

    # The same directory again without --resume is refused, and nothing changes.
    before = sorted(os.listdir(out))
    again = run_cli([*common, "--max-steps", "3"])
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and "--resume" in again.stderr
    assert sorted(os.listdir(out)) == before

    resumed = run_cli(["--out", out, "--resume", "--max-steps", "3", "--no-progress"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in open(os.path.join(out, "metrics.jsonl"))
             if "train/loss" in line]
    assert steps == [1, 2, 3]


@pytest.mark.parametrize("args,message", [
    (["--n", "0"], "need 2 <= m <= n (a group of one rollout has advantage 0 and trains nothing); got n=0"),
    (["--model", "/no/such/dir", "--max-steps", "1"], "no such file or directory"),
    (["--full", "--lora-rank", "4"], "exclude each other"),
    (["--full", "--model.lora_rank", "4"], "exclude each other"),  # the dotted flag had won: a LoRA run
    (["--resume", "--overwrite"], "--resume and --overwrite exclude each other"),
    (["--setting", "z"], "unknown setting 'z'"),
    (["--setting", "c"], "is a math setting"),
    (["--mesh", "eight"], "model.mesh: mesh spec 'eight'"),
    (["--mesh", "fsdp=²"], "model.mesh: mesh spec 'fsdp=²': expected 'N' or 'axis=size"),  # int() had refused "²"
    (["--method", "ppo"], "invalid choice"),
    (["--resume"], "holds no run to resume"),
    (["--checkpoint-every-steps", "0"], "checkpoint_every_steps must be >= 1; got 0"),
    (["--remat", "some"], "model.remat must be one of none, full, dots; got 'some'"),
    (["--warmup-steps", "0"], "tiny.warmup_steps must be an integer >= 1; got 0"),
    (["--max-operations", "3"], "tiny.max_operations must be an integer from 1 to 2, got 3"),
    (["--max-operations", "x"], "`tiny.max_operations`: Could not decode the value into any of the given types: "
                                "int: Couldn't parse 'x' into an int"),
    (["--algorithm.nope", "1"], "unrecognized argument --algorithm.nope"),
    (["--nope"], "unrecognized argument --nope"),
    (["--n", "x"], "`algorithm.n`"),
    (["--config", "/no/such.yaml"], "--config /no/such.yaml: No such file or directory"),
    (["--setting", "a"], "--setting a trains a real checkpoint: pass --model DIR"),
    (["--no-compile-cache", "--compile-cache-dir", "x"], "exclude each other"),
    (["--dataset", "/no/such/dir"], "--dataset /no/such/dir: no such file or directory"),
    (["--dataset", ROOT, "--eval-data", ROOT], "--dataset and --data / --eval-data exclude each other"),
    (["--dataset", ROOT], f"--dataset {ROOT}: no train.jsonl or train.parquet in {ROOT}"),
    (["--dataset", os.path.join(ROOT, "README.md")], "is one file, the train split: pass --eval-data"),
    (["--eval-temperature", "-1"], "eval_temperature must be >= 0 (0 = greedy); got -1.0"),
    (["--temperature", "0"], "training temperature must be > 0 (and at least 1.175e-38); got 0.0"),
    (["--eval-repeats", "3"], "eval_repeats 3 needs eval_temperature > 0"),
    (["--eval-metric", "both"], "eval_metric must be one of accuracy, accuracy_and_format"),
    # With evaluation off, these had been taken and ignored without a word.
    (["--eval-every", "null", "--eval-limit", "4"], "--eval-limit sets the evaluation, which --eval-every null"),
    (["--eval-every", "null", "--run.eval_metric", "accuracy"], "--run.eval_metric sets the evaluation"),
    (["--lr", "inf"], "learning_rate must be finite"),  # before the warm-up, not after it
    (["--lr", "-1e-4"], "learning_rate must be > 0; got -0.0001"),  # a negative number is a value, not a flag
    (["--algorithm.beta", "-1e-3"], "beta must be >= 0 and finite; got -0.001"),
    (["--lr", "-inf"], "learning_rate must be finite; got -inf"),
    (["--beta", "nan"], "beta must be finite"),
    (["--method", "pods", "--rule", "best"], "unknown selection rule 'best'"),
    (["--log", "tensorboard"], "log backends must include jsonl"),
    (["--log", "jsonl,mlflow"], "unknown log backend 'mlflow'"),
    (["--coordinator", "127.0.0.1:1"], "multi-host needs all of --coordinator, --num-processes and --process-id"),
    (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"], "--process-id must be in 0..1"),
    (["--coordinator", "h:1", "--num-processes", "0", "--process-id", "0"], "--num-processes must be >= 1; got 0"),
    (["--run.log_samples", "-1"], "log_samples must be >= 0 (0: none); got -1"),  # samples[:-1] logged all but one
    # Before the CPU makes the host devices: 100,000 of them were killed for memory after 217 s.
    (["--mesh", "100000"], "512 rollout rows must divide evenly over the mesh's 100000 batch shards"),
    (["--mesh", "data=3,tensor=2"], "512 rollout rows must divide evenly over the mesh's 3 batch shards"),
    # JAX's client raises from inside, crashes or hangs on these: refused before it starts.
    *((["--coordinator", address, "--num-processes", "2", "--process-id", "0"],
       f"--coordinator must be HOST:PORT with a port in 1..65535; got {address!r}")
      for address in ("notaport", "localhost:abc", "localhost:99999", ":1234", "h:0")),
    (["--coordinator", "h:1", "--num-processes", "3", "--process-id", "0", "--mesh", "8"],
     "--mesh 8 (8 devices) does not split over 3 processes"),
])
def test_bad_flags_give_one_line_and_exit_2(tmp_path, capsys, args, message):
    out = tmp_path / "never"
    assert cli.main("gsm8k", [*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not out.exists()  # nothing written for a bad command


@pytest.mark.slow
def test_compare_runs_methods_over_seeds_and_reports_speedups(checkpoint, data_dir, tmp_path, capsys):
    from experiments import compare

    gsm8k = os.path.join(data_dir, "gsm8k")
    out = tmp_path / "cmp"
    flags = ["--methods", "grpo,pods", "--seeds", "0,1", "--out", str(out), "--model", checkpoint,
             "--data", os.path.join(gsm8k, "train.jsonl"), "--eval-data", os.path.join(gsm8k, "test.jsonl"),
             "--eval-limit", "4", "--n", "4", "--m", "2", "--max-completion-length", "6", "--max-steps", "1",
             "--eval-every", "0", "--lora-rank", "2", "--no-progress", "--reward-workers", "1"]
    assert compare.main(flags) == 0
    printed = capsys.readouterr().out
    assert "| grpo |" in printed and "| pods |" in printed and "speed-up vs grpo" in printed
    assert [line for line in printed.splitlines() if line.startswith("== ")] == [
        f"== {label}, seed {seed}: {out / f'{label}-seed{seed}'}" for label in ("grpo", "pods") for seed in (0, 1)]
    summary = json.load(open(out / "summary.json"))
    assert [m["label"] for m in summary["methods"]] == ["grpo", "pods"]
    assert (out / "accuracy_vs_time.png").read_bytes()[:4] == b"\x89PNG"
    grpo_config = json.load(open(out / "grpo-seed0" / "config.json"))
    assert (grpo_config["algorithm"]["n"], grpo_config["algorithm"]["m"]) == (2, 2)  # GRPO generates PODS's m
    # A second invocation finds every run complete and only re-analyses.
    mtime = os.path.getmtime(out / "pods-seed1" / "metrics.jsonl")
    assert compare.main(flags) == 0
    assert os.path.getmtime(out / "pods-seed1" / "metrics.jsonl") == mtime


@pytest.mark.slow
def test_each_method_runs_on_the_tiny_preset_through_the_cli(tmp_path, capsys):
    # One short warm-up from the session's cache, shared with test_resume_killed (same seed
    # and steps); then a few steps of every method on 8 devices.
    for method in ("grpo", "grpo-ga", "pods"):
        out = tmp_path / method
        code = cli.main("gsm8k", ["--method", method, "--mesh", "8", "--max-steps", "2", "--eval-limit", "8",
                                  "--prompts-per-step", "8", "--warmup-steps", "30", "--no-progress",
                                  "--reward-workers", "1", "--out", str(out)])
        printed = capsys.readouterr().out
        assert code == 0, printed[-2000:]
        assert "built-in tiny preset" in printed and f"method                 {method}" in printed
        steps = [json.loads(line)["step"] for line in open(out / "metrics.jsonl") if "train/loss" in line]
        assert steps == [1, 2]
        assert (out / "final_model" / "config.json").is_file()
        assert not (out / "tiny_warmup").exists()  # the shared warm-up was used


@pytest.mark.slow
def test_the_grpo_toolbox_trains_on_the_tiny_preset_and_logs_to_every_backend(tmp_path, capsys, monkeypatch):
    # GSPO with two mini-batches and two passes over each, TIS against the sampler, the
    # mismatch, dynamic sampling and pass@k/maj@k, together: the metrics reach jsonl,
    # TensorBoard and W&B alike.
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    code = cli.main("gsm8k", [
        "--method", "pods", "--mesh", "8", "--max-steps", "2", "--eval-limit", "8", "--prompts-per-step", "8",
        "--warmup-steps", "30", "--no-progress", "--reward-workers", "1", "--out", str(tmp_path),
        "--algorithm.loss_type", "gspo", "--algorithm.steps_per_generation", "2", "--algorithm.num_iterations", "2",
        "--algorithm.tis_cap", "3", "--algorithm.log_mismatch", "true", "--algorithm.dynamic_sampling", "true",
        "--eval-repeats", "2", "--eval-temperature", "0.7", "--eval-k", "1,2", "--log", "jsonl,tensorboard,wandb"])
    printed = capsys.readouterr().out
    assert code == 0, printed[-2000:]
    assert "pass@2" in printed and "maj@2" in printed
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    steps = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    wanted = ["train/tis_weight_mean", "train/tis_truncated_frac", "train/mismatch_logp_abs",
              "train/mismatch_ratio_max", "train/entropy", "reward/zero_std_groups",
              "reward/zero_std_groups_selected", "data/sampling_rounds", "completion/length_mean",
              "perf/throughput", "perf/time_per_step"]
    for record in steps:
        missing = [k for k in wanted if k not in record]
        assert not missing, missing
        assert 0 < record["train/tis_weight_mean"] <= 3 and record["train/mismatch_ratio_max"] >= 1
        assert 1 <= record["data/sampling_rounds"] <= 4 and record["train/skipped"] == 0
    assert any("eval/pass_at_2" in r and "eval/maj_at_2" in r for r in records)
    events = read_events(glob.glob(str(tmp_path / "events.out.tfevents.*"))[0])
    tags = {v.tag for e in events if e.HasField("summary") for v in e.summary.value}
    assert set(wanted) <= tags, set(wanted) - tags
    (run,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    logged = {key for h in wait_for_wandb(run, lambda h: set(wanted) <= {key for r in h for key in r}) for key in h}
    assert set(wanted) <= logged, set(wanted) - logged


@pytest.mark.slow
def test_a_chat_template_that_fails_gives_one_line_and_exit_2(checkpoint, data_dir, tmp_path):
    broken = tmp_path / "broken_ckpt"
    shutil.copytree(checkpoint, broken)
    jinja = broken / "chat_template.jinja"
    if jinja.exists():
        jinja.write_text("{{ messages | no_such_filter }}")
    else:
        config_path = broken / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["chat_template"] = "{{ messages | no_such_filter }}"
        config_path.write_text(json.dumps(config))
    gsm8k = os.path.join(data_dir, "gsm8k")
    done = run_cli(["--model", str(broken), "--data", os.path.join(gsm8k, "train.jsonl"),
                    "--eval-data", os.path.join(gsm8k, "test.jsonl"), "--max-steps", "1", "--no-progress",
                    "--reward-workers", "1", "--out", str(tmp_path / "run")])
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().startswith("error: ") and "chat template" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_dataset_directory_without_a_test_file_and_chemistry_without_data_name_the_flags(tmp_path, capsys):
    only_train = tmp_path / "only_train"
    only_train.mkdir()
    (only_train / "train.jsonl").write_text("")
    assert cli.main("gsm8k", ["--dataset", str(only_train), "--out", str(tmp_path / "a")]) == 2
    assert f"no test.jsonl or test.parquet in {only_train}" in capsys.readouterr().err
    # Chemistry has no Hub dataset: with a real model the run needs local files, and says which flags.
    assert cli.main("chemistry", ["--model", str(tmp_path), "--max-steps", "1", "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--dataset DIR" in err and "--data and --eval-data" in err, err


class TrainerBuilt(BaseException):
    """Raised by the stand-in Trainer: the run was wired up, and nothing needs to train.

    A BaseException, so the CLI's handler for unexpected errors lets it through to the test."""


def test_setting_a_prints_what_it_sets_and_its_reward_weights_reach_the_trainer_and_a_resume(
        checkpoint, data_dir, tmp_path, capsys, monkeypatch):
    from podsjax import rl
    from podsjax.rewards import authors

    built = []

    def trainer(*args, **kwargs):
        built.append(kwargs)
        raise TrainerBuilt

    monkeypatch.setattr(rl, "Trainer", trainer)
    out = tmp_path / "run"
    flags = ["--setting", "a", "--model", checkpoint, "--dataset", os.path.join(data_dir, "gsm8k"),
             "--max-completion-length", "8", "--mesh", "8", "--no-compile-cache", "--out", str(out)]
    with pytest.raises(TrainerBuilt):
        cli.main("gsm8k", flags)
    printed = capsys.readouterr().out
    described = printed.index("setting a: gsm8k / Qwen/Qwen2.5-3B-Instruct / LoRA r 64")
    assert described < printed.index("loading model from")
    for line in ("algorithm.aggregation = seq-mean-token-mean", "run.eval_repeats = 5", "run.eval_temperature = 0.9",
                 "rewards.format = 1.0", "rewards.tag_count = 1.0", "rewards.format_style = authors-release",
                 "set over the setting: run.max_new_tokens = 8 (setting: 512)",
                 "set over the setting: model.mesh = 8 (setting: 1)"):
        assert line in printed, (line, printed)
    config = json.load(open(out / "config.json"))
    assert config["rewards"] == {"accuracy": 1.0, "format": 1.0, "tag_count": 1.0,
                                 "format_style": "authors-release", "extra": []}
    assert config["data"]["train"].endswith(os.path.join("gsm8k", "train.jsonl"))
    assert config["data"]["test"].endswith(os.path.join("gsm8k", "test.jsonl"))

    with pytest.raises(TrainerBuilt):  # a resumed run reads its weights back from config.json
        cli.main("gsm8k", ["--resume", "--no-compile-cache", "--out", str(out)])
    assert "setting a:" not in capsys.readouterr().out  # nothing new is set on a resume
    for kwargs in built:
        weights = [(w.name, w.weight) for w in kwargs["rewards"]]
        assert weights == [("accuracy", 1.0), ("format", 1.0), ("tag_count", 1.0)]
        # The authors' release: their grader, and the format score for wrong answers only.
        assert kwargs["rewards"][0].fn is authors.authors_gsm8k_accuracy
        assert kwargs["rewards"][1].fn.func is authors.release_format_reward
    assert len(built) == 2


def test_without_a_setting_the_rewards_are_the_defaults(tmp_path):
    from experiments import flags, run_setup
    from experiments.config import RewardSection

    _, config = flags.parse("gsm8k", ["--model", ROOT, "--max-steps", "1", "--out", str(tmp_path)])
    assert config.rewards == RewardSection()
    assert [(w.name, w.weight) for w in run_setup.make_rewards(config)] == [("accuracy", 1.0), ("format", 1.0),
                                                                         ("tag_count", 1.0)]


def test_a_dry_run_reads_local_data_as_the_run_would(checkpoint, data_dir, tmp_path, monkeypatch, capsys):
    # It had compiled, printed "dry run done" and written config.json for data the run refuses at once.
    def planned(*args, **kwargs):
        raise AssertionError("the dry run went on past bad data")

    monkeypatch.setattr(runner, "_dry_run", planned)
    out = tmp_path / "plan"
    argv = ["--model", checkpoint, "--dataset", os.path.join(data_dir, "gsm8k"), "--prompt-column", "nope",
            "--max-steps", "2", "--dry-run", "--no-compile-cache", "--out", str(out)]
    assert cli.main("gsm8k", argv) == 2
    err = capsys.readouterr().err
    assert "missing column 'nope'" in err and err.count("\n") == 1, err
    assert not out.exists()
