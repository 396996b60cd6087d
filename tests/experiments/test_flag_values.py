"""A flag's or a config file's value means what it reads as, or is one line naming the field.

Numbers are read as YAML 1.2 reads them (``010`` is ten, ``1:30`` is not a number), a list
where one value belongs is refused by name, the list shortcuts take both of their spellings,
and a run that would train the same thing twice, start thousands of processes or write
where it cannot is refused before anything starts.
"""

import json
import types

import pytest

from experiments import compare, flags, run_setup
from experiments.usage import UsageError
from podsjax.data import prompts as prompts_lib
from podsjax.rl import prompt_source
from podsjax.rl.run_config import MAX_REWARD_WORKERS, RunConfig
from podsjax.rl.trainer import Trainer


def _config(tmp_path, text: str) -> list[str]:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return ["--config", str(path)]


@pytest.mark.parametrize("source", [["--n", "010"], ["--n", "+10"], "algorithm: {n: 010}\n"])
def test_an_integer_with_leading_zeros_is_decimal(tmp_path, source):
    # YAML 1.1 (PyYAML's) read 010 as octal: --n 010 trained 8 rollouts a prompt.
    argv = _config(tmp_path, source) if isinstance(source, str) else source
    assert flags.parse("gsm8k", argv)[1].algorithm.n == 10


@pytest.mark.parametrize("text", ["1:30", "0x10", "0b11", "1_6", "\u0661\u0666", "1.5_0"])
def test_a_number_yaml_1_1_would_read_otherwise_is_refused(tmp_path, one_line, text):
    # 1:30 was sexagesimal 90; 0x10 and 0b11 were 16 and 3. YAML 1.2 reads 1_6 as text, and
    # Python's int() then made it 16, as it made Arabic-Indic digits a number.
    err = one_line(["--n", text], tmp_path / "never")
    assert "algorithm.n" in err and repr(text) in err, err


@pytest.mark.parametrize("text,value", [("1e-5", 1e-5), ("2.5E-6", 2.5e-6), (".5", 0.5), ("3", 3.0)])
def test_floats_read_as_written(text, value):
    assert flags.parse("gsm8k", ["--lr", text])[1].algorithm.learning_rate == value


def test_a_text_field_keeps_digits_as_written():
    assert flags.parse("gsm8k", ["--system-prompt", "010"])[1].run.system_prompt == "010"


@pytest.mark.parametrize("source,message", [
    (["--n", "[4]"], "algorithm.n takes a number, not a list ([4])"),
    (["--n", "{a: 1}"], 'algorithm.n takes a number, not a mapping ({"a": 1})'),
    ("algorithm: {n: [4]}\n", "algorithm.n takes a number, not a list ([4])"),
    (["--run.progress", "[true]"], "run.progress takes true or false, not a list ([true])"),
    (["--eval-k", "[[1]]"], "run.eval_k's item takes a number, not a list ([1])"),
    (["--log", "[[jsonl]]"], 'run.log\'s item takes text, not a list (["jsonl"])'),
])
def test_a_list_where_one_value_belongs_is_one_line_naming_the_field(tmp_path, one_line, source, message):
    # draccus had said "decode_int() missing 1 required positional argument: 'path'".
    argv = _config(tmp_path, source) if isinstance(source, str) else source
    err = one_line(argv, tmp_path / "never")
    assert message in err and "decode_int" not in err, err


@pytest.mark.parametrize("argv", [["--eval-k", "1,4"], ["--eval-k", "[1, 4]"], ["--run.eval_k", "[1,4]"]])
def test_the_list_shortcuts_take_the_list_syntax_too(argv):
    run = flags.parse("gsm8k", [*argv, "--eval-repeats", "4", "--eval-temperature", "0.9"])[1].run
    assert run.eval_k == (1, 4)


@pytest.mark.parametrize("value", ["jsonl", "[jsonl]", " [jsonl] "])
def test_log_takes_one_backend_in_either_spelling(value):
    assert flags.parse("gsm8k", ["--log", value])[1].run.log == ("jsonl",)


@pytest.mark.parametrize("rewards,message", [
    (["format=0", "format=1"], "--reward format is given twice"),
    (["my_rewards:brevity", "my_rewards:brevity=2"], "rewards.extra names reward 'my_rewards:brevity' twice"),
])
def test_a_reward_given_twice_is_refused(tmp_path, one_line, rewards, message):
    # The task's own kept the last weight unseen; an extra one was scored twice and summed.
    err = one_line([arg for spec in rewards for arg in ("--reward", spec)], tmp_path / "never")
    assert message in err, err


def test_reward_workers_are_capped(tmp_path, one_line):
    err = one_line(["--reward-workers", "100000"], tmp_path / "never")
    assert f"reward_workers must be at most {MAX_REWARD_WORKERS}" in err, err
    assert flags.parse("gsm8k", ["--reward-workers", str(MAX_REWARD_WORKERS)])[1].run.reward_workers == 256


def test_a_quoted_home_in_out_names_the_home(tmp_path, monkeypatch):
    # '~/runs/x' quoted had made a folder named "~" in the working directory.
    monkeypatch.setenv("HOME", str(tmp_path))
    assert flags.parse("gsm8k", ["--out", "~/runs/x"])[0].out == str(tmp_path / "runs" / "x")
    assert flags.parse("gsm8k", ["--run.out_dir", "~/runs/y"])[0].out == str(tmp_path / "runs" / "y")
    both = ["--out", "~/runs/y", "--run.out_dir", "~/runs/y"]  # one folder, both spelled with the home
    assert flags.parse("gsm8k", both)[0].out == str(tmp_path / "runs" / "y")
    assert compare.parse(["--out", "~/cmp"])[0].out == str(tmp_path / "cmp")


def test_compare_refuses_an_empty_method_list():
    # It had run the default methods.
    with pytest.raises(UsageError, match="--methods must name grpo, grpo-ga or pods; got ''"):
        compare.parse(["--out", "x", "--methods", ""])


def test_an_out_under_a_file_is_one_line_before_anything_loads(tmp_path, one_line):
    (tmp_path / "f").write_text("")
    err = one_line(["--max-steps", "1"], tmp_path / "f" / "run")
    assert f"{tmp_path / 'f'} is a file, so the run directory cannot be made under it" in err, err


def test_a_step_of_more_prompts_than_the_training_set_is_refused():
    # The endless shuffle had put some examples into one step twice, each as its own group.
    prompt_source.check_step_size(3, 3)
    tiny = flags.parse("gsm8k", ["--prompts-per-step", "2048", "--max-steps", "1"])[1]
    with pytest.raises(prompts_lib.PromptError, match="more than the training set's 2000 examples"):
        run_setup.check_sizes(tiny)  # before the tiny preset warms up
    with pytest.raises(prompts_lib.PromptError, match="prompts_per_step 4 is more than the training set's 3"):
        prompt_source.check_step_size(3, 4)
    stream = prompt_source.DataStream(["a", "b", "c"], seed=0)
    source = prompt_source.PromptSource(None, stream, max_prompt_length=8, system_prompt=None, log=print)
    with pytest.raises(prompts_lib.PromptError, match="prompts_per_step 4"):
        source.check_next(4)


def test_prompt_and_completion_past_the_model_s_positions_are_refused(tmp_path):
    run = RunConfig(out_dir=str(tmp_path), max_steps=1, max_prompt_length=512, max_new_tokens=512)
    run.check_positions(1024)
    with pytest.raises(ValueError, match="512 \\+ max_new_tokens 512 = 1024 tokens is more than the model's "
                                         "max_position_embeddings 1000"):
        run.check_positions(1000)
    model = types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=1000))
    with pytest.raises(ValueError, match="max_position_embeddings 1000"):  # the library's own runs too
        Trainer(model, None, None, [], [], None, run)


def test_the_cli_checks_positions_from_the_checkpoint_s_config(tmp_path):
    from podsjax.tiny import build

    checkpoint = tmp_path / "model"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(build.tiny_model(max_position_embeddings=600).to_hf_dict()))
    config = flags.parse("gsm8k", ["--model", str(checkpoint), "--max-steps", "1", "--max-prompt-length", "512",
                                   "--max-completion-length", "128"])[1]
    with pytest.raises(UsageError, match=f"--model {checkpoint}'s max_position_embeddings 600"):
        run_setup.check_sizes(config)
    tiny = flags.parse("gsm8k", ["--max-completion-length", "2000", "--max-steps", "1"])[1]
    with pytest.raises(UsageError, match="the tiny preset's model's max_position_embeddings 1024"):
        run_setup.check_sizes(tiny)


@pytest.mark.parametrize("changes,message", [
    (dict(out_dir=None), "out_dir must be the run directory's path; got None"),
    (dict(task="gsm9k"), "task must be one of gsm8k, math, chemistry; got 'gsm9k'"),
    (dict(keep_best="no"), "keep_best must be true or false; got 'no'"),  # "no" had kept the best
    (dict(progress=1), "progress must be true or false"),
])
def test_run_config_fields_of_another_kind_are_one_line(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        RunConfig(**{"out_dir": str(tmp_path), "max_steps": 1, **changes})


@pytest.mark.parametrize("text", [
    "Reason step by step, then write the final answer after #### on the last line.",  # YAML had cut it at " #"
    "# Role\nYou are a careful math tutor.",  # had lost its first line
    "# Instructions: solve the problem",  # had been null: no system prompt at all
    "&anchor text", "|", ">", "Answer: a number", "yes", "010", "[a, b]",
])
def test_a_text_flag_is_taken_as_written(text):
    assert flags.parse("gsm8k", ["--system-prompt", text])[1].run.system_prompt == text


def test_a_text_flag_reads_null_and_a_quoted_text():
    assert flags.parse("gsm8k", ["--system-prompt", "null"])[1].run.system_prompt is None
    assert flags.parse("gsm8k", ["--system-prompt", "'null'"])[1].run.system_prompt == "null"
    assert flags.parse("gsm8k", ["--wandb-project", "exp #3"])[1].run.wandb_project == "exp #3"


@pytest.mark.parametrize("value,shown", [("off", "bool false"), ("yes", "bool true"), ("1.50", "float 1.5")])
def test_a_config_file_s_bare_number_or_boolean_for_a_text_field_is_refused(tmp_path, one_line, value, shown):
    # `system_prompt: off` had become the prompt 'False', and 1.50 the text '1.5'.
    err = one_line(_config(tmp_path, f"run: {{system_prompt: {value}}}\n"), tmp_path / "never")
    assert f"run.system_prompt takes text, not the {shown}; quote it to mean the text" in err, err
    quoted = _config(tmp_path, f"run: {{system_prompt: '{value}'}}\n")
    assert flags.parse("gsm8k", quoted)[1].run.system_prompt == value


def test_a_config_file_s_integer_for_a_text_field_reads_as_written(tmp_path):
    assert flags.parse("gsm8k", _config(tmp_path, "model: {mesh: 8}\n"))[1].model.mesh == "8"


def test_lora_alpha_reaches_the_lora_config():
    # The default alpha equals the default rank, so only other values show the scale.
    config = flags.parse("gsm8k", ["--lora-rank", "8", "--lora-alpha", "16"])[1]
    assert (config.lora.rank, config.lora.alpha) == (8, 16)


def test_the_tiny_presets_settings_with_a_model_are_refused_in_one_line(tmp_path):
    with pytest.raises(UsageError, match="belong to the tiny preset; they mean nothing with a model.path"):
        flags.parse("gsm8k", ["--model", str(tmp_path), "--warmup-steps", "5", "--max-steps", "1"])


def test_out_and_run_out_dir_naming_one_directory_are_one_run_directory():
    assert flags.parse("gsm8k", ["--out", "x/", "--run.out_dir", "x", "--max-steps", "1"])[0].out == "x"
