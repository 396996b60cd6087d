"""The tiny preset: synthetic problems, the in-process checkpoint, the SFT loss and the cached warm-up."""

import dataclasses
import hashlib
import json
import os
import re
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from podsjax import rl, rewards
import podsjax.models as pm
from experiments import paper_settings
from podsjax import tiny
from podsjax.data import prompts
from podsjax.tiny import sft
from podsjax.tiny import warmup as warmup_lib

pytestmark = pytest.mark.cpu_mesh

# A one-layer model keeps the compiles of the warm-up tests to a few seconds.
SMALL = tiny.tiny_model(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                        head_dim=16)
SHORT_WARMUP = dict(steps=4, batch_size=4, eval_every=2, validation_size=4, test_size=4, eval_batch_size=4,
                    max_new_tokens=6, pool_size=32, min_accuracy=0.0,
                    target_accuracy=1.0, max_accuracy=1.0, model=SMALL)
APPLY = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}


@pytest.fixture(scope="module")
def tokenizer():
    return tiny.build_tokenizer()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The default-shape tiny checkpoint, as the CLI builds it."""
    return tiny.build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


# ------------------------------------------------------------------ problems


def test_generator_is_deterministic_and_seeded():
    first = tiny.generate_problems(200, seed=3)
    again = tiny.generate_problems(200, seed=3)
    assert [(e.prompt, e.answer, dict(e.columns)) for e in first] == [(e.prompt, e.answer, dict(e.columns))
                                                                       for e in again]
    other = tiny.generate_problems(200, seed=4)
    assert [e.prompt for e in first] != [e.prompt for e in other]
    assert len({e.prompt for e in first}) == 200  # distinct within a stream
    assert tiny.tiny_tasks(0, num_train=50, num_test=20)[1] == tiny.tiny_tasks(0, num_train=80, num_test=20)[1]


def test_splits_are_disjoint():
    splits = tiny.make_splits(0, num_train=3000, num_validation=128, num_test=256)
    train_q, val_q, test_q = ({e.prompt for e in s} for s in (splits.train, splits.validation, splits.test))
    assert (len(train_q), len(val_q), len(test_q)) == (3000, 128, 256)
    assert not train_q & test_q and not train_q & val_q and not val_q & test_q
    assert all(tiny.split_of(q) == "test" for q in test_q) and all(tiny.split_of(q) == "train" for q in train_q)
    train_set, test_set = tiny.tiny_tasks(0, num_train=3000, num_test=256)
    assert [e.prompt for e in train_set] == [e.prompt for e in splits.train]
    assert [e.prompt for e in test_set] == [e.prompt for e in splits.test]
    # Disjoint across seeds and sizes too: no seed trains on another seed's test questions.
    other_train, other_test = tiny.tiny_tasks(1, num_train=3000, num_test=512)
    assert not {e.prompt for e in other_train} & test_q and not train_q & {e.prompt for e in other_test}
    assert [e.prompt for e in splits.test[:100]] == [e.prompt for e in tiny.make_splits(0, num_test=100).test]


def test_gold_answers_recompute_from_the_question():
    examples = tiny.generate_problems(2000, seed=0) + tiny.generate_problems(300, seed=1, split="test")
    assert {e.columns["operations"] for e in examples} == {ops for ops, _ in tiny.TEMPLATES}
    for e in examples:
        numbers = [int(n) for n in re.findall(r"\d+", e.prompt)]
        operations = e.columns["operations"]
        assert numbers == list(e.columns["operands"]) and len(numbers) == len(operations) + 1, e.prompt
        total, lines = numbers[0], []
        for op, value in zip(operations, numbers[1:]):
            lines.append(f"{total} {op} {value} = {APPLY[op](total, value)}")
            total = APPLY[op](total, value)
            assert total >= 0, e.prompt
        assert e.answer == str(total), e.prompt
        assert e.columns["solution"] == "\n".join(lines) + f"\n#### {total}"
        assert rewards.parse_gsm8k_gold(e.columns["solution"]) == Fraction(total)


def test_sft_targets_get_full_format_and_accuracy_rewards():
    examples = tiny.generate_problems(300, seed=5)
    completions = [tiny.sft_completion(e) for e in examples]
    answers = [e.answer for e in examples]
    assert rewards.format_reward(completions) == [1.0] * len(examples)
    assert rewards.tag_count_reward(completions) == [1.0] * len(examples)
    assert rewards.gsm8k_accuracy(completions, answers) == [1.0] * len(examples)
    wrong = [str(int(a) + 1) for a in answers]
    assert rewards.gsm8k_accuracy(completions, wrong) == [0.0] * len(examples)
    # The think block holds the worked steps, not the '####' line.
    assert completions[0].startswith("<think>") and "####" not in completions[0]


# ------------------------------------------------------------------ checkpoint


def test_checkpoint_loads_through_the_normal_code_paths(checkpoint, tokenizer):
    loaded = prompts.load_tokenizer(checkpoint)
    assert loaded.eos_token == "<|im_end|>" and loaded.pad_token == "<|endoftext|>"
    assert prompts.has_chat_template(loaded) and len(loaded) <= 512
    model, params = pm.from_pretrained(checkpoint)
    config = model.config
    assert config.arch == "qwen2" and config.vocab_size == len(loaded)
    assert config.num_kv_heads < config.num_heads  # GQA
    assert config.eos_token_id == loaded.eos_token_id and config.pad_token_id == loaded.pad_token_id

    # transformers rebuilds a Qwen2 tokenizer's pre-tokenizer on load; the ids must not change.
    examples = tiny.generate_problems(20, seed=9, split="test")
    texts = prompts.build_prompts(loaded, [e.prompt for e in examples])
    for text, example in zip(texts, examples):
        ids = loaded(text, add_special_tokens=False)["input_ids"]
        assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
        completion = loaded(tiny.sft_completion(example), add_special_tokens=False)["input_ids"]
        assert loaded.decode(ids + completion) == text + tiny.sft_completion(example)
        pieces = [loaded.decode([i]) for i in ids + completion]
        assert all(len(p) == 1 for p in pieces if any(c.isdigit() for c in p))  # one digit per token

    batch = prompts.prepare_prompts(loaded, [e.prompt for e in examples], max_prompt_length=128)
    assert batch.num_dropped == 0
    logits = model.apply({"params": params}, jnp.asarray(batch.ids_PL),
                         attention_mask=jnp.asarray(batch.mask_PL)).logits_BLV
    assert logits.shape == (*batch.ids_PL.shape, config.vocab_size) and bool(jnp.all(jnp.isfinite(logits)))


def test_checkpoint_matches_transformers(checkpoint):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True, dtype=torch.float32).eval()
    model, params = pm.from_pretrained(checkpoint)
    ids = np.random.default_rng(0).integers(3, model.config.vocab_size, size=(2, 24))
    with torch.no_grad():
        expected = hf(torch.as_tensor(ids)).logits.numpy()
    actual = np.asarray(model.apply({"params": params}, jnp.asarray(ids, jnp.int32)).logits_BLV)
    np.testing.assert_allclose(actual, expected, atol=1e-4, rtol=0)


def test_build_refuses_a_non_empty_directory(tmp_path):
    (tmp_path / "other.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        tiny.build_tiny_checkpoint(tmp_path)


# ------------------------------------------------------------------ SFT


def test_sft_batches_hold_prompt_then_completion(tokenizer):
    examples = tiny.generate_problems(16, seed=2)
    data = sft.tokenize_sft(tokenizer, examples)
    assert data.prefix_ids.shape[0] > 40  # the system turn is shared
    for row, example in enumerate(examples):
        real = data.suffix_ids[row][data.suffix_mask[row] == 1]
        full = np.concatenate([data.prefix_ids, real])
        expected = prompts.build_prompt(tokenizer, example.prompt) + tiny.sft_completion(example) + "<|im_end|>"
        assert tokenizer.decode(full) == expected
        # The loss covers exactly the completion and its EOS (position t predicts t + 1).
        targets = data.suffix_ids[row][1:][data.loss_mask[row][:-1] == 1]
        assert tokenizer.decode(targets) == tiny.sft_completion(example) + "<|im_end|>"
        assert data.loss_mask[row][data.suffix_mask[row] == 0].sum() == 0


@pytest.mark.slow
def test_prefix_shared_loss_equals_the_full_sequence_loss(tokenizer):
    model = pm.Decoder(dataclasses.replace(SMALL, vocab_size=len(tokenizer)))
    params = pm.init_params(model, jax.random.key(1))
    data = sft.tokenize_sft(tokenizer, tiny.generate_problems(6, seed=4))
    prefix, ids, mask, weights = (jnp.asarray(x) for x in (data.prefix_ids, data.suffix_ids, data.suffix_mask,
                                                            data.loss_mask))

    def full_loss(p):  # the plain way: whole sequences, no cache
        b, n = ids.shape[0], prefix.shape[0]
        full_ids = jnp.concatenate([jnp.broadcast_to(prefix, (b, n)), ids], axis=1)
        full_mask = jnp.concatenate([jnp.ones((b, n), jnp.int32), mask], axis=1)
        full_weights = jnp.concatenate([jnp.zeros((b, n), jnp.float32), weights], axis=1)
        logprobs = jax.nn.log_softmax(model.apply({"params": p}, full_ids, attention_mask=full_mask).logits_BLV[:, :-1])
        nll = -jnp.take_along_axis(logprobs, full_ids[:, 1:, None], axis=-1)[..., 0]
        return jnp.sum(nll * full_weights[:, :-1]) / jnp.sum(full_weights[:, :-1])

    # Jitted because op-by-op autodiff of the decoder takes half a minute on a CPU.
    shared = jax.jit(jax.value_and_grad(lambda p: sft.sft_loss(model, p, prefix, ids, mask, weights)))
    shared_value, shared_grads = shared(params)
    full_value, full_grads = jax.jit(jax.value_and_grad(full_loss))(params)
    np.testing.assert_allclose(shared_value, full_value, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(shared_grads), jax.tree.leaves(full_grads)):
        np.testing.assert_allclose(got, want, atol=1e-5 * float(jnp.max(jnp.abs(want))) + 1e-7, rtol=0)


# ------------------------------------------------------------------ warm-up


def _digest(directory):
    with open(os.path.join(directory, "model.safetensors"), "rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest()


@pytest.mark.slow
def test_short_warm_up_writes_a_cache_that_a_second_call_reuses(tmp_path, monkeypatch):
    directory = tmp_path / "run" / tiny.WARMUP_DIRNAME
    messages = []
    stats = tiny.warm_up(directory, log=messages.append, **SHORT_WARMUP)
    assert not stats.cached and stats.steps == 4 and stats.stop_reason == "steps"
    assert [h["step"] for h in stats.history] == [2, 4]
    assert 0.0 <= stats.test_accuracy <= 1.0 and np.isfinite(stats.final_loss)
    assert stats.path == str(directory) and not os.path.exists(f"{directory}.partial")
    assert any("step 4" in m for m in messages)
    with open(directory / tiny.MARKER_FILE) as handle:
        assert json.load(handle)["config"]["steps"] == 4
    model, _ = pm.from_pretrained(directory)  # an ordinary checkpoint
    assert model.config.hidden_size == SMALL.hidden_size
    assert prompts.load_tokenizer(directory).eos_token == "<|im_end|>"
    digest = _digest(directory)

    # Same settings: the cache is reused, with nothing built or trained.
    def fail(*args, **kwargs):
        raise AssertionError("the cached warm-up was redone")

    with monkeypatch.context() as patch:
        patch.setattr(warmup_lib, "_train", fail)
        patch.setattr(warmup_lib, "build_tiny_checkpoint", fail)
        again = tiny.warm_up(directory, **SHORT_WARMUP)
    assert again.cached and _digest(directory) == digest
    assert _same_stats(again, stats)

    with pytest.raises(tiny.WarmupError, match="steps differ"):
        tiny.warm_up(directory, **{**SHORT_WARMUP, "steps": 5})

    # overwrite=True retrains, and the same seed gives the same weights.
    redone = tiny.warm_up(directory, overwrite=True, **SHORT_WARMUP)
    assert not redone.cached and _digest(directory) == digest


def _same_stats(cached, fresh):
    skip = {"cached", "history"}
    same = all(getattr(cached, f) == getattr(fresh, f) for f in cached.__dataclass_fields__ if f not in skip)
    return same and list(cached.history) == list(fresh.history)


def test_warm_up_refuses_a_directory_that_is_not_a_warm_up(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(tiny.WarmupError, match="not empty"):
        tiny.warm_up(tmp_path, **SHORT_WARMUP)
    (tmp_path / tiny.MARKER_FILE).write_text("{not json")
    with pytest.raises(tiny.WarmupError, match="unreadable"):
        tiny.warm_up(tmp_path, **SHORT_WARMUP)


def test_warm_up_under_a_file_is_one_error_not_an_os_traceback(tmp_path):
    (tmp_path / "cache").write_text("a file where the cache root should be")  # e.g. XDG_CACHE_HOME
    with pytest.raises(tiny.WarmupError, match="a file stands in its path"):
        tiny.warm_up(tmp_path / "cache" / "podsjax" / "gsm8k-seed0", **SHORT_WARMUP)


@pytest.mark.parametrize("bad, match", [
    (dict(steps=0), "steps"),
    (dict(lr=0.0), "lr"),
    (dict(target_accuracy=0.7), "min_accuracy <= target_accuracy"),
    (dict(eval_every=0), "eval_every"),
])
def test_warmup_config_is_validated(bad, match):
    with pytest.raises(ValueError, match=match):
        tiny.WarmupConfig(**bad)


def test_model_spec_is_validated():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        tiny.tiny_model(num_heads=3, num_kv_heads=2)
    with pytest.raises(ValueError, match="vocab_size must be >= 260"):
        tiny.tiny_model(vocab_size=100)
    with pytest.raises(ValueError, match="vocab_size must be >= 260"):
        tiny.WarmupConfig(model=dataclasses.replace(tiny.TINY_MODEL, vocab_size=100))


def test_rl_defaults_make_valid_configs(tmp_path):
    setting = paper_settings.TINY
    pods = {k: v for k, v in setting.methods["pods"].items() if k != "algorithm"}
    algo = paper_settings.method_config("pods", **pods, **setting.common)
    assert algo.m < algo.n
    run = rl.RunConfig(out_dir=str(tmp_path), **setting.run)
    # Every tiny prompt fits, and the rollouts of a step split evenly over 8 devices.
    _, test_set = tiny.tiny_tasks(0)
    batch = prompts.prepare_prompts(tiny.build_tokenizer(), [e.prompt for e in test_set],
                                    max_prompt_length=run.max_prompt_length)
    assert batch.num_dropped == 0
    # Evaluation runs in chunks of the same rows (eval_batch_size None), sharing the decode program.
    assert (run.prompts_per_step * algo.n) % 8 == 0 and run.eval_batch_size is None
