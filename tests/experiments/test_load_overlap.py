"""A run on a checkpoint loads its weights while transformers imports for the tokenizer
(seconds where torch is installed), not after it."""

import os
import threading

import pytest
from tiny_checkpoint import save_tiny_checkpoint

import podsjax.models as pm
from experiments import cli, runner
from podsjax.data import prompts

pytestmark = pytest.mark.cpu_mesh


def test_the_weights_load_while_the_tokenizer_loads(tmp_path, data_dir, monkeypatch):
    checkpoint = save_tiny_checkpoint(tmp_path / "model")
    weights_loading, loaded = threading.Event(), {}
    load_weights, load_tokenizer = pm.from_pretrained, prompts.load_tokenizer

    def from_pretrained(path, **kwargs):
        weights_loading.set()
        return load_weights(path, **kwargs)

    def slow_tokenizer(path):
        assert weights_loading.wait(20), "the weights waited for the tokenizer"
        return load_tokenizer(path)

    def train(config, out_dir, mesh, started_at, tasks, tokenizer, model_load, replaced=None):
        loaded["model"], loaded["params"], loaded["seconds"] = model_load.result()
        loaded["tokenizer"] = tokenizer
        return 0

    monkeypatch.setattr(pm, "from_pretrained", from_pretrained)
    monkeypatch.setattr(prompts, "load_tokenizer", slow_tokenizer)
    monkeypatch.setattr(runner, "_train_and_export", train)
    gsm8k = os.path.join(data_dir, "gsm8k")
    assert cli.main("gsm8k", ["--model", str(checkpoint), "--data", os.path.join(gsm8k, "train.jsonl"),
                              "--eval-data", os.path.join(gsm8k, "test.jsonl"), "--out", str(tmp_path / "out"),
                              "--max-steps", "1", "--no-compile-cache", "--reward-workers", "1"]) == 0
    assert loaded["model"].config.num_layers >= 1 and loaded["seconds"] > 0 and loaded["tokenizer"] is not None


def test_a_check_that_fails_while_the_weights_load_exits_after_the_load(tmp_path, data_dir, monkeypatch, capsys):
    # The interpreter stopping while a thread moves arrays onto the devices can abort the
    # process (exit status 134) instead of printing the error's one line and exiting with 2.
    checkpoint = save_tiny_checkpoint(tmp_path / "model")
    load_weights, finished = pm.from_pretrained, threading.Event()

    def slow_weights(path, **kwargs):
        loaded = load_weights(path, **kwargs)
        threading.Event().wait(1.0)
        finished.set()
        return loaded

    def refuses_the_template(*args, **kwargs):  # a check after the load began (the data's come before it)
        raise cli.UsageError("the chat template is refused")

    monkeypatch.setattr(pm, "from_pretrained", slow_weights)
    monkeypatch.setattr(prompts, "check_chat_template", refuses_the_template)
    gsm8k = os.path.join(data_dir, "gsm8k")
    assert cli.main("gsm8k", ["--model", str(checkpoint), "--data", os.path.join(gsm8k, "train.jsonl"), "--eval-data",
                              os.path.join(gsm8k, "test.jsonl"), "--out", str(tmp_path / "out"), "--max-steps", "1",
                              "--no-compile-cache", "--reward-workers", "1"]) == 2
    assert "the chat template is refused" in capsys.readouterr().err
    assert finished.is_set(), "the error returned while the weights were still loading"
