"""The RL loop end to end on real GSM8K rows and a tiny model: steps, eval, metrics, resume."""

import json
import os

import jax.numpy as jnp
import pytest
from tiny_checkpoint import save_tiny_checkpoint

import podsjax.models as pm
from podsjax import data, loop, prompts, train


@pytest.fixture(scope="module")
def setup(tmp_path_factory, shared_data_dir):
    checkpoint = save_tiny_checkpoint(tmp_path_factory.mktemp("loop_ckpt"))
    tokenizer = prompts.load_tokenizer(checkpoint)
    model, params = pm.from_pretrained(checkpoint, dtype=jnp.float32)
    gsm8k = os.path.join(shared_data_dir, "gsm8k")
    train_set = data.load_task("gsm8k", "train", path=os.path.join(gsm8k, "train.jsonl"), limit=8).examples
    test_set = data.load_task("gsm8k", "test", path=os.path.join(gsm8k, "test.jsonl"), limit=2).examples
    return model, params, tokenizer, train_set, test_set


def make_trainer(setup, out_dir, max_steps, lora=None):
    model, params, tokenizer, train_set, test_set = setup
    algo = train.preset("pods", n=4, m=2, learning_rate=1e-3)
    run = loop.RunConfig(out_dir=str(out_dir), max_steps=max_steps, prompts_per_step=2, max_new_tokens=8,
                         eval_every_s=0.0, eval_batch_size=2, checkpoint_every_steps=1, reward_workers=1,
                         progress=False)
    return loop.Trainer(model, params, tokenizer, train_set, test_set, algo, run, lora=lora)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_steps_write_metrics_checkpoints_and_resume_exactly(setup, tmp_path):
    out = tmp_path / "run"
    history = make_trainer(setup, out, max_steps=2, lora=pm.LoraConfig(rank=2, alpha=4.0)).run()
    assert [h["step"] for h in history] == [0, 1, 2]  # eval before each step and at the end
    records = [r for r in read_jsonl(out / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in records] == [1, 2]
    for key in ("reward/mean", "reward/selected_std", "reward/zero_std_groups", "time/generation",
                "time/update", "train/grad_norm", "completion/truncated_frac"):
        assert key in records[0], key
    assert sorted(os.listdir(out / "checkpoints")) == ["1", "2"]

    # A new trainer in the same directory resumes at step 2 with the saved data position.
    resumed = make_trainer(setup, out, max_steps=4, lora=pm.LoraConfig(rank=2, alpha=4.0))
    assert int(resumed.state.step) == 2 and resumed.stream.position == 4
    elapsed = resumed.host["elapsed_train_s"]
    assert elapsed > 0  # step 2 counted; step 1 compiled, off the clock
    history = resumed.run()
    # Step 3 compiles in the new process (off the clock), step 4 counts.
    assert history[-1]["step"] == 4 and history[-1]["time/elapsed_train_s"] > elapsed
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "train/loss" in r] == [1, 2, 3, 4]


@pytest.mark.parametrize("kwargs,message", [
    (dict(time_budget_s=0.0), "time_budget_s must be > 0"),
    (dict(time_budget_s=None, max_steps=None), "needs a time budget"),
    (dict(max_steps=0), "max_steps must be >= 1"),
    (dict(max_steps=1, prompts_per_step=0), "prompts_per_step must be >= 1"),
])
def test_run_config_rejects_bad_budgets(kwargs, message):
    with pytest.raises(ValueError, match=message):
        loop.RunConfig(out_dir="unused", **kwargs)


def test_resume_rewinds_logs_to_the_checkpoint_and_keeps_the_cut_tail(tmp_path):
    # What a killed run logged after its checkpoint (here: one whole record and a torn
    # line, plus a log born after it) moves to <log>.superseded; the redo logs it once.
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"ste')
    (tmp_path / "samples.jsonl").write_text('{"step": 2}\n')
    loop._rewind_logs(str(tmp_path), {"metrics.jsonl": len('{"step": 1}\n')})
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert (tmp_path / "metrics.jsonl.superseded").read_text() == '{"step": 2}\n{"ste\n'
    assert (tmp_path / "samples.jsonl").read_text() == ""
    assert (tmp_path / "samples.jsonl.superseded").read_text() == '{"step": 2}\n'
