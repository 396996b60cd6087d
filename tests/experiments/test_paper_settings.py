"""The presets: the paper's settings a-f (the table's letters, the authors' defaults) and tiny; valid configs."""

import math
import re

import pytest

from podsjax import rl
from podsjax.update import algorithms
from experiments import paper_settings
from podsjax.rewards import default_rewards

# The paper's table: task, model, hardware, LoRA rank (None = full fine-tune), mesh.
PAPER_TABLE = {
    "a": ("gsm8k", "Qwen/Qwen2.5-3B-Instruct", "1 L40S", 64, "1"),
    "b": ("gsm8k", "meta-llama/Llama-3.2-3B-Instruct", "1 L40S", 64, "1"),
    "c": ("math", "Qwen/Qwen2.5-3B-Instruct", "1 L40S", 64, "1"),
    "d": ("chemistry", "Qwen/Qwen2.5-3B-Instruct", "1 L40S", 64, "1"),
    "e": ("gsm8k", "Qwen/Qwen2.5-3B-Instruct", "8 H100", None, "8"),
    "f": ("gsm8k", "Qwen/Qwen2.5-7B-Instruct", "8 A100", None, "8"),
}
SINGLE, MULTI = "abcd", "ef"


def test_letters_follow_the_papers_table():
    assert list(paper_settings.SETTINGS) == list(PAPER_TABLE)
    for name, (task, model, hardware, rank, mesh) in PAPER_TABLE.items():
        s = paper_settings.get_setting(name.upper())
        assert (s.name, s.task, s.model, s.hardware, s.lora_rank, s.mesh) == (name, task, model, hardware, rank, mesh)
    with pytest.raises(ValueError, match="unknown setting 'z'; choose one of tiny, a, b, c, d, e, f"):
        paper_settings.get_setting("z")


@pytest.mark.parametrize("name", list(paper_settings.PRESETS))
def test_every_method_builds_valid_configs_and_rewards(name, tmp_path):
    s = paper_settings.get_setting(name)
    task = s.task or "gsm8k"
    for method in s.methods:
        config = algorithms.AlgorithmConfig(**s.algorithm_config(method))
        assert config.algorithm == method
    run = rl.RunConfig(out_dir=str(tmp_path), task=task, **s.run)
    assert run.task == task
    assert [w.name for w in default_rewards(task, **s.rewards)] == ["accuracy", "format", "tag_count"]
    described = s.describe(next(iter(s.methods)))
    for key in (*s.run, *s.rewards, *s.common, "lora_rank", "dtype"):
        assert f".{key} = " in described
    with pytest.raises(ValueError, match=f"setting {name} has no method 'ppo'"):
        s.algorithm_config("ppo")


def config(name, method):
    return algorithms.AlgorithmConfig(**paper_settings.get_setting(name).algorithm_config(method))


@pytest.mark.parametrize("name", SINGLE)
def test_single_gpu_defaults_are_the_authors(name):
    s = paper_settings.get_setting(name)
    c = config(name, "pods")
    assert (c.learning_rate, c.schedule, c.warmup_ratio) == (5e-6, "constant", 0.0)
    assert (c.adam_b1, c.adam_b2, c.weight_decay, c.max_grad_norm, c.temperature) == (0.9, 0.99, 0.1, 0.1, 0.9)
    assert c.update_temperature == 1.0  # maxvargrpo_trainer.py: the loss's log-probs at temperature 1
    assert c.aggregation == "seq-mean-token-mean"
    assert c.beta == (0.04 if name == "b" else 0.0)
    # Release 3fc107e for Qwen (MATH: correctness alone), commit 0c453d2 for Llama.
    expected = {"b": dict(accuracy=1.0, format=0.01, tag_count=0.01, format_style="authors-llama"),
                "c": dict(accuracy=1.0, format=0.0, tag_count=0.0, format_style="authors-release")}
    assert s.rewards == expected.get(name, dict(accuracy=1.0, format=1.0, tag_count=1.0,
                                                format_style="authors-release"))
    assert (s.run["prompts_per_step"], s.run["max_prompt_length"], s.run["max_new_tokens"]) == (1, 512, 512)
    # [1gpu] evaluation: 5 passes sampled at 0.9 with 512 new tokens, averaged.
    run = rl.RunConfig(out_dir="unused", task=s.task, **s.run)
    assert (run.eval_repeats, run.eval_temperature, run.eval_top_k, run.max_new_tokens) == (5, 0.9, 0, 512)
    hours, every = (1.5, 600.0) if name == "b" else (6.0, 1800.0)
    assert s.run["time_budget_s"] == hours * 3600 and s.run["eval_every_s"] == every
    assert run.eval_metric == ("accuracy_and_format" if name == "b" else "accuracy")


@pytest.mark.parametrize("name,grpo,pods", [("a", 16, (64, 16)), ("b", 16, (64, 16)), ("c", 8, (32, 8)),
                                            ("d", 16, (64, 16))])
def test_single_gpu_rollout_counts(name, grpo, pods):
    assert (config(name, "grpo").n, config(name, "grpo").m) == (grpo, grpo)
    assert (config(name, "pods").n, config(name, "pods").m) == pods
    ga = config(name, "grpo-ga")  # PODS's n rollouts, all trained, in micro-batches of PODS's m
    assert (ga.n, ga.m, ga.grad_accum) == (pods[0], pods[0], pods[0] // pods[1])


@pytest.mark.parametrize("name", MULTI)
def test_eight_gpu_settings_follow_the_run_script(name):
    s = paper_settings.get_setting(name)
    assert set(s.methods) == {"grpo-ga", "pods"}  # the paper's two methods at this scale
    # No 7B recipe or script: f's sizes are its run names in scripts/plot-a100s.py, the rest e's recipe.
    own = {"e": "exp.sh (pods_full_size)", "f": "scripts/plot-a100s.py run names"}[name]
    assert own in s.source("algorithm.n") and ("no 7B one" in s.source("algorithm.learning_rate")) == (name == "f")
    c = config(name, "pods")
    # config_pods.yaml, the recipe exp.sh names: a cosine over the epoch with 10 % warm-up.
    assert (c.learning_rate, c.schedule, c.warmup_ratio) == (2e-5, "cosine", 0.1)
    assert (c.adam_b1, c.adam_b2, c.weight_decay, c.max_grad_norm) == (0.9, 0.999, 0.0, 1.0)
    # Each micro-batch one group, TRL's bnpo its token mean: the mean of the groups' token means.
    assert (c.beta, c.aggregation, c.loss_config.group_size) == (0.0, "group-token-mean", 32)
    # grpo_trainer.py: log-probs at the sampling temperature, TRL's top_k 50 in generate.
    assert (c.temperature, c.update_temperature, c.top_k) == (0.9, 0.9, 50)
    assert s.rewards == dict(accuracy=1.0, format=1.0, tag_count=1.0, format_style="open-r1")
    assert (s.run["prompts_per_step"], s.run["max_new_tokens"], s.run["eval_every_s"]) == (8, 1024, 120.0)
    # Capped at 40 min of training clock (and at one epoch: see below).
    assert s.run["time_budget_s"] == 2400.0
    run = rl.RunConfig(out_dir="unused", task=s.task, **s.run)
    # One pass sampled as training samples: my_evaluate uses the training GenerationConfig.
    assert (run.eval_repeats, run.eval_temperature, run.eval_top_k, run.eval_metric) == (1, 0.9, 50, "accuracy")
    assert run.system_prompt.startswith("You are a helpful AI Assistant") and "<think>\n...\n</think>" in run.system_prompt
    # GRPO-GA: n = m = 32, 16 accumulation steps; PODS: n = 128, m = 32, 4 accumulation steps.
    ga = config(name, "grpo-ga")
    assert (ga.n, ga.m, ga.grad_accum) == (32, 32, 16)
    assert (c.n, c.m, c.grad_accum) == (128, 32, 4)


def hf_cosine(step, peak, warmup, total):
    """transformers' get_cosine_schedule_with_warmup, the rate of update ``step`` (from 0)."""
    if step < warmup:
        return peak * step / warmup
    return peak * max(0.0, 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup))))


@pytest.mark.parametrize("name", MULTI)
@pytest.mark.parametrize("method,updates,warmup", [("pods", 233, 24), ("grpo-ga", 58, 6)])
def test_eight_gpu_schedules_are_one_epoch_as_the_authors_trainer_steps_it(name, method, updates, warmup):
    # 7473 GSM8K train rows, one prompt per GPU a dataloader batch: 934 batches on each of
    # the 8; Hugging Face counts len(dataloader) // gradient_accumulation_steps updates
    # (grad_accum 4 for PODS, 16 for GRPO-GA) and ceil(0.1 x updates) of them warm up.
    c = config(name, method)
    assert paper_settings.epoch_updates(7473, 8, c.grad_accum) == updates
    assert (c.total_steps, c.warmup_steps) == (updates, warmup)
    s = paper_settings.get_setting(name)
    assert s.values(method)["run"]["max_steps"] == updates  # the epoch ends the run too
    schedule = algorithms.learning_rate_schedule(c)
    for step in range(updates + 1):
        assert float(schedule(step)) == pytest.approx(hf_cosine(step, 2e-5, warmup, updates), rel=1e-5, abs=1e-12)
    lines = [line for line in s.describe(method).splitlines() if ".total_steps = " in line or ".max_steps = " in line]
    assert len(lines) == 2
    for line in lines:
        assert f" = {updates}  [8gpu] " in line and f"{updates} updates, {warmup} of them warm-up" in line


def test_bad_setting_fields_raise_one_line_errors():
    base = paper_settings.get_setting("a")
    fields = {f: getattr(base, f) for f in ("name", "model", "task", "lora_rank", "dtype", "methods", "common",
                                             "run")}
    with pytest.raises(ValueError, match="lora_rank must be >= 1 or None"):
        paper_settings.Setting(**{**fields, "lora_rank": 0})


@pytest.mark.parametrize("changes,message", [
    (dict(eval_metric="both"), "eval_metric must be one of accuracy, accuracy_and_format"),
    (dict(eval_repeats=0), "eval_repeats must be >= 1"),
    (dict(eval_temperature=-0.1), "eval_temperature must be >= 0"),
    (dict(eval_temperature=float("nan")), "eval_temperature must be a finite number; got nan"),
    (dict(eval_temperature=0.0), "eval_repeats 5 needs eval_temperature > 0"),
    (dict(eval_top_k=-1), "eval_top_k must be >= 0"),
    (dict(eval_top_k=2.5), "eval_top_k must be an integer"),
])
def test_a_settings_run_with_a_bad_eval_protocol_is_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        rl.RunConfig(out_dir="unused", **{**paper_settings.get_setting("a").run, **changes})


@pytest.mark.parametrize("name", ["a", "b", "c", "d"])
def test_single_gpu_runs_ask_in_the_authors_words(name):
    # utils/data.py's SYSTEM_PROMPT_INSTRUCT reaches the run's config, and the setting's
    # description shows it on one line.
    s = paper_settings.get_setting(name)
    run = rl.RunConfig(out_dir="unused", task=s.task, **s.run)
    assert run.system_prompt.startswith("\nYou will be given a math question.\n")
    assert "<think>\nReason here." in run.system_prompt and run.system_prompt.endswith("</answer>\n")
    described = [line for line in s.describe("pods").splitlines() if "run.system_prompt" in line]
    assert len(described) == 1 and "\\n" in described[0]


@pytest.mark.parametrize("name", sorted(paper_settings.PRESETS))
@pytest.mark.parametrize("method", ["grpo-ga", "pods"])
def test_every_value_a_setting_sets_names_its_source(name, method):
    lines = paper_settings.get_setting(name).describe(method).splitlines()
    untagged = [line for line in lines if not re.search(r"  \[(paper|1gpu|8gpu|podsjax)\]( \S.*)?$", line)]
    assert not untagged, untagged



def test_the_tiny_preset_runs_any_task_at_the_sizes_measured_on_a_cpu():
    tiny = paper_settings.get_setting("tiny")
    assert tiny is paper_settings.TINY
    assert (tiny.task, tiny.model, tiny.lora_rank, tiny.mesh) == (None, None, None, None)
    pods, grpo, ga = (config("tiny", method) for method in ("pods", "grpo", "grpo-ga"))
    assert (pods.n, pods.m, pods.learning_rate, pods.temperature) == (16, 4, 2e-4, 1.0)
    # GRPO trains as many rollouts as PODS trains; GRPO-GA all of PODS's n in micro-batches of its m.
    assert (grpo.n, grpo.m) == (4, 4) and (ga.n, ga.m, ga.grad_accum) == (16, 16, 4)
    assert tiny.values("pods")["model"] == {"lora_rank": None, "dtype": "float32"}  # no checkpoint, any mesh
    run = rl.RunConfig(out_dir="unused", **tiny.run)
    # Every tiny prompt fits, and a step's rollout rows split evenly over 8 devices.
    assert (run.prompts_per_step * pods.n) % 8 == 0 and run.max_prompt_length >= 112


def test_settings_are_read_only_and_method_config_reads_their_sizes():
    with pytest.raises(TypeError):
        paper_settings.get_setting("a").run["max_new_tokens"] = 1
    for method, sizes in paper_settings.GSM8K_METHODS.items():
        assert {key: getattr(paper_settings.method_config(method), key) for key in sizes} == dict(sizes)
        assert paper_settings.get_setting("a").methods[method] == sizes
