"""Where each value of a run's config comes from: the default, the method, the setting, --config or a flag."""

import pytest

from experiments import config as config_lib
from experiments import config_decoding, flags
from experiments.usage import UsageError


def parse(*argv, task="gsm8k"):
    return flags.parse(task, list(argv))


def test_each_value_names_the_setting_file_or_flag_that_gave_it(tmp_path):
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text("run: {eval_repeats: 3}\n")
    args, config = parse("--model", str(tmp_path), "--setting", "a", "--config", str(run_yaml), "--lr", "1e-5",
                         "--algorithm.top_p", "0.95", "--full", "--reward", "format=0.5")
    origins = args.origins
    assert origins["algorithm.learning_rate"] == "--lr" and origins["algorithm.top_p"] == "--algorithm.top_p"
    assert origins["model.lora_rank"] == "--full" and origins["model.path"] == "--model"
    assert origins["run.eval_repeats"] == f"--config {run_yaml}"
    assert origins["rewards.format"] == "--reward"
    assert origins["algorithm.aggregation"] == "setting a [1gpu] trainer/maxvargrpo_trainer.py"
    assert origins["run.task"] == "experiments.gsm8k"
    assert "algorithm.epsilon" not in origins  # the default
    assert (config.algorithm.learning_rate, config.run.eval_repeats, config.rewards.format) == (1e-5, 3, 0.5)


def test_without_a_setting_the_methods_sizes_come_from_the_method():
    args, config = parse("--model", "/unused", "--method", "grpo-ga", "--max-steps", "1")
    assert (config.algorithm.n, config.algorithm.grad_accum) == (64, 4)
    assert args.origins["algorithm.n"] == args.origins["algorithm.grad_accum"] == "method grpo-ga"
    assert "run.max_new_tokens" not in args.origins


def test_one_of_n_and_m_sets_both_for_grpo_and_says_so():
    args, config = parse("--method", "grpo", "--m", "8")
    assert (config.algorithm.n, config.algorithm.m) == (8, 8)
    assert args.origins["algorithm.n"] == args.origins["algorithm.m"] == "--m (grpo: n = m)"
    assert parse("--method", "grpo-ga", "--n", "8", "--m", "8")[1].algorithm.n == 8
    # Both, differing: --m had won without a word (n 16, m 4 ran as n = m = 4).
    with pytest.raises(UsageError, match=r"^grpo trains every rollout \(n = m\), and --n 16 and --m 4 "
                                         r"differ: give one of them, or use --method pods$"):
        parse("--method", "grpo", "--n", "16", "--m", "4")
    with pytest.raises(UsageError, match=r"and --algorithm.n 16 and --m 8 differ"):  # the flags as typed
        parse("--algorithm.algorithm", "grpo", "--algorithm.n=16", "--m", "8")
    assert parse("--method", "grpo", "--n", "16", "--m", "016")[1].algorithm.m == 16
    # A value the project refuses anywhere is refused here too, not dropped for the other flag's.
    with pytest.raises(UsageError, match="algorithm.n must be a number written in decimal; got '1_6'"):
        parse("--method", "grpo", "--n", "1_6", "--m", "16")


def test_the_listing_shows_every_value_once_with_its_origin(tmp_path):
    args, config = parse("--model", str(tmp_path), "--setting", "a", "--lr", "1e-5", "--eval-limit", "10")
    text = config_lib.describe_setting("a", "pods", config, args.origins)
    lines = text.splitlines()
    assert lines[0] == "setting a: gsm8k / Qwen/Qwen2.5-3B-Instruct / LoRA r 64 / 1 L40S / mesh 1  [paper]"
    assert "  algorithm.aggregation = seq-mean-token-mean  setting a [1gpu] trainer/maxvargrpo_trainer.py" in lines
    assert "  set over the setting: algorithm.learning_rate = 1e-05 (setting: 5e-06)  --lr" in lines
    assert "  run.eval_limit = 10  --eval-limit" in lines
    algorithm_defaults = next(line for line in lines if line.startswith("  algorithm defaults: "))
    assert "epsilon = 0.2" in algorithm_defaults and "epsilon_high = null" in algorithm_defaults
    # Every field of the config appears once (the run directory is --out's, left out).
    for section in ("run", "model", "algorithm", "rewards", "data", "tiny"):
        for key in config_decoding.as_json(config)[section]:
            named = [line for line in lines if f"{section}.{key} = " in line
                     or line.startswith(f"  {section} defaults: ") and f" {key} = " in line]
            assert len(named) == 1, (section, key, named)


def test_without_origins_a_value_off_the_setting_is_a_flag_or_the_config_file(tmp_path):
    _, config = parse("--model", str(tmp_path), "--setting", "a", "--max-completion-length", "8", "--seed", "3")
    lines = config_lib.describe_setting("a", "pods", config).splitlines()
    assert "  set over the setting: run.max_new_tokens = 8 (setting: 512)  a flag or --config" in lines
    assert "  run.seed = 3  a flag or --config" in lines
    assert "  rewards.format_style = authors-release  setting a [1gpu] release 3fc107e utils/data.py" in lines


def test_the_tiny_preset_is_a_setting_like_the_papers():
    args, config = parse("--setting", "tiny", "--method", "pods")
    assert (config.algorithm.n, config.algorithm.m, config.model.lora_rank, config.run.time_budget_s) == (16, 4, None,
                                                                                                            240.0)
    text = config_lib.describe_setting("tiny", "pods", config, args.origins)
    assert text.startswith("setting tiny: any task / the built-in tiny model / full fine-tune / any CPU")
    assert "  run.eval_limit = 256  setting tiny [podsjax] measured on a 2-core CPU" in text.splitlines()
    _, math_config = parse("--setting", "tiny", task="math")  # any task
    assert math_config.run.task == "math"


def test_a_setting_of_another_task_is_refused_in_one_line(tmp_path):
    with pytest.raises(UsageError, match="setting c is a math setting; run experiments.math"):
        parse("--model", str(tmp_path), "--setting", "c")
