"""The RL loop end to end on real GSM8K rows and a tiny model: steps, eval, metrics, resume."""

import functools
import json
import os
import shutil
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_checkpoint import save_tiny_checkpoint

from podsjax import rl
from podsjax.data import datasets as data, prompts
from podsjax.devices import dry_run
from podsjax.run import checkpoint as ckpt_lib
from podsjax.run import metrics
import podsjax.models as pm
from experiments import paper_settings
from podsjax.devices import mesh as mesh_lib
from podsjax.rewards import combine as rewards_combine
from podsjax.rl import dynamic_sampling
from podsjax.run import run_files
from podsjax.sampler import sampling

pytestmark = pytest.mark.cpu_mesh


@pytest.fixture(scope="module")
def setup(tmp_path_factory, data_dir):
    checkpoint = save_tiny_checkpoint(tmp_path_factory.mktemp("loop_ckpt"))
    tokenizer = prompts.load_tokenizer(checkpoint)
    model, params = pm.from_pretrained(checkpoint, dtype=jnp.float32)
    gsm8k = os.path.join(data_dir, "gsm8k")
    train_set = data.load_task("gsm8k", "train", path=os.path.join(gsm8k, "train.jsonl"), limit=8).examples
    test_set = data.load_task("gsm8k", "test", path=os.path.join(gsm8k, "test.jsonl"), limit=2).examples
    return model, params, tokenizer, train_set, test_set


# One generator per model for the module: its trainers share the compiled programs.
shared_generator = functools.cache(sampling.Generator)


def make_trainer(setup, out_dir, max_steps, lora=None, checkpoint_every_steps=1, **parts):
    model, params, tokenizer, train_set, test_set = setup
    algo = paper_settings.method_config("pods", n=4, m=2, learning_rate=1e-3)
    run = rl.RunConfig(out_dir=str(out_dir), max_steps=max_steps, prompts_per_step=2, max_new_tokens=8,
                       eval_every_s=0.0, eval_batch_size=2, checkpoint_every_steps=checkpoint_every_steps,
                       reward_workers=1, progress=False)
    return rl.Trainer(model, params, tokenizer, train_set, test_set, algo, run, lora=lora,
                      **{"generator": shared_generator(model), **parts})


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.slow
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
    assert int(resumed.state.step) == 2 and resumed.prompts.stream.position == 4
    elapsed = resumed.host.elapsed_train_s
    assert elapsed > 0  # step 2 counted; step 1 compiled, off the clock
    history = resumed.run()
    # Step 3 compiles in the new process (off the clock), step 4 counts.
    assert history[-1]["step"] == 4 and history[-1]["time/elapsed_train_s"] > elapsed
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "train/loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in read_jsonl(out / "eval_history.jsonl")] == [0, 1, 2, 3, 4]


def test_a_step_evaluated_before_the_run_s_last_checkpoint_is_not_evaluated_again_on_resume(setup, tmp_path):
    # The end (or stop) checkpoint comes after the last step's evaluation; at eval_every_s 0 the
    # resume had evaluated that step again, logging it twice.
    out = tmp_path / "run"
    make_trainer(setup, out, max_steps=1, checkpoint_every_steps=10).run()
    assert os.listdir(out / "checkpoints") == ["1"]  # the end checkpoint alone, after step 1's evaluation
    history = make_trainer(setup, out, max_steps=2, checkpoint_every_steps=10).run()
    assert [h["step"] for h in history] == [0, 1, 2]
    assert [r["step"] for r in read_jsonl(out / "eval_history.jsonl")] == [0, 1, 2]


@pytest.mark.parametrize("kwargs,message", [
    (dict(time_budget_s=0.0), "time_budget_s must be > 0"),
    (dict(time_budget_s=None, max_steps=None), "needs a budget"),
    (dict(max_steps=0), "max_steps must be >= 1"),
    (dict(max_steps=1, prompts_per_step=0), "prompts_per_step must be >= 1"),
    (dict(time_budget_s=float("inf")), "time_budget_s must be a finite number; got inf"),
    (dict(max_steps=1, eval_every_s=float("nan")), "eval_every_s must be a finite number"),
    (dict(max_steps=1, prompts_per_step="8"), "prompts_per_step must be an integer; got '8'"),
    (dict(max_steps=1, reward_timeout_s=0), "reward_timeout_s must be > 0"),
    (dict(max_steps=1, max_nonfinite_updates=0), "max_nonfinite_updates must be >= 1"),
])
def test_run_config_rejects_bad_budgets(kwargs, message):
    with pytest.raises(ValueError, match=message):
        rl.RunConfig(out_dir="unused", **kwargs)


def test_the_loop_is_done_at_its_step_limit_or_its_training_clock_budget():
    from types import SimpleNamespace

    from podsjax.rl.run_loop import TrainingLoop

    def done(step, elapsed, **budgets):
        trainer = SimpleNamespace(run_config=rl.RunConfig(out_dir="unused", **budgets), step=step,
                                  host=SimpleNamespace(elapsed_train_s=elapsed))
        return TrainingLoop(trainer).done()

    assert not done(3, 9.9, max_steps=None, time_budget_s=10) and done(3, 10.0, max_steps=None, time_budget_s=10)
    assert not done(4, 1e6, max_steps=5, time_budget_s=None) and done(5, 0.0, max_steps=5, time_budget_s=None)
    assert done(2, 10.0, max_steps=5, time_budget_s=10)  # whichever comes first


def test_evaluation_takes_the_first_eval_limit_examples():
    from types import SimpleNamespace

    from podsjax.rewards import default_rewards

    examples = [data.Example(prompt=f"q{i}", answer=str(i)) for i in range(10)]
    generator = SimpleNamespace(model=SimpleNamespace(mesh=None))
    for limit, taken in ((2, ["q0", "q1"]), (None, [f"q{i}" for i in range(10)])):
        run_config = rl.RunConfig(out_dir="unused", max_steps=1, eval_limit=limit)
        evaluator = rl.Evaluator(generator, None, None, examples, run_config, rows=8,
                                 rewards=default_rewards("gsm8k"), eos_ids=(1,))
        assert [e.prompt for e in evaluator.examples] == taken


def test_resume_rewinds_logs_to_the_checkpoint_and_keeps_the_cut_tail(tmp_path):
    # What a killed run logged after its checkpoint (here: one whole record and a torn
    # line, plus a log born after it) moves to <log>.superseded; the redo logs it once.
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"ste')
    (tmp_path / "samples.jsonl").write_text('{"step": 2}\n')
    assert run_files.rewind_logs(str(tmp_path), {"metrics.jsonl": len('{"step": 1}\n')})
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert (tmp_path / "metrics.jsonl.superseded").read_text() == '{"step": 2}\n{"ste\n'
    assert (tmp_path / "samples.jsonl").read_text() == ""
    assert (tmp_path / "samples.jsonl.superseded").read_text() == '{"step": 2}\n'
    # Nothing logged after the checkpoint: nothing moves, and the resume does not say it did.
    assert not run_files.rewind_logs(str(tmp_path), {"metrics.jsonl": len('{"step": 1}\n')})


def test_the_first_step_compiles_the_update_behind_generation(setup, tmp_path):
    # The update's shape is known once the prompts are drawn: it compiles on another thread
    # while generation compiles and runs, once per shape, and the step's call reuses it.
    model, params, tokenizer, train_set, _ = setup
    run = rl.RunConfig(out_dir=str(tmp_path / "run"), max_steps=2, prompts_per_step=2, max_new_tokens=8,
                       eval_every_s=None, reward_workers=1, progress=False, console=False)
    algo = paper_settings.method_config("pods", n=4, m=2)
    trainer = rl.Trainer(model, params, tokenizer, [train_set[0]] * 8, [], algo, run,
                         lora=pm.LoraConfig(rank=2, alpha=4.0), generator=shared_generator(model))
    real, lowered_on = trainer.update_fn, []

    class Recorded:
        def lower(self, *args):
            lowered_on.append(threading.current_thread().name)
            return real.lower(*args)

        def __call__(self, *args):
            return real(*args)

    trainer.update_fn = Recorded()
    try:
        first = trainer.rl_step()
        second = trainer.rl_step()
    finally:
        trainer.close()
    assert lowered_on == ["podsjax-compile"]
    assert trainer.compile_counts["update"] == 1, trainer.compile_counts
    # The first step's compiles are reported as compiles (the update's, waited for, among them),
    # not as the phases they ran in; the second compiles nothing. Only the second is on the clock.
    assert first["time/compile"] > 0 and second["time/compile"] < 0.05
    phases = sum(second[f"time/{phase}"] for phase in ("generation", "scoring", "selection", "update"))
    assert trainer.host.elapsed_train_s == pytest.approx(phases + second["time/compile"])


@pytest.mark.slow
def test_each_program_compiles_once_and_the_console_says_so(setup, tmp_path):
    model, params, tokenizer, train_set, _ = setup
    # One prompt over and over: one prompt bucket, so nothing may compile after the first
    # step. Evaluation's rows (8 prompts x 1) match the rollouts' (2 x 4), so it shares
    # their decode program; its prefill (1 sample per prompt) is its own.
    same = [train_set[0]] * 8
    run = rl.RunConfig(out_dir=str(tmp_path / "run"), max_steps=3, prompts_per_step=2, max_new_tokens=8,
                       eval_every_s=0.0, eval_batch_size=8, reward_workers=1, progress=False, progress_every_s=0.0)
    lines = []
    algo = paper_settings.method_config("pods", n=4, m=2)
    trainer = rl.Trainer(model, params, tokenizer, same, same, algo, run,
                         lora=pm.LoraConfig(rank=2, alpha=4.0), log=lines.append)
    trainer.compile_log.min_report_s = 0.0  # report every compile, however fast this machine
    trainer.run()
    counts = trainer.compile_counts
    assert counts["update"] == 1 and counts["generate[sample]"] == 2, counts  # the rollouts' and evaluation's
    assert counts["select[build_batch]"] == 1
    first = next(i for i, line in enumerate(lines) if line.startswith("first step done"))
    assert not [line for line in lines[first:] if "compiled" in line], lines  # nothing after the first step
    assert any(line.startswith("compiled update (4 rows x ") for line in lines[:first]), lines
    assert any(line.startswith("compiled generate[sample] (") for line in lines[:first]), lines
    progress = [line for line in lines if line.startswith("step ")]
    assert [line.split(" |")[0] for line in progress] == ["step 2/3", "step 3/3"]
    assert all(word in progress[-1] for word in ("train clock", "reward", "eval acc", "update")), progress
    assert sum(line.startswith("eval at step") for line in lines) == 4  # before each step and at the end


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["8", None])  # None: one device, as a single GPU runs
def test_the_fit_check_compiles_what_the_first_step_runs(tmp_path_factory, data_dir, tmp_path, mesh):
    from experiments import runner
    from podsjax.devices import mesh as mesh_lib

    checkpoint = save_tiny_checkpoint(tmp_path_factory.mktemp("fit_ckpt"))
    model, params = pm.from_pretrained(checkpoint, dtype=jnp.float32,
                                       mesh=mesh_lib.make_mesh(mesh) if mesh else None)
    tokenizer = prompts.load_tokenizer(checkpoint)
    gsm8k = os.path.join(data_dir, "gsm8k")
    example = data.load_task("gsm8k", "train", path=os.path.join(gsm8k, "train.jsonl"), limit=1).examples
    run = rl.RunConfig(out_dir=str(tmp_path / "run"), max_steps=1, prompts_per_step=2, max_new_tokens=8,
                       max_prompt_length=256, eval_every_s=None, reward_workers=1, progress=False, console=False)
    algo = paper_settings.method_config("pods", n=4, m=2)
    trainer = rl.Trainer(model, params, tokenizer, example * 4, example, algo, run,
                         lora=pm.LoraConfig(rank=2, alpha=4.0))
    try:
        memory = runner._check_fits(trainer, limit=2**40)  # a device that reports its memory
        assert memory.update_temp > 0 and memory.kv_cache > 0
        before = trainer.compile_counts
        trainer.rl_step()
    finally:
        trainer.close()
    big = ("generate[sample]", "update", "select[build_batch]")
    assert [before[k] for k in big] == [1] * 3 and [trainer.compile_counts[k] for k in big] == [1] * 3, before
    with pytest.raises(dry_run.DoesNotFit, match="needs .* per device"):
        memory.limit = 1
        memory.check_fits()


@pytest.mark.slow
def test_a_bf16_full_fine_tune_trains_fp32_master_weights_and_samples_their_bf16_copy(tmp_path_factory, data_dir,
                                                                                     tmp_path):
    from experiments import runner

    checkpoint = save_tiny_checkpoint(tmp_path_factory.mktemp("bf16_ckpt"))
    mesh = mesh_lib.make_mesh("8")
    model, params = pm.from_pretrained(checkpoint, dtype=jnp.bfloat16, mesh=mesh)
    tokenizer = prompts.load_tokenizer(checkpoint)
    gsm8k = os.path.join(data_dir, "gsm8k")
    examples = data.load_task("gsm8k", "train", path=os.path.join(gsm8k, "train.jsonl"), limit=4).examples
    run = rl.RunConfig(out_dir=str(tmp_path / "run"), max_steps=2, prompts_per_step=2, max_new_tokens=8,
                       max_prompt_length=256, eval_every_s=None, reward_workers=1, checkpoint_every_steps=1,
                       progress=False, console=False)
    algo = paper_settings.method_config("pods", n=4, m=2, learning_rate=1e-3)
    param_bytes = mesh_lib.bytes_per_device(params)
    floating = lambda tree: {str(x.dtype) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}
    trainer = rl.Trainer(model, params, tokenizer, examples, examples, algo, run)
    del params
    try:
        memory = runner._check_fits(trainer, limit=2**40)
        assert memory.params == 3 * param_bytes  # the sampler's bf16 weights and their fp32 master copy
        assert 0 <= memory.optimizer - 4 * param_bytes <= 16  # two fp32 moments and the step counts
        trainer.run()
        assert floating(trainer.state) == {"float32"}
        sampled, _ = trainer.policy_params()
        assert floating(sampled) == {"bfloat16"}
        for copy, master in zip(jax.tree.leaves(sampled), jax.tree.leaves(trainer.state.params)):
            assert copy.sharding.is_equivalent_to(master.sharding, copy.ndim)
            np.testing.assert_array_equal(np.asarray(copy), np.asarray(master.astype(jnp.bfloat16)))
        counts = trainer.compile_counts  # the copy has the loaded weights' signature: no new sampler program
        assert counts["generate[sample]"] == 1 and counts["policy copy[policy_copy]"] == 1, counts
    finally:
        trainer.close()
    # The checkpoint holds the fp32 state: restoring into it checks every leaf's dtype.
    _, _, restored = ckpt_lib.Checkpointer(ckpt_lib.CheckpointConfig(str(tmp_path / "run" / "checkpoints"))
                                           ).restore_latest(jax.tree.map(mesh_lib.abstract, trainer.state))
    assert restored == 2


def test_progress_log_prints_the_first_step_then_by_time_or_steps():
    now, printed = [0.0], []
    lines = metrics.ProgressLog(printed.append, every_s=30.0, every_steps=5, clock=lambda: now[0])
    for step in range(1, 12):
        now[0] += 4.0
        lines.update(step, lambda: f"step {step}")
    # Step 1 is the first; 5 and 10 are every 5 steps; no 30 s gap comes up at 4 s a step.
    assert printed == ["step 1", "step 5", "step 10"]
    now[0] += 31.0
    assert lines.update(12, lambda: "late") and printed[-1] == "late"
    assert lines.update(13, lambda: "forced", force=True) and lines.lines == 5
    with pytest.raises(ValueError):
        metrics.ProgressLog(print, every_steps=0)


@pytest.mark.slow
def test_a_step_draws_past_prompts_that_do_not_fit_and_says_how_many(setup, tmp_path):
    model, params, tokenizer, _, test_set = setup
    short, long = data.Example("What is 2 + 2?", "4"), data.Example("What is 2 + 2? " * 40, "4")
    lengths = prompts.prepare_prompts(tokenizer, [short.prompt, long.prompt], max_prompt_length=10**6).lengths_P
    fits = int(lengths.mean())  # the short prompt fits, the long one does not

    def trainer(examples, name, lines):
        run = rl.RunConfig(out_dir=str(tmp_path / name), max_steps=3, prompts_per_step=2, max_new_tokens=4,
                           max_prompt_length=fits, eval_every_s=None, reward_workers=1, progress=False)
        algo = paper_settings.method_config("pods", n=4, m=2)
        return rl.Trainer(model, params, tokenizer, examples, test_set, algo, run,
                          log=lines.append, generator=shared_generator(model))

    lines = []
    mixed = trainer([long, long, short, long, short, long], "mixed", lines)
    # Said when the run is built, before any evaluation or compile; the stream has not moved.
    assert sum("longer than max_prompt_length" in line for line in lines) == 1 and mixed.prompts.stream.position == 0
    try:
        skipped = []
        for _ in range(3):
            before = mixed.prompts.stream.position
            scalars = mixed.rl_step()
            skipped.append(scalars["data/prompts_skipped"])
            # every skipped draw replaced; a step that runs into the next epoch also passes over the
            # examples it holds (tests/rl/test_data_stream.py)
            assert mixed.prompts.stream.position - before >= 2 + skipped[-1]
    finally:
        mixed.close()
    assert sum(skipped) > 0 and mixed.compile_counts["generate[sample]"] == 1
    assert sum("longer than max_prompt_length" in line for line in lines) == 1, lines  # said once, then counted

    # Refused when the run is built: no evaluation or compile first.
    with pytest.raises(prompts.PromptError, match=f"too few training prompts fit in max_prompt_length {fits} "
                                                  r"tokens: 6 of 6 drawn .*--max-prompt-length") as error:
        trainer([long] * 3, "none", [])
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_groups_per_prompt_draws_each_prompt_as_several_groups(setup, tmp_path):
    """Settings e-f: g groups of n for one prompt, each selected apart; the data stream moves by prompts."""
    model, params, tokenizer, train_set, test_set = setup
    algo = paper_settings.method_config("pods", n=4, m=2, groups_per_prompt=2)
    run = rl.RunConfig(out_dir=str(tmp_path / "groups"), max_steps=1, prompts_per_step=2, max_new_tokens=4,
                       eval_every_s=None, reward_workers=1, progress=False)
    lines = []
    trainer = rl.Trainer(model, params, tokenizer, train_set, test_set, algo, run, log=lines.append,
                         generator=shared_generator(model))
    try:
        examples, batch, _ = trainer.prompts.draw(run.prompts_per_step, algo.groups_per_prompt)
        drawn = [e.prompt for e in examples]
        assert drawn[0] == drawn[1] != drawn[2] == drawn[3]
        assert batch.ids_PL.shape[0] == rl.prompt_rows(run, algo) == 4 and trainer.prompts.stream.position == 2
        trainer.rl_step()
        assert trainer.prompts.stream.position == 4
    finally:
        trainer.close()
    # 4 groups x 2 selected rows enter the update: the selection ran per group.
    assert any(line.startswith("compiled update (8 rows x") for line in lines), lines
    with pytest.raises(ValueError, match="groups_per_prompt must be >= 1; got 0"):
        paper_settings.method_config("pods", groups_per_prompt=0)


def test_a_run_killed_before_its_first_checkpoint_starts_its_logs_over(setup, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "eval_history.jsonl").write_text('{"step": 0, "eval/accuracy": 0.5}\n')
    trainer = make_trainer(setup, out, max_steps=1)
    trainer.close()
    assert int(trainer.state.step) == 0
    assert not (out / "metrics.jsonl").exists() or (out / "metrics.jsonl").read_text() == ""
    assert (out / "eval_history.jsonl").read_text() == ""
    assert (out / "metrics.jsonl.superseded").read_text() == '{"step": 1}\n'


@pytest.mark.slow
def test_updates_that_stay_non_finite_stop_the_run_with_one_line(setup, tmp_path):
    algo = paper_settings.method_config("pods", n=4, m=2, learning_rate=1e-3)
    optimizer, real_step = rl.update_program(setup[0], algo, None)

    def non_finite(state, batch, frozen):  # as if every update had a NaN loss (and was skipped)
        state, metrics = real_step(state, batch, frozen)
        return state, metrics.replace(skipped=jnp.ones((), jnp.int32), loss=jnp.full((), jnp.nan))

    trainer = make_trainer(setup, tmp_path / "run", max_steps=10, update=(optimizer, non_finite))
    with pytest.raises(rl.TrainingDiverged, match="3 steps in a row had a non-finite loss") as error:
        trainer.run()
    assert "\n" not in str(error.value) and "the last checkpoint is step 2" in str(error.value)
    # The steps before the third were saved (checkpoint_every_steps=1); the third was not.
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["1", "2"]


@pytest.mark.slow
def test_an_update_batch_whose_groups_mix_prompts_stops_the_run_untrained(setup, tmp_path):
    algo = paper_settings.method_config("pods", n=4, m=2, learning_rate=1e-3)
    optimizer, real_step = rl.update_program(setup[0], algo, None)

    def mixed(state, batch, frozen):  # rows 1 and 2 swap prompts: each group of 2 holds two prompts
        prompt = slice(0, batch.input_ids.shape[1] - batch.completion_length)
        order = jnp.array([0, 2, 1, 3])
        ids, mask = batch.input_ids, batch.attention_mask
        batch = batch.replace(input_ids=ids.at[:, prompt].set(ids[order, prompt]),
                              attention_mask=mask.at[:, prompt].set(mask[order, prompt]))
        return real_step(state, batch, frozen)

    trainer = make_trainer(setup, tmp_path / "run", max_steps=2, update=(optimizer, mixed))
    before = jax.device_get(trainer.state.params)
    try:
        with pytest.raises(ValueError, match="2 prompt group.*--algorithm.shared_prefix false") as error:
            trainer.rl_step()
    finally:
        trainer.close()
    assert "\n" not in str(error.value) and int(trainer.state.step) == 0
    for a, b in zip(jax.tree.leaves(jax.device_get(trainer.state.params)), jax.tree.leaves(before)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_the_best_evaluated_policy_is_kept_and_survives_a_resume(setup, tmp_path):
    out = tmp_path / "run"
    accuracies = iter([0.1, 0.5, 0.3, 0.2, 0.6])

    def scripted_eval(params, lora):
        return {"eval/accuracy": next(accuracies), "eval/examples": 2.0}, []

    trainer = make_trainer(setup, out, max_steps=3, evaluator=scripted_eval)
    trainer.run()  # evaluations at steps 0..3: 0.1, 0.5, 0.3, 0.2
    assert (trainer.best.step, trainer.best.accuracy) == (1, 0.5)
    assert sorted(os.listdir(out / "best")) == ["1"]  # older bests pruned once a checkpoint recorded step 1
    best = trainer.best.restore(trainer.state.params)
    with ckpt_lib.Checkpointer(ckpt_lib.CheckpointConfig(str(out / "checkpoints"), keep_last=None)) as ck:
        at_step_1, _ = ck.restore(jax.tree.map(mesh_lib.abstract, trainer.state), step=1)
    for got, want in zip(jax.tree.leaves(best), jax.tree.leaves(at_step_1.params), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not all(np.array_equal(np.asarray(a), np.asarray(b))  # step 3's params differ: a real choice
                   for a, b in zip(jax.tree.leaves(best), jax.tree.leaves(trainer.state.params)))

    accuracies = iter([0.4, 0.6])  # the resumed run evaluates at step 3 again, then at 4, which beats 0.5
    resumed = make_trainer(setup, out, max_steps=4, evaluator=scripted_eval)
    assert (resumed.best.step, resumed.best.accuracy) == (1, 0.5)
    resumed.run()
    assert (resumed.best.step, resumed.best.accuracy) == (4, 0.6)
    # The last checkpoint (step 4, saved before its evaluation) still records step 1 as the best,
    # so that one stays on disk until a later checkpoint records step 4.
    assert sorted(os.listdir(out / "best")) == ["1", "4"]


@pytest.mark.slow
def test_a_recorded_best_that_is_gone_or_damaged_never_blocks_the_run_s_end(setup, tmp_path):
    # A damaged best had failed the run's last export after all its training, on every resume;
    # a removed one, with a traceback asking for a bug report.
    out = tmp_path / "run"
    accuracies = iter([0.5, 0.1])
    scripted_eval = lambda params, lora: ({"eval/accuracy": next(accuracies), "eval/examples": 2.0}, [])  # noqa: E731
    make_trainer(setup, out, max_steps=1, evaluator=scripted_eval).run()  # the checkpoint of step 1 records best 0
    shutil.rmtree(out / "best" / "0")
    lines = []
    accuracies = iter([0.2, 0.3])  # steps 1 (again: its evaluation came after the checkpoint) and 2
    resumed = make_trainer(setup, out, max_steps=2, evaluator=scripted_eval, log=lines.append)
    warning = [line for line in lines if "best policy of step 0" in line]
    assert len(warning) == 1 and "(50.0%) does not load" in warning[0] and "chosen again" in warning[0], lines
    assert (resumed.best.step, resumed.best.accuracy) == (None, None)
    resumed.run()
    assert (resumed.best.step, resumed.best.accuracy) == (2, 0.3)

    # Damaged without proof (orbax fails inside): the files may be fine, so the line says what to do.
    for path in (out / "best" / "2").rglob("*"):
        if path.is_file() and "/d/" in str(path):
            path.write_bytes(bytes(255 - b for b in path.read_bytes()))
    with pytest.raises(ckpt_lib.CheckpointCorrupt, match="move .*best/2 aside and resume again") as error:
        resumed.best.restore(resumed.state.params)
    assert "\n" not in str(error.value)
    shutil.move(out / "best" / "2", tmp_path / "moved")
    assert resumed.best.restore(resumed.state.params) is None  # warned: the run ends without best_model
    assert "the run ends without a best_model export" in lines[-1] and resumed.best.step is None


class RecordingHook(rl.Hook):
    """Records the loop's events it is called at, in order."""

    def __init__(self, name, events):
        self.name, self.events = name, events

    def on_start(self, step, history):
        self.events.append((self.name, "start", step, len(history)))

    def on_step(self, step, result):
        self.events.append((self.name, "step", step, result.step, dict(result.scalars)))

    def on_eval(self, step, evaluation):
        self.events.append((self.name, "eval", step, evaluation["eval/accuracy"]))

    def on_end(self, step):
        self.events.append((self.name, "end", step))

    def on_close(self):
        self.events.append((self.name, "close"))


@pytest.mark.slow
def test_a_user_hook_sees_each_step_and_evaluation_in_order_beside_the_run_s_own(setup, tmp_path):
    out, events = tmp_path / "run", []
    accuracies = iter([0.1, 0.5, 0.3])

    def scripted_eval(params, lora):
        return {"eval/accuracy": next(accuracies), "eval/examples": 2.0}, []

    trainer = make_trainer(setup, out, max_steps=2, evaluator=scripted_eval, hooks=[RecordingHook("a", events)])
    trainer.add_hook(RecordingHook("b", events))
    history = trainer.run()

    def of(name):
        return [e[1:] for e in events if e[0] == name]

    assert [e[:3] for e in of("a")] == [
        ("start", 0, 0), ("eval", 0, 0.1), ("step", 1, 1), ("eval", 1, 0.5), ("step", 2, 2), ("eval", 2, 0.3),
        ("end", 2), ("close",)]
    assert of("b") == of("a")
    # Both are called at each event in the order they were added, and close in reverse.
    assert [e[0] for e in events[:-2]] == ["a", "b"] * 7 and [e[0] for e in events[-2:]] == ["b", "a"]
    # The run's own hooks still wrote the metrics (the very scalars the hooks saw), the
    # evaluation history, the checkpoints and the best model.
    records = {r["step"]: r for r in read_jsonl(out / "metrics.jsonl") if "train/loss" in r}
    steps = [(step, scalars) for kind, step, _, scalars in (e for e in of("a") if e[0] == "step")]
    assert [step for step, _ in steps] == sorted(records) == [1, 2]
    for step, scalars in steps:
        assert records[step]["reward/mean"] == scalars["reward/mean"]
        assert records[step]["train/loss"] == pytest.approx(scalars["train/loss"])
    assert [h["step"] for h in history] == [h["step"] for h in run_files.read_history(str(out))] == [0, 1, 2]
    assert sorted(os.listdir(out / "checkpoints")) == ["1", "2"]
    assert (trainer.best.step, trainer.best.accuracy) == (1, 0.5) and os.listdir(out / "best") == ["1"]


@jax.jit
def _busy(tokens):
    """``tokens``, after a few hundred device matmuls (a fraction of a second on a CPU)."""
    x = jnp.full((384, 384), 1e-3, jnp.float32)
    x = jax.lax.fori_loop(0, 400, lambda i, y: jnp.tanh(y @ y + 1e-3), x)
    return tokens + (x[0, 0] * 0).astype(tokens.dtype)


class SlowGenerator:
    """The shared generator, its tokens finished by a slow device computation; it notes when
    each call began, returned and when its tokens were ready (seen from a thread of its own)."""

    def __init__(self, inner):
        self.inner, self.times, self.waiters = inner, [], []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, *args, **kwargs):
        called = time.perf_counter()
        rollouts = self.inner.generate(*args, **kwargs)
        tokens = _busy(rollouts.tokens)
        returned, times = time.perf_counter(), {}
        self.times.append(times)

        def wait():
            tokens.block_until_ready()
            times.update(called=called, returned=returned, ready=time.perf_counter())

        self.waiters.append(threading.Thread(target=wait))
        self.waiters[-1].start()
        return rollouts.replace(tokens=tokens)


@pytest.mark.slow
def test_generation_time_is_counted_in_generation_not_in_scoring(setup, tmp_path):
    # JAX returns from generate before the tokens exist: the phase must wait for them.
    slow = SlowGenerator(shared_generator(setup[0]))
    trainer = make_trainer(setup, tmp_path / "slow", max_steps=1, generator=slow)
    try:
        trainer.rl_step()  # compiles
        scalars = trainer.rl_step()
    finally:
        trainer.close()
    for waiter in slow.waiters:
        waiter.join()
    times = slow.times[-1]  # this step's own, whatever the load on the cores
    assert times["ready"] - times["returned"] > times["returned"] - times["called"], times  # the tokens lag
    # Waiting, the phase spans the call to the tokens' readiness; without the wait it is the
    # dispatch alone, and the busy time lands in scoring.
    assert scalars["time/generation"] >= 0.5 * (times["ready"] - times["called"]), (scalars, times)


class ScriptedScorer:
    """Scores each call's groups of 4 from a script: "flat" groups all get 0, "mixed" ones 0, 1, 0, 1."""

    def __init__(self, calls):
        self.calls, self.completions = list(calls), []

    def score(self, completions, rewards, **columns):
        self.completions.append(list(completions))
        script = self.calls.pop(0)
        accuracy = np.concatenate([np.zeros(4) if kind == "flat" else np.array([0.0, 1.0, 0.0, 1.0])
                                   for kind in script])
        values = np.stack([accuracy if w.name == "accuracy" else np.zeros(len(completions)) for w in rewards])
        return rewards_combine.summarize(rewards, values, np.zeros(len(completions), bool), {}, 0.0)

    def close(self):
        pass


@pytest.mark.slow
def test_dynamic_sampling_draws_again_until_the_groups_have_variance(setup, tmp_path):
    model, params, tokenizer, train_set, test_set = setup
    run = rl.RunConfig(out_dir=str(tmp_path / "dyn"), max_steps=2, prompts_per_step=2, max_new_tokens=4,
                       eval_every_s=None, reward_workers=1, progress=False)
    algo = paper_settings.method_config("pods", n=4, m=2, dynamic_sampling=True, max_sampling_rounds=2)
    # Step 1: one informative group per draw, so a second draw fills the step. Step 2: both
    # draws flat, so the first draw's groups fill in and the step keeps its shape.
    scorer = ScriptedScorer([("flat", "mixed"), ("mixed", "flat"), ("flat", "flat"), ("flat", "flat")])
    trainer = rl.Trainer(model, params, tokenizer, train_set, test_set, algo, run, scorer=scorer,
                         generator=shared_generator(model), log=lambda line: None)
    try:
        first = trainer.rl_step()
        assert first["data/sampling_rounds"] == 2 and first["data/groups_filled"] == 0
        assert first["data/zero_std_groups_drawn"] == 0.5
        assert first["reward/zero_std_groups"] == 0 and first["reward/mean"] == 0.5
        assert trainer.prompts.stream.position == 4  # both draws moved the data on
        second = trainer.rl_step()
        assert second["data/sampling_rounds"] == 2 and second["data/groups_filled"] == 2
        assert second["reward/zero_std_groups"] == 1 and second["data/zero_std_groups_drawn"] == 1
        assert trainer.step == 2 and trainer.compile_counts["update"] == 1  # one shape for every step
        # The groups trained are the drawn ones: group 1 of the first draw and group 0 of the second.
        draws = [trainer.stepper.draw_and_generate(*trainer.policy_params(), jax.random.key(i)) for i in range(2)]
        totals = [np.array(t, np.float32) for t in ([0, 0, 0, 0, 0, 1, 0, 1], [1, 0, 1, 0, 0, 0, 0, 0])]
        scores = [rl.Scored(total, np.full(8, 4), np.zeros(8)) for total in totals]
        zero = dynamic_sampling.zero_variance(np.concatenate(totals).reshape(-1, 4))
        merged, scored, stats = trainer.stepper.merge_draws(draws, scores, zero)
        assert stats == {"data/sampling_rounds": 2.0, "data/zero_std_groups_drawn": 0.5, "data/groups_filled": 0.0}
        tokens = [np.asarray(d.rollouts.tokens) for d in draws]
        expected = np.concatenate([tokens[0][4:], tokens[1][:4]])
        np.testing.assert_array_equal(np.asarray(merged.rollouts.tokens), expected)
        # Every per-row field follows the rows, the lengths too.
        np.testing.assert_array_equal(np.asarray(merged.rollouts.lengths),
                                      np.asarray(merged.rollouts.mask).sum(axis=-1))
        assert [e.prompt for e in merged.examples] == [draws[0].examples[1].prompt, draws[1].examples[0].prompt]
        np.testing.assert_array_equal(scored.total, [0, 1, 0, 1, 1, 0, 1, 0])
    finally:
        trainer.close()


def test_a_custom_evaluator_must_return_accuracy_and_examples(setup, tmp_path):
    # Without eval/examples the console line had failed with a KeyError; a NumPy accuracy had stopped
    # the run when the history was written.
    def without_examples(params, lora):
        return {"eval/accuracy": np.float32(0.5)}, []

    trainer = make_trainer(setup, tmp_path / "run", max_steps=1, evaluator=without_examples)
    try:
        with pytest.raises(ValueError, match="the evaluator's scalars lack eval/examples"):
            trainer.evaluate()
        trainer.evaluator = lambda params, lora: ({"eval/accuracy": np.float32(0.5), "eval/examples": np.int64(2)}, [])
        assert trainer.evaluate() == {"eval/accuracy": 0.5, "eval/examples": 2.0}
        assert all(type(v) is float for v in trainer.evaluate().values())
    finally:
        trainer.close()


def test_a_trainer_refuses_a_folder_another_live_process_holds(setup, tmp_path):
    # A second Trainer had cleared the running job's best policies and rewound its logs.
    import json

    from podsjax.run import run_state

    out = tmp_path / "run"
    out.mkdir()
    parent = os.getppid()  # alive for as long as this test runs
    holder = {"pid": parent, **run_state._host_identity(), "started": run_state._process_start(parent)}
    (out / run_state.LOCK_FILE).write_text(json.dumps(holder))
    with pytest.raises(run_state.RunLocked, match=f"is in use by pid {parent}"):
        make_trainer(setup, out, max_steps=1)
    (out / run_state.LOCK_FILE).unlink()
    with run_state.RunLock.acquire(str(out), heartbeat_s=0):  # this process's own lock, as the command line holds
        make_trainer(setup, out, max_steps=1).close()
