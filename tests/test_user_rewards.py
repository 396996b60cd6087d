"""--reward: the task's weights by name, and the user's own reward functions by module:function."""

import pytest

from experiments import cli, flags, runner
from podsjax import rewards


def _config(tmp_path, *given):
    return flags.parse("gsm8k", [*given, "--out", str(tmp_path / "run"), "--max-steps", "1"])[1]


def test_task_weights_by_name_and_user_functions_by_module(tmp_path):
    config = _config(tmp_path, "--reward", "format=0", "--reward", "user_rewards:brevity=0.5",
                     "--reward", "strict_format")
    assert config.rewards.format == 0.0
    assert config.rewards.extras() == [("user_rewards:brevity", 0.5), ("strict_format", 1.0)]
    weighted = runner.make_rewards(config)
    assert [(w.name, w.weight) for w in weighted] == [
        ("accuracy", 1.0), ("format", 0.0), ("tag_count", 1.0), ("user_rewards:brevity", 0.5),
        ("strict_format", 1.0)]
    completions = ["<think>x</think><answer>4</answer>", "<think>" + "x" * 60 + "</think><answer>5</answer>"]
    with rewards.RewardPool(1) as pool:  # workers import the user's module on their own
        scores = pool.score(completions, weighted, answer=["4", "4"])
    assert list(scores.per_function["user_rewards:brevity"]) == [1.0, 0.0]
    assert list(scores.total_B) == pytest.approx([1.0 + 0.5 + 1.0 + 1.0, 0.0 + 0.0 + 1.0 + 1.0])


@pytest.mark.parametrize("flag,message", [
    ("nosuch_module_xyz:fn", "reward 'nosuch_module_xyz:fn' cannot be imported (ModuleNotFoundError"),
    ("user_rewards:missing", "cannot be imported (AttributeError"),
    ("user_rewards:NOT_A_FUNCTION", "is not a function"),
    ("nosuch", "unknown reward 'nosuch'"),
    ("format=abc", "the weight after '=' must be a number"),
    ("format=inf", "the weight must be finite"),
    ("=2", "give a reward name"),
])
def test_bad_rewards_are_one_line_before_anything_is_written(tmp_path, capsys, flag, message):
    out = tmp_path / "never"
    assert cli.main("gsm8k", ["--reward", flag, "--out", str(out), "--max-steps", "1", "--no-compile-cache"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not out.exists()


def test_your_own_dataset_columns_reach_the_loader(tmp_path):
    import json

    rows = [{"prompt": f"What is {i} + {i}?", "final": str(2 * i)} for i in range(3)]
    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = _config(tmp_path, "--data", str(tmp_path), "--eval-data", str(tmp_path), "--prompt-column", "prompt",
                     "--answer-column", "final")
    assert config.data.columns("gsm8k") == {"question": "prompt", "answer": "final"}
    train, test = runner._load_tasks(config)
    assert [(e.prompt, e.answer) for e in test] == [(r["prompt"], r["final"]) for r in rows]
    without = _config(tmp_path, "--data", str(tmp_path), "--eval-data", str(tmp_path))
    with pytest.raises(cli.UsageError, match="missing field 'question'"):
        runner._load_tasks(without)
