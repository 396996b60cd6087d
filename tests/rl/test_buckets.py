"""Prompt buckets compile when they pay (podsjax.rl.buckets); the first step runs what the fit check compiled."""

import os

import jax.numpy as jnp
import numpy as np
import pytest
from tiny_checkpoint import save_tiny_checkpoint

from podsjax import rl
from podsjax.data import datasets as data, prompts
import podsjax.models as pm
from experiments import paper_settings
from podsjax.rl import buckets


def batch_of(width, pad_id=0):
    ids = np.arange(1, 1 + 2 * width, dtype=np.int32).reshape(2, width)
    mask = np.ones_like(ids)
    mask[0, :1] = 0
    return prompts.PromptBatch(np.where(mask, ids, pad_id), mask, mask.sum(1).astype(np.int32),
                               np.arange(2), 0, pad_id)


def test_left_padding_keeps_every_token_and_its_mask():
    batch = batch_of(4, pad_id=9)
    wide = buckets.left_pad(batch, 7)
    assert wide.ids_PL.shape == (2, 7)
    np.testing.assert_array_equal(wide.ids_PL[:, 3:], batch.ids_PL)
    np.testing.assert_array_equal(wide.mask_PL[:, 3:], batch.mask_PL)
    assert np.all(wide.ids_PL[:, :3] == 9) and not wide.mask_PL[:, :3].any()
    np.testing.assert_array_equal(wide.lengths_P, batch.lengths_P)
    with pytest.raises(ValueError, match="cannot pad prompts of 4 tokens to 3"):
        buckets.left_pad(batch, 3)


def test_a_new_bucket_runs_at_a_compiled_length_until_its_nth_draw():
    reuse = buckets.BucketReuse(compile_after=3)
    reuse.compiled(256)
    widths = [reuse.fit(batch_of(64)).ids_PL.shape[1] for _ in range(4)]
    assert widths == [256, 256, 64, 64]  # the third draw compiles 64; from then on it runs as itself
    assert reuse.fit(batch_of(128)).ids_PL.shape[1] == 256
    assert reuse.fit(batch_of(512)).ids_PL.shape[1] == 512  # nothing compiled holds it: it compiles now
    assert reuse.fit(batch_of(300)).ids_PL.shape[1] == 512  # the smallest compiled length that holds it


def test_a_bucket_runs_at_the_smallest_compiled_length_that_holds_it_and_evaluation_does_not_count():
    reuse = buckets.BucketReuse(compile_after=2)
    reuse.compiled(256)
    reuse.compiled(1024)
    assert reuse.fit(batch_of(64), count=False).ids_PL.shape[1] == 256  # not 1024: 4x the prefill
    # The evaluation's draw above did not count: this training draw is 64's first, not its second.
    assert reuse.fit(batch_of(64)).ids_PL.shape[1] == 256
    assert reuse.fit(batch_of(64)).ids_PL.shape[1] == 64


def test_compile_after_1_compiles_every_bucket_at_once():
    reuse = buckets.BucketReuse(compile_after=1)
    reuse.compiled(512)
    assert [reuse.fit(batch_of(w)).ids_PL.shape[1] for w in (64, 128, 64)] == [64, 128, 64]


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_a_bad_compile_after_is_refused_in_one_line(value):
    with pytest.raises(ValueError, match="compile_after must be an integer >= 1"):
        buckets.BucketReuse(value)
    with pytest.raises(ValueError, match="bucket_compile_after must be"):
        rl.RunConfig(out_dir="x", max_steps=1, bucket_compile_after=value)


@pytest.mark.slow
@pytest.mark.cpu_mesh
def test_the_first_step_compiles_nothing_after_the_fit_check_and_the_first_evaluation(tmp_path_factory, data_dir,
                                                                                       tmp_path):
    from experiments import runner

    checkpoint = save_tiny_checkpoint(tmp_path_factory.mktemp("buckets_ckpt"))
    model, params = pm.from_pretrained(checkpoint, dtype=jnp.float32)
    tokenizer = prompts.load_tokenizer(checkpoint)
    gsm8k = os.path.join(data_dir, "gsm8k")
    train = data.load_task("gsm8k", "train", path=os.path.join(gsm8k, "train.jsonl"), limit=4).examples
    test = data.load_task("gsm8k", "test", path=os.path.join(gsm8k, "test.jsonl"), limit=8).examples
    # The fit check compiles the largest bucket (1024); these prompts fall in a smaller one.
    run = rl.RunConfig(out_dir=str(tmp_path / "run"), max_steps=2, prompts_per_step=2, max_new_tokens=8,
                       max_prompt_length=1024, eval_every_s=0.0, reward_workers=1, progress=False, console=False)
    trainer = rl.Trainer(model, params, tokenizer, train, test, paper_settings.method_config("pods", n=4, m=2), run,
                         lora=pm.LoraConfig(rank=2, alpha=4.0))
    try:
        natural = trainer.prompts.prepare(train[:2]).ids_PL.shape[1]
        assert natural < 1024
        runner._check_fits(trainer, limit=2**40)
        fit_check = dict(trainer.compile_counts)
        trainer.evaluate()
        evaluated = dict(trainer.compile_counts)
        trainer.rl_step()
        before_second = dict(trainer.compile_counts)
        trainer.rl_step()
    finally:
        trainer.close()
    # The programs: the fit check's sampling and update; evaluation's sampling (one sample
    # per prompt); build_batch.
    # (Eager conversions such as a key's fold_in compile too, in milliseconds: not counted.)
    programs = {k: v for k, v in before_second.items()
                if k in ("generate[rollout_weights]", "generate[sample]", "update", "select[build_batch]")}
    assert sum(programs.values()) <= 4, before_second
    assert evaluated["generate[sample]"] == fit_check["generate[sample]"] == 2  # evaluation ran at the fit length
    assert all(before_second[k] == evaluated[k] for k in ("generate[sample]", "update"))
    assert trainer.compile_counts == before_second  # the second step compiles nothing either
