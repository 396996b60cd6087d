"""--dry-run, the fit check, --remat and the persistent compile cache, through the CLI."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from tiny_tokenizer import save_tiny_tokenizer

import podsjax.models as pm
from experiments import cli, flags, runner
from experiments.config import ModelSection
from podsjax.devices import compilation
from podsjax.devices import dry_run as dry_run_lib
from child_env import child_env

pytestmark = pytest.mark.cpu_mesh

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = pm.ModelConfig(arch="qwen2", vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True, tie_word_embeddings=True,
                       eos_token_id=2, pad_token_id=0)
# A small PODS run: 2 prompts x 8 samples, 4 trained each, 64 + 16 tokens, LoRA rank 4.
SHAPES = ["--method", "pods", "--n", "8", "--m", "4", "--prompts-per-step", "2", "--max-prompt-length", "64",
          "--max-completion-length", "16", "--max-steps", "1"]
FLAGS = [*SHAPES, "--lora-rank", "4"]


def config_only_checkpoint(directory, config=SMALL) -> str:
    """A checkpoint directory holding config.json and nothing else: no weights, no tokenizer."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config.to_hf_dict("float32"), f)
    return str(directory)


@pytest.mark.slow
def test_dry_run_reports_every_figure_from_config_json_alone(tmp_path, capsys):
    checkpoint = config_only_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "run"
    code = cli.main("gsm8k", ["--model", checkpoint, "--dry-run", "--mesh", "8", "--remat", "dots",
                              "--no-compile-cache", "--out", str(out), *FLAGS])
    printed = capsys.readouterr()
    assert code == 0, printed.err[-2000:]
    report = json.load(open(out / "dry_run.json"))
    for key in dry_run_lib.FIELDS:
        assert isinstance(report[key], int) and report[key] > 0, (key, report)
    assert set(report["compile_s"]) == {"sample", "update"}  # the scanned layout has no weights program
    assert all(seconds > 0 for seconds in report["compile_s"].values())
    assert report["remat"] == "dots" and report["devices"] == 8
    assert report["shapes"] == {"prompts": 2, "samples": 8, "update_rows": 8, "prompt_len": 64,
                                "max_new_tokens": 16}
    resident = report["params"] + report["optimizer"]
    # The scanned layout samples from the params themselves: no rollout weights, no merge.
    assert report["rollout_weights"] == 0 and report["stage_temp"]["sample"] == report["generate_temp"]
    assert report["total"] == resident + max(report["kv_cache"] + report["generate_temp"],
                                             report["batch"] + report["update_temp"])
    assert sorted(os.listdir(out)) == ["config.json", "dry_run.json"]  # nothing trained
    planned = json.load(open(out / "config.json"))  # the resolved config the figures are for
    assert planned["model"]["remat"] == "dots" and planned["algorithm"]["n"] == 8 and planned["model"]["mesh"] == "8"
    for words in ("update temporaries", "KV cache", "compiled update", "compiled generate[sample]"):
        assert words in printed.out, printed.out


def test_the_peak_holds_the_weights_merge_and_the_kv_cache_one_after_the_other():
    # The merge's temporaries are gone before sampling allocates its KV cache: the peak while
    # generating is the rollout weights beside the larger of the two, never both (GiB).
    plan = dry_run_lib.MemoryPlan(params=3, optimizer=1, kv_cache=2, generate_temp=5, update_temp=4, batch=1,
                                  compile_s={}, device_kind="cpu", devices=1, limit=None, rollout_weights=3,
                                  stage_temp={"weights": 5, "sample": 1})
    assert plan.total == 3 + 1 + 3 + 5
    sampling_larger = dataclasses.replace(plan, stage_temp={"weights": 2, "sample": 4})
    assert sampling_larger.total == 3 + 1 + 3 + 2 + 4
    updating_larger = dataclasses.replace(plan, update_temp=20)
    assert updating_larger.total == 3 + 1 + 1 + 20


@pytest.mark.parametrize("seconds, printed", [(0.86, "0.86 s"), (0.1, "0.10 s"), (0.0042, "4.2 ms"),
                                              (3.1e-5, "0.031 ms")])
def test_the_step_roofline_reads_in_milliseconds_below_a_tenth_of_a_second(seconds, printed):
    # A tiny model's step had printed as "0.00 s".
    plan = dry_run_lib.MemoryPlan(params=1, optimizer=1, kv_cache=1, generate_temp=1, update_temp=1, batch=1,
                                  compile_s={}, device_kind="TPU v5 lite", devices=1, limit=None,
                                  step_roofline_s=seconds)
    assert f"one PODS step at the TPU v5 lite's roofline: {printed} (" in "\n".join(plan.lines())


@pytest.mark.slow
def test_kv_cache_and_params_follow_the_shapes(tmp_path, capsys):
    # One device, float32: exact figures that do not depend on XLA.
    checkpoint = config_only_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "run"
    assert cli.main("gsm8k", ["--model", checkpoint, "--dry-run", "--full", "--no-compile-cache", "--out", str(out),
                              *SHAPES]) == 0
    report = json.load(open(out / "dry_run.json"))
    rows, slots = 2 * 8, 64 + 16
    kv = 2 * SMALL.num_layers * rows * SMALL.num_kv_heads * slots * SMALL.head_dim * 4
    assert kv <= report["kv_cache"] <= kv + rows * slots * 4 + 1024  # keys + values, plus mask and indices
    assert report["params"] == SMALL.num_params * 4
    assert report["optimizer"] >= 2 * SMALL.num_params * 4  # AdamW's two moments


@pytest.mark.slow
def test_a_run_that_does_not_fit_fails_with_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(dry_run_lib, "device_memory_limit", lambda device=None: 2**20)
    checkpoint = config_only_checkpoint(tmp_path / "ckpt")
    code = cli.main("gsm8k", ["--model", checkpoint, "--dry-run", "--remat", "none", "--no-compile-cache",
                              "--out", str(tmp_path / "run"), *FLAGS])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: this run needs "), err
    assert "1.0 MiB" in err and "--remat full" in err and "--lora-rank" in err


def test_remat_reaches_the_model_and_config_json(tmp_path, data_dir, monkeypatch):
    seen = {}

    class Loaded(BaseException):  # past the CLI's handler for unexpected errors
        pass

    def from_pretrained(path, **kwargs):
        seen.update(kwargs)
        raise Loaded

    import podsjax.tiny  # noqa: F401 - it binds from_pretrained on import: not to the fake below

    monkeypatch.setattr(runner.pm, "from_pretrained", from_pretrained)
    checkpoint = save_tiny_tokenizer(config_only_checkpoint(tmp_path / "ckpt"), vocab_size=SMALL.vocab_size - 20)
    gsm8k = os.path.join(data_dir, "gsm8k")
    out = tmp_path / "run"
    with pytest.raises(Loaded):
        cli.main("gsm8k", ["--model", checkpoint, "--data", os.path.join(gsm8k, "train.jsonl"),
                           "--eval-data", os.path.join(gsm8k, "test.jsonl"), "--remat", "dots",
                           "--no-compile-cache", "--out", str(out), *FLAGS])
    assert seen["remat"] == "dots"
    assert json.load(open(out / "config.json"))["model"]["remat"] == "dots"


def test_remat_defaults_to_full(tmp_path):
    assert flags.parse("gsm8k", ["--out", str(tmp_path / "x")])[1].model.remat == "full"


def test_compile_cache_is_on_by_default_and_off_with_the_flag(tmp_path, monkeypatch):
    parser = flags.build_parser("gsm8k")
    monkeypatch.setenv("PODSJAX_CACHE_DIR", str(tmp_path / "cache"))
    assert cli.setup_compile_cache(parser.parse_args([])) == str(tmp_path / "cache")
    assert compilation.compile_cache_dir() == str(tmp_path / "cache") and (tmp_path / "cache").is_dir()
    assert jax.config.jax_persistent_cache_min_compile_time_secs == compilation.MIN_CACHED_COMPILE_S
    assert cli.setup_compile_cache(parser.parse_args(["--no-compile-cache"])) is None
    assert compilation.compile_cache_dir() is None
    own = tmp_path / "own"
    assert cli.setup_compile_cache(parser.parse_args(["--compile-cache-dir", str(own)])) == str(own)
    monkeypatch.delenv("PODSJAX_CACHE_DIR")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))
    assert compilation.default_cache_dir() == str(tmp_path / "jax")
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compilation.default_cache_dir() == str(tmp_path / "xdg" / "podsjax" / "jax")


def test_an_unusable_cache_dir_gives_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    code = cli.main("gsm8k", ["--compile-cache-dir", str(blocker / "cache"), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "compile cache" in err and "--no-compile-cache" in err


@pytest.mark.parametrize("flags,message", [
    (["--mesh", "8", "--n", "3", "--m", "3", "--prompts-per-step", "1"], "must divide evenly over the mesh's 8"),
    (["--n", "8", "--m", "4"], "needs a budget: a time budget (run.time_budget_s, --time-budget)"),
])
def test_bad_shapes_give_one_line(tmp_path, capsys, flags, message):
    checkpoint = config_only_checkpoint(tmp_path / "ckpt")
    budget = ["--max-steps", "1"] if "--mesh" in flags else []
    code = cli.main("gsm8k", ["--model", checkpoint, "--dry-run", "--no-compile-cache", "--out",
                              str(tmp_path / "run"), *flags, *budget])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err


def test_an_unsupported_config_gives_one_line(tmp_path, capsys):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    code = cli.main("gsm8k", ["--model", str(checkpoint), "--dry-run", "--no-compile-cache",
                              "--out", str(tmp_path / "run"), *FLAGS])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "GPT2LMHeadModel" in err, err


def test_the_configs_remat_choices_are_the_decoders():
    for policy in pm.REMAT_POLICIES:
        assert ModelSection(remat=policy).remat == policy
    with pytest.raises(ValueError, match="model.remat must be one of none, full, dots"):
        ModelSection(remat="all")


def run_cli(args, tmp_path, env=None, task="gsm8k"):
    """The CLI in its own process (its own devices), caching compiles under ``tmp_path/cache``;
    ``env`` sets variables, or removes those it maps to None."""
    changes = env or {}
    env = {k: v for k, v in child_env().items() if k not in changes}
    env.update({k: v for k, v in changes.items() if v is not None})
    env["PODSJAX_CACHE_DIR"] = str(tmp_path / "cache")
    return subprocess.run([sys.executable, "-m", f"experiments.{task}", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_second_run_loads_its_programs_from_the_compile_cache(tmp_path):
    checkpoint = config_only_checkpoint(tmp_path / "ckpt")
    runs = []
    for attempt in range(2):
        runs.append(run_cli(["--model", checkpoint, "--dry-run", "--out", str(tmp_path / f"run{attempt}"), *FLAGS],
                            tmp_path))
        assert runs[-1].returncode == 0, runs[-1].stderr[-3000:]
    cold, warm = runs[0].stdout, runs[1].stdout
    assert f"compile cache: {tmp_path / 'cache'}" in cold
    assert "compiled update" in cold and "from the compile cache" not in cold
    assert "loaded update" in warm and "from the compile cache" in warm, warm
    assert os.listdir(tmp_path / "cache")


def test_a_cached_program_is_reported_where_its_compile_would_have_been(tmp_path):
    compilation.enable_compile_cache(tmp_path / "cache")  # every program is written, however small
    x = jnp.arange(17.0)

    def small(v):
        return jnp.cumsum(jnp.tanh(v) * 3.0 + 1.0)

    jax.jit(small)(x).block_until_ready()
    printed = {}
    for floor in (0.0, 1e3):
        jax.clear_caches()  # in memory only: the next call reads the disk
        lines = []
        log = compilation.CompileLog(lines.append, min_report_s=floor)
        with log.label("helper"):
            jax.jit(small)(x).block_until_ready()
        assert [hit for *_, hit in log.events] == [True], log.events  # counted either way
        printed[floor] = lines
    assert len(printed[0.0]) == 1 and printed[0.0][0].startswith("loaded helper[small] from the compile cache in ")
    assert printed[1e3] == []  # a helper that compiled in less than the floor is not worth a line


# The CPU proxy for "it fits by default": Qwen2.5-0.5B's shape, setting a (LoRA r64,
# PODS n 64 m 16, 512 + 512 tokens, bf16). Unrolled and without remat, the update kept
# every layer's attention scores (about 22 GB). Measured with remat full, the scan and the
# chunked LM head: 7.41 GiB, most of it one layer's XLA attention backward on CPU.
@pytest.mark.slow
def test_qwen_0_5b_setting_a_update_fits_in_8_gb(tmp_path):
    checkpoint = config_only_checkpoint(tmp_path / "qwen0.5b", pm.checkpoint_shape("Qwen2.5-0.5B"))
    out = tmp_path / "run"
    done = run_cli(["--model", checkpoint, "--setting", "a", "--method", "pods", "--dry-run", "--out", str(out)],
                   tmp_path)  # setting a's mesh is one device: its own process
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.load(open(out / "dry_run.json"))
    assert report["remat"] == "full" and report["shapes"]["update_rows"] == 16
    assert report["update_temp"] < 8e9, report


def test_the_plan_compiles_the_samplers_program_the_run_uses():
    # top-p and top-k are static in the sampler: a plan that left them at their defaults
    # would compile (and measure) another program than the run's.
    from podsjax.sampler import sampling
    from podsjax.update import algorithms

    model = pm.Decoder(SMALL)
    algo = algorithms.AlgorithmConfig(algorithm="pods", n=4, m=2, top_p=0.9, top_k=7)
    generator = sampling.Generator(model)
    dry_run_lib.plan(model, algo, pm.LoraConfig(rank=2, alpha=2.0), base_params=dry_run_lib.abstract_base(model),
                     prompts=1, prompt_len=16, max_new_tokens=4, eos_token_ids=(2,), generator=generator)
    decodes = {(key[2].top_p, key[2].top_k, key[2].max_new_tokens) for key in generator._programs.by_key
               if key[0] == "sample"}
    assert (0.9, 7, 4) in decodes and (1.0, 0, 4) not in decodes, decodes


def test_a_run_may_follow_its_dry_run_into_the_same_directory(tmp_path):
    import argparse

    from experiments import launch_checks
    from experiments.usage import UsageError

    out = tmp_path / "run"
    os.makedirs(out)
    (out / "dry_run.json").write_text("{}")  # what --dry-run leaves
    (out / "config.json").write_text(json.dumps({"run": {}}))

    def args(resume=False):
        return argparse.Namespace(out=str(out), resume=resume, overwrite=False, dry_run=False)

    launch_checks.check_out(args())  # the planned run starts there
    with pytest.raises(UsageError, match="holds no run to resume"):
        launch_checks.check_out(args(resume=True))
    (out / "metrics.jsonl").write_text("")  # a run's own files: now it is a run
    with pytest.raises(UsageError, match="is not empty"):
        launch_checks.check_out(args())
    (out / "metrics.jsonl").unlink()
    (out / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    with pytest.raises(UsageError, match="is not empty"):  # a model's config.json beside a dry run's figures
        launch_checks.check_out(args())


def _plan(config, out_dir, *args):
    """A stand-in for the dry run's compiles: it writes its figures only."""
    (open(os.path.join(out_dir, "dry_run.json"), "w")).write("{}")
    return 0


@pytest.mark.parametrize("held", [{"config.json": json.dumps(SMALL.to_hf_dict("float32")), "model.safetensors": "w"},
                                  {"config.json": json.dumps({"run": {"seed": 7}}), "metrics.jsonl": "{}\n"}],
                         ids=["model", "run"])
def test_a_dry_run_into_an_occupied_directory_writes_only_its_figures(tmp_path, capsys, monkeypatch, held):
    out = tmp_path / "occupied"
    out.mkdir()
    for name, text in held.items():
        (out / name).write_text(text)
    monkeypatch.setattr(runner, "_dry_run", _plan)
    assert cli.main("gsm8k", ["--dry-run", "--no-compile-cache", "--out", str(out), *SHAPES]) == 0
    assert sorted(os.listdir(out)) == sorted([*held, "dry_run.json"])
    for name, text in held.items():
        assert (out / name).read_text() == text


def test_a_dry_run_in_a_new_directory_records_its_config_and_the_run_follows(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setattr(runner, "_dry_run", _plan)
    assert cli.main("gsm8k", ["--dry-run", "--no-compile-cache", "--out", str(out), *SHAPES]) == 0
    assert sorted(os.listdir(out)) == ["config.json", "dry_run.json"]
    assert json.load(open(out / "config.json"))["algorithm"]["n"] == 8
    monkeypatch.setattr(runner, "_train_and_export", lambda *args: 0)
    assert cli.main("gsm8k", ["--no-compile-cache", "--out", str(out), *SHAPES]) == 0


def test_the_rollout_options_take_one_eos_id_as_the_generator_does():
    # An int had failed in tuple() ("'int' object is not iterable"), where Generator takes it.
    from podsjax.devices import dry_run
    from podsjax.update import algorithms

    algo = algorithms.AlgorithmConfig(n=4, m=2, algorithm="pods")
    assert dry_run.rollout_options(algo, 8, 2, 0)["eos_token_ids"] == (2,)
    assert dry_run.rollout_options(algo, 8, [2, 5], 0)["eos_token_ids"] == (2, 5)


@pytest.mark.parametrize("n, printed", [(3 * 2**20, "3.0 MiB"), (5 * 2**30, "5.00 GiB"), (1536, "1.5 KiB"),
                                        (2**30 - 2**20, "1023.0 MiB")])
def test_sizes_print_in_binary_units(n, printed):
    assert dry_run_lib.human_bytes(n) == printed


def test_a_full_fine_tune_in_its_own_dtype_counts_its_weights_once():
    base = {"w": jnp.zeros((8, 8), jnp.float32)}  # 256 bytes
    assert dry_run_lib._param_bytes(base, base, None) == 256  # trains the weights the sampler reads
    assert dry_run_lib._param_bytes(jax.tree.map(lambda x: x.astype(jnp.bfloat16), base), base, None) == 128 + 256
    assert dry_run_lib._param_bytes(base, {"a": jnp.zeros((8, 2), jnp.float32)}, base) == 256 + 64 + 256  # LoRA, KL ref
