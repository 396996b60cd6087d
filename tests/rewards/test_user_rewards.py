"""--reward: the task's weights by name, and the user's own reward functions by module:function."""

import pytest

from experiments import cli, flags, run_setup
from podsjax import rewards
from child_env import child_env


def _config(tmp_path, *given):
    return flags.parse("gsm8k", [*given, "--out", str(tmp_path / "run"), "--max-steps", "1"])[1]


def test_task_weights_by_name_and_user_functions_by_module(tmp_path):
    config = _config(tmp_path, "--reward", "format=0", "--reward", "user_rewards:brevity=0.5",
                     "--reward", "strict_format")
    assert config.rewards.format == 0.0
    assert config.rewards.extras() == [("user_rewards:brevity", 0.5), ("strict_format", 1.0)]
    weighted = run_setup.make_rewards(config)
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
    train, test = run_setup._load_tasks(config)
    assert [(e.prompt, e.answer) for e in test] == [(r["prompt"], r["final"]) for r in rows]
    without = _config(tmp_path, "--data", str(tmp_path), "--eval-data", str(tmp_path))
    with pytest.raises(cli.UsageError, match="missing field 'question'"):
        run_setup._load_tasks(without)


def test_a_bad_data_file_is_refused_before_any_weight_is_read(tmp_path, capsys, monkeypatch):
    # It had come after the model's load began, and waited for that load (minutes at 7B).
    from tiny_checkpoint import save_tiny_checkpoint
    from experiments import runner

    model = save_tiny_checkpoint(tmp_path / "model")
    capsys.readouterr()  # the checkpoint writer's progress bar
    (tmp_path / "bad.jsonl").write_text('{"answer": "#### 4"}\n')
    monkeypatch.setattr(runner, "_load_model", lambda *a: pytest.fail("the model began to load"))
    out = tmp_path / "run"
    assert cli.main("gsm8k", ["--model", model, "--data", str(tmp_path / "bad.jsonl"), "--eval-data",
                              str(tmp_path / "bad.jsonl"), "--out", str(out), "--max-steps", "1",
                              "--no-compile-cache"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing field 'question'" in err, err
    assert not out.exists()


@pytest.mark.slow
def test_the_cli_trains_on_your_dataset_with_your_reward_and_system_prompt(tmp_path):
    import json
    import os
    import subprocess
    import sys

    from tiny_checkpoint import save_tiny_checkpoint

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    root = os.path.dirname(here)
    dataset = tmp_path / "mine"
    dataset.mkdir()
    rows = [{"prompt": f"What is {i} + {i}?", "final": str(2 * i), "level": i % 3} for i in range(8)]
    for split in ("learn", "check"):  # split names of your own
        (dataset / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "run"
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)  # user_rewards lives here
    done = subprocess.run(
        [sys.executable, "-m", "experiments.gsm8k", "--model", checkpoint, "--dataset", str(dataset),
         "--train-split", "learn", "--test-split", "check", "--prompt-column", "prompt", "--answer-column", "final",
         "--reward", "user_rewards:length_mod_3=0.5", "--system-prompt", "Answer with one number.",
         "--n", "4", "--m", "2", "--prompts-per-step", "2", "--max-completion-length", "6", "--lora-rank", "2",
         "--max-steps", "1", "--eval-limit", "2", "--eval-every", "1000", "--no-progress", "--reward-workers", "1",
         "--no-compile-cache", "--out", str(out)],
        cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    config = json.load(open(out / "config.json"))
    assert config["data"]["train"].endswith("learn.jsonl") and config["data"]["prompt_column"] == "prompt"
    assert config["rewards"]["extra"] == ["user_rewards:length_mod_3=0.5"]
    assert config["run"]["system_prompt"] == "Answer with one number."
    step = [json.loads(line) for line in open(out / "metrics.jsonl") if "train/loss" in line][0]
    assert "reward/user_rewards:length_mod_3" in step  # scored in the reward pool, every step
    samples = [json.loads(line) for line in open(out / "samples.jsonl")]
    assert {s["prompt"] for s in samples} <= {r["prompt"] for r in rows}
    assert {s["answer"] for s in samples} <= {r["final"] for r in rows}


def test_a_hub_dataset_that_cannot_be_loaded_is_one_line(tmp_path, capsys, monkeypatch):
    from tiny_checkpoint import save_tiny_checkpoint

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt")
    capsys.readouterr()  # the checkpoint writer's progress bar
    out = tmp_path / "never"
    code = cli.main("gsm8k", ["--model", checkpoint, "--dataset", "someone/no-such-dataset-xyz", "--max-steps", "1",
                              "--no-compile-cache", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "cannot load someone/no-such-dataset-xyz split 'train' from the Hugging Face Hub" in err
    assert "someone/no-such-dataset-xyz is no local file or directory either" in err  # a mistyped path, perhaps
    assert not out.exists()


# User code that ends or stalls the process. Each case runs the CLI in a child process (with
# a short bound, set before main), so a regression fails the test instead of ending pytest.
BOUNDED = "from experiments import run_setup\nrun_setup.REWARD_IMPORT_TIMEOUT_S = 2.0\n"


def _bounded_cli(args, setup, tmp_path, timeout=120):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp_path), root, env.get("PYTHONPATH")) if p)
    code = f"import sys\n{setup}from experiments import cli\nsys.exit(cli.main('gsm8k', sys.argv[1:]))\n"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=root, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("body,message", [
    ("import os\nos._exit(3)\n", "importing import_trap ended the process (exit status 3, with no error"),
    ("import time\ntime.sleep(600)\n", "importing import_trap did not finish within 2 s"),
    ("raise SystemExit(4)\n", "importing import_trap raised SystemExit: 4"),
    ("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n", "importing import_trap ended the process "
                                                                    "(killed by SIGSEGV)"),
], ids=["os._exit", "hang", "SystemExit", "SIGSEGV"])
def test_a_reward_module_that_exits_or_hangs_at_import_is_one_line_naming_it(tmp_path, body, message):
    (tmp_path / "import_trap.py").write_text(body + "def reward(completions, **_):\n    return [0.0] * len(completions)\n")
    out = tmp_path / "never"
    done = _bounded_cli(["--reward", "import_trap:reward", "--max-steps", "1", "--no-compile-cache", "--out", str(out)],
                        BOUNDED, tmp_path)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert done.stderr.count("\n") == 1 and "--reward import_trap:reward: " + message in done.stderr, done.stderr
    assert not out.exists()


@pytest.mark.slow
def test_a_chat_template_that_loops_is_one_line_before_anything_is_written(tmp_path, data_dir):
    import os

    from tiny_checkpoint import save_tiny_checkpoint
    from tiny_tokenizer import CHATML_TEMPLATE, save_tiny_tokenizer

    # A template that would render for hours: 10^10 turns of a loop.
    looping = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}" + CHATML_TEMPLATE
    model = save_tiny_checkpoint(tmp_path / "model")
    save_tiny_tokenizer(model, chat_template=looping)
    gsm8k = os.path.join(data_dir, "gsm8k")
    out = tmp_path / "never"
    done = _bounded_cli(["--model", model, "--data", os.path.join(gsm8k, "train.jsonl"), "--eval-data",
                         os.path.join(gsm8k, "test.jsonl"), "--max-steps", "1", "--no-compile-cache", "--out", str(out)],
                        "from podsjax import prompts\nprompts.CHAT_TEMPLATE_TIMEOUT_S = 1.0\n", tmp_path)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert done.stderr.count("\n") == 1, done.stderr
    assert f"error: the chat template of {model} took more than 1 s to render one prompt" in done.stderr
    assert not out.exists()  # the corrected rerun needs no --overwrite
