"""The config tree: defaults, named settings, a config file and dotted flags, in that order; one-line errors."""

import json

import pytest

from experiments import cli, config_decoding, flags
from experiments.config import ExperimentConfig
from experiments.usage import UsageError
from experiments import paper_settings


def parse(*argv, task="gsm8k"):
    return flags.parse(task, list(argv))[1]


def test_every_field_is_a_dotted_flag_and_shortcuts_name_the_same_fields(tmp_path):
    config = parse("--algorithm.epsilon_high", "0.28", "--algorithm.top_p", "0.95", "--model.lora_rank", "null",
                   "--rewards.extra", "[my_rewards:brevity=0.1]", "--tiny.warmup_steps", "5", "--n", "32")
    assert config.algorithm.epsilon_high == 0.28 and config.algorithm.top_p == 0.95 and config.model.lora_rank is None
    assert config.rewards.extras() == [("my_rewards:brevity", 0.1)] and config.tiny.warmup_steps == 5
    assert config.algorithm.n == 32
    for flag, field in flags.SHORTCUTS.items():  # each shortcut names a real field
        section, name = field.split(".")
        assert name in {f for f in type(getattr(config, section)).__dataclass_fields__}, flag


def test_values_come_from_defaults_then_method_then_setting_then_file_then_flags(tmp_path):
    checkpoint = str(tmp_path)
    base = parse("--model", checkpoint, "--max-steps", "1")  # a real model, no setting: the method's n / m
    assert (base.algorithm.n, base.algorithm.m, base.algorithm.algorithm) == (64, 16, "pods")
    assert base.run.max_new_tokens == 512 and base.model.lora_rank == 64
    a = parse("--model", checkpoint, "--setting", "a")
    assert a.algorithm.aggregation == "seq-mean-token-mean" and a.run.eval_repeats == 5 and a.model.dtype == "bfloat16"
    assert a.rewards.format_style == "authors-release" and a.model.hub_name == paper_settings.get_setting("a").model
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text("algorithm: {n: 32, m: 8}\nrun: {eval_repeats: 3}\nmodel: {lora_rank: 16}\n")
    filed = parse("--model", checkpoint, "--setting", "a", "--config", str(run_yaml), "--m", "4")
    assert (filed.algorithm.n, filed.algorithm.m) == (32, 4)  # the file over the setting, the flag over the file
    assert filed.run.eval_repeats == 3 and filed.model.lora_rank == 16
    assert filed.algorithm.aggregation == "seq-mean-token-mean"  # the setting's, untouched
    tiny = parse()  # no model: the tiny preset
    assert (tiny.algorithm.n, tiny.algorithm.m, tiny.model.lora_rank, tiny.run.time_budget_s) == (16, 4, None, 240.0)


def test_a_runs_config_json_starts_a_new_run_like_it(tmp_path):
    config = parse("--model", str(tmp_path), "--setting", "a", "--n", "32", "--out", str(tmp_path / "old"))
    saved = tmp_path / "config.json"
    saved.write_text(json.dumps(config_decoding.as_json(config)))
    again = parse("--model", str(tmp_path), "--config", str(saved), "--out", str(tmp_path / "new"))
    assert config_decoding.as_json(again) == config_decoding.as_json(config)


def test_one_method_per_run_from_the_flag_or_the_file(tmp_path):
    # A file's algorithm.algorithm had silently trained its own method under --method's name (and
    # compare's), and without --method the preset's n / m came from PODS whatever the file said.
    pods_file, grpo_file = tmp_path / "pods.yaml", tmp_path / "grpo.yaml"
    pods_file.write_text("algorithm: {algorithm: pods, n: 8, m: 2}\n")
    grpo_file.write_text("algorithm: {algorithm: grpo-ga}\n")
    for argv, named in ((["--method", "grpo", "--config", str(pods_file)], f"--method grpo and --config {pods_file}'s"),
                        (["--method", "pods", "--algorithm.algorithm", "grpo"], "--method pods and --algorithm.algorithm")):
        with pytest.raises(UsageError, match=f"^{named}.* name different methods; name one"):
            parse(*argv)
    with pytest.raises(UsageError, match=f"^the comparison's method grpo and --config {pods_file}'s"):
        flags.parse("gsm8k", ["--config", str(pods_file), "--out", str(tmp_path / "o")], method="grpo")
    ga = parse("--config", str(grpo_file))  # the file's method chooses the preset
    expected = paper_settings.method_config("grpo-ga", **paper_settings.TINY.methods["grpo-ga"])
    assert (ga.algorithm.algorithm, ga.algorithm.n, ga.algorithm.m, ga.algorithm.grad_accum) == (
        "grpo-ga", expected.n, expected.m, expected.grad_accum)
    assert parse("--method", "pods", "--config", str(pods_file)).algorithm.m == 2  # agreeing is fine


def test_run_out_dir_is_out_on_the_command_line_only(tmp_path):
    # --help lists it as the run directory; it had been ignored for a new dated one.
    args, config = flags.parse("gsm8k", ["--run.out_dir", str(tmp_path / "a"), "--max-steps", "1"])
    assert args.out == config.run.out_dir == str(tmp_path / "a")
    with pytest.raises(UsageError, match="name two run directories; pass one"):
        flags.parse("gsm8k", ["--run.out_dir", str(tmp_path / "a"), "--out", str(tmp_path / "b")])
    old = tmp_path / "old.yaml"
    old.write_text(f"run: {{out_dir: {tmp_path / 'old'}}}\n")  # an old run's config names its own directory
    args, config = flags.parse("gsm8k", ["--config", str(old), "--out", str(tmp_path / "new")])
    assert config.run.out_dir == str(tmp_path / "new")


def test_each_named_setting_gives_a_valid_config(tmp_path):
    for name, setting in paper_settings.PRESETS.items():
        task = setting.task or "gsm8k"
        for method in setting.methods:
            model = [] if name == "tiny" else ["--model", str(tmp_path)]
            config = parse("--setting", name, "--method", method, *model, "--max-steps", "1", task=task)
            assert isinstance(config, ExperimentConfig) and config.algorithm.algorithm == method


def test_resume_reads_config_json_back_and_may_change_only_the_budget(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    config = parse("--model", str(tmp_path), "--max-steps", "2", "--out", str(out))
    (out / "config.json").write_text(json.dumps(config_decoding.as_json(config)))
    args, none = flags.parse("gsm8k", ["--resume", "--out", str(out), "--max-steps", "5", "--remat", "dots"])
    assert none is None
    resumed = config_decoding.read_run_config(str(out), args.field_flags)
    assert resumed.run.max_steps == 5 and resumed.model.remat == "dots" and resumed.run.out_dir == str(out)
    expected = config_decoding.as_json(config)
    expected["run"]["max_steps"], expected["model"]["remat"] = 5, "dots"
    assert config_decoding.as_json(resumed) == expected  # everything else as the run was
    with pytest.raises(UsageError, match="--resume keeps the run's config; --algorithm.n cannot change"):
        flags.parse("gsm8k", ["--resume", "--out", str(out), "--n", "8"])
    assert cli.main("gsm8k", ["--resume", "--out", str(out), "--lr", "1"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_help_lists_launch_flags_shortcuts_and_every_field_with_its_comment(capsys):
    assert cli.main("gsm8k", ["--help"]) == 0
    text = capsys.readouterr().out
    for words in ("--resume", "--config FILE", "--n VALUE", "= --algorithm.n", "--algorithm.epsilon_high",
                  "upper clip range", "--run.eval_temperature", "evaluation sampling temperature",
                  "--model.lora_rank", "--rewards.extra", "--tiny.warmup_dir"):
        assert words in text, words


@pytest.mark.parametrize("argv,message", [
    (["--config", "{file}"], "not YAML or JSON"),
    (["--algorithm.n", "16", "--algorithm.m", "32"], "AlgorithmConfig: need 2 <= m <= n (a group of one rollout has advantage 0 and trains nothing); got n=16, m=32"),
    (["--model.dtype", "float16"], "model.dtype must be one of float32, bfloat16; got 'float16'"),
    (["--rewards.format_style", "loose"], "rewards.format_style must be one of exact, score"),
    (["--rewards.extra", "[x=abc]"], "the weight after '=' must be a number"),
    (["--run.log", "[jsonl,csv]"], "unknown log backend 'csv'"),
])
def test_bad_values_are_one_line_naming_the_field(tmp_path, capsys, argv, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text("algorithm: [unclosed\n")
    argv = [a.replace("{file}", str(bad)) for a in argv]
    assert cli.main("gsm8k", [*argv, "--out", str(tmp_path / "never")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "never").exists()
