"""One PODS step's data flow on real GSM8K rows: prompts -> generate -> decode -> score -> select."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_checkpoint import save_tiny_checkpoint

from podsjax import rewards
from podsjax.core import grpo, selection
from podsjax.data import datasets as data, prompts
from podsjax.sampler import sampling
import podsjax.models as pm


@pytest.mark.slow
def test_prompts_to_selected_advantages_on_gsm8k(tmp_path, data_dir):
    checkpoint = save_tiny_checkpoint(tmp_path / "ckpt")
    tokenizer = prompts.load_tokenizer(checkpoint)
    model, params = pm.from_pretrained(checkpoint, dtype=jnp.float32)

    task = data.load_task("gsm8k", "test", path=os.path.join(data_dir, "gsm8k", "test.jsonl"), limit=2)
    batch = prompts.prepare_prompts(tokenizer, [e.prompt for e in task.examples], max_prompt_length=512)
    assert batch.num_dropped == 0 and batch.ids_PL.shape[1] in prompts.Bucketing().lengths(512)  # bucketed length
    n, m = 6, 2
    rollouts = sampling.Generator(model).generate(params, batch.ids_PL, batch.mask_PL, jax.random.key(0),
                                                  num_samples=n, max_new_tokens=16, temperature=1.0,
                                                  eos_token_ids=tokenizer.eos_token_id, pad_token_id=batch.pad_id)
    tokens, mask = np.asarray(rollouts.tokens), np.asarray(rollouts.mask)
    completions = tokenizer.batch_decode([row[valid] for row, valid in zip(tokens, mask)], skip_special_tokens=True)
    # Plant one perfect completion per prompt so rewards differ within each group.
    for p, example in enumerate(task.examples):
        completions[p * n] = f"<think>easy</think><answer>{example.answer}</answer>"
    scores = rewards.score_rewards(completions, rewards.default_rewards("gsm8k"),
                                   **data.reward_columns(task.examples, num_samples=n))
    rewards_PN = np.asarray(scores.total_B).reshape(2, n)
    assert np.all(rewards_PN[:, 0] == 3.0)  # accuracy 1 + format 1 + tag count 1
    assert np.all(rewards_PN[:, 1:] < 3.0)

    idx_PM = np.asarray(selection.select("max_variance", rewards_PN, m))
    assert np.all(idx_PM[:, -1] == 0)  # the planted best is in every max-variance pair
    adv_PM = np.asarray(grpo.group_advantages(np.take_along_axis(rewards_PN, idx_PM, 1)))
    assert np.all(adv_PM[:, -1] > 0) and np.all(adv_PM[:, 0] < 0)
